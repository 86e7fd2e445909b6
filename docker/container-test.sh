#!/usr/bin/env bash
# make container-test: Redis, the API and two workers as containers of one podman pod, an
# ingest through the API with a Redis crash and a worker restart in its middle, exact counts
# and every kind of read checked (docker/container_check.py, run with the project's venv),
# then the containers' health and the image's size; everything made here is removed on exit.
#
#   PYTHON       the venv's python that runs the checks (make passes $(VENV)/bin/python)
#   KEEP_IMAGES  1: keep the images (default: removed with the rest)
#   CT_TEXTS, CT_JOBS   the corpus: BBC paragraphs, in this many jobs
set -euo pipefail
# shellcheck source=docker/podman-env.sh
source "$(dirname "${BASH_SOURCE[0]}")/podman-env.sh"
cd "$ROOT"
PYTHON=${PYTHON:-.venv/bin/python}
KEEP_IMAGES=${KEEP_IMAGES:-0}
NAME=embgeom-ct-$$
POD=$NAME
VOLUME=$NAME-redis
WORKERS=(w1 w2)
start=$(date +%s)
stage() { local now; now=$(date +%s); log "stage $1 ($((now - start)) s)"; start=$now; }

cleanup() {
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    for c in redis api "${WORKERS[@]}"; do
      $PODMAN container exists "$NAME-$c" 2>/dev/null || continue
      echo "--- logs of $NAME-$c (last 40 lines)" >&2
      $PODMAN logs --tail 40 "$NAME-$c" >&2 2>&1 || true
    done
  fi
  $PODMAN pod rm --force --ignore "$POD" >/dev/null 2>&1 || true
  $PODMAN volume rm --force "$VOLUME" >/dev/null 2>&1 || true
  if [ "$KEEP_IMAGES" != 1 ]; then
    $PODMAN rmi --force "$IMAGE" >/dev/null 2>&1 || true
    if [ "$BASE" = debian ]; then
      $PODMAN rmi --force "$REDIS_IMAGE" "$PYTHON_IMAGE" "$DEBIAN_IMAGE" >/dev/null 2>&1 || true
    fi
    # the build's untagged intermediate images: the dangling ones that were not there before
    # (a prune, much faster, where there were none)
    if [ -z "$dangling_before" ]; then
      $PODMAN image prune --force >/dev/null 2>&1 || true
    else
      comm -13 <(printf '%s\n' "$dangling_before" | sort) <(dangling | sort) \
        | xargs -r $PODMAN rmi --force >/dev/null 2>&1 || true
    fi
    # podman's own pod infra image, made for the pod (kept while another pod uses it)
    $PODMAN rmi "localhost/podman-pause:$($PODMAN version --format '{{.Client.Version}}')-0" >/dev/null 2>&1 || true
  fi
  log "removed the pod, its containers and volume$([ "$KEEP_IMAGES" = 1 ] || echo ', the images')"
  exit "$rc"
}
dangling() { $PODMAN images --quiet --no-trunc --filter dangling=true 2>/dev/null || true; }
dangling_before=$(command -v "$PODMAN" >/dev/null && dangling || true)
trap cleanup EXIT
trap 'exit 130' INT TERM

"$ROOT/docker/images.sh"
stage "images built"

port=$("$PYTHON" -c 'from embgeom.store.server import free_port; print(free_port())')
# One pod: its containers share a network namespace (Redis on its 127.0.0.1:6379); only the
# API's port is published, on the host's loopback.
$PODMAN pod create --name "$POD" -p "127.0.0.1:$port:8080" >/dev/null
$PODMAN volume create "$VOLUME" >/dev/null
# Health checks are run below with `podman healthcheck run`: there may be no systemd to
# time them (--health-interval disable: no timer for the checks given here; for an image's
# own HEALTHCHECK podman still tries one and says it cannot, which quiet filters).
# Settings reach the containers only as EMBGEOM_* variables.
redis_url=redis://127.0.0.1:6379/0
# Without systemd podman cannot time an image's own health check and says so on each run.
quiet() { "$@" 2> >(grep -v 'unable to get systemd connection' >&2); }
quiet $PODMAN run -d --pod "$POD" --name "$NAME-redis" --health-interval disable \
  -v "$VOLUME:/data" "$REDIS_IMAGE" \
  redis-server --bind 127.0.0.1 --port 6379 --dir /data --appendonly yes \
  --appendfsync always --maxmemory-policy noeviction >/dev/null
quiet $PODMAN run -d --pod "$POD" --name "$NAME-api" --health-interval disable \
  -e EMBGEOM_REDIS_URL=$redis_url -e EMBGEOM_EMBEDDED_WORKERS=0 \
  "$IMAGE" embgeom serve --host 0.0.0.0 --port 8080 >/dev/null
for w in "${WORKERS[@]}"; do
  # SIGTERM lets a worker finish its window within its 30 s grace: 45 s before SIGKILL.
  $PODMAN run -d --pod "$POD" --name "$NAME-$w" --stop-timeout 45 --health-interval disable \
    --health-cmd "python -c \"import redis; redis.Redis.from_url('$redis_url', socket_timeout=3).ping()\"" \
    -e EMBGEOM_REDIS_URL=$redis_url -e EMBGEOM_LEASE_SECONDS=5 -e EMBGEOM_HEARTBEAT_SECONDS=1 \
    "$IMAGE" embgeom worker --worker-id "$w" >/dev/null
done
stage "pod up"

health() {  # each container's health check, run now; prints "name: status" lines
  local c
  for c in redis api "${WORKERS[@]}"; do
    $PODMAN healthcheck run "$NAME-$c" >/dev/null 2>&1 || true
    echo "  $NAME-$c: $($PODMAN inspect --format '{{.State.Status}}, {{.State.Health.Status}}' "$NAME-$c")"
  done
}
wait_healthy() {
  local deadline=$(( $(date +%s) + $1 )) out
  while :; do
    out=$(health)
    if ! grep -qv ': running, healthy$' <<<"$out"; then echo "$out"; return 0; fi
    if [ "$(date +%s)" -gt "$deadline" ]; then echo "$out" >&2; return 1; fi
    sleep 2
  done
}
wait_healthy 300
stage "containers healthy"

workers_args=()
for w in "${WORKERS[@]}"; do workers_args+=(--worker "$w=$NAME-$w"); done
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PYTHON" docker/container_check.py \
  --url "http://127.0.0.1:$port" --redis "$NAME-redis" "${workers_args[@]}" \
  --texts "${CT_TEXTS:-600}" --jobs "${CT_JOBS:-24}"
stage "ingest, restarts and checks"

echo "containers' health after the test:"
wait_healthy 120
$PODMAN ps --pod --filter "pod=$POD" --format '  {{.Names}}  {{.Status}}'
size=$(image_size "$IMAGE")
user=$($PODMAN image inspect --format '{{.Config.User}}' "$IMAGE")
[ -n "$user" ] && [ "${user%%:*}" != 0 ] && [ "${user%%:*}" != root ] || { echo "image runs as root" >&2; exit 1; }
$PODMAN image inspect --format '{{json .Config.Healthcheck}}' "$IMAGE" | grep -q /healthz \
  || { echo "image has no /healthz HEALTHCHECK" >&2; exit 1; }
echo "image $IMAGE: $(human_size "$size") ($size bytes), user $user, HEALTHCHECK on /healthz"
echo "container test passed"
