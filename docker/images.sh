#!/usr/bin/env bash
# make images: build the CPU image with podman and print its size.
#
# BASE=debian (default): where no registry of images is reachable, the bases are made from
# Debian's packages: debootstrap a minimal bookworm from the Debian mirror apt already uses,
# import it, and build on it docker/Dockerfile.debian-python (Debian's python3 3.11, the
# stand-in for the official python image) and docker/Dockerfile.debian-redis (Debian's
# redis-server, for make container-test). BASE=public: the official python and redis images.
#
# What of this machine a build needs is mounted into it, never copied into the image:
#   TORCH_WHEELS  a folder holding torch==TORCH_VERSION's CPU wheel for cp311 (default: the
#                 first of pip's find-links folders that holds one; none: PyTorch's CPU index)
#   HOST_CA       the CA bundle pip verifies HTTPS with (default: $PIP_CERT, else the
#                 system bundle), for a machine whose HTTPS goes through its own authority
set -euo pipefail
# shellcheck source=docker/podman-env.sh
source "$(dirname "${BASH_SOURCE[0]}")/podman-env.sh"
cd "$ROOT"

need_commands podman runc

# The Debian mirror apt uses here (deb822 .sources or one-line .list entries for the suite).
debian_mirror() {
  python3 - "$DEBIAN_SUITE" <<'PY'
import glob, re, sys
suite = sys.argv[1]
for path in sorted(glob.glob("/etc/apt/sources.list") + glob.glob("/etc/apt/sources.list.d/*")):
    try:
        text = open(path).read()
    except OSError:
        continue
    if path.endswith(".sources"):
        for block in re.split(r"\n\s*\n", text):
            f = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", block, re.M))
            if "deb" in f.get("Types", "").split() and suite in f.get("Suites", "").split():
                print(f["URIs"].split()[0]); sys.exit()
    else:
        for line in text.splitlines():
            w = re.sub(r"\[.*?\]", "", line).split()
            if len(w) >= 3 and w[0] == "deb" and w[2] == suite:
                print(w[1]); sys.exit()
print("http://deb.debian.org/debian")
PY
}

# pip's find-links folders (pip config, PIP_FIND_LINKS) holding torch's CPU wheel for cp311.
torch_wheels() {
  local dirs dir
  dirs=$( { python3 -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p"; \
            echo "${PIP_FIND_LINKS:-}"; } | tr ' ' '\n' | sed 's#^file://##' | sort -u)
  for dir in $dirs; do
    if compgen -G "$dir/torch-$TORCH_VERSION+cpu-cp311-cp311-*linux*_x86_64.whl" >/dev/null; then
      echo "$dir"; return
    fi
  done
}

build_args=(--format docker)   # docker's format: OCI images drop HEALTHCHECK
HOST_CA=${HOST_CA:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}
if [ -f "$HOST_CA" ]; then
  build_args+=(-v "$HOST_CA:/run/host-ca.crt:ro" --build-arg PIP_CERT=/run/host-ca.crt)
fi
TORCH_WHEELS=${TORCH_WHEELS:-$(torch_wheels || true)}
if [ -n "$TORCH_WHEELS" ]; then
  log "torch from $TORCH_WHEELS (mounted into the build)"
  build_args+=(-v "$TORCH_WHEELS:/run/torch-wheels:ro" --build-arg TORCH_WHEELS=/run/torch-wheels)
fi

if [ "$BASE" = debian ]; then
  if ! $PODMAN image exists "$DEBIAN_IMAGE"; then
    need_commands debootstrap
    mirror=${DEBIAN_MIRROR:-$(debian_mirror)}
    rootfs=$(mktemp -d /tmp/embgeom-rootfs.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    log "debootstrap $DEBIAN_SUITE from $mirror"
    debootstrap --variant=minbase "$DEBIAN_SUITE" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 \
      || { tail -20 "$rootfs.log" >&2; exit 1; }
    rm -f "$rootfs.log"
    tar -C "$rootfs" -c . | $PODMAN import --quiet - "$DEBIAN_IMAGE" >/dev/null
    rm -rf "$rootfs"
  fi
  log "base images on $DEBIAN_IMAGE"
  $PODMAN build --quiet --format docker --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" \
    -f docker/Dockerfile.debian-python -t "$PYTHON_IMAGE" docker >/dev/null
  $PODMAN build --quiet --format docker --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" \
    -f docker/Dockerfile.debian-redis -t "$REDIS_IMAGE" docker >/dev/null
else
  $PODMAN pull --quiet "$PYTHON_IMAGE" >/dev/null
  $PODMAN pull --quiet "$REDIS_IMAGE" >/dev/null
fi

log "building $IMAGE on $PYTHON_IMAGE"
$PODMAN build "${build_args[@]}" --build-arg PYTHON_IMAGE="$PYTHON_IMAGE" \
  --ignorefile docker/Dockerfile.cpu.dockerignore -f docker/Dockerfile.cpu -t "$IMAGE" .
size=$(image_size "$IMAGE")
echo "image $IMAGE: $(human_size "$size") ($size bytes) on $PYTHON_IMAGE"
