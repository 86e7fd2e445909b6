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


def install(app) -> None:
    metrics = Metrics()
    app.state.metrics = metrics

    @app.middleware("http")
    async def _measure(request: Request, call_next):
        start = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        metrics.requests.labels(request.method, path, str(response.status_code)).inc()
        metrics.latency.labels(request.method, path).observe(time.perf_counter() - start)
        return response


@router.get("/metrics", include_in_schema=True, response_class=Response)
def metrics_endpoint(request: Request) -> Response:
    """Prometheus text exposition."""
    rt = request.app.state.runtime
    m: Metrics = request.app.state.metrics
    m.pending.set(rt.queue.pending(rt.registry.names()))
    m.workers.set(len(rt.live_workers()))
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
