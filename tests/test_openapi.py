"""The exported OpenAPI document (openapi/openapi.json, ``python -m service.openapi_export``
or ``make openapi``) is the app's own, and it carries the fixed v1 contract of
DESIGN.md section 2: its paths, methods, query parameters and field names.

When this fails after a change to the routes or schemas, re-export the document; when a
contract name is missing, a route or field was renamed (the contract forbids that).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.app import create_app

DOC_PATH = Path(__file__).resolve().parent.parent / "openapi" / "openapi.json"
C = "/v1/collections/{collection}/models/{model}"


@pytest.fixture(scope="module")
def live():
    return create_app().openapi()


@pytest.fixture(scope="module")
def doc():
    assert DOC_PATH.is_file(), "run `python -m service.openapi_export` to create openapi/openapi.json"
    return json.loads(DOC_PATH.read_text())


def test_exported_document_is_the_apps(doc, live):
    assert doc == live, "openapi/openapi.json is stale: run `python -m service.openapi_export`"


def test_export_is_deterministic():
    from service.openapi_export import document

    assert document() == DOC_PATH.read_text()


# ----------------------------------------------------------------------------- helpers


def resolve(doc: dict, schema: dict) -> dict:
    """Follow $ref, allOf/anyOf wrappers (Optional) to a concrete schema."""
    while True:
        if "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[-1]
            schema = doc["components"]["schemas"][name]
        elif "allOf" in schema and len(schema["allOf"]) == 1:
            schema = schema["allOf"][0]
        elif "anyOf" in schema:
            concrete = [s for s in schema["anyOf"] if s.get("type") != "null"]
            assert len(concrete) == 1, schema
            schema = concrete[0]
        else:
            return schema


def properties(doc: dict, schema: dict) -> dict:
    schema = resolve(doc, schema)
    props = dict(schema.get("properties", {}))
    for part in schema.get("allOf", []):
        props.update(properties(doc, part))
    return props


def operation(doc: dict, path: str, method: str) -> dict:
    assert path in doc["paths"], f"contract path {path} missing"
    assert method in doc["paths"][path], f"{method.upper()} {path} missing"
    return doc["paths"][path][method]


def response_schema(doc: dict, path: str, method: str, status: str = "200") -> dict:
    op = operation(doc, path, method)
    assert status in op["responses"], f"{method.upper()} {path}: no {status} response"
    return resolve(doc, op["responses"][status]["content"]["application/json"]["schema"])


def query_params(doc: dict, path: str, method: str = "get") -> dict:
    op = operation(doc, path, method)
    return {p["name"]: p for p in op.get("parameters", []) if p["in"] == "query"}


def has_fields(doc: dict, schema: dict, fields: str, where: str) -> None:
    props = properties(doc, schema)
    missing = [f for f in fields.split() if f not in props]
    assert not missing, f"{where}: contract fields {missing} missing (has {sorted(props)})"


# ----------------------------------------------------------------------------- contract


def test_health_and_readiness(doc):
    has_fields(doc, response_schema(doc, "/healthz", "get"), "status", "GET /healthz")
    op = operation(doc, "/readyz", "get")
    assert {"200", "503"} <= set(op["responses"]), "GET /readyz documents 200 and 503"


def test_models(doc):
    schema = response_schema(doc, "/v1/models", "get")
    assert schema["type"] == "array"
    has_fields(doc, schema["items"], "name source architecture num_layers hidden_size vocab_size loaded",
               "GET /v1/models[]")


def test_jobs(doc):
    op = operation(doc, "/v1/jobs", "post")
    body = op["requestBody"]["content"]["application/json"]["schema"]
    has_fields(doc, body, "collection model texts include_special", "POST /v1/jobs body")
    texts = resolve(doc, properties(doc, body)["texts"])
    assert texts["type"] == "array" and resolve(doc, texts["items"])["type"] == "string"
    assert "texts" in resolve(doc, body).get("required", []), "texts is required"
    has_fields(doc, response_schema(doc, "/v1/jobs", "post", "202"), "job_id status", "POST /v1/jobs -> 202")
    status = response_schema(doc, "/v1/jobs/{job_id}", "get")
    has_fields(doc, status, "job_id status collection model texts tokens progress error",
               "GET /v1/jobs/{job_id}")
    enum = resolve(doc, properties(doc, status)["status"]).get("enum")
    assert set(enum) == {"queued", "running", "done", "failed"}, enum


def test_collections(doc):
    schema = response_schema(doc, "/v1/collections", "get")
    assert schema["type"] == "array"
    has_fields(doc, schema["items"], "name models", "GET /v1/collections[]")
    operation(doc, "/v1/collections/{collection}", "delete")


def test_layers_and_decomposition(doc):
    layers = response_schema(doc, f"{C}/layers", "get")
    row = resolve(doc, properties(doc, layers)["layers"])
    assert row["type"] == "array"
    has_fields(doc, row["items"], "layer n num_types Q M V V_W V_B cv_Q slope r2", "GET .../layers rows")
    assert {"min_count", "max_count"} <= set(query_params(doc, f"{C}/layers"))
    path = f"{C}/layers/{{layer}}/decomposition"
    has_fields(doc, response_schema(doc, path, "get"), "layer n num_types Q M V V_W V_B", "GET .../decomposition")
    assert {"min_count", "max_count"} <= set(query_params(doc, path))


def test_tokens(doc):
    path = f"{C}/layers/{{layer}}/tokens"
    page = response_schema(doc, path, "get")
    has_fields(doc, page, "tokens next_cursor", "GET .../tokens")
    items = resolve(doc, properties(doc, page)["tokens"])["items"]
    has_fields(doc, items, "token_id token n Q M V", "GET .../tokens items")
    params = query_params(doc, path)
    assert {"order_by", "desc", "limit", "cursor", "min_count", "token"} <= set(params), sorted(params)
    assert set(resolve(doc, params["order_by"]["schema"])["enum"]) == {"n", "Q", "M", "V"}
    detail = f"{path}/{{token_id}}"
    has_fields(doc, response_schema(doc, detail, "get"), "token_id token n Q M V", "GET .../tokens/{token_id}")
    assert "404" in operation(doc, detail, "get")["responses"], "404 if never seen"


def test_diagnostics_endpoints(doc):
    operation(doc, f"{C}/layers/{{layer}}/isotropy", "get")
    operation(doc, f"{C}/layers/{{layer}}/outliers", "get")


def test_errors_are_documented_with_type_and_message(doc):
    has_fields(doc, {"$ref": "#/components/schemas/ErrorBody"}, "type message", "ErrorBody")
    for path, method, status in [("/v1/jobs", "post", "404"), ("/v1/jobs", "post", "413"),
                                 ("/v1/jobs/{job_id}", "get", "404"), (f"{C}/layers", "get", "404")]:
        schema = response_schema(doc, path, method, status)
        has_fields(doc, schema, "type message", f"{method.upper()} {path} -> {status}")


def test_error_bodies_and_statuses_are_documented(live):
    # The 422 body is our ErrorBody (what the app sends), not FastAPI's HTTPValidationError;
    # an operation with a body documents 400 (not UTF-8 text) and 413; every /v1 operation
    # documents 401, 403 and 503; 429 and 503 error bodies document Retry-After.
    doc = live
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    assert "ValidationError" not in doc["components"]["schemas"]
    missing = []
    for path, item in doc["paths"].items():
        for method, op in item.items():
            where = f"{method.upper()} {path}"
            responses = op["responses"]
            needed = set()
            if op.get("parameters") or "requestBody" in op:
                needed.add("422")
            if "requestBody" in op:
                needed |= {"400", "413", "422"}
            if path.startswith("/v1/"):
                needed |= {"401", "403", "503"}
            missing += [f"{where}: {s}" for s in sorted(needed - set(responses))]
            for status, response in responses.items():
                if status.startswith(("4", "5")) and path != "/readyz":
                    schema = response["content"]["application/json"]["schema"]
                    if schema != {"$ref": "#/components/schemas/ErrorBody"}:
                        missing.append(f"{where}: {status} is not an ErrorBody")
                    if status in ("429", "503") and "Retry-After" not in response.get("headers", {}):
                        missing.append(f"{where}: {status} without Retry-After")
    assert not missing, "\n".join(missing)
    for path, method in [("/v1/jobs", "post"), (f"{C}/layers/{{layer}}/isotropy/sample", "post"),
                         ("/v1/probes/outlier-dimension", "post")]:
        assert "429" in operation(doc, path, method)["responses"], f"{method.upper()} {path}: 429"
    has_fields(doc, {"$ref": "#/components/schemas/ErrorBody"}, "type message detail", "ErrorBody")


def test_document_states_the_limits_the_routes_check(doc):
    """What a route checks itself (with its own error type) is in the document too, so a
    client generated from it sends what the service accepts."""
    from embgeom.store.keys import NAME_PATTERN

    seen = 0
    for path, item in doc["paths"].items():
        for method, op in item.items():
            for p in op.get("parameters", []):
                schema = resolve(doc, p["schema"])
                where = f"{method.upper()} {path} {p['name']}"
                if p["in"] == "path" and p["name"] in ("collection", "model"):
                    assert schema.get("pattern") == NAME_PATTERN, where
                    seen += 1
                if p["name"] == "layer" and schema.get("type") == "integer":
                    assert schema.get("minimum") == 0, where
                if p["name"] == "format" or (p["in"] == "path" and p["name"] == "name"):
                    assert schema.get("enum"), where
                if p["in"] == "query" and schema.get("type") == "integer" and "minimum" in schema \
                        and p["name"] != "layer":
                    assert "maximum" in schema, where
    assert seen >= 30
    ids = query_params(doc, "/v1/jobs")["ids"]["schema"]
    assert ids.get("pattern") == "[^,]"
    steering = resolve(doc, operation(doc, "/v1/steering/transfer", "post")["requestBody"]
                       ["content"]["application/json"]["schema"])
    assert len(steering["oneOf"]) == 2
    job = resolve(doc, operation(doc, "/v1/jobs", "post")["requestBody"]["content"]
                  ["application/json"]["schema"])
    assert resolve(doc, job["properties"]["texts"]["items"]).get("pattern")
