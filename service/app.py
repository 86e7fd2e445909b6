"""The FastAPI app, built by a factory so tests build their own against their own Redis."""

from __future__ import annotations

import gc
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import Depends, FastAPI

from embgeom.settings import Settings
from service import errors, metrics
from service.deps import require_api_key
from service.routes import collections, diagnostics, health, jobs, models
from service.runtime import Runtime

API_VERSION = "1.0.0"


def create_app(settings: Optional[Settings] = None, runtime: Optional[Runtime] = None) -> FastAPI:
    """Build the app. With ``runtime`` given, the caller owns it; otherwise the lifespan
    opens one from ``settings`` (embedded Redis + worker when no ``redis_url``)."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        rt = runtime or Runtime.open(settings)
        app.state.runtime = rt
        # torch, transformers and the tokenizers leave millions of long-lived objects:
        # out of the collector's reach, a full collection no longer stalls every request
        # in flight for ~100 ms (the tail of the latency distribution).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            if runtime is None:
                await rt.aredis.aclose()
                rt.close()

    app = FastAPI(
        title="embgeom",
        version=API_VERSION,
        summary="Exact, streaming geometry of contextual embeddings",
        description="Per-token Q (mean squared norm), M (squared norm of the mean) and V "
                    "(variance) at every layer, the decomposition Q = M + V_W + V_B, "
                    "per-layer summaries, isotropy and outlier dimensions.",
        lifespan=lifespan,
    )
    errors.install(app)
    metrics.install(app)
    app.include_router(health.router)
    app.include_router(metrics.router)
    secured = [Depends(require_api_key)]
    for module in (models, jobs, collections, diagnostics):
        app.include_router(module.router, dependencies=secured)
    return app
