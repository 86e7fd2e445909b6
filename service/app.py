"""The FastAPI app, built by a factory so tests build their own against their own Redis."""

from __future__ import annotations

import gc
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import Depends, FastAPI

from embgeom.settings import Settings
from service import auth as auth_doc
from service import errors, metrics
from service.auth import KeyTable
from service.deps import require_api_key
from service.fast_lane import FastLane
from service.limits import BodyLimit, body_limit
from service.schemas import ErrorBody
from service.routes import collections, diagnostics, health, jobs, models
from service.routes import figures
from service.routes import geometry
from service.runtime import Runtime

API_VERSION = "1.0.0"


def create_app(settings: Optional[Settings] = None, runtime: Optional[Runtime] = None) -> FastAPI:
    """Build the app. With ``runtime`` given, the caller owns it; otherwise the lifespan
    opens one from ``settings`` (embedded Redis + worker when no ``redis_url``)."""
    settings = settings or (runtime.settings if runtime is not None else Settings())
    auth = KeyTable.from_settings(settings)  # keys parsed once; a malformed one stops here

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        rt = runtime or Runtime.open(settings)
        app.state.runtime = rt
        # torch, transformers and the tokenizers leave millions of long-lived objects:
        # out of the collector's reach, a full collection does not walk them and stall
        # every request in flight (the tail of the latency distribution).
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
        # One dependency on every route: it needs a key, with the scope the method calls
        # for, on /v1 (and /metrics when asked), and lets everything else through.
        dependencies=[Depends(require_api_key)],
    )
    app.state.auth = auth
    errors.install(app)
    # A middleware added later wraps the earlier ones: the fast lane sits inside the body
    # limit and the metrics, which count what either answers.
    app.add_middleware(FastLane, lanes=collections.FAST_LANES)
    app.add_middleware(BodyLimit, limit=body_limit(settings))
    metrics.install(app)
    app.include_router(health.router)
    app.include_router(metrics.router)
    for module in (models, jobs, collections, diagnostics, figures, geometry):
        app.include_router(module.router)  # secured by the app-wide require_api_key
    _document(app, auth)
    return app


def _document(app: FastAPI, auth: KeyTable) -> None:
    """The OpenAPI document, post-processed once in one place: the real error bodies and
    statuses (:func:`service.errors.document`) and the bearer scheme
    (:func:`service.auth.document`), without a dependency per route."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            errors.document(schema, ErrorBody.model_json_schema())
            auth_doc.document(schema, auth.metrics_protected)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
