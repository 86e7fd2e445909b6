"""Errors -> HTTP, in one place. Every error body has the same shape::

    {"type": "<stable machine-readable type>", "message": "<for humans>", "detail": {...}}
"""

from __future__ import annotations

import logging
import uuid

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from embgeom.errors import (
    Conflict, EmbgeomError, InvalidInput, ModelLoadError, NotFound, Overloaded, StoreUnavailable,
    UnknownModel,
)

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
}


log = logging.getLogger(__name__)


def error_body(type_: str, message: str, detail=None) -> dict:
    return {"type": type_, "message": message, "detail": detail or {}}


def status_of(exc: EmbgeomError) -> int:
    if exc.type in STATUS_BY_TYPE:
        return STATUS_BY_TYPE[exc.type]
    for cls, status in STATUS.items():
        if isinstance(exc, cls):
            return status
    return 500


def install(app: FastAPI) -> None:
    @app.exception_handler(EmbgeomError)
    async def _embgeom(request: Request, exc: EmbgeomError):
        headers = {"Retry-After": "1"} if isinstance(exc, Overloaded) else None
        if exc.type == "unauthorized":
            headers = {"WWW-Authenticate": 'Bearer realm="embgeom"'}
        return JSONResponse(error_body(exc.type, exc.message, exc.detail), status_code=status_of(exc),
                            headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")}
                  for e in exc.errors()]
        first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"])
        return JSONResponse(
            error_body("validation_error", f"{where}: {first['msg']}", {"errors": errors}),
            status_code=422,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        type_ = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(error_body(type_, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(redis.RedisError)
    async def _redis_down(request: Request, exc: redis.RedisError):
        # Unreachable, timed out, loading its AOF, or refusing writes: the store cannot
        # answer now; retrying later can succeed.
        return JSONResponse(error_body("store_unavailable", f"Redis cannot answer: {exc}"),
                            status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        request_id = uuid.uuid4().hex
        log.error("unexpected error (request %s) on %s %s", request_id, request.method,
                  request.url.path, exc_info=exc)
        return JSONResponse(error_body("internal_error", "unexpected server error; the server log "
                                       "has the details under this request id",
                                       {"request_id": request_id}), status_code=500)
