"""Benchmarks of the ingestion path, on real BBC paragraphs and a packaged model.

``python -m embgeom.bench [--model minilm] [--texts 200] [--repeat 3] [--json]``

Every comparison is measured side by side in the same run (the two variants alternate
within each repeat, so a machine shared with other work slows both alike) and reported as
the median over the repeats, together with the median of the per-repeat ratios:

- ingestion: tokens/s of the forward pass alone against forward + device reduction
  (:func:`embgeom.reduce.reduce_batch`) + worker-local accumulation
  (:func:`embgeom.pipeline.accumulate_texts`), with where the extra time goes;
- reduction: ``reduce_batch`` (``index_add_`` segment sums) against a naive Python loop
  over the occurrences of the same batch; the two must agree within 1e-10;
- commit: :meth:`embgeom.store.AccumulatorStore.commit_job` against a real Redis
  (:class:`embgeom.redis_server.RedisServer`, AOF ``appendfsync always``) in a temporary
  folder: time per job, bytes written;
- reads: the unfiltered decomposition (O(d) maintained aggregates) against a count-filtered
  one (a scan of every token type), on the same data; the O(d) answer must equal a scan;
- memory: worker-local :class:`embgeom.stats.TokenAccumulator` bytes against a dense
  ``vocab x layers x d`` float64 array (computed, never allocated), and Redis
  ``used_memory``;
- invariance: the same texts under token budgets 512, 4096 and 16384 give the same
  token counts and per-token statistics up to float32 forward noise.

Benchmarks print figures and ratios; nothing here asserts a wall-clock time. The
correctness checks (equalities) do raise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from embgeom import keys as K
from embgeom import pipeline as _pipeline
from embgeom.pipeline import JobMoments, accumulate_texts
from embgeom.positions import batches_by_token_budget, encode_windows
from embgeom.reduce import reduce_batch
from embgeom.stats import LayerMoments, TokenAccumulator, TokenMoments

__all__ = [
    "DENSE_MODELS", "REDUCE_TOLERANCE", "INVARIANCE_TOLERANCE", "BUDGETS",
    "load_model", "bench_ingest", "bench_reduce", "naive_reduce", "bench_store",
    "bench_memory", "bench_invariance", "token_bytes", "layer_state_bytes", "accumulator_bytes", "run_bench", "figures", "format_table", "main",
]

# (vocab, hidden_states entries = blocks + 1, d) of the models the design names; the
# dense per-vocabulary float64 array the service must never allocate is their product x 8.
DENSE_MODELS: dict[str, tuple[int, int, int]] = {
    "all-MiniLM-L6-v2": (30522, 7, 384),
    "all-mpnet-base-v2": (30527, 13, 768),
    "SmolLM2-135M": (49152, 31, 576),
    "gemma-3-270m": (262144, 19, 640),
}

REDUCE_TOLERANCE = 1e-10       # reduce_batch vs the naive loop: both float64
INVARIANCE_TOLERANCE = 1e-4    # budgets change padding and BLAS blocking of a float32 forward
BUDGETS = (512, 4096, 16384)
DEFAULT_BUDGET = 16384


# ----------------------------------------------------------------------------- helpers


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def _max_rel(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b| (0 for two empty or all-zero arrays that agree)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {a.shape} vs {b.shape}")
    if a.size == 0:
        return 0.0
    diff = float(np.max(np.abs(a - b)))
    scale = float(np.max(np.abs(b)))
    return diff / scale if scale > 0 else diff


class _Timer:
    """Accumulates the wall time of the calls it wraps."""

    def __init__(self, device):
        self.device = device
        self.seconds = 0.0
        self.calls = 0

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            _sync(self.device)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            return out
        return timed


def load_model(name: str = "minilm", device: Optional[str] = None):
    """The alias ``name`` from the service's registry, loaded on ``device``."""
    from embgeom.models import ModelPool, ModelRegistry
    from embgeom.settings import Settings

    settings = Settings()
    registry = ModelRegistry.from_settings(settings)
    return ModelPool(registry, device or settings.device, max_models=1).get(name)


def _windows_and_batches(loaded, texts, budget):
    windows = encode_windows(loaded.tokenizer, texts, loaded.info.max_length)
    return windows, list(batches_by_token_budget(windows, max(budget, loaded.info.max_length)))


# ----------------------------------------------------------------------------- ingestion


def _forward_only(loaded, texts: Sequence[str], budget: int) -> float:
    start = time.perf_counter()
    _, batches = _windows_and_batches(loaded, texts, budget)
    for batch in batches:
        hidden, _, _ = loaded.hidden_states(batch)
        del hidden
    _sync(loaded.device)
    return time.perf_counter() - start


@contextlib.contextmanager
def _instrumented(loaded):
    """Time the forward passes, reductions and accumulator merges that
    :func:`accumulate_texts` makes, without copying its loop."""
    forward, reduce, add = _Timer(loaded.device), _Timer(loaded.device), _Timer(loaded.device)
    original_reduce = _pipeline.reduce_batch
    original_acc = _pipeline.TokenAccumulator

    class TimedAccumulator(original_acc):
        pass

    TimedAccumulator.add = add.wrap(original_acc.add)
    loaded.hidden_states = forward.wrap(loaded.hidden_states)
    _pipeline.reduce_batch = reduce.wrap(original_reduce)
    _pipeline.TokenAccumulator = TimedAccumulator
    try:
        yield forward, reduce, add
    finally:
        _pipeline.reduce_batch = original_reduce
        _pipeline.TokenAccumulator = original_acc
        del loaded.hidden_states


def bench_ingest(loaded, texts: Sequence[str], repeat: int = 3,
                 budget: int = DEFAULT_BUDGET) -> tuple[dict, JobMoments]:
    """Tokens/s of forward only vs forward + reduce + accumulate, side by side.

    Returns the figures and the :class:`JobMoments` of the last full run.
    """
    windows, batches = _windows_and_batches(loaded, texts, budget)
    counted = sum(sum(w.counted) for w in windows)
    loaded.hidden_states(batches[0][:1])  # warm-up: first-call allocations, lazy inits
    fwd_s, full_s, parts = [], [], []
    moments = None
    for r in range(repeat):
        order = ("forward", "full") if r % 2 == 0 else ("full", "forward")
        for what in order:
            if what == "forward":
                fwd_s.append(_forward_only(loaded, texts, budget))
                continue
            with _instrumented(loaded) as (forward, reduce, add):
                start = time.perf_counter()
                moments = accumulate_texts(loaded, texts, token_budget=budget)
                total = time.perf_counter() - start
            full_s.append(total)
            parts.append((forward.seconds, reduce.seconds, add.seconds, total))
    assert moments is not None and moments.counted == counted, "every counted token is accumulated"
    ratios = [f / w for f, w in zip(full_s, fwd_s)]
    forward_in, reduce_in, add_in = (
        _median([p[i] / p[3] for p in parts]) for i in range(3)
    )
    figures = {
        "texts": len(texts),
        "windows": len(windows),
        "batches": len(batches),
        "tokens": counted,
        "forward_s": _median(fwd_s),
        "full_s": _median(full_s),
        "forward_tokens_per_s": _median([counted / s for s in fwd_s]),
        "full_tokens_per_s": _median([counted / s for s in full_s]),
        "overhead_ratio": _median(ratios),
        "full_share_forward": forward_in,
        "full_share_reduce": reduce_in,
        "full_share_accumulate": add_in,
        "full_share_other": max(0.0, 1.0 - forward_in - reduce_in - add_in),
    }
    return figures, moments


# ----------------------------------------------------------------------------- reduction


def naive_reduce(hidden_states, keys: torch.Tensor, counted: torch.Tensor
                 ) -> tuple[TokenMoments, LayerMoments]:
    """The reference reduction: a Python loop over occurrences, float64 numpy.

    Per-token moments are accumulated one occurrence at a time (a dict of running sums,
    then a second pass for ``m2`` and unit vectors); the per-layer moments, which have no
    per-token loop to replace, use the same vectorised formulas as :func:`reduce_batch`.
    """
    mask = counted.cpu()
    X = np.stack([h.detach().cpu()[mask].to(torch.float64).numpy() for h in hidden_states])  # (L, N, d)
    flat = keys.cpu()[mask].tolist()
    L, N, d = X.shape
    sums: dict[int, np.ndarray] = {}
    count: dict[int, int] = {}
    for i, t in enumerate(flat):
        if t in sums:
            sums[t] += X[:, i]
            count[t] += 1
        else:
            sums[t] = X[:, i].copy()
            count[t] = 1
    means = {t: s / count[t] for t, s in sums.items()}
    m2 = {t: np.zeros(L) for t in sums}
    unit = {t: np.zeros((L, d)) for t in sums}
    for i, t in enumerate(flat):
        x = X[:, i]
        dev = x - means[t]
        m2[t] += np.einsum("ld,ld->l", dev, dev)
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        unit[t] += np.where(norms > 0, x / np.where(norms > 0, norms, 1.0), 0.0)
    ids = sorted(sums)
    tokens = TokenMoments(
        ids=np.array(ids, dtype=np.int64),
        n=np.array([count[t] for t in ids], dtype=np.int64),
        mean=np.stack([means[t] for t in ids], axis=1) if ids else np.zeros((L, 0, d)),
        m2=np.stack([m2[t] for t in ids], axis=1) if ids else np.zeros((L, 0)),
        unit_sum=np.stack([unit[t] for t in ids], axis=1) if ids else np.zeros((L, 0, d)),
    )
    layer_mean = X.mean(axis=1)
    centred = X - layer_mean[:, None, :]
    norms = np.linalg.norm(X, axis=2, keepdims=True)
    u = np.where(norms > 0, X / np.where(norms > 0, norms, 1.0), 0.0)
    layers = LayerMoments(
        n=N, mean=layer_mean, comoment=np.stack([c.T @ c for c in centred]),
        unit_sum=u.sum(axis=1), unit_sq_sum=(u * u).sum(axis=1), within=tokens.m2.sum(axis=1),
    )
    return tokens, layers


def _reduce_errors(a: tuple[TokenMoments, LayerMoments], b: tuple[TokenMoments, LayerMoments]) -> dict:
    ta, la = a
    tb, lb = b
    if not np.array_equal(ta.ids, tb.ids) or not np.array_equal(ta.n, tb.n) or la.n != lb.n:
        raise AssertionError("reduce_batch and the naive loop see different tokens or counts")
    return {
        "token_mean": _max_rel(ta.mean, tb.mean), "token_m2": _max_rel(ta.m2, tb.m2),
        "token_unit_sum": _max_rel(ta.unit_sum, tb.unit_sum),
        "layer_mean": _max_rel(la.mean, lb.mean), "layer_comoment": _max_rel(la.comoment, lb.comoment),
        "layer_unit_sum": _max_rel(la.unit_sum, lb.unit_sum),
        "layer_unit_sq_sum": _max_rel(la.unit_sq_sum, lb.unit_sq_sum),
        "layer_within": _max_rel(la.within, lb.within),
    }


@torch.inference_mode()
def _comoment_only(hidden_states, counted) -> None:
    """The per-layer co-moment matmuls of reduce_batch alone (to show their share)."""
    mask = counted.to(hidden_states[0].device)
    for h in hidden_states:
        x = h[mask].to(torch.float64)
        centred = x - x.mean(dim=0)
        centred.T @ centred


def bench_reduce(loaded, texts: Sequence[str], repeat: int = 3, budget: int = DEFAULT_BUDGET) -> dict:
    """reduce_batch vs the naive loop on the batch holding the most counted tokens."""
    _, batches = _windows_and_batches(loaded, texts, budget)
    batch = max(batches, key=lambda b: sum(sum(w.counted) for w in b))
    hidden, keys, counted = loaded.hidden_states(batch)
    _sync(loaded.device)
    fast_s, naive_s, com_s = [], [], []
    fast = naive = None
    for r in range(repeat):
        steps = ["fast", "naive", "comoment"]
        if r % 2:
            steps.reverse()
        for step in steps:
            start = time.perf_counter()
            if step == "fast":
                fast = reduce_batch(hidden, keys, counted)
                fast_s.append(time.perf_counter() - start)
            elif step == "naive":
                naive = naive_reduce(hidden, keys, counted)
                naive_s.append(time.perf_counter() - start)
            else:
                _comoment_only(hidden, counted)
                _sync(loaded.device)
                com_s.append(time.perf_counter() - start)
    errors = _reduce_errors(fast, naive)
    worst = max(errors.values())
    if not worst <= REDUCE_TOLERANCE:
        raise AssertionError(f"reduce_batch and the naive loop differ by {worst:.3g} (> {REDUCE_TOLERANCE}): {errors}")
    return {
        "batch_rows": len(batch),
        "batch_padded_tokens": int(counted.numel()),
        "batch_tokens": int(counted.sum()),
        "batch_types": len(fast[0]),
        "layers": len(hidden),
        "reduce_s": _median(fast_s),
        "naive_s": _median(naive_s),
        "speedup": _median([n / f for n, f in zip(naive_s, fast_s)]),
        "comoment_share": _median([c / f for c, f in zip(com_s, fast_s)]),
        "max_rel_error": worst,
        "errors": errors,
    }


# ----------------------------------------------------------------------------- Redis


def _redis_bytes(client) -> tuple[int, int]:
    """(AOF size, bytes received by the server) — what a commit writes."""
    persistence = client.info("persistence")
    stats = client.info("stats")
    return int(persistence.get("aof_current_size", 0)), int(stats["total_net_input_bytes"])


def _settled_memory(client, timeout: float = 60.0) -> dict:
    """INFO memory once no AOF rewrite is running (its buffer would count as used)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = client.info("persistence")
        if not p.get("aof_rewrite_in_progress") and not p.get("aof_rewrite_scheduled"):
            break
        time.sleep(0.05)
    return client.info("memory")


def _decomposition_agreement(fast_rows: list[dict], scan_rows: list[dict]) -> float:
    """max over layers and fields of |fast - scan| / Q (0 when both are empty)."""
    worst = 0.0
    for a, b in zip(fast_rows, scan_rows):
        if a["n"] != b["n"] or a["num_types"] != b["num_types"]:
            raise AssertionError(f"layer {a['layer']}: O(d) and scan disagree on n or num_types")
        if a["n"] == 0:
            continue
        q = abs(b["Q"])
        for field in ("Q", "M", "V", "V_W", "V_B"):
            worst = max(worst, abs(a[field] - b[field]) / q)
    return worst


def bench_store(loaded, moments: JobMoments, repeat: int = 3, reads_per_repeat: int = 5) -> dict:
    """Commit and read costs against a real Redis server in a temporary folder.

    Each repeat commits the job twice into a fresh collection: the first commit inserts
    every token, the second (a different job id, the same moments) merges into all of
    them. The reads then compare the O(d) decomposition with a scan on that data.
    """
    import redis

    from embgeom.redis_server import RedisServer
    from embgeom.reports import CountFilter, layer_rows
    from embgeom.store import AccumulatorStore

    info = loaded.info
    num_layers = info.num_layers + 1
    distinct = len(moments.tokens)
    with tempfile.TemporaryDirectory(prefix="embgeom-bench-") as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        try:
            client = redis.Redis.from_url(server.url)
            store = AccumulatorStore(client)
            merge_timer = _Timer("cpu")
            store._merged_writes = merge_timer.wrap(store._merged_writes)
            base = _settled_memory(client)
            insert_s, merge_s, insert_prep, merge_prep, insert_bytes, merge_bytes = [], [], [], [], [], []
            unfiltered_s, filtered_s, agreement, filtered_bytes = [], [], 0.0, 0
            used_memory = used_dataset = 0
            pair = None
            for r in range(repeat):
                client.flushdb()
                pair = K.PairKeys(f"bench{r}", loaded.info.name)
                for kind in ("insert", "merge"):
                    job_id = uuid.uuid4().hex
                    done = {"status": "done", "progress": 1.0, "tokens": moments.counted,
                            "finished_at": repr(time.time()), "error": ""}
                    _settled_memory(client)  # no background AOF rewrite competing with the commit
                    aof0, net0 = _redis_bytes(client)
                    merge_timer.seconds = 0.0
                    start = time.perf_counter()
                    outcome = store.commit_job(pair, job_id, 0, moments, num_layers, info.hidden_size, done)
                    elapsed = time.perf_counter() - start
                    if outcome != "committed":
                        raise AssertionError(f"commit_job returned {outcome!r}")
                    aof1, net1 = _redis_bytes(client)
                    (insert_s if kind == "insert" else merge_s).append(elapsed)
                    (insert_prep if kind == "insert" else merge_prep).append(merge_timer.seconds / elapsed)
                    (insert_bytes if kind == "insert" else merge_bytes).append(
                        {"aof": aof1 - aof0, "net": net1 - net0})
                settled = _settled_memory(client)
                used_memory = int(settled["used_memory"]) - int(base["used_memory"])
                used_dataset = int(settled["used_memory_dataset"]) - int(base["used_memory_dataset"])
                layers = range(num_layers)
                for i in range(reads_per_repeat):
                    steps = ["unfiltered", "filtered"] if i % 2 == 0 else ["filtered", "unfiltered"]
                    for step in steps:
                        start = time.perf_counter()
                        if step == "unfiltered":
                            fast_rows, _ = layer_rows(store, pair, layers, CountFilter(), with_summary=False)
                            unfiltered_s.append(time.perf_counter() - start)
                        else:
                            out0 = int(client.info("stats")["total_net_output_bytes"])
                            start = time.perf_counter()
                            layer_rows(store, pair, layers, CountFilter(min_count=2), with_summary=False)
                            filtered_s.append(time.perf_counter() - start)
                            filtered_bytes = int(client.info("stats")["total_net_output_bytes"]) - out0
                # The maintained O(d) aggregates must equal a scan over every token type.
                scan_rows, _ = layer_rows(store, pair, layers, CountFilter(1, 2**62), with_summary=False)
                agreement = max(agreement, _decomposition_agreement(fast_rows, scan_rows))
                if fast_rows[0]["n"] != 2 * moments.counted:
                    raise AssertionError("two commits of the job must count its tokens twice")
            client.close()
        finally:
            server.stop()
    if not agreement <= REDUCE_TOLERANCE:
        raise AssertionError(f"O(d) decomposition and scan differ by {agreement:.3g} of Q")
    return {
        "distinct_tokens": distinct,
        "payload_bytes": distinct * token_bytes(num_layers, info.hidden_size),
        "layer_state_bytes": layer_state_bytes(num_layers, info.hidden_size),
        "insert_s": _median(insert_s),
        "merge_s": _median(merge_s),
        "insert_ms_per_1k_tokens": _median(insert_s) * 1e6 / max(distinct, 1),
        "merge_ms_per_1k_tokens": _median(merge_s) * 1e6 / max(distinct, 1),
        "insert_share_read_merge": _median(insert_prep),
        "merge_share_read_merge": _median(merge_prep),
        "insert_aof_bytes": int(_median([b["aof"] for b in insert_bytes])),
        "merge_aof_bytes": int(_median([b["aof"] for b in merge_bytes])),
        "insert_net_bytes": int(_median([b["net"] for b in insert_bytes])),
        "merge_net_bytes": int(_median([b["net"] for b in merge_bytes])),
        "redis_used_memory": used_memory,
        "redis_used_memory_dataset": used_dataset,
        "redis_bytes_per_token": (used_memory - layer_state_bytes(num_layers, info.hidden_size)) / max(distinct, 1),
        "read_unfiltered_s": _median(unfiltered_s),
        "read_filtered_s": _median(filtered_s),
        "read_ratio": _median(filtered_s) / _median(unfiltered_s),
        "read_filtered_bytes": filtered_bytes,
        "read_agreement": agreement,
    }


# ----------------------------------------------------------------------------- memory


def token_bytes(num_layers: int, d: int) -> int:
    """Bytes a commit writes per token: (n, m2, mean) + unit sum + (n, M, m2) per layer."""
    return num_layers * ((2 + d) + d + 3) * 8


def layer_state_bytes(num_layers: int, d: int) -> int:
    """Bytes every commit rewrites whatever the job's size: per layer the d x d co-moment
    with the unit sums (``cov``) and ``(n, m2, within, mean)`` (``glob``)."""
    return num_layers * ((d * d + 2 * d) + (3 + d)) * 8


def accumulator_bytes(acc: TokenAccumulator) -> dict:
    """Live bytes of the per-token vectors (k x L x d x 8 x 2: mean and unit sum) and the
    bytes the accumulator's arrays actually hold (capacity grows by doubling)."""
    k = len(acc)
    live = k * acc.num_layers * acc.dim * 8 * 2
    allocated = sum(a.nbytes for a in (acc._ids, acc._n, acc._mean, acc._m2, acc._unit_sum))
    return {"live": live, "allocated": allocated}


def bench_memory(loaded, moments: JobMoments) -> dict:
    info = loaded.info
    acc = accumulator_bytes(moments.tokens)
    dense = {name: v * l * d * 8 for name, (v, l, d) in DENSE_MODELS.items()}
    dense_this = info.vocab_size * (info.num_layers + 1) * info.hidden_size * 8
    return {
        "distinct_tokens": len(moments.tokens),
        "layers": info.num_layers + 1,
        "hidden_size": info.hidden_size,
        "accumulator_live_bytes": acc["live"],
        "accumulator_allocated_bytes": acc["allocated"],
        "dense_this_model_bytes": dense_this,
        "dense_over_live": dense_this / max(acc["live"], 1),
        "dense_bytes": dense,
    }


# ----------------------------------------------------------------------------- invariance


def _per_token(moments: JobMoments):
    snap = moments.tokens.snapshot()
    order = np.argsort(snap.ids)
    n = snap.n[order]
    mean = snap.mean[:, order]
    M = np.einsum("lkd,lkd->lk", mean, mean)
    V = snap.m2[:, order] / n
    return snap.ids[order], n, M + V, M, V


def bench_invariance(loaded, texts: Sequence[str], reference: Optional[JobMoments] = None,
                     budgets: Sequence[int] = BUDGETS) -> dict:
    """Per-token statistics under several token budgets against the largest one.

    Token ids and counts must be identical; Q, M (relative to themselves) and V (relative
    to Q of the same token and layer, since V is 0 for a token seen once) may differ only
    by float32 forward noise.
    """
    budgets = sorted(budgets)
    results = {}
    for b in budgets:
        if b == budgets[-1] and reference is not None and b == DEFAULT_BUDGET:
            results[b] = reference
        else:
            results[b] = accumulate_texts(loaded, texts, token_budget=b)
    ref_ids, ref_n, ref_Q, ref_M, ref_V = _per_token(results[budgets[-1]])
    out = {"budgets": list(budgets), "batches": {}, "max_rel_Q": {}, "max_rel_M": {}, "max_rel_V": {}}
    for b in budgets:
        _, batches = _windows_and_batches(loaded, texts, b)
        out["batches"][b] = len(batches)
        ids, n, Q, M, V = _per_token(results[b])
        if not (np.array_equal(ids, ref_ids) and np.array_equal(n, ref_n)):
            raise AssertionError(f"token budget {b} changes which tokens are counted")
        out["max_rel_Q"][b] = float(np.max(np.abs(Q - ref_Q) / ref_Q)) if Q.size else 0.0
        out["max_rel_M"][b] = float(np.max(np.abs(M - ref_M) / np.maximum(ref_M, 1e-300))) if M.size else 0.0
        out["max_rel_V"][b] = float(np.max(np.abs(V - ref_V) / ref_Q)) if V.size else 0.0
    out["max_rel"] = max(max(out[f].values()) for f in ("max_rel_Q", "max_rel_M", "max_rel_V"))
    if not out["max_rel"] <= INVARIANCE_TOLERANCE:
        raise AssertionError(f"token budgets change per-token statistics by {out['max_rel']:.3g}")
    return out


# ----------------------------------------------------------------------------- driver


def run_bench(model: str = "minilm", texts: int = 200, repeat: int = 3,
              device: Optional[str] = None, loaded=None) -> dict:
    """Every figure, as a dict (see :func:`figures` for the table)."""
    from embgeom.corpora import bbc_texts

    started = time.perf_counter()
    if loaded is None:
        loaded = load_model(model, device)
    corpus = bbc_texts("paragraphs")[:texts]
    sections: dict[str, float] = {}

    def timed(name, fn, *args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        sections[name] = time.perf_counter() - start
        return out

    ingest, moments = timed("ingest", bench_ingest, loaded, corpus, repeat)
    results = {
        "model": loaded.info.name,
        "device": str(loaded.device),
        "torch_threads": torch.get_num_threads(),
        "repeat": repeat,
        "ingest": ingest,
        "reduce": timed("reduce", bench_reduce, loaded, corpus, repeat),
        "store": timed("store", bench_store, loaded, moments, repeat),
        "memory": bench_memory(loaded, moments),
        "invariance": timed("invariance", bench_invariance, loaded, corpus, reference=moments),
        "sections_s": sections,
    }
    results["wall_s"] = time.perf_counter() - started
    return results


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.2f} MB"


def figures(res: dict) -> list[tuple[str, str, str]]:
    """``(figure, value, note)`` rows of the table."""
    ing, red, st, mem, inv = (res[k] for k in ("ingest", "reduce", "store", "memory", "invariance"))
    rows = [
        ("ingest: texts / windows / batches / tokens",
         f"{ing['texts']} / {ing['windows']} / {ing['batches']} / {ing['tokens']}",
         "BBC paragraphs, counted (non-special) tokens, budget 16384"),
        ("ingest: forward only", f"{ing['forward_tokens_per_s']:,.0f} tok/s", f"{ing['forward_s']:.2f} s"),
        ("ingest: forward + reduce + accumulate", f"{ing['full_tokens_per_s']:,.0f} tok/s",
         f"{ing['full_s']:.2f} s"),
        ("ingest: overhead ratio (full / forward time)", f"{ing['overhead_ratio']:.2f}x",
         "median of per-repeat ratios"),
        ("ingest: full time spent in forward / reduce / accumulate / other",
         f"{ing['full_share_forward']:.0%} / {ing['full_share_reduce']:.0%} / "
         f"{ing['full_share_accumulate']:.0%} / {ing['full_share_other']:.0%}", ""),
        ("reduce: batch (rows, tokens, types, layers)",
         f"{red['batch_rows']}, {red['batch_tokens']}, {red['batch_types']}, {red['layers']}",
         f"{red['batch_padded_tokens']} padded positions"),
        ("reduce: reduce_batch (index_add_)", f"{red['reduce_s'] * 1000:.0f} ms", ""),
        ("reduce: naive Python loop over occurrences", f"{red['naive_s'] * 1000:.0f} ms", ""),
        ("reduce: speed ratio (naive / reduce_batch)", f"{red['speedup']:.2f}x", ""),
        ("reduce: co-moment matmuls / reduce_batch", f"{red['comoment_share']:.0%}",
         "the d x d covariance per layer"),
        ("reduce: max relative difference", f"{red['max_rel_error']:.1e}",
         f"asserted <= {REDUCE_TOLERANCE:g}"),
        ("commit: job (distinct tokens, per-token payload)",
         f"{st['distinct_tokens']} tokens, {_gb(st['payload_bytes'])}", "(n, m2, mean) + unit + (n, M, m2) x layers"),
        ("commit: layer state rewritten by every commit", _gb(st["layer_state_bytes"]),
         "d x d co-moment + sums per layer; SmolLM2: "
         + _gb(layer_state_bytes(*DENSE_MODELS["SmolLM2-135M"][1:])) + ", gemma-3-270m: "
         + _gb(layer_state_bytes(*DENSE_MODELS["gemma-3-270m"][1:]))),
        ("commit: insert (new tokens)", f"{st['insert_s'] * 1000:.0f} ms",
         f"{st['insert_ms_per_1k_tokens']:.0f} ms per 1k tokens; "
         f"{st['insert_share_read_merge']:.0%} in read+merge+pack (Python)"),
        ("commit: merge (existing tokens)", f"{st['merge_s'] * 1000:.0f} ms",
         f"{st['merge_ms_per_1k_tokens']:.0f} ms per 1k tokens; "
         f"{st['merge_share_read_merge']:.0%} in read+merge+pack (Python)"),
        ("commit: bytes written (AOF) insert / merge",
         f"{_gb(st['insert_aof_bytes'])} / {_gb(st['merge_aof_bytes'])}",
         f"sent {_gb(st['insert_net_bytes'])} / {_gb(st['merge_net_bytes'])}; merge "
         f"{st['merge_aof_bytes'] / ing['tokens'] / 1e3:.1f} kB per counted token "
         f"(its float32 hidden states: {res['memory']['layers'] * res['memory']['hidden_size'] * 4 / 1e3:.1f} kB)"),
        ("commit: share of the job's ingestion time", f"{st['merge_s'] / ing['full_s']:.0%}",
         "merge commit / forward+reduce+accumulate"),
        ("read: unfiltered decomposition (O(d))", f"{st['read_unfiltered_s'] * 1000:.1f} ms",
         "all layers, with_summary=False"),
        ("read: filtered decomposition (min_count=2, scan)", f"{st['read_filtered_s'] * 1000:.1f} ms",
         f"fetches {_gb(st['read_filtered_bytes'])}: every token's mean at every layer"),
        ("read: ratio (filtered / unfiltered)", f"{st['read_ratio']:.0f}x", ""),
        ("read: O(d) vs scan, max |diff| / Q", f"{st['read_agreement']:.1e}",
         f"asserted <= {REDUCE_TOLERANCE:g}"),
        ("memory: worker-local TokenAccumulator",
         f"{_gb(mem['accumulator_live_bytes'])}",
         f"{mem['distinct_tokens']} tokens x layers x d x 8 x 2; "
         f"{_gb(mem['accumulator_allocated_bytes'])} allocated"),
        ("memory: dense vocab x layers x d float64, this model", _gb(mem["dense_this_model_bytes"]),
         f"{mem['dense_over_live']:.0f}x the accumulator"),
    ]
    for name, b in mem["dense_bytes"].items():
        v, l, d = DENSE_MODELS[name]
        rows.append((f"memory: dense, {name}", _gb(b), f"{v} x {l} x {d} x 8 (not allocated)"))
    rows.append(("memory: Redis used_memory after ingestion", _gb(st["redis_used_memory"]),
                 f"one collection above an empty server; dataset {_gb(st['redis_used_memory_dataset'])}; "
                 f"{st['redis_bytes_per_token'] / 1e3:.1f} kB per token "
                 f"(payload {token_bytes(mem['layers'], mem['hidden_size']) / 1e3:.1f} kB)"))
    for name, (v, l, d) in DENSE_MODELS.items():
        rows.append((f"memory: Redis payload if all of {name}'s vocab is seen", _gb(v * token_bytes(l, d)),
                     f"{v} x {token_bytes(l, d) / 1e3:.0f} kB; not allocated"))
    for b in inv["budgets"][:-1]:
        rows.append((f"invariance: budget {b} vs {inv['budgets'][-1]}",
                     f"{max(inv['max_rel_Q'][b], inv['max_rel_M'][b], inv['max_rel_V'][b]):.1e}",
                     f"{inv['batches'][b]} batches; max rel diff of Q/M/V "
                     f"({inv['max_rel_Q'][b]:.1e}/{inv['max_rel_M'][b]:.1e}/{inv['max_rel_V'][b]:.1e})"))
    rows.append(("run: model, device, threads, repeats, wall",
                 f"{res['model']}, {res['device']}, {res['torch_threads']}, {res['repeat']}, "
                 f"{res['wall_s']:.0f} s",
                 "sections " + ", ".join(f"{k} {v:.0f} s" for k, v in res["sections_s"].items())))
    return rows


def format_table(res: dict) -> str:
    rows = figures(res)
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{'figure':<{w0}}  {'value':>{w1}}  note", "-" * (w0 + w1 + 40)]
    lines += [f"{a:<{w0}}  {b:>{w1}}  {c}".rstrip() for a, b, c in rows]
    return "\n".join(lines)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m embgeom.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="minilm", help="model alias (default: minilm)")
    parser.add_argument("--texts", type=int, default=200, help="BBC paragraphs to use (default: 200)")
    parser.add_argument("--repeat", type=int, default=3, help="repeats per comparison (default: 3)")
    parser.add_argument("--device", default=None, help="torch device (default: the service's)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.texts < 1 or args.repeat < 1:
        parser.error("--texts and --repeat must be >= 1")
    res = run_bench(args.model, args.texts, args.repeat, args.device)
    if args.json:
        json.dump(_jsonable(res), sys.stdout, indent=2)
        print()
    else:
        print(format_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
