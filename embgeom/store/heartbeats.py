"""Worker heartbeats: a worker publishes its own, and anyone (the API's /readyz and
/metrics, the benchmarks) reads who is alive without importing the worker."""

from __future__ import annotations

import json
import time

import redis

from embgeom.store import keys as K
from embgeom.store.plans import Plan, run_sync

__all__ = ["publish_heartbeat", "live_workers"]


def publish_heartbeat(client: redis.Redis, worker_id: str, details: dict,
                      silence_seconds: float, details_ttl: int) -> None:
    """One heartbeat: the worker's score in ``eg:workers`` and its details (expiring);
    ids silent for ten silence windows (SIGKILLed workers) leave the set."""
    with client.pipeline(transaction=False) as p:
        now = time.time()
        p.zadd(K.WORKERS, {worker_id: now})
        p.zremrangebyscore(K.WORKERS, "-inf", now - 10 * silence_seconds)
        p.set(K.worker(worker_id), json.dumps(details), ex=details_ttl)
        p.execute()


def live_workers(client: redis.Redis, silence_seconds: float) -> list[dict]:
    """Workers whose heartbeat is younger than ``silence_seconds``."""
    return run_sync(client, _live_workers(silence_seconds))


def _live_workers(silence_seconds: float) -> Plan:
    """Heartbeat details of the workers heard from within ``silence_seconds``."""
    # Heartbeats are scored by each worker's clock: compared with ours, as they are.
    (ids,) = yield [("zrangebyscore", K.WORKERS, time.time() - silence_seconds, "+inf")]
    if not ids:
        return []
    raws = yield [("get", K.worker(i.decode())) for i in ids]
    return [json.loads(raw) for raw in raws if raw]
