"""Prometheus metrics: request counts and latencies per route, queue depth, live workers,
and the checkpoints: retries, give-ups, dead letters (fleet-wide counters kept in Redis),
and per pair those in flight, the age of the oldest and those dead-lettered."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from embgeom.store.checkpoints import checkpoint_health

# Fleet-wide checkpoint counters (eg:stats:checkpoints, counted by the workers) -> help.
CHECKPOINT_COUNTERS = {
    "retries": "Times a worker retried a checkpoint after a transient store error",
    "abandoned": "Checkpoints a worker gave up (retries spent or refused by Redis), "
                 "left to another worker's adoption",
    "dead_lettered": "Checkpoints dead-lettered: their tries spent, their jobs failed "
                     "with the reason",
    "adopted": "Checkpoints taken over from a silent or failed owner",
    "retried_dead": "Dead-lettered checkpoints put back in flight",
}


class _StoredCounters:
    """Counters whose values live in Redis (every worker adds to them): exposed as
    Prometheus counters with the values read at the last scrape."""

    def __init__(self):
        self.values: dict[str, int] = {}

    def collect(self):
        for name, help_text in CHECKPOINT_COUNTERS.items():
            family = CounterMetricFamily(f"embgeom_checkpoint_{name}", help_text)
            family.add_metric([], self.values.get(name, 0))
            yield family


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
        self.stored = _StoredCounters()
        self.registry.register(self.stored)
        self.in_flight = Gauge("embgeom_checkpoints_in_flight", "Checkpoints sealed and not yet "
                               "completed, per pair (readers' 'applying')", ["pair"],
                               registry=self.registry)
        self.oldest = Gauge("embgeom_checkpoint_oldest_sealed_seconds", "Age of the oldest "
                            "checkpoint in flight, per pair", ["pair"], registry=self.registry)
        self.dead = Gauge("embgeom_checkpoints_dead_letter", "Dead-lettered checkpoints kept for a "
                          "retry, per pair (pieces they applied stay counted: see the jobs' error)",
                          ["pair"], registry=self.registry)


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
    health = checkpoint_health(rt.redis)
    m.stored.values = health["counters"]
    now_ms = time.time() * 1000
    for gauge in (m.in_flight, m.oldest, m.dead):
        gauge.clear()
    for pair, h in health["pairs"].items():
        m.in_flight.labels(pair).set(h["in_flight"])
        m.dead.labels(pair).set(h["dead"])
        if h["oldest_sealed_ms"] is not None:
            m.oldest.labels(pair).set(max(0.0, (now_ms - h["oldest_sealed_ms"]) / 1000))
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
