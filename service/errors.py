"""Errors -> HTTP, in one place. Every error body has the same shape::

    {"type": "<stable machine-readable type>", "message": "<for humans>", "detail": {...}}

whatever raised it: the library (:mod:`embgeom.errors`), request validation, the router
(404, 405), the body limit (413, :mod:`service.limits`), the store (503), or an unexpected
exception anywhere, a middleware included (500 ``internal_error`` with a request id; the
trace goes to the server log only). :func:`document` makes the OpenAPI document say so.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from typing import Optional

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from embgeom.errors import (
    Conflict, EmbgeomError, InvalidInput, ModelLoadError, NotFound, Overloaded, StoreUnavailable,
    UnknownModel,
)

__all__ = ["Unauthorized", "Forbidden", "ModelLoading", "ErrorResponse", "error_body", "status_of", "install",
           "document"]

STATUS = {
    Conflict: 409,
    InvalidInput: 422,
    UnknownModel: 404,
    NotFound: 404,
    ModelLoadError: 503,
    Overloaded: 429,
    StoreUnavailable: 503,
}

# Types whose status differs from their class's.
STATUS_BY_TYPE = {
    "payload_too_large": 413,
    "unknown_model": 404,
    "unauthorized": 401,
    "forbidden": 403,
    "model_loading": 503,
}

# Statuses the router itself answers (no route matched, or not with this method, or a
# body that is not text).
HTTP_TYPES = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed",
              413: "payload_too_large"}

log = logging.getLogger(__name__)


class Unauthorized(EmbgeomError):
    """No bearer token, or not a configured key (401 with a ``WWW-Authenticate`` challenge)."""

    type = "unauthorized"

    def __init__(self, message: str, invalid_token: bool = False):
        super().__init__(message)
        challenge = 'Bearer realm="embgeom"'
        if invalid_token:
            challenge += ', error="invalid_token"'
        self.headers = {"WWW-Authenticate": challenge}


class Forbidden(EmbgeomError):
    """A configured key without the scope the request needs (403)."""

    type = "forbidden"

    def __init__(self, scope: str):
        super().__init__(f"this API key lacks the {scope!r} scope", scope=scope)
        self.headers = {"WWW-Authenticate":
                        f'Bearer realm="embgeom", error="insufficient_scope", scope="{scope}"'}


class ModelLoading(EmbgeomError):
    """The model a request needs is still loading in this process after the request waited
    ``model_load_wait_seconds`` for it (503, ``Retry-After``; :mod:`service.sync_models`)."""

    type = "model_loading"

    def __init__(self, name: str, retry_after: int):
        super().__init__(f"model {name!r} is loading in this process; retry in {retry_after} s",
                         model=name, retry_after=retry_after)
        self.headers = {"Retry-After": str(retry_after)}


def error_body(type_: str, message: str, detail=None) -> dict:
    return {"type": type_, "message": message, "detail": detail or {}}


def _clean(value):
    """``value`` with every lone surrogate replaced by its escape and non-finite numbers by
    None: an error may quote what a client sent (a JSON key, a location, a value), and
    neither can be written as UTF-8 JSON."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {_clean(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class ErrorResponse(JSONResponse):
    """A JSON error body that always encodes (non-finite numbers become null)."""

    def render(self, content) -> bytes:
        try:
            return json.dumps(content, ensure_ascii=False, allow_nan=False,
                              separators=(",", ":")).encode("utf-8")
        except (UnicodeEncodeError, ValueError, TypeError):
            return json.dumps(_clean(content), ensure_ascii=False, allow_nan=False, default=str,
                              separators=(",", ":")).encode("utf-8")


def error_response(type_: str, message: str, status_code: int, detail=None,
                   headers: Optional[dict] = None) -> ErrorResponse:
    return ErrorResponse(error_body(type_, message, detail), status_code=status_code, headers=headers)


def status_of(exc: EmbgeomError) -> int:
    if exc.type in STATUS_BY_TYPE:
        return STATUS_BY_TYPE[exc.type]
    for cls, status in STATUS.items():
        if isinstance(exc, cls):
            return status
    return 500


def _retry_after(status: int) -> Optional[dict]:
    # Overloaded, store or model unavailable: retrying later can succeed.
    return {"Retry-After": "1"} if status in (429, 503) else None


def internal_error(request_id: str) -> ErrorResponse:
    return error_response("internal_error", "unexpected server error; the server log has the "
                          "details under this request id", 500, {"request_id": request_id},
                          {"X-Request-ID": request_id})


def install(app: FastAPI) -> None:
    @app.exception_handler(EmbgeomError)
    async def _embgeom(request: Request, exc: EmbgeomError):
        status = status_of(exc)
        if status == 500:
            return _unexpected_response(request, exc)
        headers = getattr(exc, "headers", None) or _retry_after(status)
        return error_response(exc.type, exc.message, status, exc.detail, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")}
                  for e in exc.errors()]
        first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"])
        return error_response("validation_error", f"{where}: {first['msg']}", 422, {"errors": errors})

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        type_ = HTTP_TYPES.get(exc.status_code, "http_error")
        message = str(exc.detail)
        if exc.status_code == 400:
            message = "the request body could not be read as JSON text (it must be UTF-8)"
        return error_response(type_, message, exc.status_code, headers=exc.headers)

    @app.exception_handler(redis.RedisError)
    async def _redis_down(request: Request, exc: redis.RedisError):
        # Unreachable, timed out, loading its AOF, or refusing writes: the store cannot
        # answer now; retrying later can succeed.
        return error_response("store_unavailable", f"Redis cannot answer: {exc}", 503,
                              headers={"Retry-After": "1"})

    # Starlette runs this one from its outermost middleware, so it also catches what a
    # middleware raises. (It then re-raises, for the server to log: the trace stays there.)
    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return _unexpected_response(request, exc)


def _unexpected_response(request: Request, exc: BaseException) -> ErrorResponse:
    request_id = uuid.uuid4().hex
    log.error("unexpected error (request %s) on %s %s", request_id, request.method,
              request.url.path, exc_info=exc)
    return internal_error(request_id)


# ----------------------------------------------------------------------------- OpenAPI

ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying",
                               "schema": {"type": "string"}}}


def _error(description: str, headers: Optional[dict] = None) -> dict:
    out = {"description": description, "content": {"application/json": {"schema": ERROR_REF}}}
    if headers:
        out["headers"] = headers
    return out


def document(openapi: dict, error_schema: dict) -> None:
    """Make the document describe the error bodies the app really sends: 422 is our
    ``ErrorBody`` (not FastAPI's ``HTTPValidationError``); an operation with a body can
    answer 400 (not UTF-8 text) and 413; every ``/v1`` operation and ``/metrics`` read the
    store (503); 429 and 503 come with ``Retry-After``."""
    schemas = openapi.setdefault("components", {}).setdefault("schemas", {})
    schemas.setdefault("ErrorBody", error_schema)
    for path, item in openapi.get("paths", {}).items():
        for method, op in item.items():
            if not isinstance(op, dict) or "responses" not in op:
                continue
            responses = op["responses"]
            if "422" in responses:
                responses["422"] = _error("Invalid input: validation_error or an invalid_* type")
            if "requestBody" in op:
                responses.setdefault("400", _error("invalid_body: the body is not UTF-8 text"))
                responses.setdefault("413", _error("payload_too_large: the body, or the texts it "
                                                   "carries, exceed a limit"))
                responses.setdefault("422", _error("Invalid input: validation_error or an "
                                                   "invalid_* type"))
            if path.startswith("/v1/") or path == "/metrics":
                responses.setdefault("503", _error("store_unavailable: the store cannot answer "
                                                   "now", RETRY_AFTER))
            for status in ("429", "503"):
                error = responses.get(status, {}).get("content", {}).get("application/json", {})
                if error.get("schema") == ERROR_REF:
                    responses[status].setdefault("headers", RETRY_AFTER)
    for name in ("HTTPValidationError", "ValidationError"):  # in this order: the first refers to the second
        if f'"#/components/schemas/{name}"' not in json.dumps(openapi):
            schemas.pop(name, None)
