#!/usr/bin/env bash
# Build the memvit image where no container registry is reachable (the offline path): a stand-in base
# image (docker/base-image.sh) and a wheelhouse filled by this machine's own pip, served to the build
# over loopback. With a registry, `docker compose build` or `docker build -t memvit:latest .` does the
# same from python:3.11-slim-bookworm and needs none of this.
#
#   sudo docker/build.sh                               # -> memvit:latest, what `docker compose up` runs
#   sudo TORCH_VARIANT=cpu docker/build.sh memvit:cpu  # CPU-only torch: pip must reach PyTorch's CPU index
#
# Environment:
#   TORCH_VARIANT        cuda (default; PyPI's torch, which carries CUDA) or cpu
#   TORCH_CPU_INDEX_URL  the cpu variant's index (default https://download.pytorch.org/whl/cpu)
#   MEMVIT_BASE_IMAGE    build FROM this image instead of the stand-in memvit-base:bookworm
#   MEMVIT_WHEELHOUSE    the wheelhouse folder (default /tmp/memvit-wheelhouse)
#   MEMVIT_WHEEL_PORT    the loopback port it is served on to the build (default 18081)
#   BUILD_KEEP=1         keep the wheelhouse and the build stage, so that a rebuild takes about a minute
#   MEMVIT_KEPT_FILE     append the list of what was kept to this file instead of printing it
#
# What it leaves: the image; the stand-in base (about 0.2 GB, needed to rebuild); a running Docker
# engine if it had to start one; Debian packages it installed (docker.io, debootstrap). The last lines
# it prints list each of them with the command that removes it. Without BUILD_KEEP it removes the
# wheelhouse it filled (about 3 GB) and the build stage's image (as large as the image).
# Needs root (apt, dockerd, debootstrap).
set -euo pipefail
cd "$(dirname "$0")/.."
source docker/common.sh
SECONDS="${MEMVIT_ELAPSED:-0}"  # docker/smoke.sh passes its clock, so the step times read on

IMAGE="${1:-memvit:latest}"
VARIANT="${TORCH_VARIANT:-cuda}"
CPU_INDEX="${TORCH_CPU_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
WHEELHOUSE="${MEMVIT_WHEELHOUSE:-/tmp/memvit-wheelhouse}"
KEEP="${BUILD_KEEP:-0}"
WHEEL_SERVER=""
WHEELHOUSE_CREATED=0
KEPT=()

# The build stages' images this build made (the legacy builder keeps them, dangling, even when the
# build fails) and the image the tag named before: removed, or listed when BUILD_KEEP=1.
new_stages() {
    local stage
    # -a: a failed build leaves its finished steps as intermediate images, which are not "dangling"
    for stage in $(docker image ls -a -q --no-trunc --filter label=memvit.stage=build); do
        grep -qx "$stage" <<<"$STAGES_BEFORE" || echo "$stage"
    done
}
tidy_build() {
    local stage
    if [[ $KEEP == 1 ]]; then
        for stage in $(new_stages); do
            KEPT+=("build stage ${stage:7:12} (the cache for a rebuild): docker image rm ${stage:7:12}")
        done
    else
        # Removing one stage's image can take another's with it (a parent no longer needed): go
        # round until none is left, and say so if one will not go.
        for _ in 1 2 3; do
            for stage in $(new_stages); do docker image rm "$stage" >/dev/null 2>&1 || true; done
        done
        [[ -z "$(new_stages)" ]] \
            || KEPT+=("build stages that would not go: docker image ls --filter label=memvit.stage=build")
    fi
    # A rebuilt tag leaves the image it named before untagged: nothing refers to it any more.
    local now
    now="$(docker image inspect "$IMAGE" --format '{{.Id}}' 2>/dev/null || true)"
    if [[ -n "$PREVIOUS" && "$PREVIOUS" != "$now" ]]; then
        if [[ -z "$(docker image inspect "$PREVIOUS" --format '{{join .RepoTags ","}}' 2>/dev/null)" ]] \
            && docker image rm "$PREVIOUS" >/dev/null 2>&1; then
            echo "removed the image $IMAGE named before this build (${PREVIOUS:7:12})"
        else
            KEPT+=("the image $IMAGE named before this build (${PREVIOUS:7:12}; a container may use it)")
        fi
    fi
}

cleanup() {
    local rc=$?
    [[ -z "$WHEEL_SERVER" ]] || kill "$WHEEL_SERVER" 2>/dev/null || true
    [[ -z "${STAGES_BEFORE+set}" ]] || tidy_build
    rm -f "${REQUIREMENTS:-}"
    if [[ $WHEELHOUSE_CREATED == 1 ]]; then
        if [[ $KEEP == 1 ]]; then
            KEPT+=("wheelhouse $WHEELHOUSE ($(du -sh "$WHEELHOUSE" | cut -f1)): rm -rf $WHEELHOUSE")
        else
            rm -rf "$WHEELHOUSE"
        fi
    elif [[ -d "$WHEELHOUSE" ]]; then
        KEPT+=("wheelhouse $WHEELHOUSE (it was there before this run): rm -rf $WHEELHOUSE")
    fi
    if [[ -n "${MEMVIT_KEPT_FILE:-}" ]]; then  # docker/smoke.sh reports for both
        [[ ${#KEPT[@]} -eq 0 ]] || printf '%s\n' "${KEPT[@]}" >>"$MEMVIT_KEPT_FILE"
    elif [[ ${#KEPT[@]} -gt 0 ]]; then
        echo
        echo "kept:"
        printf '  %s\n' "${KEPT[@]}"
    fi
    exit $rc
}
trap cleanup EXIT

docker/torch-variant.sh "$VARIANT" docker/requirements.txt >/dev/null  # fails fast on a bad variant

docker info >/dev/null 2>&1 || step "Docker engine"
ensure_engine
[[ $ENGINE_STARTED == 0 ]] || KEPT+=("a running dockerd, started by this script: kill \$(cat /var/run/docker.pid)")

BASE_IMAGE="${MEMVIT_BASE_IMAGE:-}"
if [[ -z "$BASE_IMAGE" ]]; then
    step "Base image"
    BASE_IMAGE=memvit-base:bookworm
    bash docker/base-image.sh "$BASE_IMAGE"
    KEPT+=("base $BASE_IMAGE ($(image_size "$BASE_IMAGE"), needed to rebuild): docker image rm $BASE_IMAGE")
fi

step "Wheelhouse $WHEELHOUSE ($VARIANT torch) from the host's pip"
[[ -d "$WHEELHOUSE" ]] || WHEELHOUSE_CREATED=1
mkdir -p "$WHEELHOUSE"
# The image's Python is 3.11 on x86_64 glibc 2.36 (bookworm): the host's own wheel tags must match.
python3 -c 'import platform, sys; assert sys.version_info[:2] == (3, 11) and platform.machine() == "x86_64"' \
    || fail "the wheelhouse needs a host python3.11 on x86_64 (the image's interpreter)"
REQUIREMENTS="$(mktemp)"
docker/torch-variant.sh "$VARIANT" docker/requirements.txt > "$REQUIREMENTS"
INDEX_ARGS=()
if [[ $VARIANT == cpu ]]; then
    # Fail in seconds, not after pip's minutes of retries, where the index is out of reach.
    python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=15)' \
        "$CPU_INDEX" 2>/dev/null \
        || fail "cannot reach $CPU_INDEX, where the cpu variant's torch comes from (TORCH_CPU_INDEX_URL names a mirror)"
    INDEX_ARGS=(--extra-index-url "$CPU_INDEX")
fi
python3 -m pip download --quiet --disable-pip-version-check --only-binary=:all: "${INDEX_ARGS[@]}" \
    -r "$REQUIREMENTS" "setuptools>=77" -d "$WHEELHOUSE" 2>&1 | { grep -v 'is ignored' || true; }
[[ -n "$(ls "$WHEELHOUSE"/torch-*.whl 2>/dev/null)" ]] || fail "the wheelhouse has no torch wheel"
# A fixed port: the build's PIP_FIND_LINKS names it, and a build argument that changes from one build
# to the next would invalidate the cached dependency layer.
WHEEL_PORT="${MEMVIT_WHEEL_PORT:-18081}"
python3 -m http.server --bind 127.0.0.1 --directory "$WHEELHOUSE" "$WHEEL_PORT" >/dev/null 2>&1 &
WHEEL_SERVER=$!
# Ours, not something else already on that port (pip would then fail minutes into the build).
for _ in $(seq 20); do curl -fs "http://127.0.0.1:$WHEEL_PORT/" | grep -q 'torch-' && break; sleep 0.5; done
kill -0 "$WHEEL_SERVER" 2>/dev/null || fail "cannot serve the wheelhouse on 127.0.0.1:$WHEEL_PORT (in use? set MEMVIT_WHEEL_PORT)"

step "docker build $IMAGE (FROM $BASE_IMAGE, TORCH_VARIANT=$VARIANT)"
# The build stages' images from before this build are someone's cache: only new ones are removed.
STAGES_BEFORE="$(docker image ls -a -q --no-trunc --filter label=memvit.stage=build)"
PREVIOUS="$(docker image inspect "$IMAGE" --format '{{.Id}}' 2>/dev/null || true)"
BUILD_STARTED=$SECONDS
docker build --network host --quiet --force-rm \
    --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg TORCH_VARIANT="$VARIANT" \
    --build-arg PIP_NO_INDEX=1 \
    --build-arg PIP_FIND_LINKS="http://127.0.0.1:$WHEEL_PORT/" \
    -t "$IMAGE" .
BUILD_SECONDS=$((SECONDS - BUILD_STARTED))
[[ "$(docker image inspect "$IMAGE" --format '{{.Config.User}}')" != "" ]] || fail "image runs as root"
if docker buildx version >/dev/null 2>&1 && [[ "${DOCKER_BUILDKIT:-1}" != 0 ]]; then
    KEPT+=("BuildKit's build cache, which holds the build stage ($(docker buildx du 2>/dev/null | awk '/^Total/ {print $2}')): docker buildx prune")
fi
echo "built $IMAGE: $(image_size "$IMAGE") in $BUILD_SECONDS s"
KEPT+=("image $IMAGE ($(image_size "$IMAGE")): docker image rm $IMAGE")
