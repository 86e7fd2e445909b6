"""Bounded requests: the body limit enforced while the body is read (413 before any
parsing), byte and count caps on synchronous requests, synchronous model runs off the event
loop and at most ``max_sync_runs`` at once (429 beyond, never queued), and no synchronous
Redis call on the event loop, on any route.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient

from embgeom.settings import Settings
from service.app import create_app
from service.limits import BodyLimit, body_limit
from tests.conftest import test_settings as settings_for
from tests.test_auth import route_requests

LIMIT = 4096
SAMPLE = "/v1/collections/c/models/minilm/layers/2/isotropy/sample"
PROBE = "/v1/probes/outlier-dimension"


@pytest.fixture
def client(redis_server):
    settings = settings_for(redis_server.url, max_body_bytes=LIMIT, max_sync_texts=10,
                            max_sync_bytes=100, max_sync_runs=1)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


def is_error(r, status: int, type_: str) -> bool:
    return r.status_code == status and r.json()["type"] == type_ and isinstance(r.json()["detail"], dict)


# ---------------------------------------------------------------------------- body limit

def test_body_over_the_limit_is_413_before_parsing(client):
    ok = json.dumps({"texts": ["x" * 50]}).encode()
    too_big_valid = json.dumps({"texts": ["x" * LIMIT]}).encode()
    too_big_junk = b"\xff{not json" * (LIMIT // 10 + 1)  # would be 400/422 if it were parsed
    for url in ("/v1/jobs", SAMPLE, PROBE, "/v1/collections/c"):
        method = "PUT" if url == "/v1/collections/c" else "POST"
        for body in (too_big_valid, too_big_junk):
            r = client.request(method, url, content=body, headers={"content-type": "application/json"})
            assert is_error(r, 413, "payload_too_large"), (url, r.status_code, r.text[:200])
            assert r.json()["detail"]["limit"] == LIMIT
    r = client.post("/v1/jobs", content=ok, headers={"content-type": "application/json"})
    assert r.status_code == 202, r.text


def test_streamed_body_is_counted_while_it_arrives(client):
    # No Content-Length (chunked): the bytes are counted as they come.
    def chunks(total):
        sent = 0
        while sent < total:
            yield b" " * 512
            sent += 512

    r = client.post("/v1/jobs", content=chunks(LIMIT * 4), headers={"content-type": "application/json"})
    assert is_error(r, 413, "payload_too_large"), r.text

    def small():
        yield b'{"texts": '
        yield b'["a streamed text"]}'

    r = client.post("/v1/jobs", content=small(), headers={"content-type": "application/json"})
    assert r.status_code == 202, r.text


def test_body_limit_reads_no_more_than_the_limit_and_never_calls_the_app():
    # At the ASGI level: an endless chunked body. The middleware stops reading after the
    # chunk that crosses the limit, answers 413, and the app never runs.
    received = []
    called = []

    async def app(scope, receive, send):
        called.append(scope)

    async def receive():
        received.append(1)
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/jobs",
             "headers": [(b"transfer-encoding", b"chunked")]}
    asyncio.run(BodyLimit(app, 4500)(scope, receive, send))
    assert not called
    assert len(received) == 5  # 5,000 bytes: the first chunk over 4,500
    assert sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["type"] == "payload_too_large"
    # By Content-Length: nothing is read at all.
    received.clear()
    scope["headers"] = [(b"content-length", b"4501")]
    asyncio.run(BodyLimit(app, 4500)(scope, receive, send))
    assert not received and not called


def test_default_body_limit_holds_a_maximal_job():
    s = Settings(max_job_bytes=1_000_000)
    texts = ["\"quoted\"\n" * 10] * (1_000_000 // 100)
    body = json.dumps({"collection": "c", "model": "minilm", "texts": texts}, ensure_ascii=False)
    assert sum(len(t.encode()) for t in texts) <= s.max_job_bytes
    assert len(body.encode()) <= body_limit(s)
    assert body_limit(Settings(max_job_bytes=1_000_000, max_body_bytes=5000)) == 5000


# -------------------------------------------------------------- synchronous requests

def test_synchronous_requests_are_capped_in_texts_and_bytes(client):
    # max_sync_texts=10, max_sync_bytes=100 (UTF-8: 51 two-byte characters are 102 bytes).
    cases = [
        (SAMPLE, {"texts": ["a"] * 11, "reference": "identity"}),
        (SAMPLE, {"texts": ["x" * 60, "y" * 41], "reference": "identity"}),
        (SAMPLE, {"texts": ["\u00e9" * 51], "reference": "identity"}),
        (PROBE, {"layer": 1, "texts": ["a"] * 11, "labels": [0, 1] * 5 + [0]}),
        (PROBE, {"layer": 1, "texts": ["x" * 30] * 4, "labels": [0, 0, 1, 1]}),
    ]
    for url, body in cases:
        r = client.post(url, json=body)
        assert is_error(r, 413, "payload_too_large"), (url, r.status_code, r.text[:200])


class _Stub:
    """Stands for the model: blocks until released, so runs can be held in flight."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()

    def get(self, name):
        self.entered.set()
        assert self.release.wait(30)
        return None


@contextmanager
def held_run(client, monkeypatch):
    """One isotropy sample in flight (its model stubbed to block), for the duration."""
    stub = _Stub()
    rt = client.app.state.runtime
    monkeypatch.setattr(rt, "_sync_models", stub)
    from embgeom import probes

    monkeypatch.setattr(probes, "sample_isotropy",
                        lambda *a, **k: {"layer": 2, "n_points": 1, "zeta": 0.2, "reference": "identity",
                                         "isoscore": 0.5, "isoscore_star": 0.5})
    result = {}
    body = {"texts": ["held"], "reference": "identity"}
    thread = threading.Thread(target=lambda: result.setdefault("r", client.post(SAMPLE, json=body)))
    thread.start()
    assert stub.entered.wait(30)
    try:
        yield result
    finally:
        stub.release.set()
        thread.join(30)


def test_model_runs_beyond_the_limit_are_429_at_once(client, monkeypatch):
    with held_run(client, monkeypatch) as first:
        for url, body in ((SAMPLE, {"texts": ["second"], "reference": "identity"}),
                          (PROBE, {"layer": 1, "texts": ["a", "b", "c", "d"], "labels": [0, 0, 1, 1]})):
            start = time.monotonic()
            r = client.post(url, json=body)
            assert is_error(r, 429, "overloaded"), (url, r.status_code, r.text[:200])
            assert r.headers["retry-after"] == "1"
            assert time.monotonic() - start < 5, "refused at once, not queued"
        # The run is off the event loop: other requests are answered meanwhile.
        start = time.monotonic()
        assert client.get("/healthz").status_code == 200
        assert client.get("/v1/collections").status_code == 200
        assert time.monotonic() - start < 5
    assert first["r"].status_code == 200, first["r"].text
    # The slot is free again.
    r = client.post(SAMPLE, json={"texts": ["third"], "reference": "identity"})
    assert r.status_code != 429, r.text


def test_a_failed_run_frees_its_slot(client, monkeypatch):
    from embgeom import probes

    def fail(*a, **k):
        raise RuntimeError("model exploded")

    class Pool:
        def get(self, name):
            return None

    monkeypatch.setattr(client.app.state.runtime, "_sync_models", Pool())
    monkeypatch.setattr(probes, "sample_isotropy", fail)
    for _ in range(3):  # max_sync_runs=1: a leaked slot would make the second a 429
        r = client.post(SAMPLE, json={"texts": ["x"], "reference": "identity"})
        assert is_error(r, 500, "internal_error"), r.text


# ------------------------------------------------------------ models loading in the API

PROBE_BODY = {"model": "minilm", "layer": 1, "texts": ["good day", "great film", "bad day", "awful film"],
              "labels": [1, 1, 0, 0], "test_fraction": 0.5}


@pytest.fixture
def loads(monkeypatch):
    """Every model load of a ModelPool, by name (the real load runs; a test may gate it)."""
    from embgeom.compute.models import ModelPool

    real = ModelPool._load
    record = {"names": [], "gate": threading.Event()}
    record["gate"].set()

    def counted(self, name):
        record["names"].append(name)
        assert record["gate"].wait(60)
        return real(self, name)

    monkeypatch.setattr(ModelPool, "_load", counted)
    yield record
    record["gate"].set()


def post_in_thread(client, url, body, timeout=30):
    """POST from another thread; the response, or None when none came within ``timeout``."""
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", client.post(url, json=body)), daemon=True)
    thread.start()
    thread.join(timeout)
    return out.get("r")


def until_served(client, url, body, tries=240):
    """Retry as the 503 says (Retry-After) until the request is served."""
    for _ in range(tries):
        r = client.post(url, json=body)
        if not is_error(r, 503, "model_loading"):
            return r
        time.sleep(min(float(r.headers["retry-after"]), 0.5))
    raise AssertionError("the model never finished loading")


def test_a_first_probe_waits_for_its_model_while_healthz_stays_fast(redis_server, loads):
    """A first call just works: the request waits (on the thread pool) for the load it
    started and answers 200; /healthz is answered meanwhile."""
    settings = settings_for(redis_server.url, max_sync_runs=2)
    with TestClient(create_app(settings)) as client:
        loads["gate"].clear()  # the load starts, and cannot finish until the gate opens
        out: dict = {}

        def first():
            t0 = time.monotonic()
            out["r"] = client.post(PROBE, json=PROBE_BODY)
            out["seconds"] = time.monotonic() - t0

        thread = threading.Thread(target=first, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 60
            while loads["names"] == [] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert loads["names"] == ["minilm"], "the first request started no load"
            waits = []
            for _ in range(10):  # a second, with the request waiting for the gated load
                t0 = time.perf_counter()
                assert client.get("/healthz").status_code == 200
                waits.append(time.perf_counter() - t0)
                time.sleep(0.1)
            assert thread.is_alive(), "the request did not wait for its model"
            assert max(waits) < 0.5, f"/healthz waited {max(waits):.2f} s behind a model's load"
        finally:
            loads["gate"].set()
        thread.join(120)
        r = out["r"]
        assert r.status_code == 200, r.text
        assert r.json()["n_train"] + r.json()["n_test"] == 4
        assert out["seconds"] >= 1.0
        assert loads["names"] == ["minilm"]
        assert client.app.state.runtime.sync_pool.loaded() == ["minilm"]


def test_a_load_past_the_wait_answers_503_model_loading_with_retry_after(redis_server, loads):
    """Only past ``model_load_wait_seconds`` is a request answered 503 ``model_loading``
    (with ``Retry-After``); its retry joins the same load."""
    settings = settings_for(redis_server.url, max_sync_runs=2, model_load_wait_seconds=0.2)
    with TestClient(create_app(settings)) as client:
        loads["gate"].clear()
        try:
            start = time.monotonic()
            r = post_in_thread(client, PROBE, PROBE_BODY)
            took = time.monotonic() - start
            assert r is not None, "the request waited past its bound"
            assert is_error(r, 503, "model_loading"), (r.status_code, r.text[:300])
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["detail"]["model"] == "minilm"
            assert 0.2 <= took < 10, took
            assert client.app.state.runtime.sync_pool.loaded() == []
            # A second request while the load runs: 503 again, and no second load.
            assert is_error(post_in_thread(client, PROBE, PROBE_BODY), 503, "model_loading")
        finally:
            loads["gate"].set()
        r = until_served(client, PROBE, PROBE_BODY)
        assert r.status_code == 200, r.text
        assert r.json()["n_train"] + r.json()["n_test"] == 4
        assert loads["names"] == ["minilm"]


def test_two_first_requests_load_the_model_once(redis_server, loads, monkeypatch):
    from embgeom.compute.models import ModelPool

    # Pools take a while to make: two first requests both find none made yet, and each
    # would make (and load into) its own without the runtime's lock.
    real_init = ModelPool.__init__

    def slow_init(self, *args, **kwargs):
        time.sleep(0.5)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(ModelPool, "__init__", slow_init)
    settings = settings_for(redis_server.url, max_sync_runs=4)
    with TestClient(create_app(settings)) as client:
        answers = [None] * 3

        def post(i):
            answers[i] = client.post(PROBE, json=PROBE_BODY)

        threads = [threading.Thread(target=post, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [r.status_code for r in answers] == [200] * 3, [r.text[:200] for r in answers]
        assert loads["names"] == ["minilm"], loads["names"]


def test_a_failed_load_is_503_model_unavailable_then_retried(redis_server, monkeypatch):
    from embgeom.compute.models import ModelPool
    from embgeom.errors import ModelLoadError

    calls = []
    gate = threading.Event()
    gate.set()

    def broken(self, name):
        calls.append(name)
        assert gate.wait(60)
        raise ModelLoadError(name, "weights missing")

    monkeypatch.setattr(ModelPool, "_load", broken)
    settings = settings_for(redis_server.url, max_sync_runs=2)
    with TestClient(create_app(settings)) as client:
        # The request waits for its load and is told its failure.
        r = client.post(PROBE, json=PROBE_BODY)
        assert is_error(r, 503, "model_unavailable"), r.text
        assert "weights missing" in r.json()["message"]
        # The next request starts a new load (and is told again).
        assert is_error(client.post(PROBE, json=PROBE_BODY), 503, "model_unavailable")
        assert calls == ["minilm", "minilm"]
        # A failure no request was waiting for any more is told to the next one, once.
        client.app.state.runtime.sync_models.wait_seconds = 0.1
        gate.clear()
        assert is_error(client.post(PROBE, json=PROBE_BODY), 503, "model_loading")
        gate.set()
        deadline = time.monotonic() + 30
        while client.app.state.runtime.sync_models.loading() and time.monotonic() < deadline:
            time.sleep(0.05)
        r = client.post(PROBE, json=PROBE_BODY)
        assert is_error(r, 503, "model_unavailable"), r.text
        assert calls == ["minilm"] * 3
        r = client.post(PROBE, json=PROBE_BODY)  # the one after: a new load, failing again
        assert r.status_code == 503 and r.json()["type"] in ("model_loading", "model_unavailable"), r.text
        assert calls == ["minilm"] * 4


# ------------------------------------------------------- no sync Redis on the loop

@contextmanager
def forbid_sync_redis_on_loop(rt):
    """Record every command of the synchronous Redis client issued from a thread that is
    running an event loop (a blocking call inside an ``async def`` route or dependency)."""
    pool = rt.redis.connection_pool
    real = pool.get_connection
    violations = []

    def guarded(*args, **kwargs):
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # a thread-pool thread: fine
        else:
            import traceback

            violations.append("".join(traceback.format_stack(limit=12)))
        return real(*args, **kwargs)

    pool.get_connection = guarded
    try:
        yield violations
    finally:
        pool.get_connection = real


def test_guard_sees_a_sync_call_on_the_loop(client):
    rt = client.app.state.runtime

    async def blocking():
        rt.redis.ping()

    with forbid_sync_redis_on_loop(rt) as violations:
        asyncio.run(blocking())
        threading.Thread(target=rt.redis.ping).start()
        time.sleep(0.2)
    assert len(violations) == 1


def test_no_route_calls_sync_redis_on_the_event_loop(client):
    rt = client.app.state.runtime
    # Some data for the reads to find.
    client.put("/v1/collections/c", json={})
    client.post("/v1/jobs", json={"collection": "c", "texts": ["a b c"]})
    with forbid_sync_redis_on_loop(rt) as violations:
        for method, url, kwargs in route_requests(client.app):
            client.request(method, url.replace("/authc/", "/c/"), **kwargs)
        for url in ("/healthz", "/readyz", "/metrics", "/v1/jobs?ids=a,b",
                    "/v1/collections/c/models/minilm/layers?min_count=2",
                    "/v1/collections/c/models/minilm/layers/1/tokens?limit=5"):
            client.get(url)
    assert not violations, violations[0]


def test_a_first_read_of_a_model_does_not_stall_other_requests(tmp_path_factory, monkeypatch):
    """The first token page of a model waits for its configuration and tokenizer (a child
    reads them: seconds). On the event loop, that wait stalled every request meanwhile,
    /healthz included; on the thread pool, /healthz answers while the page waits. The read
    is made 1.5 s longer here, so the difference cannot hide in the noise."""
    from embgeom.compute import catalogue
    from tests.conftest import app_with_worker, wait_for_jobs

    with app_with_worker(tmp_path_factory) as c:
        r = c.post("/v1/jobs", json={"collection": "cold", "model": "minilm",
                                     "texts": ["A first text.", "And a second one."]})
        assert [s["status"] for s in wait_for_jobs(c, [r.json()["job_id"]], timeout=300)] == ["done"]
        registry = c.app.state.runtime.registry
        registry._tokenizers.clear()
        registry._infos.clear()  # the model's configuration: read on the first read too
        reads = []
        read = catalogue.read_in_child

        def slow_read(sources, *args, **kwargs):
            reads.append(sorted(sources))
            time.sleep(1.5)
            return read(sources, *args, **kwargs)

        monkeypatch.setattr(catalogue, "read_in_child", slow_read)
        page: dict = {}

        def read_page():
            t0 = time.perf_counter()
            page["status"] = c.get("/v1/collections/cold/models/minilm/layers/1/tokens").status_code
            page["seconds"] = time.perf_counter() - t0

        reader = threading.Thread(target=read_page)
        reader.start()
        time.sleep(0.3)  # the page is inside the read of its model's files
        t0 = time.perf_counter()
        assert c.get("/healthz").status_code == 200
        healthz_s = time.perf_counter() - t0
        reader.join()
        assert page["status"] == 200 and page["seconds"] >= 1.5  # the read ran, off the loop
        assert healthz_s < 0.5, f"/healthz waited {healthz_s:.2f} s behind a model's first read"
        assert reads == [["minilm"]]  # configuration and tokenizer: one child
        assert registry.vocabulary_loaded("minilm") and registry.info_loaded("minilm")


def test_four_first_reads_of_smollm2_leave_healthz_fast(redis_server):
    """A model's first read waits for its configuration and tokenizer. Read in the API's
    process, transformers held the GIL while it parsed them (170 ms for SmolLM2's
    configuration, 230 ms for its tokenizer, each read four times by four first requests):
    /healthz waited up to 815 ms over HTTP. A child reads them once now and sends back the
    vocabulary (token strings and markers), not the tokenizer. The collection does
    not exist (a 404 the read finds after the model's files): what is measured is the
    model's first read, not the page."""
    page = "/v1/collections/cold/models/smollm2/layers/15/tokens?limit=10000"
    with TestClient(create_app(settings_for(redis_server.url)), raise_server_exceptions=False) as c:
        answers: list[tuple] = []
        pages = [threading.Thread(target=lambda: answers.append((lambda r: (r.status_code, r.json()["type"]))(c.get(page))))
                 for _ in range(4)]
        for t in pages:
            t.start()
        waits = []
        while any(t.is_alive() for t in pages):
            t0 = time.perf_counter()
            assert c.get("/healthz").status_code == 200
            waits.append(time.perf_counter() - t0)
            time.sleep(0.01)
        for t in pages:
            t.join()
        assert answers == [(404, "collection_not_found")] * 4  # checked after the model's read
        assert len(waits) >= 20, "the first read took under a fifth of a second: nothing was measured"
        assert max(waits) < 0.3, f"/healthz waited {max(waits) * 1000:.0f} ms behind the first reads"
        assert c.app.state.runtime.registry.vocabulary_loaded("smollm2")
