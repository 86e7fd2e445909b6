"""Queue housekeeping against a real Redis: consumer pruning, fenced failure paths."""

from __future__ import annotations

import time

from embgeom.store import keys as K
from embgeom.store.jobs import JobQueue, JobRequest
from embgeom.worker import redis_client


def test_prune_consumers_removes_only_idle_empty_ones(redis_server):
    r = redis_client(redis_server.url)
    q = JobQueue(r)
    r.sadd(K.streams("minilm"), "c:minilm")  # what submit() records
    stream = K.PairKeys("c", "minilm").jobs
    q.ensure_group(stream)
    first = r.xadd(stream, {"job_id": "a", "pair": "c:minilm"})
    r.xadd(stream, {"job_id": "b", "pair": "c:minilm"})
    r.xreadgroup(K.GROUP, "dead", {stream: ">"}, count=1)
    r.xreadgroup(K.GROUP, "holder", {stream: ">"}, count=1)
    r.xack(stream, K.GROUP, first)  # "dead" holds nothing now; "holder" holds one entry
    time.sleep(0.2)
    assert q.prune_consumers(["minilm"], idle_seconds=0.1) == 1
    assert [c["name"] for c in r.xinfo_consumers(stream, K.GROUP)] == [b"holder"]
    assert q.prune_consumers(["minilm"], idle_seconds=3600) == 0


def test_superseded_delivery_can_neither_requeue_nor_dead_letter(redis_server):
    r = redis_client(redis_server.url)
    q = JobQueue(r, max_attempts=5)
    job_id, _ = q.submit(JobRequest("c", "minilm", ["some text"]), ["minilm"])
    stale = q.take("w1", ["minilm"], lease_seconds=60, block_ms=100)
    time.sleep(0.05)
    fresh = q.take("w2", ["minilm"], lease_seconds=0.01, block_ms=100)  # takes it over
    assert fresh is not None and fresh.epoch == stale.epoch + 1
    assert q.retry_later(stale, "boom") is False
    assert q.fail(stale.pair, job_id, stale.stream, stale.entry_id, "boom", epoch=stale.epoch) is False
    status = q.status(job_id)
    assert status["status"] == "running" and status["error"] is None
    assert r.exists(stale.pair.payload(job_id)) == 1
    # The owner can still requeue it.
    assert q.retry_later(fresh, "owner's error") is True
    assert q.status(job_id)["status"] == "queued"
