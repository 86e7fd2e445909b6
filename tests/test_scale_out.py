"""Scale-out and faults: several workers on one real Redis, crashes, take-overs, fencing,
a Redis crash and restart, dead letters, SIGTERM, readiness and back-pressure.

Everything runs against real ``redis-server`` processes started here on free ports (AOF,
``appendfsync always``), real ``embgeom worker`` processes (short leases so take-overs
happen in seconds) and the packaged MiniLM over BBC paragraphs. No mocks: faults are real
signals (SIGKILL, SIGTERM) to real processes, or, for the two instants that a signal
cannot hit on purpose (between the commit and the XACK; a stale delivery that wakes up
after a take-over), a worker driven step by step in this process.

The yardstick is a reference run: the same jobs through one worker with no fault. A
faulty run must give exactly the same per-token counts at every layer (the whole
``/tokens`` listing, walked with its cursor), the same values and self-similarities
within 1e-5 relative, and the same ``/layers``, unfiltered and filtered by count
(``min_count`` 2 and 10: the count buckets' vector sums). Each run, faulty or not, is
also checked against the independent reference of ``tests/reference.py`` (the model
run one text at a time, two-pass float64 over the raw hidden states) with the
tolerances of ``tests/test_e2e_minilm.py``: per-token counts exact, per-token values and
decompositions within 1e-4 of Q, self-similarity within 1e-4.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Iterator, Optional

import httpx
import numpy as np
import pytest
import redis
import torch
from fastapi.testclient import TestClient

from embgeom.store import keys as K
from embgeom.corpora import bbc_texts
from embgeom.compute.catalogue import ModelRegistry
from embgeom.compute.models import ModelPool
from embgeom.store.delivery import WorkerQueue
from embgeom.store.jobs import JobRequest, JobStreams
from embgeom.store.submission import JobSubmitter
from embgeom.sources import minilm_path
from embgeom.store.server import RedisServer, free_port
from embgeom.store.heartbeats import live_workers
from embgeom.worker import Worker, redis_client
from service.app import create_app
from embgeom.testing import reference as R
from embgeom.testing.serve import ServiceProcess
from tests.conftest import WorkerThread, wait_for_jobs
from tests.conftest import test_settings as settings_for

MODEL = "minilm"
NUM_LAYERS = 7  # MiniLM: embedding output + 6 blocks
JOBS = 12
TEXTS_PER_JOB = 50
REL_TOL = 1e-5
RAW_TOL = 1e-4  # against the raw hidden states: float32 forward noise (test_e2e_minilm.py)
FILTERS = (1, 2, 10)  # min_count of the /layers compared: 2 and 10 read the bucket sums
# Small forward batches: a job runs in a dozen batches, so it is seen "running" with
# 0 < progress < 1 and a signal can land in its middle. (Windows of at most 128 tokens;
# the paragraphs used are shorter, so no text is cut.)
TOKEN_BUDGET = 128

# What every worker process and in-process API of this file runs with.
WORKER_ENV = {
    "EMBGEOM_LEASE_SECONDS": "3",
    "EMBGEOM_HEARTBEAT_SECONDS": "0.5",
    "EMBGEOM_TOKEN_BUDGET": str(TOKEN_BUDGET),
    "EMBGEOM_MAX_WINDOW_TOKENS": str(TOKEN_BUDGET),
    "OMP_NUM_THREADS": "1",  # three workers on two cores: no oversubscription
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def _paragraphs() -> list[str]:
    """BBC paragraphs of moderate length (fast on CPU, varied tokens), in corpus order."""
    return [p for p in bbc_texts("paragraphs") if 60 <= len(p) <= 260]


PARAGRAPHS = _paragraphs()[1500:]
JOB_TEXTS = [PARAGRAPHS[i * TEXTS_PER_JOB:(i + 1) * TEXTS_PER_JOB] for i in range(JOBS)]
# Short jobs for the workers driven step by step in this process.
SMALL = [JOB_TEXTS[0][:15], JOB_TEXTS[1][:15]]
# Longer jobs for the SIGTERM test: a signal lands with several seconds of work left.
LONG_TEXTS = PARAGRAPHS[JOBS * TEXTS_PER_JOB:JOBS * TEXTS_PER_JOB + 450]


# ------------------------------------------------------------------------------ helpers


def api_settings(url: str, **overrides):
    values = {"token_budget": TOKEN_BUDGET, "max_window_tokens": TOKEN_BUDGET, **overrides}
    return settings_for(url, **values)


class Fleet:
    """Worker processes of one test, each with a known worker id; all killed at the end."""

    def __init__(self, url: str, log_dir: Path, env: Optional[dict] = None):
        self.url = url
        self.log_dir = log_dir
        self.env = {**WORKER_ENV, **(env or {})}
        self.procs: dict[str, ServiceProcess] = {}
        self._n = 0

    def start(self, grace: Optional[float] = None, name: Optional[str] = None) -> str:
        self._n += 1
        name = name or f"w{self._n}"
        args = ["worker", "--redis-url", self.url, "--worker-id", name]
        if grace is not None:
            args += ["--grace", str(grace)]
        self.procs[name] = ServiceProcess(args, env=self.env,
                                          log_path=self.log_dir / f"worker-{name}.log").start()
        return name

    def sigkill(self, name: str) -> None:
        self.procs[name].kill()

    def sigterm(self, name: str) -> None:
        self.procs[name].process.send_signal(signal.SIGTERM)

    def alive(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.process.poll() is None]

    def close(self) -> None:
        for proc in self.procs.values():
            proc.kill()

    def logs(self) -> str:
        out = []
        for name in self.procs:
            path = self.log_dir / f"worker-{name}.log"
            if path.exists():
                out.append(f"--- {name}\n" + path.read_text(errors="replace")[-3000:])
        return "\n".join(out)


@contextlib.contextmanager
def redis_at(path: Path, port: Optional[int] = None) -> Iterator[RedisServer]:
    server = RedisServer(path, port=port).start(timeout=120)
    try:
        yield server
    finally:
        server.kill()
        shutil.rmtree(path, ignore_errors=True)  # AOFs of these runs are hundreds of MB


@contextlib.contextmanager
def fleet(url: str, log_dir: Path, env: Optional[dict] = None) -> Iterator[Fleet]:
    f = Fleet(url, log_dir, env)
    try:
        yield f
    finally:
        f.close()


def post_job(client, texts, collection: str, key: Optional[str] = None, model: str = MODEL,
             timeout: float = 60) -> str:
    """POST /v1/jobs until it is acknowledged (202); retries 503s (Redis down) with the
    same Idempotency-Key, so a retried submission is still one job."""
    headers = {"Idempotency-Key": key} if key else {}
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = client.post("/v1/jobs", json={"collection": collection, "model": model,
                                              "texts": list(texts)}, headers=headers)
            if r.status_code == 202:
                return r.json()["job_id"]
            assert r.status_code == 503, r.text
        except (redis.RedisError, httpx.HTTPError):
            pass
        assert time.monotonic() < deadline, "POST /v1/jobs never acknowledged"
        time.sleep(0.3)


def ready_workers(client) -> int:
    r = client.get("/readyz")
    return r.json().get("workers", 0) if r.status_code in (200, 503) else 0


def wait_workers(client, count: int, timeout: float = 120, fl: Optional[Fleet] = None) -> None:
    deadline = time.monotonic() + timeout
    while ready_workers(client) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {count} live workers" + (f"\n{fl.logs()}" if fl else ""))
        time.sleep(0.2)


def wait_running(client, job_ids, timeout: float = 180, below: float = 1.0) -> dict:
    """The first job seen running with 0 < progress < ``below`` (its worker is mid-job)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ended = 0
        for job_id in job_ids:
            s = client.get(f"/v1/jobs/{job_id}").json()
            if s["status"] == "running" and 0 < s["progress"] < below and s["worker"]:
                return s
            ended += s["status"] in ("done", "failed")
        if ended == len(job_ids):
            raise AssertionError("every job ended before one was seen mid-way")
        time.sleep(0.05)
    raise TimeoutError("no job was seen running mid-way")


def walk_tokens(client, collection: str, layer: int, page: int = 2000) -> dict[int, tuple]:
    """Every token of a layer, walked page by page with the cursor: id -> (n, Q, M, V,
    self-similarity)."""
    out: dict[int, tuple] = {}
    cursor = None
    while True:
        params = {"limit": page}
        if cursor:
            params["cursor"] = cursor
        r = client.get(f"/v1/collections/{collection}/models/{MODEL}/layers/{layer}/tokens",
                       params=params)
        assert r.status_code == 200, r.text
        body = r.json()
        for t in body["tokens"]:
            assert t["token_id"] not in out, "a token served twice across pages"
            out[t["token_id"]] = (t["n"], t["Q"], t["M"], t["V"], t["self_similarity"])
        cursor = body["next_cursor"]
        if cursor is None:
            assert len(out) == body["total"]
            return out


def snapshot(client, collection: str) -> dict:
    """/layers for each count filter of FILTERS, and every token of every layer."""
    layers = {}
    for min_count in FILTERS:
        r = client.get(f"/v1/collections/{collection}/models/{MODEL}/layers",
                       params={"min_count": min_count})
        assert r.status_code == 200, r.text
        layers[min_count] = r.json()["layers"]
        assert len(layers[min_count]) == NUM_LAYERS
    return {"layers": layers[1], "filtered": layers,
            "tokens": {l: walk_tokens(client, collection, l) for l in range(NUM_LAYERS)}}


def _rel(a: float, b: float, scale: float) -> float:
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-12 * scale, 1e-300)


def compare(ref: dict, got: dict) -> dict:
    """Counts exactly equal, values within REL_TOL; returns the max relative errors."""
    worst = {"token_values": 0.0, "layer_values": 0.0}
    for layer in range(NUM_LAYERS):
        a, b = ref["tokens"][layer], got["tokens"][layer]
        assert a.keys() == b.keys(), f"layer {layer}: token sets differ " \
            f"({len(a.keys() - b.keys())} missing, {len(b.keys() - a.keys())} extra)"
        bad = {t: (a[t][0], b[t][0]) for t in a if a[t][0] != b[t][0]}
        assert not bad, f"layer {layer}: counts differ for {len(bad)} tokens, e.g. {list(bad.items())[:5]}"
        for t, (n, *vals) in a.items():
            for x, y in zip(vals[:3], b[t][1:4]):
                worst["token_values"] = max(worst["token_values"], _rel(x, y, abs(vals[0])))
            assert (vals[3] is None) == (b[t][4] is None), (layer, t)
            if vals[3] is not None:  # self-similarity, in [-1, 1]
                worst["token_values"] = max(worst["token_values"], abs(vals[3] - b[t][4]))
    for min_count in FILTERS:
        for ra, rb in zip(ref["filtered"][min_count], got["filtered"][min_count]):
            assert ra["layer"] == rb["layer"]
            assert ra["n"] == rb["n"] and ra["num_types"] == rb["num_types"], (ra, rb)
            for field in ("Q", "M", "V", "V_W", "V_B", "cv_Q", "slope", "r2"):
                worst["layer_values"] = max(worst["layer_values"],
                                            _rel(ra[field], rb[field], abs(ra["Q"])))
    assert worst["token_values"] <= REL_TOL, worst
    assert worst["layer_values"] <= REL_TOL, worst
    return worst


def raw_self_similarity(ids: np.ndarray, X: np.ndarray) -> dict[int, Optional[float]]:
    """Per token type, the mean cosine over its distinct pairs of occurrences, from the
    pairwise cosine matrix of its raw states (None for a type seen once)."""
    U = X.astype(np.float64) / np.linalg.norm(X.astype(np.float64), axis=1, keepdims=True)
    out: dict[int, Optional[float]] = {}
    for t in np.unique(ids):
        u = U[ids == t]
        n = u.shape[0]
        cos = u @ u.T
        out[int(t)] = None if n < 2 else float((cos.sum() - np.trace(cos)) / (n * (n - 1)))
    return out


def compare_raw(raw, got: dict) -> dict:
    """A snapshot against the raw hidden states (tests/reference.py): per-token counts
    exact, per-token Q, M, V within RAW_TOL of Q_t and self-similarity within RAW_TOL,
    each filtered /layers within RAW_TOL of Q. Returns the max errors."""
    worst = {"token_values": 0.0, "self_similarity": 0.0, "layer_values": 0.0}
    for layer in range(NUM_LAYERS):
        X = raw.states[layer]
        ref = R.token_stats(raw.ids, X)
        sims = raw_self_similarity(raw.ids, X)
        listed = got["tokens"][layer]
        assert sorted(listed) == ref["ids"].tolist(), f"layer {layer}: token sets differ"
        for j, t in enumerate(ref["ids"].tolist()):
            n, Q, M, V, sim = listed[t]
            assert n == ref["n"][j], (layer, t, n, ref["n"][j])
            for x, y in ((Q, ref["Q"][j]), (M, ref["M"][j]), (V, ref["V"][j])):
                worst["token_values"] = max(worst["token_values"], abs(x - y) / ref["Q"][j])
            assert (sim is None) == (sims[t] is None), (layer, t, sim, sims[t])
            if sim is not None:
                worst["self_similarity"] = max(worst["self_similarity"], abs(sim - sims[t]))
        for min_count in FILTERS:
            want = R.decomposition(raw.ids, X, min_count=min_count)
            row = got["filtered"][min_count][layer]
            assert (row["n"], row["num_types"]) == (want["n"], want["num_types"]), (layer, min_count)
            for q in ("Q", "M", "V", "V_W", "V_B"):
                worst["layer_values"] = max(worst["layer_values"], abs(row[q] - want[q]) / want["Q"])
    assert all(v <= RAW_TOL for v in worst.values()), worst
    return worst


def expected_counts(tokenizer, texts) -> Counter:
    """Occurrences of each token id in ``texts``: the tokenizer's own ids, special tokens
    not added (the default counting rule), independently of the pipeline."""
    counts: Counter = Counter()
    for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        counts.update(ids)
    return counts


def stored_counts(client, collection: str, layer: int = 0) -> Counter:
    return Counter({t: v[0] for t, v in walk_tokens(client, collection, layer).items()})


def assert_counted_once(client, rdb: redis.Redis, collection: str, job_texts, tokenizer) -> None:
    """Every layer holds exactly one occurrence per token occurrence of the jobs' texts."""
    want: Counter = Counter()
    for texts in job_texts:
        want += expected_counts(tokenizer, texts)
    for layer in (0, NUM_LAYERS - 1):
        assert stored_counts(client, collection, layer) == want, f"layer {layer}"
    layers = client.get(f"/v1/collections/{collection}/models/{MODEL}/layers").json()["layers"]
    assert {row["n"] for row in layers} == {sum(want.values())}
    assert done_jobs(rdb, collection) == len(job_texts)


def done_jobs(rdb: redis.Redis, collection: str) -> int:
    """Jobs of a collection whose checkpoint completed (status done)."""
    pair = K.PairKeys(collection, MODEL)
    return sum(rdb.hget(k, "status") == b"done" for k in rdb.scan_iter(pair.job("*")))


def live_worker_details(rdb: redis.Redis) -> list[dict]:
    return live_workers(rdb, 3 * 0.5 + 2)


def model_streams(rdb: redis.Redis, model: str = MODEL) -> list[str]:
    """The job streams of every pair of ``model`` (one per collection)."""
    return JobStreams(rdb).streams([model])


def stream_state(rdb: redis.Redis, model: str = MODEL) -> tuple[int, int]:
    """(entries in the model's streams, entries pending in their groups)."""
    streams = model_streams(rdb, model)
    return (sum(rdb.xlen(s) for s in streams),
            sum(rdb.xpending(s, K.GROUP)["pending"] for s in streams if rdb.exists(s)))


def pending_entries(rdb: redis.Redis, model: str = MODEL) -> list[dict]:
    """XPENDING details of every entry of the model's streams."""
    return [p for s in model_streams(rdb, model) for p in rdb.xpending_range(s, K.GROUP, "-", "+", 10)]


@contextlib.contextmanager
def api(url: str, **overrides) -> Iterator[TestClient]:
    """The real app on a real Redis, in this process (enqueue-only: no embedded worker)."""
    with TestClient(create_app(api_settings(url, **overrides))) as client:
        yield client


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def registry() -> ModelRegistry:
    return ModelRegistry.from_settings(api_settings("redis://unused"))


@pytest.fixture(scope="module")
def pool(registry) -> ModelPool:
    """One loaded MiniLM shared by the in-process workers of this file."""
    p = ModelPool(registry, "cpu")
    p.get(MODEL)
    return p


@pytest.fixture(scope="module")
def tokenizer(registry):
    return registry.tokenizer(MODEL)


@pytest.fixture(scope="module")
def raw():
    """The independent reference: MiniLM run on every text of JOB_TEXTS one at a time,
    its raw hidden states (tests/reference.py)."""
    from transformers import AutoModel, AutoTokenizer

    path = str(minilm_path())
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return R.raw_hidden_states(model, AutoTokenizer.from_pretrained(path),
                               [t for texts in JOB_TEXTS for t in texts])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tokenizer, raw) -> dict:
    """The yardstick: every job through one worker process, no fault, itself checked
    against the raw hidden states."""
    tmp = tmp_path_factory.mktemp("reference")
    with redis_at(tmp / "redis") as server, fleet(server.url, tmp) as fl, api(server.url) as client:
        fl.start()
        ids = [post_job(client, texts, "ref") for texts in JOB_TEXTS]
        final = wait_for_jobs(client, ids, timeout=900)
        assert all(s["status"] == "done" for s in final), final
        snap = snapshot(client, "ref")
    want: Counter = Counter()
    for texts in JOB_TEXTS:
        want += expected_counts(tokenizer, texts)
    assert Counter({t: v[0] for t, v in snap["tokens"][0].items()}) == want
    print("reference run against the raw states:", compare_raw(raw, snap))
    snap["job_tokens"] = [s["tokens"] for s in final]
    return snap


@pytest.fixture
def server(tmp_path) -> Iterator[RedisServer]:
    with redis_at(tmp_path / "redis") as s:
        yield s


def in_process_worker(url: str, pool: ModelPool, worker_id: str, queue_cls=WorkerQueue) -> Worker:
    s = api_settings(url, token_budget=4096)  # driven step by step: no need for small batches
    w = Worker(redis_client(url), s, registry=pool.registry, pool=pool, worker_id=worker_id)
    w.queue = queue_cls(w.r, s.max_attempts)
    return w


def run_job(worker: Worker, delivery) -> str:
    """Drive one delivered job through a worker step by step: into its window, then its
    checkpoint. Returns "committed", "fenced" (another delivery owns it) or "duplicate"
    (another delivery counted it)."""
    outcome = worker.process(worker.feeder.prepare(delivery))
    if outcome != "merged":
        return outcome
    status = worker.checkpoint()
    return {"completed": "committed", "lost": "fenced"}.get(status, status)


def take(worker: Worker, timeout: float = 10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        d = worker.queue.take(worker.id, [MODEL], worker.settings.lease_seconds, block_ms=200)
        if d is not None:
            return d
    return None


# --------------------------------------------------------------------------------- tests


def test_three_workers_match_one_worker(server, tmp_path, reference, raw):
    serve = ServiceProcess.serve(redis_url=server.url, env=WORKER_ENV, log_path=tmp_path / "serve.log").start()
    base = serve.url
    try:
        with fleet(server.url, tmp_path) as fl, httpx.Client(base_url=base, timeout=60) as client:
            for _ in range(3):
                fl.start()
            serve.wait_ready()
            wait_workers(client, 3, fl=fl)
            ids = [post_job(client, texts, "three") for texts in JOB_TEXTS]
            final = wait_for_jobs(client, ids, timeout=900)
            assert all(s["status"] == "done" for s in final), final
            assert len({s["worker"] for s in final}) >= 2, "the jobs were not shared out"
            assert [s["tokens"] for s in final] == reference["job_tokens"]
            snap = snapshot(client, "three")
            compare(reference, snap)
            compare_raw(raw, snap)
            assert stream_state(redis.Redis.from_url(server.url)) == (0, 0)
    finally:
        serve.terminate()


def test_worker_sigkill_mid_job_counts_once(server, tmp_path, reference, raw):
    with fleet(server.url, tmp_path) as fl, api(server.url) as client:
        fl.start(), fl.start()
        wait_workers(client, 2, fl=fl)
        ids = [post_job(client, texts, "killed") for texts in JOB_TEXTS]
        victim = wait_running(client, ids)
        fl.sigkill(victim["worker"])
        at_kill = client.get(f"/v1/jobs/{victim['job_id']}").json()
        fl.start()  # a replacement, as an orchestrator would
        final = wait_for_jobs(client, ids, timeout=900)
        assert all(s["status"] == "done" for s in final), final
        if at_kill["status"] != "done":  # it was not committed before the kill: taken over
            done = client.get(f"/v1/jobs/{victim['job_id']}").json()
            assert done["attempts"] >= 2 and done["worker"] != victim["worker"], done
        snap = snapshot(client, "killed")
        compare(reference, snap)
        compare_raw(raw, snap)
        assert stream_state(redis.Redis.from_url(server.url)) == (0, 0)


class CrashInAck(RuntimeError):
    pass


class AckCrashingQueue(WorkerQueue):
    """The worker dies after its checkpoint completed and before the XACK."""

    def ack_many(self, stream, entry_ids):
        raise CrashInAck("killed between the completion and the XACK")


def test_crash_between_commit_and_ack_counts_once(server, pool, tokenizer):
    rdb = redis.Redis.from_url(server.url)
    with api(server.url) as client:
        job_a = post_job(client, SMALL[0], "gap")
        job_b = post_job(client, SMALL[1], "gap")

        crashed = in_process_worker(server.url, pool, "crashes-in-ack", AckCrashingQueue)
        d = take(crashed)
        assert d is not None and d.job_id == job_a
        with pytest.raises(CrashInAck):
            run_job(crashed, d)
        assert client.get(f"/v1/jobs/{job_a}").json()["status"] == "done"
        assert stream_state(rdb)[1] == 1  # committed, but its entry is still pending
        # A fresh worker (another id) takes the entry over after the lease; the
        # redelivery finds the job committed: acknowledged, nothing counted.
        fresh = in_process_worker(server.url, pool, "fresh")
        time.sleep(crashed.settings.lease_seconds + 0.5)
        assert fresh.queue.take(fresh.id, [MODEL], fresh.settings.lease_seconds, block_ms=100) is None
        assert stream_state(rdb) == (1, 0)  # only job b's entry is left, undelivered

        # The same worker id restarting (its own pending entry, read back with "0").
        d = take(crashed)
        assert d is not None and d.job_id == job_b
        with pytest.raises(CrashInAck):
            run_job(crashed, d)
        restarted = in_process_worker(server.url, pool, "crashes-in-ack")
        assert restarted.queue.own_pending(restarted.id, [MODEL]) is None
        assert stream_state(rdb) == (0, 0)

        for job in (job_a, job_b):
            s = client.get(f"/v1/jobs/{job}").json()
            assert s["status"] == "done" and s["progress"] == 1.0, s
        assert_counted_once(client, rdb, "gap", SMALL, tokenizer)


def test_stale_worker_is_fenced(server, pool, tokenizer):
    rdb = redis.Redis.from_url(server.url)
    with api(server.url) as client:
        job_a = post_job(client, SMALL[0], "fenced")
        job_b = post_job(client, SMALL[1], "fenced")
        stale = in_process_worker(server.url, pool, "stale")
        owner = in_process_worker(server.url, pool, "owner")
        lease = stale.settings.lease_seconds

        # 1. The stale delivery wakes up after the take-over and tries to commit first.
        d_stale = take(stale)
        assert d_stale.job_id == job_a and d_stale.epoch == 1
        time.sleep(lease + 0.5)  # silent past its lease (no heartbeat)
        d_owner = owner.queue.take(owner.id, [MODEL], lease, block_ms=100)
        assert d_owner is not None and d_owner.job_id == job_a and d_owner.epoch == 2
        assert run_job(stale, d_stale) == "fenced"
        s = client.get(f"/v1/jobs/{job_a}").json()
        assert s["status"] == "running" and s["worker"] == "owner", s
        assert done_jobs(rdb, "fenced") == 0
        assert stream_state(rdb)[1] == 1  # the fenced delivery acknowledged nothing
        # Its heartbeat must not pull the entry back from the new owner, nor write progress.
        assert stale.queue.refresh(d_stale, stale.id) is False
        assert stale.queue.progress(d_stale, 0.5, 123) is False
        assert client.get(f"/v1/jobs/{job_a}").json()["tokens"] == 0
        owners = {p["consumer"].decode() for p in pending_entries(rdb)}
        assert owners == {"owner"}, owners
        assert run_job(owner, d_owner) == "committed"

        # 2. The stale delivery wakes up after the new owner committed: a duplicate.
        d_stale = take(stale)
        assert d_stale.job_id == job_b
        time.sleep(lease + 0.5)
        d_owner = owner.queue.take(owner.id, [MODEL], lease, block_ms=100)
        assert d_owner.job_id == job_b
        assert run_job(owner, d_owner) == "committed"
        assert run_job(stale, d_stale) == "duplicate"
        assert stream_state(rdb) == (0, 0)
        assert_counted_once(client, rdb, "fenced", SMALL, tokenizer)


def test_redis_restart_with_jobs_in_flight(tmp_path, reference, raw):
    data = tmp_path / "redis"
    port = free_port()
    server = RedisServer(data, port=port).start(timeout=120)
    faults = []
    try:
        with fleet(server.url, tmp_path) as fl, api(server.url) as client:
            fl.start(), fl.start()
            wait_workers(client, 2, fl=fl)
            half = JOBS // 2
            ids = [post_job(client, texts, "restart", key=f"restart-{i}")
                   for i, texts in enumerate(JOB_TEXTS[:half])]
            in_flight = wait_running(client, ids)
            server.kill()
            faults.append(("redis SIGKILL", in_flight["job_id"], in_flight["progress"]))
            # Down: the API says so, and a POST is refused (not acknowledged).
            assert client.get("/readyz").status_code == 503
            r = client.post("/v1/jobs", json={"collection": "restart", "model": MODEL,
                                              "texts": JOB_TEXTS[half]},
                            headers={"Idempotency-Key": f"restart-{half}"})
            assert r.status_code == 503 and r.json()["type"] == "store_unavailable", r.text
            time.sleep(2)
            server = RedisServer(data, port=port).start(timeout=120)
            # Every job acknowledged before the crash survived it (AOF, fsync always).
            for job_id in ids:
                assert client.get(f"/v1/jobs/{job_id}").status_code == 200
            ids += [post_job(client, texts, "restart", key=f"restart-{i}")
                    for i, texts in enumerate(JOB_TEXTS[half:], start=half)]
            final = wait_for_jobs(client, ids, timeout=900)
            assert all(s["status"] == "done" for s in final), (final, fl.logs())
            assert sorted(fl.alive()) == ["w1", "w2"], "a worker did not survive the outage"
            snap = snapshot(client, "restart")
            compare(reference, snap)
            compare_raw(raw, snap)
            rdb = redis.Redis.from_url(server.url)
            assert done_jobs(rdb, "restart") == JOBS
            assert stream_state(rdb) == (0, 0)
    finally:
        server.kill()
        shutil.rmtree(data, ignore_errors=True)


def test_idempotency_key_counts_once(server, tokenizer):
    rdb = redis.Redis.from_url(server.url)
    with api(server.url) as client:
        body = {"collection": "idem", "model": MODEL, "texts": SMALL[0]}
        first = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k-1"})
        second = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k-1"})
        assert first.status_code == second.status_code == 202
        job_id = first.json()["job_id"]
        assert second.json()["job_id"] == job_id

        # Racing requests with one key: one job.
        results = []
        def post():
            results.append(client.post("/v1/jobs", json={**body, "texts": SMALL[1]},
                                       headers={"Idempotency-Key": "k-2"}).json()["job_id"])
        threads = [threading.Thread(target=post) for _ in range(6)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert len(set(results)) == 1
        assert stream_state(rdb)[0] == 2

        # The same race on the queue itself, many times over: never a second job.
        for round_ in range(25):
            barrier, ids = threading.Barrier(8), []
            def submit(round_=round_):
                q = JobSubmitter(redis.Redis.from_url(server.url))
                barrier.wait()
                ids.append(q.submit(JobRequest("idem-race", MODEL, ["a few words"]), [MODEL],
                                    f"race-{round_}")[0])
            threads = [threading.Thread(target=submit) for _ in range(8)]
            [t.start() for t in threads]
            [t.join() for t in threads]
            assert len(set(ids)) == 1, f"round {round_}: {len(set(ids))} jobs for one key"
        assert stream_state(rdb)[0] == 2 + 25
        rdb.xtrim(K.PairKeys("idem-race", MODEL).jobs, maxlen=0, approximate=False)  # not this test's to run

        with WorkerThread(api_settings(server.url)):
            final = wait_for_jobs(client, [job_id, results[0]], timeout=600)
        assert all(s["status"] == "done" for s in final)
        again = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k-1"})
        assert again.status_code == 202 and again.json()["job_id"] == job_id
        assert again.json()["status"] == "done"
        assert_counted_once(client, rdb, "idem", SMALL, tokenizer)
        assert stream_state(rdb) == (0, 0)


def test_always_failing_job_dead_letters_without_blocking(server, tmp_path, tokenizer):
    broken = '{"broken": {"source": "/nonexistent/model"}}'
    rdb = redis.Redis.from_url(server.url)
    with fleet(server.url, tmp_path, env={"EMBGEOM_MODELS": broken}) as fl, \
            api(server.url, models={"broken": {"source": "/nonexistent/model"}}) as client:
        fl.start()
        bad = post_job(client, JOB_TEXTS[0][:5], "dead", model="broken")
        good = [post_job(client, JOB_TEXTS[i][:10], "dead") for i in range(3)]
        final = wait_for_jobs(client, [bad, *good], timeout=600)
        failed, *ok = final
        assert failed["status"] == "failed", failed
        assert failed["attempts"] == 3
        assert "nonexistent" in failed["error"] and "3 attempts" in failed["error"], failed["error"]
        assert all(s["status"] == "done" for s in ok), ok
        assert stream_state(rdb, "broken") == (0, 0)  # dead-lettered: acknowledged and gone
        assert rdb.get(K.PairKeys("dead", "broken").payload(bad)) is None
        assert_counted_once(client, rdb, "dead", [JOB_TEXTS[i][:10] for i in range(3)], tokenizer)
        assert fl.alive() == ["w1"]


def test_sigterm_finishes_or_hands_back(server, tmp_path, tokenizer):
    rdb = redis.Redis.from_url(server.url)
    with fleet(server.url, tmp_path) as fl, api(server.url) as client:
        # Hand back: no grace, so the job goes back to the queue mid-way.
        quick = fl.start(grace=0)
        wait_workers(client, 1, fl=fl)
        handed = post_job(client, LONG_TEXTS[:150], "term")
        assert wait_running(client, [handed], below=0.5)["worker"] == quick
        fl.sigterm(quick)
        assert fl.procs[quick].process.wait(timeout=60) == 0
        s = client.get(f"/v1/jobs/{handed}").json()
        assert s["status"] == "queued" and s["attempts"] == 0, s  # back, attempt not counted
        assert stream_state(rdb) == (1, 0)

        # Finish: a long grace; another worker is live and must not take the job over.
        patient_a, patient_b = fl.start(grace=600), fl.start(grace=600)
        wait_workers(client, 2, fl=fl)
        assert wait_for_jobs(client, [handed], timeout=600)[0]["worker"] in (patient_a, patient_b)
        # Its end is several seconds (more than a lease) after the signal.
        finished = post_job(client, LONG_TEXTS[150:], "term")
        victim = wait_running(client, [finished], below=0.3)["worker"]
        fl.sigterm(victim)
        time.sleep(1.5)
        pending = pending_entries(rdb)
        if client.get(f"/v1/jobs/{finished}").json()["status"] == "running":
            # Still at it during its grace: still heartbeating, so its lease holds.
            assert len(pending) == 1 and pending[0]["consumer"].decode() == victim, pending
            assert pending[0]["time_since_delivered"] < 1200, pending
            assert victim in {w["id"] for w in live_worker_details(rdb)}
        assert fl.procs[victim].process.wait(timeout=120) == 0
        s = client.get(f"/v1/jobs/{finished}").json()
        assert s["status"] == "done" and s["worker"] == victim and s["attempts"] == 1, s
        assert_counted_once(client, rdb, "term", [LONG_TEXTS[:150], LONG_TEXTS[150:]], tokenizer)
        assert stream_state(rdb) == (0, 0)


def test_readyz_tracks_workers_and_redis(tmp_path):
    data, port = tmp_path / "redis", free_port()
    server = RedisServer(data, port=port).start()
    try:
        with fleet(server.url, tmp_path) as fl, api(server.url) as client:
            r = client.get("/readyz")
            assert r.status_code == 503 and r.json()["workers"] == 0 and r.json()["redis"] is True
            name = fl.start()
            wait_workers(client, 1, fl=fl)
            assert client.get("/readyz").status_code == 200

            server.kill()
            r = client.get("/readyz")
            assert r.status_code == 503 and r.json()["redis"] is False
            server = RedisServer(data, port=port).start()
            deadline = time.monotonic() + 30
            while client.get("/readyz").status_code != 200:  # the worker reconnects
                assert time.monotonic() < deadline, fl.logs()
                time.sleep(0.2)

            fl.sigkill(name)
            killed_at = time.monotonic()
            while client.get("/readyz").status_code != 503:
                assert time.monotonic() - killed_at < 15
                time.sleep(0.2)
            assert client.get("/readyz").json()["workers"] == 0
    finally:
        server.kill()


def test_backpressure_answers_429(server):
    with api(server.url, max_pending_jobs=2) as client:
        body = {"collection": "bp", "model": MODEL, "texts": ["a few words"]}
        first = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "bp-1"})
        assert first.status_code == 202
        assert client.post("/v1/jobs", json=body).status_code == 202
        r = client.post("/v1/jobs", json=body)
        assert r.status_code == 429, r.text
        assert r.json()["type"] == "overloaded"
        assert int(r.headers["Retry-After"]) >= 1
        # A replay of an acknowledged job is not new work: still answered.
        replay = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "bp-1"})
        assert replay.status_code == 202 and replay.json()["job_id"] == first.json()["job_id"]
        assert stream_state(redis.Redis.from_url(server.url))[0] == 2
