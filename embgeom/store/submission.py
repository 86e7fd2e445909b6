"""The submitting side of the job queue (the API): enqueue a job once per idempotency key,
refuse work past the pending bound. The protocol is told in :mod:`embgeom.store.jobs`."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from typing import Optional, Sequence

import redis

from embgeom.errors import InvalidInput, Overloaded
from embgeom.store import keys as K
from embgeom.store.jobs import JobRequest, JobStreams
from embgeom.store.scripts import CLAIM_KEY

__all__ = ["JobSubmitter", "request_fingerprint"]


def request_fingerprint(request: JobRequest) -> str:
    """What an idempotency key must keep naming: the same pair, texts and options."""
    h = hashlib.sha256()
    h.update(json.dumps([request.collection, request.model]).encode())
    for text in request.texts:
        h.update(hashlib.sha256(text.encode()).digest())
    return h.hexdigest()


class JobSubmitter(JobStreams):
    """Enqueues jobs: each in one MULTI on its pair's slot, at most once per idempotency key."""

    def __init__(self, client: redis.Redis, max_pending: int = 10000,
                 idempotency_ttl: int = 7 * 24 * 3600):
        super().__init__(client)
        self.max_pending = max_pending
        self.idempotency_ttl = idempotency_ttl

    def pending(self, models: Sequence[str]) -> int:
        """Jobs queued or running (their stream entries are deleted when they end)."""
        streams = self.streams(models)
        if not streams:
            return 0
        # Not a transaction: on a cluster the streams are in many slots (the pipeline
        # sends each command to its node).
        with self.r.pipeline(transaction=False) as p:
            for stream in streams:
                p.xlen(stream)
            return sum(p.execute())

    def submit(self, request: JobRequest, models: Sequence[str],
               idempotency_key: Optional[str] = None) -> tuple[str, bool]:
        """Enqueue a job; returns ``(job_id, created)``.

        The job hash, its payload, its idempotency record and its stream entry are
        written in one MULTI on the pair's slot, so an acknowledged job is never
        half-enqueued. With an idempotency key, the same key returns the first job and
        enqueues nothing; the same key with another request is refused.
        """
        fingerprint = request_fingerprint(request)
        pair = K.PairKeys(request.collection, request.model)
        if idempotency_key is not None:
            self._claim_key(pair, idempotency_key, fingerprint)
            replay = self._replay(pair, idempotency_key, fingerprint)
            if replay is not None:
                return replay, False
        if self.pending(models) >= self.max_pending:
            raise Overloaded(f"{self.max_pending} jobs are pending; retry later",
                             max_pending=self.max_pending)
        job_id = uuid.uuid4().hex
        stream = pair.jobs
        self.ensure_group(stream)
        payload = json.dumps(list(request.texts), ensure_ascii=False)
        idem = pair.idem(idempotency_key) if idempotency_key is not None else None
        # Directory entries first, each an idempotent command in its own slot: once the
        # MULTI below has run, the job can be found (status by id, its stream by the
        # workers, its pair in the listing). If the MULTI never runs they are orphans,
        # which is harmless (see embgeom.store.keys).
        with self.r.pipeline(transaction=False) as p:
            p.set(K.jobref(job_id), pair.pair)
            p.sadd(K.streams(request.model), pair.pair)
            p.sadd(K.PAIRS, pair.pair)
            p.execute()
        # The key, the job hash, its payload and its stream entry are written in one
        # MULTI, under WATCH of the key: of two racing requests with one key, exactly one
        # EXEC succeeds and the other finds its job on the retry. (Claiming the key with
        # SET NX before the MULTI let a racer see the key before its job existed, take
        # it for a dead key, and enqueue a second job.) WATCH of the generation keeps a
        # DELETE from slipping between reading it and enqueuing. Every key is in the
        # pair's slot.
        with self.r.pipeline(transaction=True) as p:
            while True:
                try:
                    p.watch(pair.gen, *([idem] if idem else []))
                    if idem is not None:
                        # A key left by a job of a deleted collection generation is free again.
                        replay = self._replay(pair, idempotency_key, fingerprint)
                        if replay is not None:
                            p.unwatch()
                            self.r.delete(K.jobref(job_id))  # our orphan; best effort
                            return replay, False
                    gen = int(p.get(pair.gen) or b"0")
                    p.multi()
                    if idem is not None:
                        p.set(idem, job_id, ex=self.idempotency_ttl)
                    p.hset(pair.job(job_id), mapping={
                        "job_id": job_id, "collection": request.collection, "model": request.model,
                        "status": "queued", "texts": len(request.texts), "tokens": 0, "progress": 0.0,
                        "bytes": len(payload.encode()), "error": "", "attempts": 0, "epoch": 0,
                        "worker": "", "gen": gen, "checkpoint": "",
                        "created_at": repr(time.time()), "idempotency_key": idempotency_key or "",
                        "fingerprint": fingerprint,
                    })
                    p.set(pair.payload(job_id), payload)
                    p.xadd(stream, {"job_id": job_id, "pair": pair.pair})
                    p.execute()
                    break
                except redis.WatchError:
                    continue
        # Again after: a DELETE of the collection whose SREM ran between our first SADD
        # and our MULTI (our job is in the new generation) must not leave it unlisted, nor
        # a worker's rescan that found the stream still empty (see ``WorkerQueue._rescan``).
        with self.r.pipeline(transaction=False) as p:
            p.sadd(K.PAIRS, pair.pair)
            p.sadd(K.streams(request.model), pair.pair)
            p.execute()
        self.notify(pair)
        return job_id, True

    def _claim_key(self, pair: K.PairKeys, idempotency_key: str, fingerprint: str) -> None:
        """Record which pair an Idempotency-Key belongs to; refuse its reuse for another.

        The job id is kept per pair (``eg:{c:m}:idem:<key>``, in the submission's MULTI);
        this global pointer, claimed atomically (:data:`~embgeom.store.scripts.CLAIM_KEY`),
        refuses the key for another collection or model while the first pair's claim
        stands: a claim whose job does not exist yet (a submission in flight) stands, and
        only a job of a since-deleted generation gives the key up (a compare-and-set, so
        two racing takeovers cannot both win).
        """
        owner_key = K.idempotency(idempotency_key)
        owner = CLAIM_KEY(self.r, [owner_key], [pair.pair, self.idempotency_ttl, ""])
        owner = owner.decode() if isinstance(owner, bytes) else owner
        if owner == pair.pair:
            return
        other = K.PairKeys(*K.split_pair(owner))
        refused = InvalidInput("this Idempotency-Key was used for a different request",
                               type="idempotency_key_reused")
        # Raises idempotency_key_reused while the other pair's job counts (the
        # fingerprints differ: they include the pair); None when it does not.
        if self.r.get(other.idem(idempotency_key)) is None:
            raise refused  # claimed by a submission still in flight (or one that failed)
        if self._replay(other, idempotency_key, fingerprint) is not None:
            raise refused
        taken = CLAIM_KEY(self.r, [owner_key], [pair.pair, self.idempotency_ttl, owner])
        if (taken.decode() if isinstance(taken, bytes) else taken) != pair.pair:
            raise refused

    def _replay(self, pair: K.PairKeys, idempotency_key: str, fingerprint: str) -> Optional[str]:
        """The job an idempotency key already names in this pair, if it still counts.

        The same key with a different request is refused; a key whose job belonged to a
        since-deleted generation of its collection no longer counts (None).
        """
        existing = self.r.get(pair.idem(idempotency_key))
        if existing is None:
            return None
        job_id = existing.decode()
        job_gen, job_fingerprint = self.r.hmget(pair.job(job_id), ["gen", "fingerprint"])
        if job_fingerprint is None:
            return None
        if job_fingerprint.decode() != fingerprint:
            raise InvalidInput("this Idempotency-Key was used for a different request",
                               type="idempotency_key_reused", job_id=job_id)
        if int(job_gen or b"0") != int(self.r.get(pair.gen) or b"0"):
            return None
        return job_id
