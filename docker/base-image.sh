#!/usr/bin/env bash
# Build a local stand-in for the Dockerfile's FROM image when no registry is reachable:
# a minimal Debian bookworm (debootstrap) with Debian's python3 and python3-venv, imported with
# `docker import`. Elsewhere, use the default BASE_IMAGE (python:3.11-slim-bookworm) instead.
#
#   docker/base-image.sh [TAG]          # default tag: memvit-base:bookworm
#
# Needs root, debootstrap and a running Docker engine; takes 2-4 minutes.
set -euo pipefail

TAG="${1:-memvit-base:bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

if docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "base image $TAG already present"
    exit 0
fi
command -v debootstrap >/dev/null || {
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
}

ROOTFS="$(mktemp -d /tmp/memvit-rootfs.XXXXXX)"
LOG="$(mktemp /tmp/memvit-debootstrap.XXXXXX.log)"
trap 'rm -rf "$ROOTFS" "$LOG"' EXIT
echo "debootstrap bookworm from $MIRROR (about a minute)"
if ! debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$ROOTFS" "$MIRROR" \
    >"$LOG" 2>&1; then
    tail -40 "$LOG" >&2
    echo "debootstrap failed (its last lines above)" >&2
    exit 1
fi
# Keep the image small: no apt lists, caches or docs.
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/*
tar -C "$ROOTFS" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    - "$TAG"
echo "imported $TAG"
