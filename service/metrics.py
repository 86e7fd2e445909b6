"""Prometheus metrics: request counts and latencies per route, queue depth, live workers."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest


router = APIRouter(tags=["health"])


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("embgeom_http_requests_total", "HTTP requests",
                                ["method", "route", "status"], registry=self.registry)
        self.latency = Histogram("embgeom_http_request_seconds", "HTTP request latency",
                                 ["method", "route"], registry=self.registry)
        self.pending = Gauge("embgeom_jobs_pending", "Jobs queued or running", registry=self.registry)
        self.workers = Gauge("embgeom_workers_live", "Workers with a fresh heartbeat",
                             registry=self.registry)
        self.stages = Gauge("embgeom_worker_stage_seconds", "Seconds a live worker spent per stage "
                            "since it started (forward_reduce, merge, shards.write, ...)",
                            ["worker", "stage"], registry=self.registry)
        self.checkpoints = Gauge("embgeom_worker_checkpoints", "Checkpoints a live worker completed",
                                 ["worker"], registry=self.registry)


class _Measure:
    """Pure ASGI middleware (no per-request task or body buffering, unlike
    ``BaseHTTPMiddleware``): counts and times each request by its route template."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            method = scope.get("method", "")
            self.metrics.requests.labels(method, path, str(status["code"])).inc()
            self.metrics.latency.labels(method, path).observe(time.perf_counter() - start)


def install(app) -> None:
    metrics = Metrics()
    app.state.metrics = metrics
    app.add_middleware(_Measure, metrics=metrics)


@router.get("/metrics", include_in_schema=True, response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
                             "description": "Prometheus text exposition format"}})
def metrics_endpoint(request: Request) -> Response:
    """Prometheus text exposition."""
    rt = request.app.state.runtime
    m: Metrics = request.app.state.metrics
    m.pending.set(rt.queue.pending(rt.registry.names()))
    live = rt.live_workers()
    m.workers.set(len(live))
    m.stages.clear()
    m.checkpoints.clear()
    for w in live:
        m.checkpoints.labels(w["id"]).set(w.get("checkpoints", 0))
        for stage, seconds in w.get("stage_seconds", {}).items():
            m.stages.labels(w["id"], stage).set(seconds)
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
