"""Replaying reductions: the worker's host side at full speed, without a model.

A :class:`ReplayEngine` stands in for :class:`embgeom.compute.engine.Engine`: its
``prepare`` returns a job's recorded batches and its ``run`` returns each batch's moments
(the real token ids and counts of BBC text as MiniLM's tokenizer cuts it, in token-budget
batches; values drawn once from a fixed random pool of the shape asked, so any model
shape replays without holding per-batch arrays). Everything else is the real worker:
merges into the window, export, seal, shard and layer writes, completion, ack.

``python -m benchmarks.replay --redis-url URL --shape minilm --collection c`` runs one
replay worker process (the ``workers_one_collection`` figure starts several).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np
import torch

from benchmarks.shapes import REPLAY_SHAPES
from embgeom.compute.engine import PreparedJob
from embgeom.stats import LayerMoments, TokenMoments

__all__ = ["Recording", "record_bbc", "ReplayEngine", "fold", "replay_settings", "submit_replay_jobs"]

F64 = torch.float64


@dataclass
class Recording:
    """Token ids of a corpus cut into batches: per batch (ids, counts); jobs as batch ranges."""

    batches: list            # (ids int64 (k,), n int64 (k,), embeddings N)
    jobs: list               # list of batch index lists
    tokens: int
    tokenize_seconds: float


def fold(window, ids, n, s1, s2, unit) -> None:
    """What the worker does with a batch's per-type sums once the reduction has them: look
    up the window's rows of ``ids`` (appending new keys; their shifts stay 0 here) and
    :meth:`~embgeom.compute.window.WindowAccumulator.add_sums`. Returns None, the token
    moments a fused reduction returns."""
    rows, _ = window.rows(ids.to(window.device))
    window.add_sums(rows, n, s1, s2, unit)


@lru_cache(maxsize=4)
def record_bbc(texts_per_job: int = 250, limit: Optional[int] = None) -> Recording:
    """BBC paragraphs through MiniLM's tokenizer and the service's own windows and batches
    (:func:`embgeom.compute.engine.padded_batches` at the model's window length and the
    service's token budget, as a worker prepares a job of a default collection)."""
    from embgeom.compute.engine import CountingRule, padded_batches
    from embgeom.compute.catalogue import ModelRegistry
    from embgeom.corpora import bbc_texts
    from embgeom.settings import Settings

    settings = Settings()
    registry = ModelRegistry.from_settings(settings)
    tokenizer, window = registry.tokenizer("minilm"), registry.info("minilm").max_length
    rule = CountingRule(layers=(0,))
    texts = bbc_texts("paragraphs")
    if limit is not None:
        texts = texts[:limit]
    batches, jobs, tokens = [], [], 0
    t0 = time.perf_counter()
    prepared = [padded_batches(tokenizer, texts[i:i + texts_per_job], rule, window,
                               settings.token_budget, getattr(tokenizer, "pad_token_id", None) or 0)[1]
                for i in range(0, len(texts), texts_per_job)]
    tokenize_seconds = time.perf_counter() - t0
    for padded in prepared:
        job = []
        for batch in padded:
            keys = batch.keys[batch.counted]
            ids, counts = np.unique(keys, return_counts=True)
            job.append(len(batches))
            batches.append((ids.astype(np.int64), counts.astype(np.int64), int(counts.sum())))
            tokens += int(counts.sum())
        jobs.append(job)
    return Recording(batches, jobs, tokens, tokenize_seconds)


class ReplayEngine:
    """Returns recorded batches' moments of a given shape (see the module docstring)."""

    def __init__(self, recording: Recording, layers: int, d: int, self_similarity: bool,
                 seed: int = 0):
        self.recording = recording
        self.loaded = None
        k_max = max(len(ids) for ids, _, _ in recording.batches)
        g = torch.Generator().manual_seed(seed)
        self._mean = torch.randn((k_max, layers, d), generator=g, dtype=F64)
        self._m2 = torch.rand((k_max, layers), generator=g, dtype=F64) * d
        self._unit = torch.randn((k_max, layers, d), generator=g, dtype=F64) if self_similarity else None
        self._lay_mean = torch.randn((layers, d), generator=g, dtype=F64)
        c = torch.randn((layers, d, d), generator=g, dtype=F64)
        self._com = c @ c.transpose(1, 2)
        self._lay_unit = torch.randn((layers, d), generator=g, dtype=F64)

    def prepare(self, texts) -> PreparedJob:
        job = int(texts[0].split(":", 1)[1])
        batches = self.recording.jobs[job]
        counted = sum(self.recording.batches[b][2] for b in batches)
        return PreparedJob(batches, counted, len(batches))

    def run(self, batch: int, window=None):
        """The batch's moments. With ``window`` (the worker's path), its per-type sums go
        into it as the reduction's would (:meth:`WindowAccumulator.add_sums`, the rows
        looked up, new rows' shifts left at 0) and the token moments returned are None;
        the co-moment GEMM is device work (what the host ceiling leaves out) and is not
        replayed. Without one, the token moments and a recorded co-moment are returned."""
        ids, n, N = self.recording.batches[batch]
        k = len(ids)
        unit = None if self._unit is None else self._unit[:k]
        layers = LayerMoments(N, self._lay_mean, None if window is not None else self._com,
                              self._lay_unit, self._lay_unit.abs())
        if window is not None:
            return fold(window, torch.from_numpy(ids), torch.from_numpy(n).to(F64),
                        self._mean[:k], self._m2[:k], unit), layers
        tokens = TokenMoments(torch.from_numpy(ids), torch.from_numpy(n).to(F64), self._mean[:k],
                              self._m2[:k], unit)
        return tokens, layers


def replay_settings(redis_url: str, **overrides):
    from embgeom.settings import Settings

    return Settings(redis_url=redis_url, **overrides)


def prepare_collection(client, collection: str, shape: str) -> None:
    """Create the collection with the shape's layers and self-similarity setting."""
    from embgeom.store.collections import Collections
    from embgeom.store.conf import CollectionSettings

    spec = REPLAY_SHAPES[shape]
    Collections(client).put(collection, CollectionSettings(
        layers=tuple(spec["keep"]) if spec["keep"] else None,
        self_similarity=spec["self_similarity"]))


def submit_replay_jobs(client, collection: str, model: str, jobs: range) -> list[str]:
    from embgeom.store.jobs import JobRequest
    from embgeom.store.submission import JobSubmitter

    q = JobSubmitter(client, max_pending=10**9)
    return [q.submit(JobRequest(collection, model, [f"replay:{j}"]), [model])[0] for j in jobs]


def replay_worker(redis_url: str, shape: str, model: str = "minilm", worker_id: Optional[str] = None,
                  recording: Optional[Recording] = None, settings_overrides: Optional[dict] = None,
                  prebuild: bool = False):
    """A real :class:`embgeom.worker.Worker` whose engine replays ``shape``; ``prebuild``
    draws the engine's pool now rather than at the first job (a timed run then starts
    with the process ready)."""
    from embgeom.compute.catalogue import ModelRegistry
    from embgeom.store.connection import redis_client
    from embgeom.worker import Worker

    spec = REPLAY_SHAPES[shape]
    recording = recording or record_bbc()
    settings = replay_settings(redis_url, worker_models=[model], **(settings_overrides or {}))
    registry = _ShapeRegistry(ModelRegistry.from_settings(settings), spec)
    engines = {}

    def factory(conf, _model):
        key = (conf.L, conf.d, conf.self_similarity)
        if key not in engines:
            engines[key] = ReplayEngine(recording, conf.L, conf.d, conf.self_similarity)
        return engines[key]

    if prebuild:
        L = len(spec["keep"]) if spec["keep"] else spec["layers"]
        engines[(L, spec["d"], spec["self_similarity"])] = ReplayEngine(
            recording, L, spec["d"], spec["self_similarity"])

    return Worker(redis_client(redis_url), settings, registry=registry, worker_id=worker_id,
                  engine_factory=factory)


class _ShapeRegistry:
    """The real registry, with the model's layer count and width replaced by a shape's."""

    def __init__(self, registry, spec):
        self._r = registry
        self._spec = spec

    def __getattr__(self, name):
        return getattr(self._r, name)

    def info(self, name):
        from dataclasses import replace

        return replace(self._r.info(name), num_layers=self._spec["layers"] - 1,
                       hidden_size=self._spec["d"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--shape", default="minilm", choices=sorted(REPLAY_SHAPES))
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--stats", default=None, help="write the worker's stage clock here (JSON)")
    parser.add_argument("--ready", default=None,
                        help="create this file once torch is imported, BBC tokenised and the "
                             "engine built: a timer started after it measures the work only")
    args = parser.parse_args(argv)
    from embgeom.settings import Settings

    logging.basicConfig(level=(Settings().log_level or "WARNING").upper())
    worker = replay_worker(args.redis_url, args.shape, worker_id=args.worker_id, prebuild=True)
    signal.signal(signal.SIGTERM, lambda *_: worker.request_stop(60))
    if args.ready:
        open(args.ready, "w").close()
    worker.run()
    if args.stats:
        with open(args.stats, "w") as f:
            json.dump({"seconds": dict(worker.clock.seconds), "counts": dict(worker.clock.counts),
                       "checkpoints": worker.checkpoints, "jobs": worker.jobs_done}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
