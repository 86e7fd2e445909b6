"""``benchmarks/gpu.sh``: the figures of ``make bench`` on one GPU, bounded in time.

``python -m benchmarks.gpu [--device cuda|cpu] [--models mpnet,minilm,smollm2,gpt2_random]
[--dtypes bf16,fp32] [--texts N] [--seconds-per-run S] [--budget-seconds B] [--out PATH]``
(``--help`` for the rest) measures, in this order, on ``--device``:

1. for each model x dtype (dtype-major, in the order given: the default puts MPNet in bf16
   first, the issue's target), within the budget less what steps 2 and 3 keep
   (``--merge-seconds`` + ``--steady-seconds``):

   - ``bare_tok_s``: the bare forward (:func:`benchmarks.run.bare_forward`: tokenise, the
     service's own token-budget batches of each job, ``output_hidden_states=True``), on the
     device, after two warm-up jobs, the clock stopped after ``torch.cuda.synchronize``.
   - ``forward_only_tok_s``: the same batches already tokenised and on the device: the
     forward passes alone (what the GPU reaches without the host's tokenisation).
   - ``service_tok_s`` and ``ratio`` (service / bare, target >= 0.8 for MPNet in bf16 on a
     GPU): ``embgeom serve`` embedded (its Redis, its worker: ``EMBGEOM_DEVICE`` and
     ``EMBGEOM_DTYPE`` set for it), the same texts and jobs over HTTP, from the first POST to
     every job done; bare and service alternated, medians of ``--repeat``; each run on a
     fresh collection (deleted after it: an MPNet run over BBC leaves gigabytes in Redis).
     The texts: BBC's sentences (:func:`benchmarks.run.e2e_texts`, every article, cycled),
     as many as make a bare run last ``--seconds-per-run`` or a service run
     ``--service-seconds``, whichever is fewer, by one job of each measured first
     (``--texts`` fixes the number instead); jobs of ``--texts-per-job``.
   - FLOPs: per sequence of ``n`` real tokens, ``2 P n + 4 L d_attn n^2``, with ``P`` the
     weights every token is multiplied by (each ``nn.Linear`` / GPT-2 ``Conv1D`` weight, the
     BERT/MPNet pooler excluded: it sees one token a sequence; no LM head: ``AutoModel``),
     ``L`` the blocks, ``d_attn`` = heads x head width; ``4 L d_attn n^2`` is ``Q K^T`` and
     ``softmax(.) V``, the full square (no causal halving), the forward third of PaLM's
     ``6N + 12 L H Q T`` (Chowdhery et al. 2022, appendix B). Embeddings, norms, biases,
     softmax and activations are not counted, nor padding: padded positions are work the
     batching wastes. ``bare_flop_s`` = those FLOPs / the bare forward's seconds, and
     ``bare_frac_peak_bf16`` its fraction of the GPU's peak dense bf16 FLOP/s (:data:`PEAK_BF16`,
     by ``torch.cuda.get_device_name``; ``--peak-flops`` otherwise), printed for fp32 too
     (against the bf16 peak, as the issue asks); ``matmul_bf16_flop_s`` is an 8192^3 bf16
     matrix product measured on the same GPU (what a GEMM reaches there).
2. ``merge``: :func:`benchmarks.run.bench_merge` on the device (``--merge-jobs`` recorded BBC
   jobs, ``--merge-repeat`` alternated repeats): ``merge.merge_over_bare`` is the worker's
   window merge over a bare ``index_add_`` of the same arrays on the same device
   (``merge_tok_s``, ``bare_tok_s`` beside it); skipped with less than ``--merge-seconds``
   left.
3. ``steady_state``: :func:`benchmarks.steady_state.bench_steady_state` on the device, one
   call per shape of ``--steady-shapes`` (default MiniLM, MPNet and 1B shapes), the window
   on the device: ``steady_state.<shape>.tok_s`` and the rest of what it returns. The shapes
   share at most ``--steady-seconds`` (seeding included; each shape's share less a few
   seconds for its wind-down), ``--steady-tokens`` each (default 10^7 on a GPU,
   :data:`benchmarks.steady_state.CPU_TOKENS` on a CPU), the seeded vocabulary bounded by
   ``--steady-max-store-bytes``; a shape whose share is under ``--steady-min-seconds`` is
   recorded as skipped. On a CPU the recording's jobs are cut into one batch each
   (``bench_steady_state``'s ``quick``), so a few thousand tokens make a run.
4. ``host_ceiling_tok_s``: the CPU-side replay of :mod:`benchmarks.replay` for the shapes
   (:func:`benchmarks.run.replay_store`, the quick sizes), last, if the budget still allows;
   else ``python -m benchmarks.run --only ceiling`` gives them (and ``--only workers,reads``
   the other host figures: they do not depend on the GPU).

``merge`` and ``steady_state`` carry the names of ``make bench``'s ``bench.json`` and are
printed against the same targets (:data:`benchmarks.run.TARGETS`); the JSON's ``device``
(and each of their ``device``) says where they ran.

``gpt2_random`` is a GPT-2-shaped model (12 blocks, 768 wide, 12 heads, 1,024 positions)
initialised at random with a fixed seed, with SmolLM2's byte-level BPE tokenizer
(MiniLM's where SmolLM2 is missing), saved once into a temporary folder and registered to
this process and to the service as an alias through ``EMBGEOM_MODELS``.

Every step is bounded: ``--budget-seconds`` for the whole run (a model x dtype, the merge or
a steady-state shape that cannot start in what is left is recorded as skipped), ``--run-cap``
seconds for one service run. An error is recorded (``error`` / ``service_error``, with the
service's log tail; ``merge.error``, ``steady_state.<shape>.error``) and the next
measurement goes on. Results are written after every step to ``--out`` (default
``$OUT/gpu_bench.json`` where ``OUT`` is set, else ``gpu_bench.json`` in the repository);
``python -m benchmarks.gpu --table PATH`` prints the table of a results file.
``--device cpu`` runs every step on the CPU (``GPU_BENCH_CPU=1 bash benchmarks/gpu.sh`` with
tiny sizes: the test suite's dry run, ``tests/test_benchmarks.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

from embgeom.testing.models import GPT2_SHAPE, build_gpt2_random

REPO = Path(__file__).resolve().parent.parent

# Peak dense (no sparsity) bf16 tensor FLOP/s of the datasheets, by a pattern of
# torch.cuda.get_device_name(); first match wins (so PCIe / NVL before plain H100).
PEAK_BF16: list[tuple[str, float]] = [
    (r"H100.*PCIe", 756e12),
    (r"H100.*NVL", 835e12),
    (r"GH200|H200|H100|H800", 989e12),
    (r"A100|A800", 312e12),
    (r"L40S", 362e12),
    (r"\bL4\b", 121e12),
]

TARGET_RATIO = 0.8  # service / bare, MPNet in bf16 on a GPU
# Seconds a steady-state shape's share leaves for its wind-down past its budget (the jobs
# already submitted finish, the store is counted, its Redis stops).
STEADY_WIND_DOWN_S = 5.0


class Interrupted(BaseException):
    """SIGTERM (``timeout``): unwinds past the per-measurement ``except Exception``."""


def _on_sigterm(signum, frame):
    raise Interrupted()


_T0 = time.perf_counter()


def _log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------- pure parts


def peak_bf16_flops(device_name: str) -> Optional[float]:
    """Peak dense bf16 FLOP/s of a GPU named ``device_name`` (None if not in the table)."""
    for pattern, flops in PEAK_BF16:
        if re.search(pattern, device_name or ""):
            return flops
    return None


def matmul_params(model) -> int:
    """Weights every token is multiplied by: each ``nn.Linear`` and GPT-2 ``Conv1D``
    weight, outside a pooler (one token a sequence) and an LM head."""
    import torch

    try:
        from transformers.pytorch_utils import Conv1D
        kinds = (torch.nn.Linear, Conv1D)
    except ImportError:  # pragma: no cover - transformers without Conv1D
        kinds = (torch.nn.Linear,)
    total = 0
    for name, module in model.named_modules():
        if any(part in ("pooler", "lm_head") for part in name.split(".")):
            continue
        if isinstance(module, kinds):
            total += module.weight.numel()
    return total


def attention_shape(config) -> tuple[int, int]:
    """(blocks, d_attn = heads x head width) of a transformers config."""
    layers = int(config.num_hidden_layers)
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    return layers, heads * int(head_dim)


def forward_flops(tokens: int, sum_sq: int, params: int, layers: int, d_attn: int) -> float:
    """FLOPs of the forward of sequences of ``tokens`` real tokens in all, ``sum_sq`` the
    sum of their squared lengths: ``2 P n + 4 L d_attn n^2`` per sequence (module docstring)."""
    return 2.0 * params * tokens + 4.0 * layers * d_attn * sum_sq


def _fmt(x, spec: str, missing: str = "-") -> str:
    return missing if x is None else format(x, spec)


def table(res: dict) -> str:
    """The results as a fixed-width table (one row per model x dtype), then the extras."""
    head = ("model", "dtype", "bare tok/s", "fwd-only tok/s", "service tok/s", "ratio",
            "GFLOP/tok", "bare TFLOP/s", "bare/peak", "fwd/peak", "note")
    rows = []
    for key, r in (res.get("runs") or {}).items():
        model, dtype = key.rsplit(".", 1)
        note = r.get("skipped") or ""
        if r.get("error"):
            note = "error: " + r["error"].strip().splitlines()[-1][:60]
        elif r.get("service_error"):
            note = "service error: " + r["service_error"].strip().splitlines()[-1][:50]
        target = r.get("ratio_target")
        if target is not None and r.get("ratio") is not None and not note:
            note = f"target >= {target}: {'met' if r['ratio'] >= target else 'MISSED'}"
        tflop = r.get("bare_flop_s")
        rows.append((model, dtype, _fmt(r.get("bare_tok_s"), ",.0f"),
                     _fmt(r.get("forward_only_tok_s"), ",.0f"), _fmt(r.get("service_tok_s"), ",.0f"),
                     _fmt(r.get("ratio"), ".3f"), _fmt(r.get("gflop_per_token"), ".3f"),
                     _fmt(None if tflop is None else tflop / 1e12, ".2f"),
                     _fmt(r.get("bare_frac_peak_bf16"), ".2%"),
                     _fmt(r.get("forward_only_frac_peak_bf16"), ".2%"), note))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)] if rows else [len(h) for h in head]
    lines = ["  ".join(str(x).ljust(w) if i in (0, 1, 10) else str(x).rjust(w)
                       for i, (x, w) in enumerate(zip(row, widths))).rstrip()
             for row in [head, *rows]]
    gpu = res.get("gpu") or {}
    extra = [f"device: {res.get('device')}  {gpu.get('name', '')}  torch {res.get('torch')} "
             f"(CUDA {res.get('torch_cuda')})"]
    if res.get("peak_bf16_flop_s"):
        extra.append(f"peak bf16 dense: {res['peak_bf16_flop_s'] / 1e12:,.0f} TFLOP/s "
                     f"({res.get('peak_source')})")
    if res.get("matmul_bf16_flop_s"):
        extra.append(f"measured 8192^3 bf16 matmul: {res['matmul_bf16_flop_s'] / 1e12:,.0f} TFLOP/s")
    extra += _step_lines(res)
    for shape, v in (res.get("host_ceiling_tok_s") or {}).items():
        extra.append(f"host_ceiling_tok_s.{shape}: " + (f"{v:,.0f}" if isinstance(v, (int, float)) else str(v)))
    if res.get("host_ceiling_skipped"):
        extra.append(f"host ceiling: {res['host_ceiling_skipped']}")
    if res.get("wall_s") is not None:
        extra.append(f"wall: {res['wall_s']} s")
    return "\n".join(lines + [""] + extra)


def _verdict(res: dict, name: str) -> str:
    """``target verdict`` of ``name`` by :data:`benchmarks.run.TARGETS` (empty without)."""
    try:
        from benchmarks.run import verdict
    except Exception:  # noqa: BLE001 - a table printed where benchmarks.run cannot import
        return ""
    target, mark = verdict(res, name)
    return f"  (target {target}: {mark})" if target else ""


def _step_lines(res: dict) -> list[str]:
    """The merge and steady-state steps, one line per figure, under bench.json's names."""
    lines = []
    m = res.get("merge")
    if isinstance(m, dict):
        if m.get("merge_over_bare") is not None:
            lines.append(f"merge.merge_over_bare: {m['merge_over_bare']:.3f}{_verdict(res, 'merge.merge_over_bare')}; "
                         f"window merge {_fmt(m.get('merge_tok_s'), ',.0f')} tok/s over bare index_add_ "
                         f"{_fmt(m.get('bare_tok_s'), ',.0f')} tok/s, {_fmt(m.get('tokens'), ',')} tokens, "
                         f"device {m.get('device')}")
        else:
            lines.append("merge: " + _note(m))
    ss = res.get("steady_state")
    if isinstance(ss, dict):
        for shape, r in ss.items():
            if isinstance(r, dict) and r.get("tok_s") is not None:
                lines.append(f"steady_state.{shape}.tok_s: {r['tok_s']:,.0f}"
                             f"{_verdict(res, f'steady_state.{shape}.tok_s')}; {_fmt(r.get('tokens'), ',')} tokens, "
                             f"{_fmt(r.get('window_tokens'), ',.0f')} a window, checkpoint "
                             f"{_fmt(r.get('checkpoint_s'), '.2f')} s, device {r.get('device')}"
                             + ("; short of 10^7 tokens" if r.get("short_of_1e7") else ""))
            else:
                lines.append(f"steady_state.{shape}: " + _note(r if isinstance(r, dict) else {"error": r}))
    return lines


def _note(r: dict) -> str:
    if r.get("skipped"):
        return f"skipped ({r['skipped']})"
    if r.get("error"):
        return "error: " + str(r["error"]).strip().splitlines()[-1][:100]
    return "no figure"


# ------------------------------------------------------------------ measurement


class Results:
    """The results dict, written (atomically) after every step."""

    def __init__(self, path: Path, data: dict):
        self.path = Path(path)
        self.data = data

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=float) + "\n")
        os.replace(tmp, self.path)


def _start_time(pid: int) -> Optional[int]:
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _descendants(pid: int) -> list[tuple[int, int]]:
    """(process id, start time) of the processes under ``pid`` (Linux /proc; the
    service's workers and Redis run in sessions of their own, so a process-group kill
    would miss them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            start = _start_time(child)
            if start is not None:
                out.append((child, start))
            todo.append(child)
    return out


class Service:
    """``embgeom serve`` (embedded Redis and one worker) for one device and dtype."""

    def __init__(self, env: dict):
        from benchmarks.run import serve_process

        self.tmp = Path(tempfile.mkdtemp(prefix="embgeom-gpu-serve-"))
        self.serve = serve_process(self.tmp, env=env)
        self.ready = False

    def wait_ready(self, timeout: float) -> None:
        self.serve.wait_ready(timeout)
        self.ready = True

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return (self.tmp / "serve.log").read_bytes()[-chars:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, grace: float = 20) -> None:
        """SIGTERM (the service stops its worker and Redis), then SIGKILL to whatever of
        its process tree is left after ``grace`` seconds (by id and start time)."""
        proc = self.serve.process
        tree = _descendants(proc.pid) if proc.poll() is None else []
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except Exception:  # noqa: BLE001 - TimeoutExpired
                proc.kill()
        for pid, start in tree:
            if _start_time(pid) == start:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            proc.wait(timeout=5)
        except Exception:  # noqa: BLE001
            pass
        shutil.rmtree(self.tmp, ignore_errors=True)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_flops(device, n: int = 8192, reps: int = 10) -> float:
    """bf16 FLOP/s of an n^3 matrix product (3 warm-ups, mean of ``reps``, CUDA events)."""
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1000 / reps
    del a, b
    torch.cuda.empty_cache()
    return 2.0 * n ** 3 / seconds


class Geometry:
    """Real tokens, squared lengths and padded positions of the batches seen."""

    def __init__(self):
        self.batches = []
        self.tokens = self.sum_sq = self.padded = 0

    def __call__(self, batch) -> None:
        lengths = batch.attention.sum(axis=1)
        self.tokens += int(lengths.sum())
        self.sum_sq += int((lengths * lengths).sum())
        self.padded += int(batch.attention.size)
        self.batches.append(batch)


def forward_only(loaded, batches) -> float:
    """Seconds of the forward passes alone over ``batches`` already on the device."""
    import torch

    on_device = [(torch.from_numpy(b.input_ids).to(loaded.device),
                  torch.from_numpy(b.attention).to(loaded.device)) for b in batches]
    _sync(loaded.device)
    start = time.perf_counter()
    for ids, attention in on_device:
        hidden = loaded.hidden_states(ids, attention)
        del hidden
    _sync(loaded.device)
    return time.perf_counter() - start


class Bench:
    def __init__(self, args, results: Results, deadline: float):
        self._failures = {}
        self.args = args
        self.res = results
        self.deadline = deadline
        self.tmp = Path(tempfile.mkdtemp(prefix="embgeom-gpu-bench-"))
        self.texts: list[str] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    # -- models ---------------------------------------------------------------

    def register_gpt2_random(self) -> Path:
        """Add ``gpt2_random`` to ``EMBGEOM_MODELS`` (this process's settings and, through
        the environment, the service's), at the folder :meth:`build_gpt2_random` fills:
        an alias resolves to its folder on first use, so the service may start first."""
        folder = self.tmp / "gpt2_random"
        extra = json.loads(os.environ.get("EMBGEOM_MODELS") or "{}")
        extra["gpt2_random"] = {"source": str(folder), "description": "GPT-2 shape at random (seed 0)"}
        os.environ["EMBGEOM_MODELS"] = json.dumps(extra)
        return folder

    def build_gpt2_random(self, folder: Path) -> None:
        """The random GPT-2 with SmolLM2's tokenizer (MiniLM's where SmolLM2 is missing)."""
        from embgeom.compute.catalogue import ModelRegistry
        from embgeom.settings import Settings
        from embgeom.sources import minilm_path

        t = time.perf_counter()
        registry = ModelRegistry.from_settings(Settings())
        try:
            source, name = registry.path("smollm2"), "smollm2"
        except Exception as exc:  # noqa: BLE001 - the package missing: MiniLM's WordPiece
            _log(f"SmolLM2's tokenizer unavailable ({exc}); gpt2_random takes MiniLM's")
            source, name = minilm_path(), "minilm"
        build_gpt2_random(folder, source, seed=0)
        self.res.data["gpt2_random"] = {"shape": GPT2_SHAPE, "seed": 0, "tokenizer": name,
                                        "folder": str(folder), "build_s": round(time.perf_counter() - t, 1)}

    # -- one model x dtype ----------------------------------------------------

    def measure(self, out: dict, pool, model: str, dtype: str, service_for) -> dict:
        """Bare forward, forward only and FLOPs of ``model``, and the service on the same
        texts and jobs. Figures go into ``out`` as they come (an interruption keeps them)."""
        import httpx
        import torch

        from benchmarks.run import bare_forward, run_jobs, split_jobs

        args = self.args
        out.update(model=model, dtype=dtype)
        t = time.perf_counter()
        loaded = pool.get(model)
        out["load_s"] = round(time.perf_counter() - t, 2)
        info = loaded.info
        config = loaded.model.config
        params = matmul_params(loaded.model)
        layers, d_attn = attention_shape(config)
        out["info"] = {"architecture": info.architecture, "blocks": info.num_layers,
                       "hidden_size": info.hidden_size, "vocab_size": info.vocab_size,
                       "max_length": info.max_length, "d_attn": d_attn,
                       "params_total": sum(p.numel() for p in loaded.model.parameters()),
                       "params_matmul": params,
                       "attn_implementation": getattr(config, "_attn_implementation", None)}
        budget = args.token_budget
        per_job = args.texts_per_job
        cal = max(1, min(per_job, args.texts // 2)) if args.texts else per_job
        first, second = self.texts[:cal], self.texts[cal:2 * cal]
        # Warm-up (kernels, allocator, cuBLAS), then one job's rate sizes the runs.
        bare_forward(loaded, [first], budget)
        cal_s, cal_tokens = bare_forward(loaded, [second], budget)
        tok_per_text = cal_tokens / len(second)
        out["calibration_tok_s"] = cal_tokens / cal_s

        # The service: its first job loads the model into its worker; its second, on a
        # fresh collection like every run's, sizes the runs too (a run lasts about
        # --service-seconds, or its bare forward about --seconds-per-run, whichever is less).
        client, service, ratios = None, [], []

        def service_failed(exc: BaseException) -> None:
            nonlocal client
            out["service_error"] = f"{type(exc).__name__}: {exc}"
            if self._svc is not None:
                out["service_log_tail"] = self._svc.log_tail()
            if client is not None:
                client.close()
                client = None
            self.service_failed(dtype)

        try:
            svc = service_for()
            client = httpx.Client(base_url=svc.serve.url, timeout=120)
            t = time.perf_counter()
            run_jobs(client, f"warm-{model}-{dtype}", [first], model=model,
                     timeout=max(10, min(args.warm_cap, self.left() - 10)))
            out["service_warm_s"] = round(time.perf_counter() - t, 2)
            s, c = run_jobs(client, f"cal-{model}-{dtype}", [second], model=model,
                            timeout=max(10, min(args.run_cap, self.left() - 10)))
            out["service_calibration_tok_s"] = c / s
            self._delete(client, out, f"warm-{model}-{dtype}", f"cal-{model}-{dtype}")
        except Exception as exc:  # noqa: BLE001 - recorded; the bare figures go on
            service_failed(exc)

        if args.texts:
            n = args.texts
        else:
            tokens = out["calibration_tok_s"] * args.seconds_per_run
            if out.get("service_calibration_tok_s"):
                tokens = min(tokens, out["service_calibration_tok_s"] * args.service_seconds)
            n = max(2 * per_job, min(int(tokens / max(tok_per_text, 1e-9)), args.max_texts))
        n_jobs = max(2, math.ceil(n / per_job))
        texts = self._texts(n)
        jobs = split_jobs(texts, n_jobs)
        out.update(texts=n, jobs=n_jobs, texts_per_job=math.ceil(n / n_jobs), token_budget=budget)
        self.res.save()

        # Bare forward (the geometry of the batches recorded on the first run).
        geom = Geometry()
        if loaded.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(loaded.device)
        seconds, counted = bare_forward(loaded, jobs, budget, on_batch=geom)
        bare = [counted / seconds]
        out.update(tokens_counted=counted, tokens_real=geom.tokens, positions_padded=geom.padded,
                   padding_share=1 - geom.tokens / max(1, geom.padded), batches=len(geom.batches))
        flops = forward_flops(geom.tokens, geom.sum_sq, params, layers, d_attn)
        out["gflop_per_token"] = flops / max(1, geom.tokens) / 1e9
        out["gflop_per_token_2p"] = 2 * params / 1e9
        # Forward passes alone, the same batches on the device.
        fwd_s = forward_only(loaded, geom.batches)
        geom.batches = []
        out["forward_only_tok_s"] = counted / fwd_s
        out["forward_only_flop_s"] = flops / fwd_s
        if loaded.device.type == "cuda":
            out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(loaded.device) / 2**30
        if model == "mpnet" and dtype == "bf16" and loaded.device.type == "cuda":
            out["ratio_target"] = TARGET_RATIO

        def summarise():
            out["bare_tok_s"] = statistics.median(bare)
            out["bare_tok_s_runs"] = bare
            out["bare_flop_s"] = flops / counted * out["bare_tok_s"]
            peak = self.res.data.get("peak_bf16_flop_s")
            if peak:
                out["bare_frac_peak_bf16"] = out["bare_flop_s"] / peak
                out["forward_only_frac_peak_bf16"] = out["forward_only_flop_s"] / peak
            if service:
                out.update(service_tok_s=statistics.median(service), service_tok_s_runs=service,
                           ratio=statistics.median(service) / statistics.median(bare),
                           ratio_per_repeat=ratios)
            self.res.save()

        summarise()
        # The service, alternated with the bare forward: bare, service; service, bare; ...
        try:
            for r in range(args.repeat if client is not None else 0):
                expected = counted / bare[-1] + (counted / service[-1] if service else
                                                 counted / bare[-1] * 3) + 10
                if r and self.left() < expected + 15:
                    out["repeats_cut"] = f"{r} of {args.repeat} repeats: budget"
                    break
                for what in (("bare", "service") if r % 2 == 0 else ("service", "bare")):
                    if what == "bare" and r:  # the first repeat's bare run is the one above
                        s, c = bare_forward(loaded, jobs, budget)
                        bare.append(c / s)
                    elif what == "service":
                        name = f"e2e-{model}-{dtype}-{r}"
                        cap = max(5.0, min(args.run_cap, self.left() - 10))
                        s, c = run_jobs(client, name, jobs, model=model, timeout=cap)
                        service.append(c / s)
                        out["service_tokens_counted"] = c
                        self._delete(client, out, name)
                ratios.append(service[-1] / bare[-1])
                summarise()
        except Exception as exc:  # noqa: BLE001 - recorded; the next model goes on
            service_failed(exc)
        finally:
            if client is not None:
                client.close()
        summarise()
        return out

    def _delete(self, client, out: dict, *collections: str) -> None:
        """Drop measured collections (Redis memory, and the AOF once it is rewritten: an
        MPNet run over BBC leaves gigabytes)."""
        for name in collections:
            try:
                client.delete(f"/v1/collections/{name}").raise_for_status()
            except Exception as exc:  # noqa: BLE001 - recorded, not fatal
                out.setdefault("delete_errors", []).append(f"{name}: {type(exc).__name__}: {exc}")

    def _texts(self, n: int) -> list[str]:
        if len(self.texts) < n:
            from benchmarks.run import e2e_texts

            self.texts = e2e_texts(n, held_out=False, cycle=True)
        return self.texts[:n]

    # -- the service ----------------------------------------------------------

    _svc: Optional[Service] = None
    _failures: dict = {}  # dtype -> service failures; a service that never got ready: 99

    def service(self, dtype: str) -> Service:
        """The running service for ``dtype``, started again after a failure, not after
        two (nor after one that never got ready: each would cost --ready-cap again)."""
        if self._failures.get(dtype, 0) >= 2:
            raise RuntimeError(f"embgeom serve for {dtype} failed before: not started again")
        if self._svc is None:
            self.start_service(dtype)
        if not self._svc.ready:
            try:
                self._svc.wait_ready(max(10, min(self.args.ready_cap, self.left() - 10)))
            except Exception:
                self._failures[dtype] = 99
                raise RuntimeError("embgeom serve not ready:\n" + self._svc.log_tail()) from None
        return self._svc

    def service_failed(self, dtype: str) -> None:
        self._failures[dtype] = self._failures.get(dtype, 0) + 1
        self.drop_service()

    def start_service(self, dtype: str) -> None:
        self.drop_service()
        env = {"EMBGEOM_DEVICE": self.args.device, "EMBGEOM_DTYPE": dtype,
               "EMBGEOM_TOKEN_BUDGET": str(self.args.token_budget),
               "EMBGEOM_MODELS": os.environ.get("EMBGEOM_MODELS", "{}")}
        self._svc = Service(env)

    def drop_service(self) -> None:
        if self._svc is not None:
            svc, self._svc = self._svc, None
            svc.stop()

    # -- all ------------------------------------------------------------------

    def run(self) -> None:
        """The steps in order: the models (to the deadline less what the merge and the
        steady state keep), the merge, the steady state, the host ceiling."""
        args = self.args
        deadline = self.deadline
        self.deadline -= (args.merge_seconds if args.merge else 0) + (args.steady_seconds if args.steady else 0)
        try:
            self.models()
        finally:
            self.deadline = deadline
        if args.merge:
            self.merge()
        if args.steady:
            self.steady_state()
        if args.ceiling:
            self.host_ceiling()

    def models(self) -> None:
        """Step 1: each model x dtype (:meth:`measure`)."""
        from embgeom.compute.catalogue import ModelRegistry
        from embgeom.compute.models import ModelPool
        from embgeom.settings import Settings

        args, data = self.args, self.res.data
        runs = data.setdefault("runs", {})
        gpt2 = self.register_gpt2_random() if "gpt2_random" in args.models else None
        for i, dtype in enumerate(args.dtypes):
            # The service starts (its Redis, its worker's imports) while this process loads.
            if self.left() > args.min_seconds_per_model:
                self.start_service(dtype)
            if i == 0:
                if gpt2 is not None:
                    try:
                        self.build_gpt2_random(gpt2)
                    except Exception as exc:  # noqa: BLE001
                        data["gpt2_random"] = {"error": traceback.format_exc(limit=3)}
                        _log(f"gpt2_random not built: {exc}")
                    self.res.save()
                self._texts(2 * args.texts_per_job)
            pool = ModelPool(ModelRegistry.from_settings(Settings()), args.device, max_models=1, dtype=dtype)
            for model in args.models:
                key = f"{model}.{dtype}"
                if self.left() < args.min_seconds_per_model:
                    runs[key] = {"skipped": f"budget: {self.left():.0f} s left"}
                    _log(f"{key}: skipped (budget)")
                    continue
                if model == "gpt2_random" and "folder" not in data.get("gpt2_random", {}):
                    runs[key] = {"error": "gpt2_random was not built (see gpt2_random.error)"}
                    continue
                _log(f"{key}: measuring ({self.left():.0f} s left)")
                runs[key] = {}
                try:
                    r = self.measure(runs[key], pool, model, dtype, lambda: self.service(dtype))
                    _log(f"{key}: bare {r['bare_tok_s']:,.0f} tok/s, forward only "
                         f"{r['forward_only_tok_s']:,.0f}, service {_fmt(r.get('service_tok_s'), ',.0f')} "
                         f"tok/s, ratio {_fmt(r.get('ratio'), '.3f')}"
                         + (f"; {r['service_error'].splitlines()[0]}" if r.get("service_error") else ""))
                except Exception as exc:  # noqa: BLE001 - recorded; the next model goes on
                    runs[key]["error"] = traceback.format_exc(limit=4)
                    _log(f"{key}: error {type(exc).__name__}: {exc}")
                finally:
                    pool._models.clear()
                    self._free()
                    self.res.save()
            self.drop_service()

    def _free(self) -> None:
        import torch

        if torch.device(self.args.device).type == "cuda":
            torch.cuda.empty_cache()

    def merge(self) -> None:
        """Step 2: :func:`benchmarks.run.bench_merge` on the device, if the budget allows."""
        args, data = self.args, self.res.data
        if self.left() < args.merge_seconds:
            data["merge"] = {"skipped": f"budget: {self.left():.0f} s left", "device": args.device}
            _log("merge: skipped (budget)")
            self.res.save()
            return
        _log(f"merge: {args.merge_jobs} jobs, {args.merge_repeat} repeats on {args.device} ({self.left():.0f} s left)")
        try:
            from benchmarks.run import bench_merge

            data["merge"] = m = bench_merge(args.merge_jobs, args.merge_repeat, args.device)
            _log(f"merge: merge_over_bare {m['merge_over_bare']:.3f} (merge {m['merge_tok_s']:,.0f} tok/s, "
                 f"bare {m['bare_tok_s']:,.0f} tok/s, {m['device']})")
        except Interrupted:
            data["merge"] = {"skipped": "interrupted (SIGTERM)", "device": args.device}
            raise
        except Exception as exc:  # noqa: BLE001 - recorded; the steady state goes on
            data["merge"] = {"error": traceback.format_exc(limit=6), "device": args.device}
            _log(f"merge: error {type(exc).__name__}: {exc}")
        finally:
            self._free()
            self.res.save()

    def steady_state(self) -> None:
        """Step 3: :func:`benchmarks.steady_state.bench_steady_state` on the device, one
        shape a call, the shapes sharing at most ``--steady-seconds`` of what is left."""
        import torch

        args, data = self.args, self.res.data
        out = data.setdefault("steady_state", {})
        quick = args.steady_quick if args.steady_quick is not None else torch.device(args.device).type != "cuda"
        end = time.monotonic() + min(args.steady_seconds, max(0.0, self.left()))
        shapes = args.steady_shapes
        for i, shape in enumerate(shapes):
            left = min(end - time.monotonic(), self.left())
            share = left / (len(shapes) - i) - STEADY_WIND_DOWN_S
            if share < args.steady_min_seconds:
                out[shape] = {"skipped": f"budget: {max(0.0, left):.0f} s left for {len(shapes) - i} shapes",
                              "device": args.device}
                _log(f"steady_state {shape}: skipped (budget)")
                self.res.save()
                continue
            _log(f"steady_state {shape}: {share:.0f} s on {args.device} ({self.left():.0f} s left)")
            try:
                from benchmarks.steady_state import bench_steady_state

                out[shape] = bench_steady_state(quick, None, device=args.device, budget_s=share,
                                                tokens=args.steady_tokens, shapes=[shape],
                                                max_store_bytes=args.steady_max_store_bytes)[shape]
                out[shape]["budget_s"] = round(share, 1)
                out[shape]["quick"] = quick
            except Interrupted:
                out[shape] = {"skipped": "interrupted (SIGTERM)", "device": args.device}
                raise
            except Exception as exc:  # noqa: BLE001 - recorded; the next shape goes on
                out[shape] = {"error": traceback.format_exc(limit=6), "device": args.device}
                _log(f"steady_state {shape}: error {type(exc).__name__}: {exc}")
            finally:
                self._free()
                self.res.save()

    def host_ceiling(self) -> None:
        """The CPU-side replay figures (quick sizes), while the budget allows."""
        from benchmarks.run import Slowest, replay_store

        data = self.res.data
        sizes = {"minilm": 4, "mpnet_shape": 2, "1b_shape": 1}
        ceilings = data.setdefault("host_ceiling_tok_s", {})
        slowest = Slowest()
        for shape, jobs in sizes.items():
            if self.left() < self.args.ceiling_seconds:
                data["host_ceiling_skipped"] = (f"{shape} and after: budget ({self.left():.0f} s left); "
                                                "run `python -m benchmarks.run --only ceiling`")
                break
            _log(f"host ceiling {shape} ({jobs} jobs)")
            try:
                with replay_store(shape, jobs, slowest) as (out, _, _):
                    ceilings[shape] = out["tok_s"]
                    data.setdefault("host_ceiling_stages", {})[shape] = out
            except Exception as exc:  # noqa: BLE001
                ceilings[shape] = f"error: {type(exc).__name__}: {exc}"
            self.res.save()

    def close(self, grace: float = 20) -> None:
        if self._svc is not None:
            svc, self._svc = self._svc, None
            svc.stop(grace)
        shutil.rmtree(self.tmp, ignore_errors=True)


# ------------------------------------------------------------------------- main


def _default_out() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "gpu_bench.json" if out else REPO / "gpu_bench.json"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="mpnet,minilm,smollm2,gpt2_random")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--texts", type=int, default=0,
                        help="texts per run (default: sized so a bare run lasts --seconds-per-run)")
    parser.add_argument("--seconds-per-run", type=float, default=3,
                        help="a run's bare forward lasts about this long (unless --service-seconds binds)")
    parser.add_argument("--service-seconds", type=float, default=8,
                        help="a service run lasts about this long at most (by its calibration job)")
    parser.add_argument("--max-texts", type=int, default=400_000)
    parser.add_argument("--texts-per-job", type=int, default=2000)
    parser.add_argument("--token-budget", type=int, default=None,
                        help="padded tokens per batch, here and in the service (default: Settings)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--budget-seconds", type=float, default=430,
                        help="the whole run, model loading included")
    parser.add_argument("--run-cap", type=float, default=60, help="seconds one service run may take")
    parser.add_argument("--warm-cap", type=float, default=120,
                        help="seconds the service's first job of a model may take (model loading)")
    parser.add_argument("--ready-cap", type=float, default=90, help="seconds embgeom serve may take to start")
    parser.add_argument("--min-seconds-per-model", type=float, default=40,
                        help="a model x dtype does not start with less than this left")
    parser.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                        help="skip the CPU-side replay figures")
    parser.add_argument("--ceiling-seconds", type=float, default=40,
                        help="a replay shape does not start with less than this left")
    parser.add_argument("--no-merge", dest="merge", action="store_false", help="skip the merge step")
    parser.add_argument("--merge-jobs", type=int, default=12, help="recorded BBC jobs the merge replays")
    parser.add_argument("--merge-repeat", type=int, default=3, help="alternated merge / bare repeats")
    parser.add_argument("--merge-seconds", type=float, default=30,
                        help="kept for the merge out of the budget; it does not start with less left")
    parser.add_argument("--no-steady-state", dest="steady", action="store_false",
                        help="skip the steady-state step")
    parser.add_argument("--steady-shapes", default="minilm,mpnet_shape,1b_shape",
                        help="shapes of benchmarks.steady_state, in this order")
    parser.add_argument("--steady-seconds", type=float, default=150,
                        help="kept for the steady state out of the budget: the shapes share at most this")
    parser.add_argument("--steady-min-seconds", type=float, default=15,
                        help="a steady-state shape does not start with a smaller share")
    parser.add_argument("--steady-tokens", type=int, default=None,
                        help="tokens per shape (default 10^7 on a GPU, steady_state.CPU_TOKENS on a CPU)")
    parser.add_argument("--steady-max-store-bytes", type=float, default=None,
                        help="bound on a shape's seeded vocabulary (default 1e9 on a GPU, "
                             "steady_state.CPU_STORE_BYTES on a CPU)")
    parser.add_argument("--steady-quick", action=argparse.BooleanOptionalAction, default=None,
                        help="one recorded batch a job (default: on a CPU, not on a GPU)")
    parser.add_argument("--peak-flops", type=float, default=None,
                        help="peak dense bf16 FLOP/s of the device (default: by its name)")
    parser.add_argument("--out", type=Path, default=None, help="results JSON (default $OUT/gpu_bench.json)")
    parser.add_argument("--table", type=Path, default=None, metavar="PATH",
                        help="print the table of a results file and exit")
    args = parser.parse_args(argv)
    if args.table is not None:
        print(table(json.loads(args.table.read_text())))
        return 0
    args.models = [m for m in args.models.split(",") if m]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.steady_shapes = [x for x in args.steady_shapes.split(",") if x]

    start = time.monotonic()
    deadline = start + args.budget_seconds
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    signal.signal(signal.SIGTERM, _on_sigterm)
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()

    from embgeom.settings import Settings

    if args.token_budget is None:
        args.token_budget = Settings().token_budget
    device = torch.device(args.device)
    if args.steady_max_store_bytes is None and device.type == "cuda":
        args.steady_max_store_bytes = 1e9
    data: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "device": args.device,
                  "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cpus": os.cpu_count(),
                  "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  "flops_formula": "per sequence of n real tokens: 2*P*n + 4*L*d_attn*n^2 "
                                   "(P = Linear/Conv1D weights outside pooler and LM head)",
                  "runs": {}}
    results = Results(args.out or _default_out(), data)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device: "
                  "this torch is a CPU build or the driver is missing", file=sys.stderr)
            data["error"] = "torch.cuda.is_available() is False"
            results.save()
            return 3
        props = torch.cuda.get_device_properties(device)
        name = torch.cuda.get_device_name(device)
        data["gpu"] = {"name": name, "memory_gib": round(props.total_memory / 2**30, 1),
                       "multiprocessors": props.multi_processor_count,
                       "capability": f"{props.major}.{props.minor}"}
        try:
            data["tf32_matmul"] = bool(torch.backends.cuda.matmul.allow_tf32)
        except Exception:  # noqa: BLE001 - a torch that renamed it
            pass
    else:
        name = ""
    peak = args.peak_flops or peak_bf16_flops(name)
    data["peak_bf16_flop_s"] = peak
    data["peak_source"] = ("--peak-flops" if args.peak_flops else
                           f"datasheet, dense bf16 ({name})" if peak else "unknown: pass --peak-flops")
    results.save()
    bench = Bench(args, results, deadline)
    try:
        if device.type == "cuda":
            try:
                data["matmul_bf16_flop_s"] = matmul_flops(device)
            except Exception as exc:  # noqa: BLE001
                data["matmul_error"] = f"{type(exc).__name__}: {exc}"
        bench.run()
    except Interrupted:
        data["interrupted"] = "SIGTERM (time limit)"
        _log("interrupted: writing what was measured")
    except Exception:  # noqa: BLE001 - recorded: the table of what was measured still prints
        data["error"] = traceback.format_exc(limit=6)
        _log(data["error"])
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        data["wall_s"] = round(time.monotonic() - start, 1)
        results.save()
        print()
        print(table(data))
        print(f"\nwrote {results.path}", flush=True)
        bench.close(grace=5 if data.get("interrupted") else 20)
    return 0 if not data.get("error") else 1


if __name__ == "__main__":
    sys.exit(main())
