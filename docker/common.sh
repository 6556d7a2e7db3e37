# Shared by docker/build.sh and docker/smoke.sh (sourced, not run).
# shellcheck shell=bash

step() { printf '\n== [%4ds] %s\n' "$SECONDS" "$*"; }
fail() { echo "FAILED: $*" >&2; exit 1; }

# A Docker engine that answers: starts dockerd (installing Debian's docker.io when it is missing) if
# none does. Sets ENGINE_STARTED=1 when this call started it, so the caller can stop it again.
ENGINE_STARTED=0
DOCKERD_LOG=/tmp/memvit-dockerd.log
ensure_engine() {
    docker info >/dev/null 2>&1 && return 0
    if ! command -v dockerd >/dev/null; then
        echo "installing Debian's docker.io (a system package: it stays installed)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io >/dev/null
    fi
    (dockerd >"$DOCKERD_LOG" 2>&1 &)
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || fail "dockerd did not start (see $DOCKERD_LOG)"
    # shellcheck disable=SC2034  # read by the script that sources this
    ENGINE_STARTED=1
    echo "started dockerd (log: $DOCKERD_LOG)"
}

# Stops the dockerd that ensure_engine started (and the containerd it runs).
stop_engine() {
    local pid
    pid="$(cat /var/run/docker.pid 2>/dev/null || true)"
    [[ -n "$pid" ]] || return 0
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || return 0; sleep 1; done
    echo "dockerd ($pid) did not stop within 30 s" >&2
}

image_exists() { docker image inspect "$1" >/dev/null 2>&1; }
image_size() { docker image inspect "$1" --format '{{.Size}}' | awk '{printf "%.2f GB", $1 / 1e9}'; }
