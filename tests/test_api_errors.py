"""Bad input: every one gets a 4xx JSON error ``{"type", "message", "detail"}`` with a
stable ``type`` and a readable ``message``, never a 500, and changes no statistic.

Each test seeds a collection through the real path (app on a real Redis + a worker
thread running the packaged MiniLM), snapshots what a client can read (``/layers`` with
and without a count filter, one token page, ``/v1/collections``), sends the bad requests,
lets the worker drain anything that might have been queued, and compares the snapshot
exactly (``as_of.version`` included, so even a commit that changed nothing would show).

All cases of a group are run and their failures reported together, so one run lists
every defect of the group.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import time

import pytest
from fastapi.testclient import TestClient

from embgeom.settings import ModelSource
from service.app import create_app
from tests.conftest import WorkerThread, wait_for_jobs
from tests.conftest import test_settings as settings_for

SEED = "seed"
BASE = f"/v1/collections/{SEED}/models/minilm"
SEED_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Quarterly profits at US media giant TimeWarner jumped 76% to $1.13bn.",
    "The firm said the dog and the fox were not part of the deal.",
]
# The smallest limits the settings allow: a job over them must be refused with 413.
MAX_TEXTS = 1000
MAX_BYTES = 1_000_000


def snapshot(client: TestClient) -> dict:
    return {
        "layers": client.get(f"{BASE}/layers").json(),
        "filtered": client.get(f"{BASE}/layers?min_count=2&max_count=1000").json(),
        "tokens": client.get(f"{BASE}/layers/3/tokens?limit=10000").json(),
        "collections": client.get("/v1/collections").json(),
    }


def drain(client: TestClient, timeout: float = 60) -> None:
    """Wait until no job is queued or running, so an accepted bad job would have counted."""
    rt = client.app.state.runtime
    deadline = time.monotonic() + timeout
    while rt.queue.pending(rt.registry.names()) > 0:
        assert time.monotonic() < deadline, "queue did not drain"
        time.sleep(0.2)
    time.sleep(0.3)


@pytest.fixture
def api(redis_server):
    """(client, settings): the app, a worker, and one seeded collection."""
    settings = settings_for(
        redis_server.url, max_job_texts=MAX_TEXTS, max_job_bytes=MAX_BYTES, max_attempts=1,
        # A configured alias whose files are missing: a job for it can never run.
        models={"broken": ModelSource(source="/nonexistent/embgeom-test-model")},
    )
    app = create_app(settings)
    with TestClient(app, raise_server_exceptions=False) as client, WorkerThread(settings):
        # The API loads a model in the background (503 model_loading meanwhile): load first.
        app.state.runtime.sync_pool.get("minilm")
        r = client.post("/v1/jobs", json={"collection": SEED, "texts": SEED_TEXTS})
        assert r.status_code == 202, r.text
        (status,) = wait_for_jobs(client, [r.json()["job_id"]], timeout=120)
        assert status["status"] == "done" and status["tokens"] > 0
        yield client


def check_cases(client: TestClient, cases) -> None:
    """Run every ``(label, request kwargs, expected status, expected type)``; the stats
    must not move. Fails once, listing every case that went wrong."""
    before = snapshot(client)
    assert before["layers"]["layers"][0]["n"] > 0
    problems = []
    for label, (method, url, kwargs), want_status, want_type in cases:
        r = client.request(method, url, **kwargs)
        try:
            body = r.json()
        except ValueError:
            problems.append(f"{label}: {r.status_code}, not JSON: {r.text[:120]!r}")
            continue
        if r.status_code != want_status:
            problems.append(f"{label}: status {r.status_code} != {want_status}: {r.text[:200]}")
            continue
        if not isinstance(body, dict) or body.get("type") != want_type:
            problems.append(f"{label}: type {body.get('type') if isinstance(body, dict) else body!r} != {want_type}")
            continue
        if not isinstance(body.get("message"), str) or len(body["message"]) < 5:
            problems.append(f"{label}: unreadable message {body.get('message')!r}")
        if not isinstance(body.get("detail"), dict):
            problems.append(f"{label}: detail is not an object: {body.get('detail')!r}")
    drain(client)
    after = snapshot(client)
    for key in before:
        if after[key] != before[key]:
            problems.append(f"statistics changed: {key}")
    assert not problems, "\n".join(problems)


def post(json_body=None, **kwargs):
    if json_body is not None:
        kwargs["json"] = json_body
    return ("POST", "/v1/jobs", kwargs)


def raw(content: bytes, content_type="application/json", url="/v1/jobs"):
    return ("POST", url, {"content": content, "headers": {"content-type": content_type}})


def get(url):
    return ("GET", url, {})


def cursor(payload) -> str:
    return base64.urlsafe_b64encode(json.dumps(payload).encode()).decode().rstrip("=")


V = "validation_error"


def test_bad_job_submissions(api):
    ok = {"collection": "other", "texts": ["fine text"]}
    cases = [
        ("unknown model", post({**ok, "model": "no-such-model"}), 404, "unknown_model"),
        ("hub id as model", post({**ok, "model": "bert-base-uncased"}), 404, "unknown_model"),
        ("model not a name", post({**ok, "model": "sentence-transformers/x"}), 422, V),
        ("empty texts list", post({**ok, "texts": []}), 422, V),
        ("empty string text", post({**ok, "texts": ["fine", ""]}), 422, V),
        ("whitespace text", post({**ok, "texts": [" \n\t "]}), 422, V),
        ("non-string text (int)", post({**ok, "texts": ["fine", 5]}), 422, V),
        ("non-string text (null)", post({**ok, "texts": [None]}), 422, V),
        ("non-string text (object)", post({**ok, "texts": [{"text": "a"}]}), 422, V),
        ("texts a string", post({**ok, "texts": "not a list"}), 422, V),
        ("texts null", post({**ok, "texts": None}), 422, V),
        ("missing texts", post({"collection": "other"}), 422, V),
        ("empty object", post({}), 422, V),
        ("extra field", post({**ok, "textz": ["a"]}), 422, V),
        ("extra field (options)", post({**ok, "options": {"x": 1}}), 422, V),
        ("collection with space", post({**ok, "collection": "my collection"}), 422, V),
        ("collection 65 chars", post({**ok, "collection": "c" * 65}), 422, V),
        ("collection unicode", post({**ok, "collection": "caf\u00e9"}), 422, V),
        ("collection empty", post({**ok, "collection": ""}), 422, V),
        ("collection slash", post({**ok, "collection": "a/b"}), 422, V),
        ("collection hash tag", post({**ok, "collection": "a{b}"}), 422, V),
        ("collection not a string", post({**ok, "collection": 7}), 422, V),
        ("include_special not a bool", post({**ok, "include_special": "maybe"}), 422, V),
        ("bad JSON", raw(b'{"texts": ["a"'), 422, V),
        ("not JSON at all", raw(b"texts=a"), 422, V),
        ("JSON array body", raw(b'["a", "b"]'), 422, V),
        ("JSON string body", raw(b'"a"'), 422, V),
        ("empty body", raw(b""), 422, V),
        ("invalid UTF-8 body", raw(b'{"texts": ["\xff\xfe"]}'), 400, "invalid_body"),
        ("idempotency key too long", post(ok, headers={"Idempotency-Key": "k" * 201}), 422, V),
    ]
    check_cases(api, cases)


def test_text_with_lone_surrogate_is_a_422_not_a_500(api):
    # JSON allows the escape "\ud800" (a lone UTF-16 surrogate); Python decodes it into a
    # str that cannot be encoded as UTF-8. It is bad input, to be refused like an empty
    # text, not an internal error.
    cases = [("lone surrogate", raw(b'{"collection": "other", "texts": ["ok \\ud800 text"]}'), 422, V)]
    check_cases(api, cases)


def test_job_limits(api):
    # EMBGEOM_MAX_JOB_TEXTS / _BYTES at their minimum allowed values (1,000 / 1,000,000).
    half = "x" * (MAX_BYTES // 2)
    cases = [
        ("one text too many", post({"collection": "other", "texts": ["a"] * (MAX_TEXTS + 1)}),
         413, "payload_too_large"),
        ("one byte too many", post({"collection": "other", "texts": [half, half + "y"]}),
         413, "payload_too_large"),
        # the limit is on UTF-8 bytes, not characters: 500,001 chars of 2 bytes each
        ("multi-byte text over the byte limit",
         post({"collection": "other", "texts": ["\u00e9" * (MAX_BYTES // 2 + 1)]}),
         413, "payload_too_large"),
    ]
    check_cases(api, cases)


def test_bad_reads(api):
    t = f"{BASE}/layers/3/tokens"
    cases = [
        # collections
        ("unknown collection layers", get("/v1/collections/nope/models/minilm/layers"), 404, "collection_not_found"),
        ("unknown collection decomposition",
         get("/v1/collections/nope/models/minilm/layers/1/decomposition"), 404, "collection_not_found"),
        ("unknown collection tokens", get("/v1/collections/nope/models/minilm/layers/1/tokens"), 404,
         "collection_not_found"),
        ("unknown collection token", get("/v1/collections/nope/models/minilm/layers/1/tokens/1996"), 404,
         "collection_not_found"),
        ("delete unknown collection", ("DELETE", "/v1/collections/nope", {}), 404, "collection_not_found"),
        ("collection with space", get("/v1/collections/my%20seed/models/minilm/layers"), 422,
         "invalid_collection_name"),
        ("collection 65 chars", get(f"/v1/collections/{'c' * 65}/models/minilm/layers"), 422,
         "invalid_collection_name"),
        ("collection unicode", get("/v1/collections/caf%C3%A9/models/minilm/layers"), 422,
         "invalid_collection_name"),
        ("delete bad name", ("DELETE", "/v1/collections/caf%C3%A9", {}), 422, "invalid_collection_name"),
        # models and layers
        ("unknown model", get(f"/v1/collections/{SEED}/models/no-such-model/layers"), 404, "unknown_model"),
        ("layer 7 of minilm", get(f"{BASE}/layers/7/decomposition"), 404, "layer_not_found"),
        ("layer 7 tokens", get(f"{BASE}/layers/7/tokens"), 404, "layer_not_found"),
        ("layer 7 token", get(f"{BASE}/layers/7/tokens/1996"), 404, "layer_not_found"),
        ("layer -1", get(f"{BASE}/layers/-1/decomposition"), 404, "layer_not_found"),
        ("layer -1 tokens", get(f"{BASE}/layers/-1/tokens"), 404, "layer_not_found"),
        ("layer not an int", get(f"{BASE}/layers/one/decomposition"), 422, V),
        # tokens
        ("unseen token id", get(f"{t}/29999"), 404, "token_not_found"),
        ("negative token id", get(f"{t}/-1"), 404, "token_not_found"),
        ("token id past int64", get(f"{t}/9223372036854775808"), 404, "token_not_found"),
        ("token id far past int64", get(f"{t}/{10 ** 30}"), 404, "token_not_found"),
        ("neighbors of a token id past int64", get(f"{t}/{10 ** 30}/neighbors"), 404, "token_not_found"),
        ("token id not an int", get(f"{t}/the"), 422, V),
        ("token string not in vocabulary", get(f"{t}?token=qqqzzzxxq"), 404, "token_not_in_vocabulary"),
        ("empty token string", get(f"{t}?token="), 404, "token_not_in_vocabulary"),
        ("invalid cursor", get(f"{t}?cursor=not-a-cursor!"), 422, "invalid_cursor"),
        ("empty cursor", get(f"{t}?cursor="), 422, "invalid_cursor"),
        ("cursor of a JSON list", get(f"{t}?cursor={cursor([1, 2])}"), 422, "invalid_cursor"),
        ("order_by unknown", get(f"{t}?order_by=cv"), 422, V),
        ("limit 0", get(f"{t}?limit=0"), 422, V),
        ("limit too large", get(f"{t}?limit=10001"), 422, V),
        ("desc not a bool", get(f"{t}?desc=sideways"), 422, V),
        # count filters
        ("min_count=0", get(f"{BASE}/layers?min_count=0"), 422, V),
        ("min_count=0 decomposition", get(f"{BASE}/layers/1/decomposition?min_count=0"), 422, V),
        ("min_count=0 tokens", get(f"{t}?min_count=0"), 422, V),
        ("min_count not an int", get(f"{BASE}/layers?min_count=ten"), 422, V),
        ("max_count=0", get(f"{BASE}/layers?max_count=0"), 422, V),
        ("max_count < min_count", get(f"{BASE}/layers?min_count=10&max_count=5"), 422, "invalid_filter"),
        ("max_count < min_count decomposition",
         get(f"{BASE}/layers/2/decomposition?min_count=3&max_count=2"), 422, "invalid_filter"),
        ("max_count < min_count tokens", get(f"{t}?min_count=3&max_count=2"), 422, "invalid_filter"),
        # jobs
        ("unknown job id", get("/v1/jobs/0123456789abcdef0123456789abcdef"), 404, "job_not_found"),
        ("junk job id", get("/v1/jobs/nope"), 404, "job_not_found"),
        # routes
        ("unknown route", get("/v1/nothing-here"), 404, "not_found"),
        ("wrong method", ("PUT", "/v1/jobs", {"json": {}}), 405, "method_not_allowed"),
    ]
    check_cases(api, cases)


def test_forged_cursors_are_422_not_500(api):
    # A cursor is opaque, but a client can decode it and send one back with a wrong field
    # type: it must be refused like any other invalid cursor.
    t = f"{BASE}/layers/3/tokens"
    cases = [
        ("cursor v not a number", get(f"{t}?cursor={cursor({'v': 'x', 'id': 1})}"), 422, "invalid_cursor"),
        ("cursor v null", get(f"{t}?cursor={cursor({'v': None, 'id': 1})}"), 422, "invalid_cursor"),
        ("cursor id not an int", get(f"{t}?cursor={cursor({'v': 1.0, 'id': 'x'})}"), 422, "invalid_cursor"),
        ("cursor id a list", get(f"{t}?cursor={cursor({'v': 1.0, 'id': [1]})}"), 422, "invalid_cursor"),
    ]
    check_cases(api, cases)


def test_job_for_an_unavailable_model_fails_without_touching_statistics(api):
    # "broken" is configured but its files are missing here (/v1/models: available false).
    # The API accepts it on purpose: in production the API does not hold the models, the
    # workers on other machines do. The job must end failed with its error, and no
    # statistic of any other pair may move.
    models = {m["name"]: m for m in api.get("/v1/models").json()}
    assert models["broken"]["available"] is False
    before = snapshot(api)
    r = api.post("/v1/jobs", json={"collection": "fresh", "model": "broken", "texts": ["a b c"]})
    assert r.status_code == 202
    status = wait_for_jobs(api, [r.json()["job_id"]])[0]
    assert status["status"] == "failed"
    assert "could not be loaded" in status["error"] and "/nonexistent/embgeom-test-model" in status["error"]
    drain(api)
    after = snapshot(api)
    # The submitted job made "fresh" a collection (with nothing in it); nothing else moved.
    assert {k: v for k, v in after.items() if k != "collections"} == \
        {k: v for k, v in before.items() if k != "collections"}
    assert [c for c in after["collections"] if c["name"] != "fresh"] == before["collections"]
    assert {"name": "fresh", "models": ["broken"]} in after["collections"]
    r = api.get("/v1/collections/fresh/models/minilm/layers/0/decomposition")
    assert r.status_code == 404 and r.json()["type"] == "model_not_in_collection"


# ------------------------------------------------------------ non-finite and surrogates

SAMPLE = f"{BASE}/layers/3/isotropy/sample"
PROBE = "/v1/probes/outlier-dimension"
PROBE_OK = {"layer": 2, "texts": ["a b", "c d", "e f", "g h"], "labels": [0, 0, 1, 1]}


def test_non_finite_numbers_and_lone_surrogates_are_422_wherever_they_enter(api):
    # Python's JSON reads NaN, Infinity and 1e999 (inf); a query float parses "inf", "nan"
    # and "1e999" alike. None is a number any statistic can use. A lone surrogate ("\ud800"
    # in JSON) is a str that no tokenizer or UTF-8 encoder takes. Both were 500s outside
    # job submission (threshold=inf on outliers; a surrogate in a sample's text).
    out = f"{BASE}/layers/3/outliers"
    cases = []
    for spelling in ("inf", "-inf", "nan", "NaN", "1e999", "Infinity"):
        cases += [
            (f"outliers threshold={spelling}", get(f"{out}?threshold={spelling}"), 422, V),
            (f"model outliers threshold={spelling}", get(f"{BASE}/outliers?threshold={spelling}"), 422, V),
        ]
    for literal in (b"NaN", b"Infinity", b"-Infinity", b"1e999"):
        cases += [
            (f"sample zeta={literal.decode()}",
             raw(b'{"texts": ["a b c"], "zeta": ' + literal + b"}", url=SAMPLE), 422, V),
            (f"probe test_fraction={literal.decode()}",
             raw(json.dumps(PROBE_OK)[:-1].encode() + b', "test_fraction": ' + literal + b"}", url=PROBE),
             422, V),
            (f"job with a number {literal.decode()} as a text",
             raw(b'{"collection": "other", "texts": [' + literal + b"]}"), 422, V),
        ]
    surrogate = b'"ok \\ud800 text"'
    cases += [
        ("sample text with a lone surrogate", raw(b'{"texts": [' + surrogate + b"]}", url=SAMPLE), 422, V),
        ("sample text with a low surrogate", raw(b'{"texts": ["\\udc00"]}', url=SAMPLE), 422, V),
        ("probe text with a lone surrogate",
         raw(json.dumps({**PROBE_OK, "texts": ["a", "b", "c", "d"]}).replace('"d"', surrogate.decode()).encode(),
             url=PROBE), 422, V),
        ("probe label with a lone surrogate",
         raw(json.dumps({**PROBE_OK, "labels": ["x", "x", "y", "z"]}).replace('"z"', surrogate.decode()).encode(),
             url=PROBE), 422, V),
        ("job field name with a lone surrogate",
         raw(b'{"collection": "other", "texts": ["a"], ' + surrogate + b": 1}"), 422, V),
        ("collection settings with a lone surrogate",
         ("PUT", "/v1/collections/other", {"content": b'{"preset": ' + surrogate + b"}",
                                           "headers": {"content-type": "application/json"}}), 422, V),
    ]
    check_cases(api, cases)


def test_every_body_refuses_non_finite_numbers_and_lone_surrogates():
    # Every request body of the app (a route added later included) derives from
    # schemas.RequestBody, which refuses both anywhere inside it.
    from service.schemas import RequestBody
    from tests.test_auth import api_routes

    app = create_app()
    bodies = []
    for path, methods, route in api_routes(app):
        for param in route.dependant.body_params:
            model = param.field_info.annotation if hasattr(param, "field_info") else param.type_
            bodies.append((f"{sorted(methods)} {path}", model))
    assert len(bodies) >= 4
    wrong = [f"{where}: {model}" for where, model in bodies
             if not (isinstance(model, type) and issubclass(model, RequestBody))]
    assert not wrong, "request bodies not deriving from service.schemas.RequestBody:\n" + "\n".join(wrong)


def test_every_query_float_refuses_non_finite_numbers():
    from tests.test_auth import api_routes

    app = create_app()
    wrong = []
    checked = 0

    def params(dependant):
        yield from dependant.query_params + dependant.path_params + dependant.header_params
        for sub in dependant.dependencies:
            yield from params(sub)

    for path, methods, route in api_routes(app):
        for field in params(route.dependant):
            parsed = [field.validate(v, {}, loc=("query",)) for v in ("1.5", "0.5")]
            if not any(not errors and isinstance(value, float) for value, errors in parsed):
                continue  # not a float
            checked += 1
            for bad in ("inf", "-inf", "nan", "1e999"):
                if not field.validate(bad, {}, loc=("query",))[1]:
                    wrong.append(f"{sorted(methods)} {path} ?{field.name}={bad} is accepted")
    assert checked >= 2
    assert not wrong, "\n".join(wrong)


def test_an_error_message_quoting_a_lone_surrogate_still_encodes(api):
    # The error may quote what was sent (here, an unknown field whose name is a lone
    # surrogate): the body is still UTF-8 JSON, the surrogate escaped.
    r = api.post("/v1/jobs", content=b'{"texts": ["a"], "\\ud83d": 1}',
                 headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["type"] == V
    r.content.decode("utf-8")
    assert "\\ud83d" in r.json()["message"]


# ------------------------------------------------------------------- 500 and 503

@pytest.fixture
def bare(redis_server):
    """(app, client, server): the app on a real Redis, no worker, with routes that fail."""
    app = create_app(settings_for(redis_server.url, store_timeout_seconds=1.0))

    @app.get("/v1/test-boom")
    def boom():
        raise RuntimeError("a bug with a secret in its message")

    with TestClient(app, raise_server_exceptions=False) as client:
        yield app, client, redis_server


def test_unexpected_exception_is_a_json_500_with_a_request_id(bare, caplog):
    app, client, _ = bare
    with caplog.at_level("ERROR", logger="service.errors"):
        r = client.get("/v1/test-boom")
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["type"] == "internal_error" and set(body) == {"type", "message", "detail"}
    request_id = body["detail"]["request_id"]
    assert len(request_id) == 32 and r.headers["x-request-id"] == request_id
    assert "secret" not in r.text and "Traceback" not in r.text  # the trace is in the log only
    logged = [rec for rec in caplog.records if request_id in rec.getMessage()]
    assert logged and logged[0].exc_info is not None


def test_exception_inside_a_middleware_is_a_json_500(redis_server):
    app = create_app(settings_for(redis_server.url))

    class Broken:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http" and scope["path"] == "/healthz":
                raise ValueError("middleware bug")
            await self.app(scope, receive, send)

    app.add_middleware(Broken)
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/healthz")
        assert r.status_code == 500 and r.json()["type"] == "internal_error"
        assert "request_id" in r.json()["detail"]
        assert client.get("/v1/collections").status_code == 200


def _store_cases():
    return [("GET", f"{BASE}/layers", {}),                                    # async read
            ("GET", f"{BASE}/layers/1/tokens/1996", {}),                      # async read
            ("GET", f"{BASE}/layers/1/isotropy", {}),                         # thread pool
            ("GET", "/v1/collections", {}),                                   # thread pool
            ("GET", "/v1/models", {}),
            ("GET", "/v1/jobs/0123456789abcdef0123456789abcdef", {}),
            ("POST", "/v1/jobs", {"json": {"texts": ["a b"]}}),               # a write
            ("DELETE", "/v1/collections/gone", {}),
            ("GET", f"{BASE}/layers/1/export?format=csv", {}),               # streamed once read
            ("GET", f"{BASE}/figures/decomposition", {}),
            ("GET", "/metrics", {})]


def test_store_down_is_503_store_unavailable_everywhere(bare):
    _, client, server = bare
    server.kill()
    problems = []
    for method, url, kwargs in _store_cases():
        r = client.request(method, url, **kwargs)
        if r.status_code != 503 or r.json().get("type") != "store_unavailable" \
                or r.headers.get("retry-after") != "1":
            problems.append(f"{method} {url}: {r.status_code} {r.text[:160]}")
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json()["redis"] is False
    assert not problems, "\n".join(problems)


def test_store_timeout_is_503_within_the_store_timeout(bare):
    # A Redis that accepts connections and never answers (SIGSTOP): reads on the async
    # client and commands of the sync one both give up after store_timeout_seconds (1 s).
    _, client, server = bare
    client.get(f"{BASE}/layers")
    client.get("/v1/collections")  # both clients connected before the pause
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        for method, url, kwargs in _store_cases()[:4]:
            start = time.monotonic()
            r = client.request(method, url, **kwargs)
            took = time.monotonic() - start
            assert r.status_code == 503 and r.json()["type"] == "store_unavailable", (url, r.text)
            assert took < 8, (url, took)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    # and it recovers without a restart
    deadline = time.monotonic() + 20
    while client.get("/v1/collections").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
