"""Under load and faults: 32 concurrent readers and an ingestion running while Redis is
SIGKILLed and restarted from its AOF.

Real processes: a redis-server on a fixed port, ``embgeom serve --redis-url`` (the API),
one ``embgeom worker``. Readers hit the token lookup and the per-layer summary in a loop.
While Redis is down every read must fail fast with a JSON 503 ``store_unavailable``
(never hang, never a 500); once it is back, reads recover without restarting anything;
and every acknowledged job is counted exactly once (each per-token count equals the
tokenizer's own count of the texts, at the first and last layers).

Printed: the error rate, the slowest failed read, and the recovery time (from Redis
answering again to the first successful read).
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import httpx
import pytest

from embgeom.store.server import RedisServer, free_port
from embgeom.testing.serve import ServiceProcess
from tests.conftest import wait_for_jobs
from tests.test_scale_out import (
    MODEL, NUM_LAYERS, PARAGRAPHS, WORKER_ENV, expected_counts, fleet, post_job, walk_tokens,
)

pytestmark = pytest.mark.slow

READERS = 32
JOBS = [PARAGRAPHS[i * 20:(i + 1) * 20] for i in range(10)]


class Readers:
    """READERS threads reading in a loop; every answer is recorded (time, status, type, s)."""

    def __init__(self, base: str, token_ids: list[int]):
        self.base, self.token_ids = base, token_ids
        self.records: list[tuple[float, int, str, float]] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(READERS)]

    def _run(self, i: int) -> None:
        paths = [f"/v1/collections/load/models/{MODEL}/layers/3/tokens/{t}" for t in self.token_ids]
        paths.append(f"/v1/collections/load/models/{MODEL}/layers/3/decomposition")
        with httpx.Client(base_url=self.base, timeout=30) as client:
            k = i
            while not self.stop.is_set():
                k += 1
                start = time.monotonic()
                try:
                    r = client.get(paths[k % len(paths)])
                    kind = r.json().get("type", "") if r.status_code != 200 else ""
                    status = r.status_code
                except httpx.HTTPError as exc:
                    status, kind = -1, type(exc).__name__
                with self.lock:
                    self.records.append((start, status, kind, time.monotonic() - start))

    def __enter__(self):
        [t.start() for t in self.threads]
        return self

    def __exit__(self, *exc):
        self.stop.set()
        [t.join(timeout=60) for t in self.threads]


def test_readers_and_ingestion_through_a_redis_restart(tmp_path):
    data, port = tmp_path / "redis", free_port()
    server = RedisServer(data, port=port).start(timeout=120)
    api = ServiceProcess.serve(redis_url=server.url, env=WORKER_ENV, log_path=tmp_path / "serve.log").start()
    base = api.url
    try:
        with fleet(server.url, tmp_path) as fl, httpx.Client(base_url=base, timeout=60) as client:
            fl.start()
            # The API answers (no worker check: /readyz needs one live worker).
            api.wait_ready(timeout=120, path="/healthz")
            first = post_job(client, JOBS[0], "load", key="load-0")
            assert wait_for_jobs(client, [first], timeout=300)[0]["status"] == "done"
            token_ids = list(walk_tokens(client, "load", 3))[:200]

            with Readers(base, token_ids) as readers:
                ids = [first] + [post_job(client, texts, "load", key=f"load-{i}")
                                 for i, texts in enumerate(JOBS[1:6], start=1)]
                time.sleep(2)
                killed_at = time.monotonic()
                server.kill()
                time.sleep(3)
                server = RedisServer(data, port=port).start(timeout=120)
                back_at = time.monotonic()
                # More submissions after the restart (a retried POST keeps its key: one job).
                ids += [post_job(client, texts, "load", key=f"load-{i}")
                        for i, texts in enumerate(JOBS[6:], start=6)]
                final = wait_for_jobs(client, ids, timeout=900)
                time.sleep(1)
            assert all(s["status"] == "done" for s in final), (final, fl.logs())

            records = sorted(readers.records)
            down = [r for r in records if killed_at + 0.2 <= r[0] < back_at - 0.2]
            failed = [r for r in records if r[1] != 200]
            assert down, "no read was made while Redis was down"
            # While down: fast JSON 503s, nothing else.
            assert {r[1] for r in down} <= {503}, Counter((r[1], r[2]) for r in down)
            assert {r[2] for r in down} == {"store_unavailable"}
            slowest_failure = max(r[3] for r in failed)
            assert slowest_failure < 5.0, slowest_failure
            # After: recovered without restarting the API.
            after = [r for r in records if r[0] >= back_at]
            first_ok = next(r for r in after if r[1] == 200)
            recovery = first_ok[0] - back_at
            assert recovery < 10.0, recovery
            assert all(r[1] == 200 for r in after if r[0] > first_ok[0] + 2.0), \
                Counter((r[1], r[2]) for r in after if r[1] != 200)
            assert not [r for r in records if r[1] >= 500 and r[1] != 503], "a 5xx other than 503"

            # Nothing acknowledged lost or counted twice.
            tokenizer_counts: Counter = Counter()
            from embgeom.compute.catalogue import ModelRegistry
            from tests.test_scale_out import api_settings

            tokenizer = ModelRegistry.from_settings(api_settings("redis://unused")).tokenizer(MODEL)
            for texts in JOBS:
                tokenizer_counts += expected_counts(tokenizer, texts)
            for layer in (0, NUM_LAYERS - 1):
                got = Counter({t: v[0] for t, v in walk_tokens(client, "load", layer).items()})
                assert got == tokenizer_counts, f"layer {layer}"
            print(f"\n{len(records)} reads by {READERS} readers; {len(failed)} failed "
                  f"({len(failed) / len(records):.1%}), all 503 store_unavailable, the slowest in "
                  f"{slowest_failure * 1000:.0f} ms; Redis down {back_at - killed_at:.1f} s; "
                  f"reads recovered {recovery:.2f} s after Redis answered again; "
                  f"{len(ids)} jobs, each counted once")
    finally:
        api.terminate()
        server.kill()
