"""Durable jobs on Redis Streams: submission, status, delivery, retries, dead letters.

One stream per (collection, model) pair (``eg:{c:m}:jobs``), in the pair's hash slot,
one consumer group ``workers`` on each. A stream entry carries only a job id; the texts
wait in the pair's payload key and the status in the pair's job hash (see
:mod:`embgeom.store.keys`). So submission, delivery, requeue, dead letter, ack and commit each
touch one slot only, and work unchanged on Redis Cluster. Workers find the streams of
the models they serve in ``eg:streams:<model>`` and poll them one at a time, round-robin
(no cross-slot XREADGROUP). A delivery bumps the job's ``epoch``: only the newest
delivery may seal it into a checkpoint (fencing a worker that wakes up late). A job
already sealed into a checkpoint comes back as a delivery naming that checkpoint, which
the worker adopts as a whole (:mod:`embgeom.store.checkpoints`). Entries are acknowledged
and deleted once the job's checkpoint completes or the job is dead-lettered, so the
streams' total length is the number of pending jobs.

The queue has two sides, each its own module over what this one holds (the streams'
directory, their consumer group, the notifications, a job's status):
:mod:`embgeom.store.submission` (the API: submit, idempotency) and
:mod:`embgeom.store.delivery` (the workers: take, claim, ack, retry, dead letters). Both
use the key layout of :mod:`embgeom.store.keys` and the scripts of
:mod:`embgeom.store.scripts`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import redis

from embgeom.errors import NotFound
from embgeom.store import keys as K

__all__ = ["JobRequest", "Delivery", "JobStreams", "TERMINAL"]

TERMINAL = ("done", "failed")


@dataclass(frozen=True)
class JobRequest:
    collection: str
    model: str
    texts: Sequence[str]


@dataclass(frozen=True)
class Delivery:
    """A job handed to a worker: ``epoch`` fences its commit."""

    job_id: str
    entry_id: str
    stream: str
    pair: K.PairKeys
    epoch: int
    attempts: int
    texts: Optional[list]
    gen: int = 0
    checkpoint: Optional[str] = None  # set when the job is already sealed into one


class JobStreams:
    """What both sides of the queue share: the client, the job streams' directory and
    consumer group, the notifications that wake idle workers (sent by both sides, waited
    for by workers), and a job's status."""

    def __init__(self, client: redis.Redis):
        self.r = client
        self._groups: set[str] = set()

    def ensure_group(self, stream: str) -> None:
        if stream in self._groups:
            return
        try:
            self.r.xgroup_create(stream, K.GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._groups.add(stream)

    def forget_groups(self) -> None:
        """Re-check the consumer groups on next use (after a reconnect)."""
        self._groups.clear()

    def streams(self, models: Sequence[str]) -> list[str]:
        """The job streams of every pair of these models (from the directory), sorted."""
        pairs: set[bytes] = set()
        for model in models:
            pairs |= self.r.smembers(K.streams(model))
        return sorted(K.PairKeys(*K.split_pair(p.decode())).jobs for p in pairs)

    NOTIFY_MAXLEN = 1000

    def notify(self, pair: K.PairKeys) -> None:
        """Wake the idle workers of the pair's model (a hint: losing one costs at most the
        workers' longest wait)."""
        self.r.xadd(K.notify(pair.model), {"pair": pair.pair}, maxlen=self.NOTIFY_MAXLEN,
                    approximate=True)

    def wait_for_work(self, models: Sequence[str], timeout_ms: int, last: dict) -> list[str]:
        """Block until a notification for ``models`` (or ``timeout_ms``); returns the pairs
        named. ``last`` holds the last id seen per stream and is updated (the first call
        starts from the newest entry, so nothing older wakes it)."""
        streams = {K.notify(m): None for m in models}
        for s in streams:
            if s not in last:
                newest = self.r.xrevrange(s, count=1)
                last[s] = newest[0][0] if newest else "0-0"
        got = self.r.xread({s: last[s] for s in streams}, block=timeout_ms, count=100)
        pairs = []
        for stream, entries in got or []:
            stream = stream.decode() if isinstance(stream, bytes) else stream
            for entry_id, fields in entries:
                last[stream] = entry_id
                pairs.append(fields[b"pair"].decode())
        return pairs

    def status(self, job_id: str) -> dict:
        ref = self.r.get(K.jobref(job_id))
        if ref is None:
            raise NotFound("job_not_found", f"no job {job_id!r}", job_id=job_id)
        pair = K.PairKeys(*K.split_pair(ref.decode()))
        raw = self.r.hgetall(pair.job(job_id))
        if not raw:
            raise NotFound("job_not_found", f"no job {job_id!r}", job_id=job_id)
        job = {k.decode(): v.decode() for k, v in raw.items()}
        return {
            "job_id": job_id,
            "status": job["status"],
            "collection": job["collection"],
            "model": job["model"],
            "texts": int(job["texts"]),
            "tokens": int(job.get("tokens", 0)),
            "progress": float(job.get("progress", 0.0)),
            "error": job.get("error") or None,
            "attempts": int(job.get("attempts", 0)),
            "worker": job.get("worker") or None,
            "created_at": float(job["created_at"]),
            "started_at": float(job["started_at"]) if job.get("started_at") else None,
            "finished_at": float(job["finished_at"]) if job.get("finished_at") else None,
        }
