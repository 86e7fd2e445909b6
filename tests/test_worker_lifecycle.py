"""A worker that runs for weeks: what it holds is bounded by what it is told to keep.

* Engines belong to the model pool and leave with their model: cycling models (with a
  DELETE, a new generation, between each job) under ``max_loaded_models=1`` keeps one
  model object alive, not one per (model, settings, generation).

Real Redis (``redis_server``), jobs driven through a real :class:`Worker` step by step
(take -> prepare -> process -> checkpoint, as ``tests/test_scale_out.py`` does), small
random-weight GPT-2 models registered through settings (with MiniLM's tokenizer) where
only the shape matters.
"""

from __future__ import annotations

import gc
import random
import weakref

import pytest

from benchmarks.gpu import build_gpt2_random
from embgeom.compute.models import LoadedModel
from embgeom.settings import ModelSource
from embgeom.sources import minilm_path
from embgeom.store import keys as K
from embgeom.store.collections import Collections
from embgeom.store.conf import CollectionSettings
from embgeom.store.jobs import JobQueue, JobRequest
from embgeom.worker import Worker, redis_client
from tests.conftest import test_settings

# name -> GPT-2 shape; "wide" has 4x the layers and 8x the width of the narrow ones.
SHAPES = {
    "ga": dict(n_layer=2, n_embd=32, n_head=2, n_positions=64),
    "gb": dict(n_layer=2, n_embd=32, n_head=2, n_positions=64),
    "wide": dict(n_layer=8, n_embd=256, n_head=4, n_positions=64),
}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, ModelSource]:
    root = tmp_path_factory.mktemp("models")
    return {name: ModelSource(source=str(build_gpt2_random(root / name, minilm_path(), seed=i, **shape)))
            for i, (name, shape) in enumerate(SHAPES.items())}


def make_worker(url: str, serves: list[str], **overrides) -> Worker:
    settings = test_settings(url, worker_models=serves, lease_seconds=60, **overrides)
    return Worker(redis_client(url), settings, worker_id=f"w-{'-'.join(serves)}-{id(overrides)}")


def ingest(worker: Worker, collection: str, model: str, texts: list[str]) -> str:
    """Submit one job and run it through ``worker`` into its window (``worker.window``,
    checkpointed by :func:`checkpoint`); returns its job id."""
    job_id, _ = worker.queue.submit(JobRequest(collection, model, texts), worker.models)
    delivery = worker.queue.take(worker.id, [model], 60, block_ms=0,
                                 only=K.PairKeys(collection, model).jobs)
    assert delivery is not None and delivery.job_id == job_id
    assert worker.process(worker._prepare(delivery)) == "merged"
    return job_id


def checkpoint(worker: Worker) -> None:
    assert worker.checkpoint() == "completed"


def sentences(seed: int, n: int, words: int = 12) -> list[str]:
    rng = random.Random(seed)
    vocab = "the a model token layer window cycle memory river stone glass bread".split()
    return [" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(n)]


def test_cycling_models_keeps_one_engine_per_loaded_model(redis_server, tiny_models):
    """DELETE + re-ingest, alternating two models, under max_loaded_models=1: every model
    object but the one loaded now is collected, and so is every engine but its own."""
    w = make_worker(redis_server.url, ["ga", "gb"], models=tiny_models, max_loaded_models=1)
    collections = Collections(w.r)
    models, engines = [], []
    for cycle in range(6):
        model = ("ga", "gb")[cycle % 2]
        if cycle:
            collections.delete("cyc")  # a new generation for every pair of the collection
        ingest(w, "cyc", model, sentences(cycle, 20))
        checkpoint(w)
        conf = w.pair_conf(K.PairKeys("cyc", model), collections.gen(K.PairKeys("cyc", model)))
        engines.append(weakref.ref(w.engine(conf, model)))
        loaded = w.pool.get(model)  # the most recently used: returned, not loaded again
        assert isinstance(loaded, LoadedModel)
        models.append(weakref.ref(loaded))
        del loaded
    gc.collect()
    alive_models = [i for i, r in enumerate(models) if r() is not None]
    alive_engines = [i for i, r in enumerate(engines) if r() is not None]
    assert w.pool.loaded() == ["gb"]
    assert alive_models == [5], f"model objects of cycles {alive_models} still alive"
    assert alive_engines == [5], f"engines of cycles {alive_engines} still alive"
