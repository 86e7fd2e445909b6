"""Steady state: the real worker replaying recorded windows into a store that already
holds the vocabulary, at the service's own checkpoint budgets.

Per shape (:data:`SHAPES`, :data:`benchmarks.shapes.REPLAY_SHAPES`), in a fresh Redis
started as the service starts its own (AOF, ``appendfsync always``):

1. *seed*: every token type of the replayed part of the recording is written once (jobs
   of count-1 batches covering the vocabulary, through the same worker), untimed;
2. *timed*: recorded BBC jobs (MiniLM's tokenizer, the model's maximum window of 512
   tokens, the service's token-budget batches: :func:`benchmarks.replay.record_bbc`),
   cycled until ``tokens`` (recording job ``j mod J`` for the ``j``-th job), through a
   real :class:`embgeom.worker.Worker`: window merges, export, seal, shard and layer
   writes, completion, ack. Every type a timed window touches is already stored: no
   window adds a type (``new_types`` says so), as at a service that has run a while;
3. the same again with fixed window budgets (``by_window``): ``checkpoint_tokens`` = W
   and no time budget, so each window holds about W tokens (whole jobs).

The engine (:class:`SteadyEngine`) returns each batch's moments *on ``device``* (values
from a fixed random pool of the shape, as :class:`benchmarks.replay.ReplayEngine`), and
the worker builds its window on the engine's device, so on a GPU the merges run there.
The co-moment GEMM is device work of the real reduction and is not replayed.

Figures per shape: ``tok_s`` = tokens / seconds from the worker's start to its last job
done; ``window_tokens`` and ``types_per_window`` the mean tokens and distinct types of a
window; ``checkpoint_s`` the mean seconds from seal to completion; ``checkpoint_bytes``
the mean bytes a checkpoint wrote. ``tokens`` is what was replayed: short of 10^7 where
a time budget or the CPU plan (:data:`CPU_TOKENS`) cut it (``short_of_1e7``).

``python -m benchmarks.steady_state --device cpu|cuda --tokens N --shapes a,b --out f.json``
(``--recording f.npz`` replays a recording saved by ``--save-recording f.npz``: no
tokenizer, corpus or packaged model needed; see ``benchmarks/gpu_steady.sh``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch

from benchmarks.replay import Recording
from benchmarks.shapes import REPLAY_SHAPES

__all__ = ["SHAPES", "bench_steady_state", "SteadyEngine", "ReplayRegistry", "save_recording",
           "load_recording", "steady_shape", "table"]

F64 = torch.float64
# In this order: a run cut short keeps the shapes of the acceptance first.
SHAPES = ("minilm", "mpnet_shape", "1b_shape", "7b_shape_5_layers", "1b_shape_all_layers")
TARGET_TOKENS = 10**7
MODEL = "minilm"      # the recording is MiniLM's tokenisation; the shape replaces its size
VOCAB = 30522         # MiniLM's vocabulary (the pair's configuration records it)
# Tokens per shape on a CPU (2 cores here), aiming at the section within ~8 minutes (full)
# or ~90 s (quick), seeding included: a time budget stops submitting jobs, but the
# windows already taken are finished (on 2 busy cores 1.1M / 178k / 160k tokens of
# minilm / mpnet_shape / 1b_shape took 114 / 154 / 302 s, seeding included). Short of
# 10^7: the JSON's ``tokens`` says how short.
# Quick runs cut the recording's jobs into one batch each (about 3,200 tokens), so that
# a few thousand tokens make a run; their windows are the few jobs that fit.
CPU_TOKENS = {
    False: {"minilm": 600_000, "mpnet_shape": 80_000, "1b_shape": 40_000,
            "1b_shape_all_layers": 20_000, "7b_shape_5_layers": 20_000},
    True: {"minilm": 30_000, "mpnet_shape": 8_000, "1b_shape": 8_000,
           "1b_shape_all_layers": 4_000, "7b_shape_5_layers": 4_000},
}
CPU_BUDGET_S = {False: 420.0, True: 75.0}
# The seeded vocabulary's bytes on a CPU (this machine has 24 GiB shared): a larger
# shape cycles a shorter prefix of the recording (``recording_jobs``).
CPU_STORE_BYTES = 6.0e8
# Fixed window budgets of the sweep (tokens per window; a window holds whole jobs of
# about 20k tokens). A row replays half the default row's tokens; only the budgets that
# give it 2 windows or more run, the largest SWEEP_ROWS of them.
WINDOW_SWEEP = (40_000, 400_000, 2_000_000)
SWEEP_ROWS = 2


# ------------------------------------------------------------------ recordings


def save_recording(rec: Recording, path) -> None:
    """The recording as one ``.npz``: concatenated ids and counts, per-batch sizes and
    embeddings, batches per job (jobs are consecutive batch ranges), the window."""
    flat = [b for job in rec.jobs for b in job]
    assert flat == list(range(len(rec.batches))), "jobs must be consecutive batch ranges"
    np.savez_compressed(
        path, ids=np.concatenate([b[0] for b in rec.batches]),
        counts=np.concatenate([b[1] for b in rec.batches]),
        sizes=np.array([len(b[0]) for b in rec.batches]),
        embeddings=np.array([b[2] for b in rec.batches]),
        job_batches=np.array([len(j) for j in rec.jobs]),
        tokenize_seconds=np.array(rec.tokenize_seconds), window=np.array(recording_window()))


def load_recording(path) -> Recording:
    """Inverse of :func:`save_recording`."""
    z = np.load(path)
    cuts = np.cumsum(z["sizes"])[:-1]
    batches = [(i.astype(np.int64), c.astype(np.int64), int(n)) for i, c, n in
               zip(np.split(z["ids"], cuts), np.split(z["counts"], cuts), z["embeddings"])]
    starts = np.concatenate([[0], np.cumsum(z["job_batches"])])
    jobs = [list(range(a, b)) for a, b in zip(starts[:-1], starts[1:])]
    rec = Recording(batches, jobs, int(z["embeddings"].sum()), float(z["tokenize_seconds"]))
    rec.window = int(z["window"])
    return rec


def recording_window() -> int:
    """The window :func:`benchmarks.replay.record_bbc` cuts at: MiniLM's maximum."""
    from embgeom.compute.catalogue import ModelRegistry
    from embgeom.settings import Settings

    return ModelRegistry.from_settings(Settings()).info(MODEL).max_length


def job_tokens(rec: Recording) -> np.ndarray:
    """Embeddings (per layer) of each recorded job, int64 (J,)."""
    return np.array([sum(rec.batches[b][2] for b in job) for job in rec.jobs], dtype=np.int64)


def jobs_for(rec: Recording, tokens: int) -> int:
    """Cycled jobs (job ``j`` is recording job ``j mod J``) whose tokens first reach
    ``tokens`` (at least one)."""
    per = job_tokens(rec)
    cycles, rest = divmod(max(1, tokens), int(per.sum()))
    # searchsorted: the first job whose running total reaches ``rest``
    return cycles * len(per) + (int(np.searchsorted(np.cumsum(per), rest)) + 1 if rest else 0)


def cycled_tokens(rec: Recording, jobs: int) -> int:
    """Tokens of the first ``jobs`` cycled jobs."""
    per = job_tokens(rec)
    cycles, rest = divmod(jobs, len(per))
    return int(cycles * per.sum() + per[:rest].sum())


def within_store(rec: Recording, jobs: int, row_bytes: int, max_bytes: Optional[float]) -> Recording:
    """The recording cut to the longest prefix of its first ``jobs`` jobs whose vocabulary
    takes at most ``max_bytes`` at ``row_bytes`` a type (at least one job); uncut if it
    fits (or no bound). Cycling a cut recording keeps every timed type seeded."""
    jobs = min(jobs, len(rec.jobs))
    if max_bytes is None or len(vocabulary(rec, jobs)) * row_bytes <= max_bytes:
        return rec if jobs == len(rec.jobs) or max_bytes is None else _prefix(rec, jobs)
    lo, hi = 1, jobs  # the largest fitting prefix, by bisection (vocabulary grows with jobs)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(vocabulary(rec, mid)) * row_bytes <= max_bytes else (lo, mid - 1)
    return _prefix(rec, lo)


def _prefix(rec: Recording, jobs: int) -> Recording:
    cut = Recording(rec.batches, rec.jobs[:jobs], sum(rec.batches[b][2] for j in rec.jobs[:jobs] for b in j),
                    rec.tokenize_seconds)
    cut.window = getattr(rec, "window", None)
    return cut


def batch_jobs(rec: Recording) -> Recording:
    """The same recording with one batch a job."""
    cut = Recording(rec.batches, [[b] for job in rec.jobs for b in job], rec.tokens, rec.tokenize_seconds)
    cut.window = getattr(rec, "window", None)
    return cut


def vocabulary(rec: Recording, jobs: int) -> np.ndarray:
    """Distinct ids of the first ``jobs`` cycled jobs, sorted int64."""
    used = rec.jobs[:min(jobs, len(rec.jobs))]
    return np.unique(np.concatenate([rec.batches[b][0] for job in used for b in job]))


# ---------------------------------------------------------------------- engine


class SteadyEngine:
    """:class:`benchmarks.replay.ReplayEngine` on ``device``, cycling, with seed jobs.

    ``prepare(["replay:j"])`` is recording job ``j mod J``; ``prepare(["seed:i"])`` the
    ``i``-th seed job: count-1 batches over ``seed`` (sorted ids), at most
    ``seed_rows`` types a job (a window's byte budget), at most the largest recorded
    batch's types a batch. ``run`` returns a batch's moments on ``device``: ids and
    counts kept there per batch, values the first k rows of a fixed random pool. Given
    the window (the worker always gives it), the per-type sums go into it as the fused
    reduction's do; no co-moment is returned: the GEMM is the reduction's device work,
    which this replay leaves out."""

    def __init__(self, recording: Recording, layers: int, d: int, self_similarity: bool,
                 device="cpu", seed: Optional[np.ndarray] = None, seed_rows: int = 1 << 30,
                 rng_seed: int = 0):
        dev = torch.device(device)
        self.recording = recording
        self.loaded = SimpleNamespace(device=dev)  # the worker builds its window there
        k_max = max(len(ids) for ids, _, _ in recording.batches)
        g = torch.Generator().manual_seed(rng_seed)
        self._mean = torch.randn((k_max, layers, d), generator=g, dtype=F64).to(dev)
        self._m2 = (torch.rand((k_max, layers), generator=g, dtype=F64) * d).to(dev)
        self._unit = (torch.randn((k_max, layers, d), generator=g, dtype=F64).to(dev)
                      if self_similarity else None)
        self._lay_mean = torch.randn((layers, d), generator=g, dtype=F64).to(dev)
        self._lay_unit = torch.randn((layers, d), generator=g, dtype=F64).to(dev)
        self._lay_unit_sq = self._lay_unit.abs()
        batches = list(recording.batches)
        self.seed_jobs: list[list[int]] = []
        if seed is not None and len(seed):
            per_job = max(1, min(seed_rows, len(seed)))
            for a in range(0, len(seed), per_job):
                ids = seed[a:a + per_job]
                job = []
                for b in range(0, len(ids), k_max):
                    chunk = ids[b:b + k_max].astype(np.int64)
                    job.append(len(batches))
                    batches.append((chunk, np.ones_like(chunk), len(chunk)))
                self.seed_jobs.append(job)
        self.prepared = 0  # jobs prepared: how far the worker has taken the queue
        self._batches = [(torch.from_numpy(ids).to(dev), torch.from_numpy(n).to(F64).to(dev), int(N))
                         for ids, n, N in batches]

    def prepare(self, texts):
        from embgeom.compute.engine import PreparedJob

        kind, j = texts[0].split(":", 1)
        jobs = self.seed_jobs if kind == "seed" else self.recording.jobs
        batches = jobs[int(j) % len(jobs)]
        self.prepared += 1
        return PreparedJob(batches, sum(self._batches[b][2] for b in batches), len(batches))

    def run(self, batch: int, window=None):
        from benchmarks.replay import fold
        from embgeom.stats import LayerMoments, TokenMoments

        ids, n, N = self._batches[batch]
        k = len(ids)
        unit = None if self._unit is None else self._unit[:k]
        layers = LayerMoments(N, self._lay_mean, None, self._lay_unit, self._lay_unit_sq)
        if window is not None:  # the worker's path: the sums go into its window
            return fold(window, ids, n, self._mean[:k], self._m2[:k], unit), layers
        return TokenMoments(ids, n, self._mean[:k], self._m2[:k], unit), layers


class _Vocabulary:
    """What the worker asks of a tokenizer when it resolves a pair: its length."""

    pad_token_id = 0

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size


class ReplayRegistry:
    """A model registry without a model: one name, of a shape's layers and width, the
    recording's window and MiniLM's vocabulary (what a worker resolves a pair with)."""

    def __init__(self, spec: dict, window: int, model: str = MODEL, vocab: int = VOCAB):
        self.spec, self.window, self.model, self.vocab = spec, window, model, vocab

    def names(self) -> list[str]:
        return [self.model]

    def info(self, name):
        from embgeom.compute.catalogue import ModelInfo

        return ModelInfo(name=name, source="replay", architecture="Replay",
                         num_layers=self.spec["layers"] - 1, hidden_size=self.spec["d"],
                         vocab_size=self.vocab, max_length=self.window, tokenizer_size=self.vocab)

    def tokenizer(self, name, keep=True):
        return _Vocabulary(self.vocab)


# ----------------------------------------------------------------------- redis


def store_types(client, collection: str) -> int:
    """Token types the pair's shard aggregates count."""
    from embgeom.store.keys import PairKeys
    from embgeom.store.reader import Reader, run_sync

    reader = Reader()
    return run_sync(client, reader.aggs(run_sync(client, reader.pair_state(PairKeys(collection, MODEL)))))["types"]


# ---------------------------------------------------------------------- replay


def _watch_checkpoints(worker) -> list[dict]:
    """Per completed checkpoint of ``worker``: its tokens, distinct types, seconds from
    seal to completion and bytes written (wraps its checkpointer's two calls)."""
    done: list[dict] = []
    sealed_at: dict[str, float] = {}
    cp = worker.checkpointer
    seal, apply = cp.seal, cp.apply_and_complete

    def timed_seal(pair, gen, cid, *args, **kwargs):
        sealed_at[cid] = time.perf_counter()
        return seal(pair, gen, cid, *args, **kwargs)

    def timed_apply(pair, conf, cid, window, *args, **kwargs):
        out = apply(pair, conf, cid, window, *args, **kwargs)
        now = time.perf_counter()
        done.append({"tokens": int(sum(window.job_tokens.values())), "types": int(len(window.tokens.ids)),
                     "seconds": now - sealed_at.pop(cid, now),
                     "bytes": int(out.shards.bytes_written + out.layer_bytes), "at": now})
        return out

    cp.seal, cp.apply_and_complete = timed_seal, timed_apply
    return done


def replay_jobs(url: str, client, engine: SteadyEngine, registry: ReplayRegistry, texts: list[str],
                tokens_of: list[int], collection: str = "c", budget_s: Optional[float] = None,
                overrides: Optional[dict] = None) -> dict:
    """Run the jobs ``texts`` (one text each: ``replay:j`` / ``seed:i``) through a new
    worker, submitted ahead of it as it goes, until all are done or, past ``budget_s``,
    no more is submitted (what was is finished). Returns tokens, seconds (worker start to
    last job done), tok_s and the checkpoints (:func:`_watch_checkpoints`)."""
    from embgeom.settings import Settings
    from embgeom.store.connection import redis_client
    from embgeom.store.jobs import JobRequest
    from embgeom.store.submission import JobSubmitter
    from embgeom.worker import Worker

    settings = Settings(redis_url=url, worker_models=[MODEL], **(overrides or {}))
    q = JobSubmitter(client, max_pending=10**9)
    # Jobs queued beyond those the worker has taken (prepared): what it takes in 2 s, and
    # 2 more (the feeder prepares one ahead), so that it never finds the queue empty (it would checkpoint early), yet stops
    # soon once the submissions stop.
    taken0 = engine.prepared

    def ahead(elapsed: float) -> int:
        taken = engine.prepared - taken0
        return taken + 2 + math.ceil(taken * 2 / max(elapsed, 2.0))  # not from a first instant

    submitted = 0

    def submit_up_to(n: int) -> None:
        nonlocal submitted
        while submitted < min(n, len(texts)):
            q.submit(JobRequest(collection, MODEL, [texts[submitted]]), [MODEL])
            submitted += 1

    worker = Worker(redis_client(url), settings, registry=registry, worker_id=f"steady-{os.getpid()}",
                    engine_factory=lambda conf, model: engine)
    windows = _watch_checkpoints(worker)
    submit_up_to(ahead(1e9))
    thread = threading.Thread(target=worker.run, daemon=True, name="steady-worker")
    start = last = time.perf_counter()
    thread.start()
    done = 0
    try:
        while done < submitted or submitted < len(texts):
            if thread.is_alive() is False:
                raise RuntimeError("the replay worker stopped")
            now = time.perf_counter()
            if budget_s is None or now - start < budget_s:
                submit_up_to(ahead(now - start))
            elif submitted < len(texts):
                texts = texts[:submitted]  # out of time: finish what was submitted
            if worker.jobs_done != done:
                done, last = worker.jobs_done, now
            time.sleep(0.01)
    finally:
        worker.request_stop(5)
        thread.join(timeout=600)
    seconds = last - start
    tokens = int(sum(tokens_of[:done]))
    for w in windows:
        w["at"] -= start
    return {"tokens": tokens, "jobs": done, "seconds": seconds, "tok_s": tokens / seconds if seconds else 0.0,
            "windows": windows, "stages_s": {k: round(v, 3) for k, v in sorted(worker.clock.seconds.items()) if v}}


def _summary(run: dict, budget: str) -> dict:
    """One row: tok_s and the mean window."""
    w = run["windows"]
    mean = (lambda key: float(np.mean([x[key] for x in w]))) if w else (lambda key: 0.0)
    return {"budget": budget, "tok_s": run["tok_s"], "tokens": run["tokens"], "seconds": round(run["seconds"], 3),
            "checkpoints": len(w), "window_tokens": mean("tokens"), "types_per_window": mean("types"),
            "checkpoint_s": mean("seconds"), "checkpoint_bytes": mean("bytes"),
            "max_types_per_window": max((x["types"] for x in w), default=0)}


def _default_budget(settings) -> str:
    return (f"defaults: checkpoint_seconds={settings.checkpoint_seconds:g}, checkpoint_max_share="
            f"{settings.checkpoint_max_share:g}, checkpoint_tokens={settings.checkpoint_tokens:,}, "
            f"checkpoint_bytes={settings.checkpoint_bytes:,}")


def steady_shape(shape: str, recording: Recording, tokens: int, device: str = "cpu",
                 budget_s: Optional[float] = None, slowest=None, sweep=WINDOW_SWEEP,
                 on_store=None, max_store_bytes: Optional[float] = None) -> dict:
    """One shape: seed, the default row, then the window sweep (see the module docstring).
    ``max_store_bytes`` bounds the seeded vocabulary (:func:`within_store`).
    ``on_store(client, jobs)``, if given, sees the store and the cycled jobs replayed (default
    row, then each sweep row) before the server stops."""
    from embgeom.compute.window import WindowAccumulator
    from embgeom.settings import Settings

    spec = REPLAY_SHAPES[shape]
    t0 = time.perf_counter()
    deadline = None if budget_s is None else t0 + budget_s
    L = len(spec["keep"]) if spec["keep"] else spec["layers"]
    recording = within_store(recording, jobs_for(recording, tokens),
                             WindowAccumulator.row_bytes(L, spec["d"], spec["self_similarity"]), max_store_bytes)
    seed = vocabulary(recording, jobs_for(recording, tokens))
    defaults = Settings()
    # Seed jobs of half a window's byte budget: each seed window closes on its bytes.
    seed_rows = WindowAccumulator.rows_within(L, spec["d"], spec["self_similarity"], defaults.checkpoint_bytes) // 2
    engine = SteadyEngine(recording, L, spec["d"], spec["self_similarity"], device, seed, seed_rows)
    registry = ReplayRegistry(spec, getattr(recording, "window", None) or recording_window())
    per_job = [int(x) for x in job_tokens(recording)]
    from benchmarks.run import redis_server

    with redis_server(slowest, f"steady_state {shape}", prefix="embgeom-steady-") as (server, client):
        from benchmarks.replay import prepare_collection

        prepare_collection(client, "c", shape)
        seed_texts = [f"seed:{i}" for i in range(len(engine.seed_jobs))]
        seeded = replay_jobs(server.url, client, engine, registry, seed_texts,
                             [engine.prepare([t]).counted for t in seed_texts])
        types_before = store_types(client, "c")
        seed_seconds = time.perf_counter() - t0

        def row(tokens_row, share, overrides, label):
            n = jobs_for(recording, tokens_row)
            texts = [f"replay:{j}" for j in range(n)]
            left = None if deadline is None else max(1.0, (deadline - time.perf_counter()) * share)
            run = replay_jobs(server.url, client, engine, registry, texts,
                              [per_job[j % len(per_job)] for j in range(n)], budget_s=left, overrides=overrides)
            return run, _summary(run, label)

        sizes = [w for w in sweep if 2 * w <= tokens // 2][-SWEEP_ROWS:]
        main_run, main = row(tokens, 0.6 if sizes else 1.0, None, _default_budget(defaults))
        by_window, sweep_runs = [main], []
        for i, W in enumerate(sizes):
            share = 1.0 / (len(sizes) - i)
            # No time budget: the window closes on W tokens (or its bytes), between jobs.
            run, r = row(tokens // 2, share, {"checkpoint_tokens": W, "checkpoint_seconds": 1e6},
                       f"checkpoint_tokens={W:,}, no time budget")
            by_window.append(r)
            sweep_runs.append(run)
        types_after = store_types(client, "c")
        used = client.info("memory")["used_memory"]
        if on_store is not None:
            on_store(client, [main_run["jobs"]] + [r["jobs"] for r in sweep_runs])
    return {**{k: main[k] for k in ("tok_s", "window_tokens", "types_per_window", "checkpoint_s",
                                    "checkpoint_bytes", "tokens", "checkpoints", "seconds")},
            "device": device, "short_of_1e7": main["tokens"] < TARGET_TOKENS,
            "vocabulary": int(len(seed)), "seed_seconds": round(seed_seconds, 3),
            "seed_checkpoints": len(seeded["windows"]), "types_before": types_before,
            "types_after": types_after, "new_types": types_after - types_before,
            "stages_s": main_run["stages_s"], "redis_used_memory_bytes": used, "recording_tokens": recording.tokens,
            "recording_jobs": len(recording.jobs),
            "cycles": main["tokens"] / recording.tokens, "windows": main_run["windows"],
            "by_window": by_window, "wall_s": round(time.perf_counter() - t0, 3)}


def bench_steady_state(quick: bool, slowest, device: str = "cpu", budget_s: Optional[float] = None,
                       tokens: Optional[int] = None, shapes: Optional[list[str]] = None,
                       recording: Optional[Recording] = None, max_store_bytes: Optional[float] = None,
                       on_shape=None) -> dict:
    """``{shape: steady_shape(...)}`` for ``shapes`` (default :data:`SHAPES`).

    ``tokens``: per shape (default 10^7 on a GPU, :data:`CPU_TOKENS` on a CPU);
    ``budget_s``: the whole section, shared equally by the shapes, seeding included
    (default :data:`CPU_BUDGET_S` on a CPU, none on a GPU); ``max_store_bytes``: the
    seeded vocabulary's bound (default :data:`CPU_STORE_BYTES` on a CPU, none on a GPU);
    ``on_shape(results so far)`` after each shape."""
    from benchmarks.replay import record_bbc

    shapes = list(shapes or SHAPES)
    recording = recording or record_bbc()
    if quick:
        recording = batch_jobs(recording)
    if device == "cpu":
        budget_s = CPU_BUDGET_S[quick] if budget_s is None else budget_s
        max_store_bytes = CPU_STORE_BYTES if max_store_bytes is None else max_store_bytes
    out = {}
    start = time.perf_counter()
    for i, shape in enumerate(shapes):
        want = tokens or (TARGET_TOKENS if device != "cpu" else CPU_TOKENS[quick][shape])
        left = None if budget_s is None else (budget_s - (time.perf_counter() - start)) / (len(shapes) - i)
        out[shape] = steady_shape(shape, recording, want, device, left, slowest,
                                  max_store_bytes=max_store_bytes)
        if on_shape is not None:
            on_shape(out)
        print(f"steady_state {shape}: {out[shape]['tokens']:,} tokens at {out[shape]['tok_s']:,.0f} tok/s "
              f"({out[shape]['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    return out


def table(res: dict) -> str:
    """One line per shape and window budget."""
    lines = [f"{'shape':<22} {'window budget':<44} {'tok/s':>10} {'tokens':>11} {'win tok':>10} "
             f"{'types/win':>9} {'ckpt s':>7} {'ckpt MB':>8} {'ckpts':>5}"]
    for shape, r in res.items():
        for row in r["by_window"]:
            lines.append(f"{shape:<22} {row['budget'][:44]:<44} {row['tok_s']:>10,.0f} {row['tokens']:>11,} "
                         f"{row['window_tokens']:>10,.0f} {row['types_per_window']:>9,.0f} "
                         f"{row['checkpoint_s']:>7.2f} {row['checkpoint_bytes'] / 1e6:>8.1f} {row['checkpoints']:>5}")
        lines.append(f"{'':<22} vocabulary {r['vocabulary']:,} seeded in {r['seed_seconds']:.1f} s, "
                     f"new types in timed windows: {r['new_types']}, device {r['device']}"
                     + (f"; SHORT of 10^7 tokens ({r['tokens']:,})" if r["short_of_1e7"] else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.steady_state",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per shape (default: see CPU_TOKENS; 10^7 on a GPU)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all shapes (seeding included)")
    parser.add_argument("--recording", default=None, help="a recording saved by --save-recording")
    parser.add_argument("--save-recording", default=None, help="save the BBC recording here and stop")
    parser.add_argument("--max-store-bytes", type=float, default=None,
                        help="bound on the seeded vocabulary's bytes (default 1e9 on a CPU, none on a GPU)")
    parser.add_argument("--out", default=None, help="write the JSON here (after each shape)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.save_recording:
        from benchmarks.replay import record_bbc

        save_recording(record_bbc(), args.save_recording)
        print(f"saved {args.save_recording}")
        return 0
    recording = load_recording(args.recording) if args.recording else None
    shapes = [s for s in args.shapes.split(",") if s]

    def write(res):
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2, default=float) + "\n")

    res = bench_steady_state(args.quick, None, args.device, args.budget, args.tokens, shapes, recording,
                             args.max_store_bytes, write)
    print(table(res))
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
