"""The fast lane (:mod:`service.fast_lane`) answers exactly what the full app answers.

Two apps on one real Redis holding MiniLM statistics of a few texts, with API keys
configured: the app as built, and the same app with its FastLane middleware taken out
(every request through FastAPI's routing and dependencies). Every request, served or
passed on by the lane, must get the same status, the same body byte for byte and the
same content type from both; and so must a read when Redis is down. The metrics count a
request the lane served under its route, like any other.
"""

from __future__ import annotations

import contextlib

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.fast_lane import FastLane
from service.routes.collections import FAST_LANES
from tests.conftest import WorkerThread, wait_for_jobs
from tests.conftest import test_settings as settings_for

ROOT = "root-key-0123456789"
KEYS = {"reader-key-0123456789": ["read"], "writer-key-0123456789": ["write"]}
READ = {"Authorization": "Bearer reader-key-0123456789"}
BASE = "/v1/collections/seed/models/minilm/layers"
TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "Quarterly profits at US media giant TimeWarner jumped 76% to $1.13bn."]
TOKEN_ROUTE = "/v1/collections/{collection}/models/{model}/layers/{layer}/tokens/{token_id}"


def without_lane(app):
    """``app`` with the FastLane middleware taken out (before its first request builds
    the middleware stack)."""
    app.user_middleware = [m for m in app.user_middleware if m.cls is not FastLane]
    return app


@contextlib.contextmanager
def both_apps(settings):
    with TestClient(create_app(settings), raise_server_exceptions=False) as fast, \
            TestClient(without_lane(create_app(settings)), raise_server_exceptions=False) as full:
        yield fast, full


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
    from embgeom.testing.redis import private_redis

    with private_redis(tmp_path_factory.mktemp("redis")) as server:
        settings = settings_for(server.url, api_key=ROOT, api_keys=KEYS)
        with both_apps(settings) as (fast, full), WorkerThread(settings):
            fast.headers["Authorization"] = f"Bearer {ROOT}"  # for wait_for_jobs' polls
            r = fast.post("/v1/jobs", json={"collection": "seed", "texts": TEXTS})
            assert r.status_code == 202, r.text
            (status,) = wait_for_jobs(fast, [r.json()["job_id"]], timeout=180)
            assert status["status"] == "done"
            del fast.headers["Authorization"]
            yield fast, full


def answer(client: TestClient, method: str, path: str, headers: dict) -> tuple:
    r = client.request(method, path, headers=headers)
    return r.status_code, r.headers.get("content-type"), r.content


def seen_token_ids(client: TestClient) -> list[int]:
    page = client.get(f"{BASE}/3/tokens", params={"limit": 50}, headers=READ).json()
    return [t["token_id"] for t in page["tokens"]]


def test_the_lane_serves_the_token_route_of_the_app():
    (route, _), = FAST_LANES
    assert route.path == TOKEN_ROUTE and route.methods == {"GET"}


def test_every_answer_equals_the_full_apps(apps):
    fast, full = apps
    ids = seen_token_ids(fast)
    assert len(ids) > 10
    cases = [("GET", f"{BASE}/{layer}/tokens/{t}", READ) for layer in (0, 3, 6) for t in ids[:5]]
    cases += [
        ("GET", f"{BASE}/3/tokens/{ids[0]}?unused=1", READ),   # a query the route ignores
        ("GET", f"{BASE}/3/tokens/0{ids[0]}", READ),          # a leading zero: the same id
        ("GET", f"{BASE}/3/tokens/29999", READ),               # never seen: 404 token_not_found
        ("GET", f"{BASE}/7/tokens/{ids[0]}", READ),            # past the last layer: 404
        ("GET", f"{BASE}/99999999999999999999/tokens/1", READ),
        ("GET", f"{BASE}/3/tokens/9223372036854775808", READ),     # past int64: never seen, 404
        ("GET", f"{BASE}/3/tokens/-9223372036854775809", READ),
        ("GET", f"{BASE}/x/tokens/1", READ),                   # not a number: 422 from the app
        ("GET", f"{BASE}/-1/tokens/1", READ),
        ("GET", f"{BASE}/3/tokens/abc", READ),
        ("GET", f"{BASE}/3/tokens/%C2%B2", READ),              # a digit that is not 0-9
        ("GET", f"{BASE}/3/tokens/{ids[0]}/", READ),           # trailing slash
        ("GET", "/v1/collections/seed/models/nosuch/layers/3/tokens/1", READ),   # unknown model
        ("GET", "/v1/collections/bad!name/models/minilm/layers/3/tokens/1", READ),
        ("GET", "/v1/collections/empty/models/minilm/layers/3/tokens/1", READ),  # no data
        ("GET", f"{BASE}/3/tokens/{ids[0]}", {}),                                  # no key
        ("GET", f"{BASE}/3/tokens/{ids[0]}", {"Authorization": "Bearer wrong-key-000000"}),
        ("GET", f"{BASE}/3/tokens/{ids[0]}", {"Authorization": "Bearer writer-key-0123456789"}),
        ("GET", f"{BASE}/3/tokens/{ids[0]}", {"Authorization": "Basic xyz"}),
        ("HEAD", f"{BASE}/3/tokens/{ids[0]}", READ),
        ("POST", f"{BASE}/3/tokens/{ids[0]}", READ),
    ]
    differ = []
    for method, path, headers in cases:
        got, want = answer(fast, method, path, headers), answer(full, method, path, headers)
        if got != want:
            differ.append((method, path, headers, got, want))
    assert not differ, "\n".join(map(repr, differ))
    statuses = {answer(fast, m, p, h)[0] for m, p, h in cases}
    assert {200, 401, 403, 404, 405, 422} <= statuses  # the cases reach every outcome
    assert 500 not in statuses


def test_a_served_request_is_counted_under_its_route(apps):
    fast, _ = apps
    (token_id, *_) = seen_token_ids(fast)

    def count() -> float:
        text = fast.get("/metrics").text
        line = next((x for x in text.splitlines() if x.startswith("embgeom_http_requests_total{")
                     and f'route="{TOKEN_ROUTE}"' in x and 'status="200"' in x), None)
        return 0.0 if line is None else float(line.rsplit(" ", 1)[1])

    before = count()
    for _ in range(3):
        assert fast.get(f"{BASE}/3/tokens/{token_id}", headers=READ).status_code == 200
    assert count() == before + 3


def test_redis_down_gets_the_apps_503(tmp_path):
    from embgeom.testing.redis import private_redis

    with private_redis(tmp_path) as server:
        url = server.url
    # The server is gone: nothing listens on its port.
    settings = settings_for(url, store_timeout_seconds=1.0)
    with both_apps(settings) as (fast, full):
        path = f"{BASE}/3/tokens/1000"
        got, want = answer(fast, "GET", path, {}), answer(full, "GET", path, {})
        assert got[0] == 503 and b'"store_unavailable"' in got[2]
        assert got[:2] == want[:2]
        # The message names Redis's error, whose wording may differ between two tries.
        assert got[2].split(b'"message"')[0] == want[2].split(b'"message"')[0]
