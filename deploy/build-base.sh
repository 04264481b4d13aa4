#!/usr/bin/env bash
# Build the Debian base image pdserve's Dockerfile starts FROM, without pulling from a registry: debootstrap a
# minimal Debian (packages come from the Debian mirror) and import it into the local docker daemon.
#   usage: deploy/build-base.sh [TAG]   (default pdserve-base:bookworm-nocc; skipped when the image exists)
set -euo pipefail
TAG="${1:-pdserve-base:bookworm-nocc}"
SUITE="${SUITE:-bookworm}"
MIRROR="${MIRROR:-}"  # empty: debootstrap's own default mirror
if docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "base image $TAG exists"; exit 0
fi
command -v debootstrap >/dev/null || { echo "needs debootstrap (apt-get install debootstrap), as root" >&2; exit 1; }
ROOTFS="$(mktemp -d /tmp/pdserve-rootfs.XXXXXX)"
trap 'rm -rf "$ROOTFS"' EXIT
# python3 + venv: the image's interpreter (bookworm: 3.11); ca-certificates: pip over https. No compiler: the
# Dockerfile's build stage installs g++ to compile the CPU kernels into the package, and the runtime stage, this
# base as it is, must have none.
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$ROOTFS" \
  ${MIRROR:+"$MIRROR"}
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin
tar -C "$ROOTFS" -c . | docker import --change 'ENV LANG=C.UTF-8' - "$TAG"
echo "built $TAG"
