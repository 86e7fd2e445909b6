"""Queue housekeeping against a real Redis: consumer pruning, fenced failure paths."""

from __future__ import annotations

import time

from embgeom.store import keys as K
from embgeom.store.delivery import WorkerQueue
from embgeom.store.jobs import JobRequest
from embgeom.store.submission import JobSubmitter
from embgeom.worker import redis_client


def test_prune_consumers_removes_only_idle_empty_ones(redis_server):
    r = redis_client(redis_server.url)
    q = WorkerQueue(r)
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
    q = WorkerQueue(r, max_attempts=5)
    job_id, _ = JobSubmitter(r).submit(JobRequest("c", "minilm", ["some text"]), ["minilm"])
    stale = q.take("w1", ["minilm"], lease_seconds=60, block_ms=100)
    time.sleep(0.05)
    # Another worker (its own queue object, as every worker has) takes it over.
    fresh = WorkerQueue(r, max_attempts=5).take("w2", ["minilm"], lease_seconds=0.01, block_ms=100)
    assert fresh is not None and fresh.epoch == stale.epoch + 1
    assert q.retry_later(stale, "boom") is False
    assert q.fail(stale.pair, job_id, stale.stream, stale.entry_id, "boom", epoch=stale.epoch) is False
    status = q.status(job_id)
    assert status["status"] == "running" and status["error"] is None
    assert r.exists(stale.pair.payload(job_id)) == 1
    # The owner can still requeue it.
    assert q.retry_later(fresh, "owner's error") is True
    assert q.status(job_id)["status"] == "queued"


def test_idle_polls_touch_only_notified_pairs_and_rescans_retire_empty_streams(redis_server):
    """Worker polling costs the same however many pairs were ever created: between
    rescans, a take polls only the streams notifications named; a rescan drops the empty
    streams from the directory, and a delivery puts its pair back."""
    r = redis_client(redis_server.url)
    submitter, q = JobSubmitter(r), WorkerQueue(r)
    for i in range(30):  # 30 pairs ever created, each with a job that then ended
        job_id, _ = submitter.submit(JobRequest(f"old{i}", "minilm", ["x"]), ["minilm"])
        d = q.take("w", ["minilm"], lease_seconds=60, block_ms=0, only=K.PairKeys(f"old{i}", "minilm").jobs)
        q.ack(d.stream, d.entry_id)
    worker = WorkerQueue(r)
    assert worker.take("w", ["minilm"], lease_seconds=60, block_ms=0) is None  # a rescan
    assert r.scard(K.streams("minilm")) == 0  # every stream was empty: retired
    job_id, _ = submitter.submit(JobRequest("new", "minilm", ["y"]), ["minilm"])
    # Between rescans nothing is polled until a notification names the pair.
    assert worker.take("w", ["minilm"], lease_seconds=60, block_ms=0) is None
    worker.note(worker.wait_for_work(["minilm"], 100, {K.notify("minilm"): "0-0"}))
    d = worker.take("w", ["minilm"], lease_seconds=60, block_ms=0)
    assert d is not None and d.job_id == job_id
    assert r.sismember(K.streams("minilm"), "new:minilm")  # back in the directory while it runs


def test_heartbeat_prunes_workers_silent_for_ten_silence_windows(redis_server):
    from embgeom.store.heartbeats import live_workers, publish_heartbeat

    r = redis_client(redis_server.url)
    now = time.time()
    r.zadd(K.WORKERS, {"sigkilled": now - 1000, "slow": now - 5})
    publish_heartbeat(r, "me", {"id": "me"}, silence_seconds=10, details_ttl=11)
    assert sorted(m.decode() for m in r.zrange(K.WORKERS, 0, -1)) == ["me", "slow"]
    assert 0 < r.ttl(K.worker("me")) <= 11
    assert [w["id"] for w in live_workers(r, 10)] == ["me"]


def test_an_idempotency_key_may_not_outlive_its_jobs_record():
    """Past the record, a retry would find no job and be counted again: refused at start."""
    import pytest
    from pydantic import ValidationError

    from embgeom.settings import Settings

    with pytest.raises(ValidationError, match="must not exceed retention_seconds"):
        Settings(idempotency_ttl_seconds=7200, retention_seconds=3600)
    assert Settings(idempotency_ttl_seconds=3600, retention_seconds=3600).retention_seconds == 3600


def test_a_backlog_found_by_a_rescan_is_drained_without_waiting_for_the_next(redis_server):
    """Jobs queued before a worker listened (no notification reaches it) are all taken
    one after the other, not one per rescan (every half lease)."""
    r = redis_client(redis_server.url)
    q = JobSubmitter(r)
    ids = [q.submit(JobRequest("backlog", "minilm", [f"t{i}"]), ["minilm"])[0] for i in range(3)]
    worker = WorkerQueue(r)
    taken = [worker.take("w", ["minilm"], lease_seconds=600, block_ms=0) for _ in range(3)]
    assert [d.job_id for d in taken if d is not None] == ids


def test_a_rescan_racing_submissions_never_drops_a_queued_stream_from_the_directory(redis_server):
    """A rescan retires streams it finds empty; a submission to a new pair makes its stream
    (empty), lists it, then adds its entry. A rescan reading the length in between must not
    leave a stream with a job unlisted: only a notification would then find it, and a
    worker starting meanwhile skips notifications older than its first read (the job
    would wait for the next submission to its pair). Hundreds of racing rounds: after
    them, every stream holding a job is listed."""
    import threading

    r = redis_client(redis_server.url)
    submitter, rescanner = JobSubmitter(r), WorkerQueue(redis_client(redis_server.url))
    done = threading.Event()

    def rescan_until_done():
        while not done.is_set():
            rescanner._rescan(["minilm"])

    thread = threading.Thread(target=rescan_until_done)
    thread.start()
    try:
        for i in range(400):
            submitter.submit(JobRequest(f"race{i}", "minilm", ["x"]), ["minilm"])
    finally:
        done.set()
        thread.join()
    listed = {m.decode() for m in r.smembers(K.streams("minilm"))}
    unlisted = [i for i in range(400) if f"race{i}:minilm" not in listed]
    assert not unlisted, f"{len(unlisted)} queued streams left the directory, e.g. race{unlisted[0]}"
