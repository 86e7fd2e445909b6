# Sourced by docker/images.sh and docker/container-test.sh: podman, its configuration and
# the names and build inputs both scripts share. Every value can be given in the environment.
# shellcheck shell=bash

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export CONTAINERS_CONF=${CONTAINERS_CONF:-$ROOT/docker/containers.conf}
PODMAN=${PODMAN:-podman}
# debian: the bases are made here from Debian's packages (debootstrap; root and a Debian
# mirror needed, no registry of images); public: the official python and redis images.
BASE=${BASE:-debian}
IMAGE=${IMAGE:-localhost/embgeom:cpu}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
DEBIAN_SUITE=bookworm
DEBIAN_IMAGE=${DEBIAN_IMAGE:-localhost/embgeom-debian:$DEBIAN_SUITE}
if [ "$BASE" = debian ]; then
  PYTHON_IMAGE=${PYTHON_IMAGE:-localhost/embgeom-python:3.11-$DEBIAN_SUITE}
  REDIS_IMAGE=${REDIS_IMAGE:-localhost/embgeom-redis:7-$DEBIAN_SUITE}
else
  PYTHON_IMAGE=${PYTHON_IMAGE:-python:3.11.11-slim-bookworm}
  REDIS_IMAGE=${REDIS_IMAGE:-redis:7.4.2}
fi

log() { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }

# The commands a step needs, each from the Debian package of its name, installed as root
# (sudo where there is one) when missing.
need_commands() {
  local missing=() cmd
  for cmd in "$@"; do command -v "$cmd" >/dev/null || missing+=("$cmd"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo; sudo=$(command -v sudo || true)
  log "installing ${missing[*]}"
  $sudo apt-get install -y "${missing[@]}" >/dev/null \
    || { $sudo apt-get update >/dev/null && $sudo apt-get install -y "${missing[@]}" >/dev/null; }
}

human_size() { numfmt --to=iec-i --suffix=B "$1"; }

image_size() { $PODMAN image inspect --format '{{.Size}}' "$1"; }
