from __future__ import annotations

import redis
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from service.deps import RuntimeDep
from service.schemas import Health, Readiness

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz() -> dict:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
def readyz(rt: RuntimeDep):
    """200 when Redis answers and at least one worker has a fresh heartbeat, else 503."""
    try:
        redis_ok = bool(rt.redis.ping())
        workers = len(rt.live_workers())
    except redis.RedisError:
        redis_ok, workers = False, 0
    ready = redis_ok and workers > 0
    body = {"status": "ready" if ready else "unavailable", "redis": redis_ok,
            "workers": workers, "embedded": rt.embedded}
    return JSONResponse(body, status_code=200 if ready else 503)
