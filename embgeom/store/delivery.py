"""The delivering side of the job queue (the workers): take a job, hold it under a lease,
hand it back, acknowledge it, or dead-letter it. The protocol is told in
:mod:`embgeom.store.jobs`."""

from __future__ import annotations

import json
import time
from typing import Optional, Sequence

import redis

from embgeom.store import keys as K
from embgeom.store.jobs import TERMINAL, Delivery, JobStreams
from embgeom.store.scripts import PROGRESS, REFRESH

__all__ = ["WorkerQueue"]


class WorkerQueue(JobStreams):
    """The queue as a worker sees it: deliveries fenced by epochs, retries, dead letters."""

    def __init__(self, client: redis.Redis, max_attempts: int = 3,
                 retention_seconds: int = 7 * 24 * 3600):
        super().__init__(client)
        self.max_attempts = max_attempts
        self.retention_seconds = retention_seconds
        self._claim_cursor: dict[str, bytes | str] = {}
        self._turn = 0  # round-robin start among the streams polled by take()
        self._hot: set[str] = set()  # streams named by notifications, not yet found empty
        self._next_rescan = 0.0

    def prune_consumers(self, models: Sequence[str], idle_seconds: float = 3600.0) -> int:
        """Remove consumers (dead workers) that hold nothing and were idle this long.

        Each worker process joins the group under a new name; without this the group's
        consumer list would only grow. Returns how many were removed.
        """
        removed = 0
        for stream in self.streams(models):
            self.ensure_group(stream)
            for consumer in self.r.xinfo_consumers(stream, K.GROUP):
                if consumer["pending"] == 0 and consumer["idle"] >= idle_seconds * 1000:
                    self.r.xgroup_delconsumer(stream, K.GROUP, consumer["name"])
                    removed += 1
        return removed

    def take(self, worker_id: str, models: Sequence[str], lease_seconds: float,
             block_ms: int = 1000, only: Optional[str] = None) -> Optional[Delivery]:
        """Next job for this worker: a silent worker's expired job first, then a new one.

        Which streams it polls, one at a time (a read of several streams would be
        cross-slot on a cluster):

        - ``only``: that one stream (a worker filling the window of one pair);
        - otherwise the streams named by recent notifications (:meth:`note`), so an idle
          poll costs the same however many pairs were ever created;
        - and, every half lease, every stream in the directory (a *rescan*): it reclaims
          the entries of silent workers (XAUTOCLAIM), catches a lost notification, and
          retires from the directory the streams left empty.

        Streams are taken one further along at each call so that no pair starves the
        others. With nothing anywhere, waits up to ``block_ms`` (at most 250 ms) and
        returns None.
        """
        if only is not None:
            streams, rescan = [only], True
        else:
            now = time.monotonic()
            rescan = now >= self._next_rescan
            if rescan:
                self._next_rescan = now + max(0.5, lease_seconds / 2)
                streams = self._rescan(models)
                # Streams with entries stay polled until found empty, as if notified: a
                # backlog queued before this worker listened is not left to the next rescan.
                self._hot.update(streams)
            else:
                streams = sorted(self._hot)
        if streams and only is None:
            self._turn = (self._turn + 1) % len(streams)
            streams = streams[self._turn:] + streams[:self._turn]
        for stream in streams:
            self.ensure_group(stream)
        for stream in streams if rescan else ():
            # Resume the scan where the last one stopped: one XAUTOCLAIM call looks at a
            # bounded number of pending entries, and an expired entry further down must
            # still be found when many workers hold fresh ones.
            next_id, claimed, *_ = self.r.xautoclaim(
                stream, K.GROUP, worker_id, min_idle_time=int(lease_seconds * 1000),
                start_id=self._claim_cursor.get(stream, "0-0"), count=1,
            )
            self._claim_cursor[stream] = next_id
            if claimed:
                entry_id, fields = claimed[0]
                if fields:  # an entry deleted meanwhile comes back empty
                    return self._deliver(worker_id, stream, entry_id, fields)
                self.r.xack(stream, K.GROUP, entry_id)
        for stream in streams:
            got = self.r.xreadgroup(K.GROUP, worker_id, {stream: ">"}, count=1)
            for _, entries in got or []:
                for entry_id, fields in entries:
                    return self._deliver(worker_id, stream, entry_id, fields)
            self._hot.discard(stream)  # drained: until the next notification
        if block_ms > 0:
            time.sleep(min(block_ms, 250) / 1000)
        return None

    def note(self, pairs: Sequence[str]) -> None:
        """Pairs a notification named: their streams are polled until found empty."""
        for p in pairs:
            self._hot.add(K.PairKeys(*K.split_pair(p)).jobs)

    def _rescan(self, models: Sequence[str]) -> list[str]:
        """Every stream of the directory; the empty ones leave it (XLEN 0: nothing queued,
        nothing pending).

        Neither step is atomic with a submission (the stream and the directory are in
        different slots), so a removed stream's length is read again after its SREM and
        it is put back if an entry came meanwhile; a submission lists its pair again after
        its entry is written. Either the re-read sees the entry or the submission's second
        SADD comes after the SREM: a stream holding a job never stays unlisted."""
        def lengths_of(flat):
            with self.r.pipeline(transaction=False) as p:
                for _, raw in flat:
                    p.xlen(K.PairKeys(*K.split_pair(raw.decode())).jobs)
                return p.execute() if flat else []

        def in_pipeline(command, flat):
            with self.r.pipeline(transaction=False) as p:
                for m, raw in flat:
                    getattr(p, command)(K.streams(m), raw)
                p.execute()

        flat = [(m, raw) for m in models for raw in self.r.smembers(K.streams(m))]
        lengths = lengths_of(flat)
        queued = [item for item, n in zip(flat, lengths) if n]
        empty = [item for item, n in zip(flat, lengths) if n == 0]
        if empty:
            in_pipeline("srem", empty)
            refilled = [item for item, n in zip(empty, lengths_of(empty)) if n]
            if refilled:
                in_pipeline("sadd", refilled)
                queued += refilled
        return sorted({K.PairKeys(*K.split_pair(raw.decode())).jobs for _, raw in queued})

    def own_pending(self, worker_id: str, models: Sequence[str]) -> Optional[Delivery]:
        """A job this worker id was given before and has not finished (after a reconnect)."""
        for stream in self.streams(models):
            self.ensure_group(stream)
            got = self.r.xreadgroup(K.GROUP, worker_id, {stream: "0"}, count=1)
            for _, entries in got or []:
                for entry_id, fields in entries:
                    if fields:
                        return self._deliver(worker_id, stream, entry_id, fields)
                    self.r.xack(stream, K.GROUP, entry_id)
        return None

    def _deliver(self, worker_id: str, stream: str, entry_id: bytes, fields: dict) -> Optional[Delivery]:
        job_id = fields[b"job_id"].decode()
        pair = K.PairKeys(*K.split_pair(fields[b"pair"].decode()))
        job_key = pair.job(job_id)
        with self.r.pipeline(transaction=True) as p:
            p.hincrby(job_key, "epoch", 1)
            p.hincrby(job_key, "attempts", 1)
            p.hmget(job_key, "status", "error", "gen", "checkpoint")
            p.get(pair.payload(job_id))
            p.get(pair.gen)
            epoch, attempts, (status, error, job_gen, checkpoint), payload, gen = p.execute()
        status = (status or b"").decode()
        if status in TERMINAL or payload is None:
            # Finished before (its ack was lost in a crash), or so long ago that its
            # records are gone (past the retention horizon): acknowledge, count nothing.
            if not status:
                self.r.delete(job_key)  # only the counters HINCRBY just recreated
            self.ack(stream, entry_id)
            return None
        if int(job_gen or 0) != int(gen or 0):
            # Its collection was deleted after it was queued: void, without running it.
            self.fail(pair, job_id, stream, entry_id,
                      "the collection was deleted while the job was queued")
            return None
        checkpoint = (checkpoint or b"").decode() or None
        # A job sealed into a checkpoint is not failed alone (its checkpoint holds other
        # jobs, maybe partly applied): the checkpoint's tries bound it, and the worker
        # dead-letters it whole (Worker.adopt, Checkpointer.dead_letter).
        if checkpoint is None and attempts > self.max_attempts:
            last = (error or b"").decode() or "the worker stopped while running it"
            self.fail(pair, job_id, stream, entry_id,
                      f"gave up after {attempts - 1} attempts; last error: {last}")
            return None
        with self.r.pipeline(transaction=False) as p:
            p.hset(job_key, mapping={"status": "running", "worker": worker_id,
                                     "started_at": repr(time.time())})
            p.sadd(K.streams(pair.model), pair.pair)  # back in the directory while it runs
            p.execute()
        entry = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        return Delivery(job_id, entry, stream, pair, int(epoch), int(attempts),
                        json.loads(payload), int(gen or 0), checkpoint)

    def claim(self, stream: str, worker_id: str, entry_ids: Sequence) -> None:
        """Make this worker the owner of these entries (an adopted checkpoint's jobs)."""
        if entry_ids:
            self.r.xclaim(stream, K.GROUP, worker_id, min_idle_time=0,
                          message_ids=list(entry_ids), justid=True)

    def refresh(self, delivery: Delivery, worker_id: str) -> bool:
        """Reset the entry's idle time so no other worker takes it over (heartbeat).

        Returns False, and claims nothing, once a newer delivery owns the job: XCLAIM with
        ``min_idle_time=0`` would otherwise pull the entry back from the worker that took
        it over. The check and the claim are one script on the pair's slot.
        """
        return self.refresh_many([delivery], worker_id)[0]

    def refresh_many(self, deliveries: Sequence[Delivery], worker_id: str) -> list[bool]:
        """:meth:`refresh` of every job a worker holds, in one round trip."""
        if not deliveries:
            return []
        with self.r.pipeline(transaction=False) as p:
            for d in deliveries:
                REFRESH.queue(p, [d.pair.job(d.job_id), d.stream],
                              [str(d.epoch), K.GROUP, worker_id, d.entry_id])
            return [bool(x) for x in p.execute()]

    def progress(self, delivery: Delivery, fraction: float, tokens: int) -> bool:
        """Written only by the delivery that owns the job, and only while it runs."""
        return bool(PROGRESS(self.r, [delivery.pair.job(delivery.job_id)],
                             [str(delivery.epoch), repr(round(fraction, 4)), int(tokens)]))

    def ack(self, stream: str, entry_id: bytes) -> None:
        self.ack_many(stream, [entry_id])

    def retire_refs(self, job_ids: Sequence[str]) -> None:
        """Ended jobs' directory entries live as long as their records (retention)."""
        if job_ids:
            with self.r.pipeline(transaction=False) as p:
                for job_id in job_ids:
                    p.expire(K.jobref(job_id), self.retention_seconds)
                p.execute()

    def ack_many(self, stream: str, entry_ids: Sequence) -> None:
        """Acknowledge and delete entries of one stream (a checkpoint's jobs)."""
        if not entry_ids:
            return
        with self.r.pipeline(transaction=True) as p:
            p.xack(stream, K.GROUP, *entry_ids)
            p.xdel(stream, *entry_ids)
            p.execute()

    def _as_owner(self, job_key: str, epoch: Optional[int], write) -> bool:
        """Run ``write(pipe)`` in one MULTI, only while ``epoch`` still owns the job.

        A superseded delivery (another worker took the job over) must neither requeue nor
        dead-letter it. ``epoch=None`` skips the check (used at delivery time).
        """
        with self.r.pipeline(transaction=True) as p:
            while True:
                try:
                    p.watch(job_key)
                    if epoch is not None and int(p.hget(job_key, "epoch") or b"0") != epoch:
                        p.unwatch()
                        return False
                    p.multi()
                    write(p)
                    p.execute()
                    return True
                except redis.WatchError:
                    continue

    def retry_later(self, delivery: Delivery, error: str, attempt_counts: bool = True) -> bool:
        """A failed attempt: record the error and put the job back at the end of the queue.

        With ``attempt_counts=False`` (a hand-back) the attempt is not counted. Returns
        False when the delivery no longer owns the job (nothing is changed then).
        """
        def write(p):
            p.hset(delivery.pair.job(delivery.job_id), mapping={"status": "queued", "error": error})
            if not attempt_counts:
                p.hincrby(delivery.pair.job(delivery.job_id), "attempts", -1)
            p.xack(delivery.stream, K.GROUP, delivery.entry_id)
            p.xdel(delivery.stream, delivery.entry_id)
            p.xadd(delivery.stream, {"job_id": delivery.job_id, "pair": delivery.pair.pair})
        owned = self._as_owner(delivery.pair.job(delivery.job_id), delivery.epoch, write)
        if owned:
            self.notify(delivery.pair)
        return owned

    def fail(self, pair: K.PairKeys, job_id: str, stream: str, entry_id: bytes, error: str,
             epoch: Optional[int] = None) -> bool:
        """Dead-letter a job: failed with its error, payload dropped, entry acknowledged.

        With ``epoch``, only while that delivery still owns the job."""
        def write(p):
            p.hset(pair.job(job_id), mapping={"status": "failed", "error": error,
                                              "finished_at": repr(time.time())})
            p.expire(pair.job(job_id), self.retention_seconds)
            p.delete(pair.payload(job_id))
            p.xack(stream, K.GROUP, entry_id)
            p.xdel(stream, entry_id)
        owned = self._as_owner(pair.job(job_id), epoch, write)
        if owned:
            self.retire_refs([job_id])
        return owned
