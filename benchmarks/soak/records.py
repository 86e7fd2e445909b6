"""What the soak's threads record (:class:`Log`), the jobs it submitted, and the HTTP
client that times and records every response."""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Optional

import httpx


@dataclass
class Job:
    job_id: str
    collection: str
    model: str
    texts: list[str]
    epoch: int
    submitted: float
    status: str = "queued"
    error: Optional[str] = None


@dataclass
class Log:
    """Everything the threads record, under one lock."""

    start: float = field(default_factory=time.time)
    lock: threading.Lock = field(default_factory=threading.Lock)
    latency: dict = field(default_factory=lambda: defaultdict(list))   # endpoint -> [ms]
    statuses: dict = field(default_factory=lambda: defaultdict(Counter))  # endpoint -> status -> n
    errors_5xx: list = field(default_factory=list)
    requests_at: list = field(default_factory=list)  # when each request was sent (time.time())
    connect_errors: Counter = field(default_factory=Counter)
    rss: list = field(default_factory=list)          # (t, role, pid, process_memory(), loaded, at rest, work)
    redis_mem: list = field(default_factory=list)    # (t, used_memory MB, rss MB)
    redis_families: list = field(default_factory=list)  # (t, {pair: {family: bytes}})
    faults: list = field(default_factory=list)       # {"t", "what", "down_s"}
    outages: list = field(default_factory=list)      # (start, end) when Redis 503s are allowed
    checkpoints: dict = field(default_factory=dict)  # "pair/cp" -> record
    inflight_now: list = field(default_factory=list)  # checkpoints sealed at the last sample
    unexpected_exits: list = field(default_factory=list)
    events: list = field(default_factory=list)

    def t(self) -> float:
        return round(time.time() - self.start, 2)

    def note(self, text: str) -> None:
        with self.lock:
            self.events.append((self.t(), text))
        print(f"[soak {self.t():7.1f}s] {text}", flush=True)


class Http:
    """One client per thread: every response timed and recorded by endpoint; 5xx kept."""

    def __init__(self, url: str, log: Log, timeout: float = 120):
        self.client = httpx.Client(base_url=url, timeout=timeout)
        self.log = log

    def request(self, method: str, path: str, endpoint: str, **kw) -> Optional[httpx.Response]:
        start = time.perf_counter()
        with self.log.lock:
            self.log.requests_at.append(time.time())
        try:
            r = self.client.request(method, path, **kw)
        except httpx.HTTPError as exc:
            with self.log.lock:
                self.log.connect_errors[f"{endpoint}: {type(exc).__name__}"] += 1
            return None
        ms = (time.perf_counter() - start) * 1000
        with self.log.lock:
            self.log.latency[endpoint].append(ms)
            self.log.statuses[endpoint][r.status_code] += 1
            if endpoint.endswith("/report") and r.status_code == 200:
                # a first drawing of its version (miss) apart from the answers of one drawn
                # before (hit, stale): the report page's target is about the latter
                by_cache = f"{endpoint} (cache {r.headers.get('x-embgeom-cache', '?')})"
                self.log.latency[by_cache].append(ms)
                self.log.statuses[by_cache][r.status_code] += 1
            if r.status_code >= 500:
                self.log.errors_5xx.append({"t": self.log.t(), "at": time.time(), "endpoint": endpoint,
                                            "path": path, "status": r.status_code,
                                            "body": r.text[:500]})
        return r

    def close(self) -> None:
        self.client.close()
