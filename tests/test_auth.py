"""API keys with scopes, on every route of the app.

The app runs on a real Redis with keys configured: one all-scope ``EMBGEOM_API_KEY`` and
one key per scope. For every route the app has (``app.routes``, so a route added later is
covered without touching this file) and every method it answers: no key is 401 with a
``WWW-Authenticate: Bearer`` challenge, a wrong key is 401, a key without the needed scope
is 403 ``forbidden``, a key with it is neither. Health, readiness and the documentation
stay open; ``/metrics`` needs a key only when ``EMBGEOM_METRICS_REQUIRE_KEY`` says so.
"""

from __future__ import annotations

import hmac
import json
import re
from typing import Iterator

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from embgeom.settings import Settings
from embgeom.store.server import RedisServer
from service import auth
from service.app import create_app
from service.runtime import Runtime
from tests.conftest import test_settings as settings_for

ROOT = "root-key-all-scopes"
KEYS = {"reader-key": ["read"], "writer-key": ["write"], "admin-key": ["admin"],
        "read-write-key": ["read", "write"]}
RIGHT = {"read": "reader-key", "write": "writer-key", "admin": "admin-key"}
# A key without the scope: for read routes the writer's, for write routes the reader's,
# for admin routes one that holds both others.
LACKING = {"read": "writer-key", "write": "reader-key", "admin": "read-write-key"}
SCOPE = {"GET": "read", "POST": "write", "PUT": "write", "PATCH": "write", "DELETE": "admin"}

# Path parameter values that reach each route (the answer may be 404 or 422: what is
# checked is only that it is not 401/403 with the right key).
PATH_VALUES = {"collection": "authc", "model": "minilm", "layer": "1", "token_id": "1",
               "job_id": "0" * 32, "name": "vm_scatter"}


def api_routes(app) -> list[tuple[str, set, APIRoute]]:
    """``(path, methods, route)`` of every API route of ``app`` (FastAPI >= 0.16x keeps an
    included router as one entry of ``app.routes``; older versions copy its routes in)."""
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:
        return [(r.path, r.methods, r) for r in app.routes if isinstance(r, APIRoute)]
    return [(c.path, c.methods, c.original_route) for c in iter_route_contexts(app.routes)
            if isinstance(c.original_route, APIRoute)]


def route_requests(app) -> Iterator[tuple[str, str, dict]]:
    """``(method, url, request kwargs)`` for every method of every API route of ``app``."""
    for path, methods, _ in api_routes(app):
        url = re.sub(r"\{(\w+)(:[^}]*)?\}", lambda m: PATH_VALUES.get(m.group(1), "x"), path)
        for method in sorted(methods):
            kwargs = {"json": {}} if method in ("POST", "PUT", "PATCH") else {}
            yield method, url, kwargs


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory) -> Iterator[str]:
    server = RedisServer(tmp_path_factory.mktemp("auth") / "redis").start()
    try:
        yield server.url
    finally:
        server.kill()


def keyed_settings(url: str, **overrides) -> Settings:
    return settings_for(url, api_key=ROOT, api_keys=KEYS, **overrides)


@pytest.fixture(scope="module")
def client(redis_url) -> Iterator[TestClient]:
    with TestClient(create_app(keyed_settings(redis_url)), raise_server_exceptions=False) as c:
        yield c


def test_every_v1_route_needs_a_key_with_its_scope(client):
    problems = []
    seen = 0
    for method, url, kwargs in route_requests(client.app):
        if not url.startswith("/v1/"):
            continue
        seen += 1
        scope = SCOPE[method]
        label = f"{method} {url}"
        r = client.request(method, url, **kwargs)
        if r.status_code != 401 or r.json().get("type") != "unauthorized":
            problems.append(f"{label} without a key: {r.status_code} {r.text[:120]}")
        elif not r.headers.get("www-authenticate", "").startswith("Bearer"):
            problems.append(f"{label} without a key: no WWW-Authenticate: Bearer challenge")
        for header in (bearer("not-a-key"), bearer(ROOT + "x"), bearer(ROOT[:-1]),
                       {"Authorization": f"Basic {ROOT}"}, {"Authorization": ROOT}):
            r = client.request(method, url, headers=header, **kwargs)
            if r.status_code != 401 or "Bearer" not in r.headers.get("www-authenticate", ""):
                problems.append(f"{label} with {header['Authorization'][:14]}...: {r.status_code}")
        r = client.request(method, url, headers=bearer(LACKING[scope]), **kwargs)
        if r.status_code != 403 or r.json().get("type") != "forbidden":
            problems.append(f"{label} with a key lacking {scope}: {r.status_code} {r.text[:120]}")
        elif f'scope="{scope}"' not in r.headers.get("www-authenticate", ""):
            problems.append(f"{label}: 403 without an insufficient_scope challenge")
        for key in (RIGHT[scope], ROOT):
            r = client.request(method, url, headers=bearer(key), **kwargs)
            if r.status_code in (401, 403):
                problems.append(f"{label} with a key holding {scope}: {r.status_code} {r.text[:120]}")
            elif r.status_code >= 500:
                problems.append(f"{label} with a key holding {scope}: server error {r.text[:120]}")
    assert seen >= 15, f"only {seen} /v1 routes found"
    assert not problems, "\n".join(problems)


def test_health_readiness_and_docs_stay_open(client):
    for url in ("/healthz", "/readyz", "/docs", "/redoc", "/openapi.json", "/metrics"):
        r = client.get(url)
        assert r.status_code not in (401, 403), (url, r.status_code)
        assert r.status_code < 500 or url == "/readyz", (url, r.status_code, r.text[:200])
    # Every non-/v1 API route too (whatever is added later outside /v1 is open).
    for method, url, kwargs in route_requests(client.app):
        if not url.startswith("/v1/"):
            assert client.request(method, url, **kwargs).status_code not in (401, 403), url


def test_metrics_protected_only_when_asked(redis_url):
    settings = keyed_settings(redis_url, metrics_require_key=True)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        r = c.get("/metrics")
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        assert c.get("/metrics", headers=bearer("nope")).status_code == 401
        assert c.get("/metrics", headers=bearer("writer-key")).status_code == 403
        r = c.get("/metrics", headers=bearer("reader-key"))
        assert r.status_code == 200 and "embgeom_http_requests_total" in r.text
        assert c.get("/healthz").status_code == 200
        assert c.get("/readyz").status_code in (200, 503)


def test_keys_from_a_file_are_read_once_at_start(redis_url, tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"file-reader": ["read"], "file-admin": ["admin"]}))
    settings = settings_for(redis_url, api_keys_file=path)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        path.unlink()  # parsed at start-up: no request reads it again
        assert c.get("/v1/collections").status_code == 401
        assert c.get("/v1/collections", headers=bearer("file-reader")).status_code == 200
        assert c.get("/v1/collections", headers=bearer("file-admin")).status_code == 403
        assert c.delete("/v1/collections/nope", headers=bearer("file-admin")).status_code == 404


def test_no_key_configured_leaves_v1_open(redis_url):
    with TestClient(create_app(settings_for(redis_url)), raise_server_exceptions=False) as c:
        assert c.get("/v1/collections").status_code == 200
        assert c.get("/v1/collections", headers=bearer("anything")).status_code == 200


@pytest.mark.parametrize("overrides, fragment", [
    ({"api_keys": {"": ["read"]}}, "non-empty"),
    ({"api_keys": {"has space": ["read"]}}, "printable ASCII"),
    ({"api_keys": {"caf\u00e9": ["read"]}}, "printable ASCII"),
    ({"metrics_require_key": True}, "no API key"),
])
def test_malformed_keys_stop_the_start(redis_url, overrides, fragment):
    with pytest.raises(ValueError, match=fragment):
        create_app(settings_for(redis_url, **overrides))


def test_bad_keys_file_stops_the_start(redis_url, tmp_path):
    for content in ("not json", '["a list"]', '{"k": ["read", "root"]}', '{"k": "read"}'):
        path = tmp_path / "keys.json"
        path.write_text(content)
        with pytest.raises(ValueError, match="EMBGEOM_API_KEYS_FILE"):
            create_app(settings_for(redis_url, api_keys_file=path))
    with pytest.raises(ValueError, match="EMBGEOM_API_KEYS_FILE"):
        create_app(settings_for(redis_url, api_keys_file=tmp_path / "missing.json"))


def test_token_is_compared_with_every_key_in_constant_time(monkeypatch):
    # SHA-256 of the token against each configured key's, by hmac.compare_digest, with no
    # early exit: the time does not tell how much of a key matched, nor which key did.
    table = auth.KeyTable.from_settings(Settings(api_key=ROOT, api_keys=KEYS))
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for token, expected in ((ROOT, set(auth.SCOPES)), ("reader-key", {"read"}), ("nope", None),
                            ("r" * 10_000, None)):
        calls.clear()
        scopes = table.scopes_of(token)
        assert (set(scopes) if scopes is not None else None) == expected
        assert calls == [(32, 32)] * (len(KEYS) + 1), "one fixed-length comparison per key"


def test_openapi_declares_the_bearer_scheme_on_v1_only(client):
    doc = client.app.openapi()
    assert doc["components"]["securitySchemes"]["bearer"] == {
        **doc["components"]["securitySchemes"]["bearer"], "type": "http", "scheme": "bearer"}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if path.startswith("/v1/"):
                assert op.get("security") == [{"bearer": []}], (method, path)
                assert {"401", "403"} <= set(op["responses"]), (method, path)
            else:
                assert "security" not in op, (method, path)


def test_openapi_declares_metrics_security_when_protected(redis_url):
    settings = keyed_settings(redis_url, metrics_require_key=True)
    doc = create_app(settings).openapi()
    assert doc["paths"]["/metrics"]["get"]["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/healthz"]["get"]


def test_runtime_settings_are_used_when_only_a_runtime_is_given(redis_url):
    rt = Runtime.open(keyed_settings(redis_url))
    try:
        with TestClient(create_app(runtime=rt), raise_server_exceptions=False) as c:
            assert c.get("/v1/collections").status_code == 401
            assert c.get("/v1/collections", headers=bearer(ROOT)).status_code == 200
    finally:
        rt.close()
