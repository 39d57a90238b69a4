#!/usr/bin/env bash
# Make a local base image for the testbed from Debian packages, for machines that cannot pull from an
# image registry: debootstrap a bookworm minbase with python3 (3.11, like python:3.11-slim), venv and
# iproute2 (tc netem for the LOSS setting), then `docker import` it.
#
#   testbed/make-base-image.sh [TAG]        (default tag: zerosum-base:bookworm; needs root)
#   docker compose build --build-arg BASE_IMAGE=zerosum-base:bookworm
set -euo pipefail
tag="${1:-zerosum-base:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "base image $tag exists"
    exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install debootstrap" >&2; exit 1; }
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,iproute2,ca-certificates \
    bookworm "$root" "$mirror"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import --change 'CMD ["/bin/bash"]' - "$tag"
echo "built base image $tag"
