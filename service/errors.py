"""Errors -> HTTP, in one place. Every error body has the same shape::

    {"type": "<stable machine-readable type>", "message": "<for humans>", "detail": {...}}
"""

from __future__ import annotations

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from embgeom.errors import (
    EmbgeomError, InvalidInput, ModelLoadError, NotFound, Overloaded, StoreUnavailable,
    UnknownModel,
)

STATUS = {
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
}


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

    @app.exception_handler(redis.ConnectionError)
    async def _redis_down(request: Request, exc: redis.ConnectionError):
        return JSONResponse(error_body("store_unavailable", f"Redis is unreachable: {exc}"),
                            status_code=503)
