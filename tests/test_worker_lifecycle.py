"""A worker that runs for weeks: what it holds is bounded by what it is told to keep.

* Engines belong to the model pool and leave with their model: cycling models (with a
  DELETE, a new generation, between each job) under ``max_loaded_models=1`` keeps one
  model object alive, not one per (model, settings, generation).
* A new window's capacity is what its own shape (layers x width) needed before, within
  the byte budget, not the largest window any model reached.
* Everything that decides counts is pinned in the pair's configuration: two workers with
  different ``max_window_tokens`` count one collection by the window length of the first.

Real Redis (``redis_server``), jobs driven through a real :class:`Worker` step by step
(take -> prepare -> process -> checkpoint, as ``tests/test_scale_out.py`` does), small
random-weight GPT-2 models registered through settings (with MiniLM's tokenizer) where
only the shape matters, the packaged MiniLM where counts are compared with its tokenizer.
"""

from __future__ import annotations

import gc
import json
import math
import random
import weakref

import pytest

from embgeom.testing.models import build_gpt2_random
from embgeom.compute.models import LoadedModel
from embgeom.settings import ModelSource
from embgeom.sources import minilm_path
from embgeom.store import keys as K
from embgeom.store.collections import Collections
from embgeom.store.conf import CollectionSettings
from embgeom.store.jobs import JobRequest
from embgeom.store.submission import JobSubmitter
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
    job_id, _ = JobSubmitter(worker.r).submit(JobRequest(collection, model, texts), worker.models)
    delivery = worker.queue.take(worker.id, [model], 60, block_ms=0,
                                 only=K.PairKeys(collection, model).jobs)
    assert delivery is not None and delivery.job_id == job_id
    assert worker.process(worker.feeder.prepare(delivery)) == "merged"
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


def test_a_workers_tokenizers_leave_with_their_models(redis_server, tiny_models):
    """Under max_loaded_models=1, alternating two models: each model's tokenizer is
    collected with the model (the registry's cache kept every tokenizer a worker had
    touched: about 300 MB for Gemma 3, a one-time step the soak saw in every worker), and
    resolving a pair's configuration keeps none."""
    w = make_worker(redis_server.url, ["ga", "gb"], models=tiny_models, max_loaded_models=1)
    tokenizers = []
    for cycle in range(4):
        model = ("ga", "gb")[cycle % 2]
        ingest(w, "tok", model, sentences(cycle, 5))
        checkpoint(w)
        loaded = w.pool.get(model)
        tokenizers.append(weakref.ref(loaded.tokenizer))
        del loaded
    gc.collect()
    assert [i for i, r in enumerate(tokenizers) if r() is not None] == [3]
    assert w.registry._tokenizers == {}
    assert w.registry.info("ga").tokenizer_size == len(w.registry.tokenizer("ga", keep=False)) > 1000


def test_a_small_window_of_a_wide_model_does_not_start_at_a_narrow_models_size(redis_server, tiny_models):
    """A narrow window reaches many rows; the next window, of a model 4x deeper and 8x
    wider, holding 2 short texts, starts within the byte budget and below the narrow
    window's row count; the narrow shape's next window starts at the size it reached."""
    budget = 4 << 20  # bytes of per-token state a window may hold
    w = make_worker(redis_server.url, ["ga", "wide"], models=tiny_models, checkpoint_bytes=budget)
    # ~2,000 distinct token ids of MiniLM's vocabulary, as text.
    tokenizer = w.registry.tokenizer("ga")
    vocab = [t for t in tokenizer.convert_ids_to_tokens(range(2000, 6000)) if t.isalpha()][:2000]
    texts = [" ".join(vocab[i:i + 40]) for i in range(0, len(vocab), 40)]
    ingest(w, "narrow", "ga", texts)
    narrow_rows = len(w.window.acc)
    assert narrow_rows >= 1500
    checkpoint(w)

    def per_row(L: int, d: int) -> int:  # n, key, then per layer m2, mean (d), unit sums (d)
        return 8 * (2 + L * (1 + 2 * d))

    ingest(w, "wide", "wide", ["a short text", "another one"])
    acc = w.window.acc
    capacity = acc._keys.shape[0]
    wide_bytes = capacity * per_row(SHAPES["wide"]["n_layer"] + 1, SHAPES["wide"]["n_embd"])
    assert capacity < narrow_rows, capacity
    assert wide_bytes <= budget, wide_bytes
    checkpoint(w)

    # The narrow shape remembers what it needed: no doubling from scratch next time.
    ingest(w, "narrow", "ga", ["one more"])
    assert w.window.acc._keys.shape[0] >= narrow_rows
    checkpoint(w)


def test_the_first_window_of_a_wide_shape_starts_within_64_mb(redis_server):
    """No earlier window of its shape: a 17 x 2048 model (SmolLM2-1.7B-like hidden states,
    557 kB per token row) starts at the rows 64 MB hold, not at 1,024 rows (570 MB)."""
    from embgeom.compute.window import WindowAccumulator
    from embgeom.store.conf import PairConf

    w = make_worker(redis_server.url, ["minilm"])  # the default byte budget: 1 GiB
    conf = PairConf.resolve(CollectionSettings(), 0, 17, 2048, 49152, 32, 2 << 20)
    acc = w.window_policy.accumulator(conf, None)
    row = 8 * (2 + 17 * (1 + 2 * 2048)) + 4 * 17 * 2048  # the checkpointed state and the float32 shifts
    assert WindowAccumulator.row_bytes(17, 2048, True) == row
    assert 0 < acc._keys.shape[0] * row <= 64 << 20


def expected_counts(tokenizer, texts: list[str], window: int) -> int:
    """Tokens counted with special tokens included, the texts cut into windows of at most
    ``window`` tokens, each with its [CLS] and [SEP]: n + 2 ceil(n / (window - 2))."""
    n = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    return sum(k + 2 * math.ceil(k / (window - 2)) for k in n)


def test_window_length_is_pinned_in_the_pair_config(redis_server):
    """Worker A (windows of 16 tokens) resolves the pair; worker B (windows of 64) runs the
    next job of the same collection: both count by A's window length."""
    url = redis_server.url
    a = make_worker(url, ["minilm"], max_window_tokens=16)
    b = make_worker(url, ["minilm"], max_window_tokens=64, token_budget=4096)
    Collections(a.r).put("special", CollectionSettings(include_special=True))
    texts_a, texts_b = sentences(1, 6, words=40), sentences(2, 6, words=40)
    tokenizer = a.registry.tokenizer("minilm")
    want_a, want_b = (expected_counts(tokenizer, t, 16) for t in (texts_a, texts_b))
    assert want_b != expected_counts(tokenizer, texts_b, 64)  # the window length matters here

    job_a = ingest(a, "special", "minilm", texts_a)
    checkpoint(a)
    job_b = ingest(b, "special", "minilm", texts_b)
    checkpoint(b)
    q = JobSubmitter(a.r)
    assert q.status(job_a)["tokens"] == want_a
    assert q.status(job_b)["tokens"] == want_b
    conf = Collections(a.r).conf(K.PairKeys("special", "minilm"))
    assert conf.window_tokens == 16


def test_window_growth_stops_doubling_at_its_byte_budget():
    """Doubling up to ``max_capacity`` (the rows the byte budget holds), then a quarter
    more at a time: a job past the budget never allocates twice what it uses; the
    moments are those of every batch (counts checked against the ids added)."""
    import torch

    from embgeom.compute.reduce import reduce_batch
    from embgeom.compute.window import WindowAccumulator

    acc = WindowAccumulator(1, 2, False, capacity=4, max_capacity=10)
    capacities = []
    for start in range(0, 15, 3):  # 3 new ids a batch, each id once
        keys = torch.arange(start, start + 3)[None]
        hidden = [torch.randn(1, 3, 2)]
        acc.add(*reduce_batch(hidden, [0], keys, torch.ones_like(keys, dtype=torch.bool), False,
                              "fp32", acc.layers))
        capacities.append(acc.capacity)
    assert capacities == [4, 8, 10, 12, 15]
    tokens, layers = acc.export()
    assert tokens.ids.tolist() == list(range(15)) and tokens.n.tolist() == [1] * 15
    assert layers.n == 15


def test_a_conf_fixed_before_the_window_was_pinned_counts_by_the_workers_length(redis_server):
    """A configuration stored without ``window_tokens`` still reads; its engine cuts
    windows at the worker's model maximum, as before the field existed."""
    from embgeom.store.conf import PairConf

    w = make_worker(redis_server.url, ["minilm"], max_window_tokens=32)
    fresh = w.pair_conf(K.PairKeys("old", "minilm"), 0)
    assert fresh.window_tokens == 32
    raw = json.loads(fresh.to_json())
    del raw["window_tokens"]
    old = PairConf.from_json(json.dumps(raw))
    assert old.window_tokens == 0
    assert w.engine(old, "minilm").window == 32 == w.registry.info("minilm").max_length


def test_a_worker_preparing_a_job_is_not_at_rest(redis_server, tiny_models):
    """The heartbeat's ``at_rest`` (what the soak compares memory at) is false while the
    feeder holds a job: taken and being prepared (its model loading: the soak saw a third
    weight file mapped at "rest"), or prepared and waiting for the main thread."""
    w = make_worker(redis_server.url, ["ga"], models=tiny_models)
    JobSubmitter(w.r).submit(JobRequest("rest", "ga", sentences(0, 3)), w.models)
    w.feeder.idle.set()  # as the feeder leaves it when it finds no job
    assert w.heartbeat_details()["at_rest"]
    w.feeder.idle.clear()  # as it does when it has taken one
    delivery = w.queue.take(w.id, ["ga"], 60, block_ms=0)
    assert not w.heartbeat_details()["at_rest"]
    w.feeder.ready.put(w.feeder.prepare(delivery))
    w.feeder.idle.set()  # the feeder found nothing more; the job waits, prepared
    details = w.heartbeat_details()
    assert not details["at_rest"]
    assert w.process(w.feeder.ready.get()) == "merged"
    checkpoint(w)
    details = w.heartbeat_details()
    assert details["at_rest"]
    # The C heap beside it (embgeom.heap.usage): what the process holds vs keeps free.
    assert details["heap"]["in_use_mb"] > 0 and details["heap"]["arenas"] >= 1
