"""Adoption: a delivered job already sealed into a checkpoint (its owner stopped, or gave
it up) is completed here, by recomputing the checkpoint's jobs, or dead-lettered."""

from __future__ import annotations

import json
import logging
import math
from typing import Optional

import redis

from embgeom.compute.models import ModelPool
from embgeom.settings import Settings
from embgeom.stats import WindowMoments
from embgeom.store.checkpoints import Held
from embgeom.store.jobs import Delivery
from embgeom.worker.checkpointing import Checkpointing
from embgeom.worker.pairs import Pairs
from embgeom.worker.returns import Returns
from embgeom.worker.stores import Stores
from embgeom.worker.windows import WindowPolicy

log = logging.getLogger(__name__)


class Adoption:
    """Takes sealed checkpoints over, or ends them (dead letter, or a duplicate delivery
    left to its live owner)."""

    def __init__(self, worker_id: str, settings: Settings, stores: Stores, pool: ModelPool,
                 pairs: Pairs, windows: WindowPolicy, returns: Returns,
                 checkpointing: Checkpointing):
        self.worker_id = worker_id
        self.settings = settings
        self.stores = stores
        self.pool = pool
        self.pairs = pairs
        self.windows = windows
        self.returns = returns
        self.checkpointing = checkpointing

    def adopt(self, d: Delivery) -> str:
        """A delivered job already sealed into a checkpoint: take the checkpoint over,
        recompute its jobs, apply what is missing, complete it. A checkpoint whose tries
        are spent is dead-lettered instead."""
        try:
            record = self.stores.checkpointer.adopt(d.pair, d.checkpoint,
                                                    self.settings.checkpoint_apply_attempts)
            if record is None or record["status"] == "exhausted":
                return self._not_adopted(d, record)
        except redis.RedisError as exc:
            # Refused (out of memory...) or Redis is gone: not ours; its lease runs out
            # and it is delivered again.
            self.returns.release(d)
            if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
                raise
            log.error("worker %s could not adopt checkpoint %s: %s", self.worker_id, d.checkpoint, exc)
            return "deferred"
        log.info("adopting checkpoint %s of %s (%d jobs)", d.checkpoint, d.pair.pair, len(record["jobs"]))
        try:
            self.stores.queue.claim(record["stream"], self.worker_id, record["entries"])
            conf = self.pairs.conf(d.pair, record["gen"])
            moments, held = self._recompute(d, record, conf)
        except (redis.ConnectionError, redis.TimeoutError):
            self.returns.release(d)  # the lease runs out; the next delivery adopts it again
            raise
        except Exception as exc:
            # It cannot even be recomputed here (a missing payload, a model that fails):
            # this try counts; the next delivery adopts it again, or dead-letters it.
            self.returns.release(d)
            return self.checkpointing.give_up(
                d.pair, self.stores.collections.conf(d.pair, record["gen"]), d.checkpoint, exc)
        self.pool.release_evicted()
        return self.checkpointing.apply_sealed(d.pair, conf, d.checkpoint, moments, held,
                                               record["stream"], record["piece_tokens"], [d])

    def _recompute(self, d: Delivery, record: dict, conf) -> tuple[WindowMoments, list[Held]]:
        """The checkpoint's moments, from its jobs' payloads run again in one window."""
        engine = self.pairs.engine(conf, d.pair.model)
        acc = self.windows.accumulator(conf, engine)
        payloads = [self.stores.r.get(d.pair.payload(j)) for j in record["jobs"]]
        held, names = [], {}
        for job_id, entry, epoch, payload in zip(record["jobs"], record["entries"],
                                                 record["epochs"], payloads):
            job = engine.prepare(json.loads(payload))
            for batch in job.batches:
                acc.add(*engine.run(batch, acc))
            held.append(Held(job_id, entry, epoch, job.counted))
            names.update(job.names)
        tokens, layers = acc.export()
        # The engine and the window's device memory go with this frame: not held while
        # the checkpoint is applied.
        return WindowMoments(tokens, layers, {h.job_id: h.tokens for h in held}, names), held

    def sealed_delivery_limit(self) -> int:
        """Deliveries of a sealed job after which its checkpoint is dead-lettered even
        though no try failed (a safety net: an owner holds its lease at most
        checkpoint_apply_seconds + one lease per try, and each held lease costs at most
        one more delivery per lease)."""
        s = self.settings
        per_try = math.ceil((s.checkpoint_apply_seconds + s.lease_seconds) / s.lease_seconds) + 1
        return s.max_attempts + s.checkpoint_apply_attempts * per_try

    def _not_adopted(self, d: Delivery, record: Optional[dict]) -> str:
        """A sealed job's delivery that does not adopt: the checkpoint completed (ack),
        its owner is alive (it will ack), or it is to be dead-lettered: its tries are
        spent, or its jobs came back too often (:meth:`sealed_delivery_limit`)."""
        queue = self.stores.queue
        status = queue.status(d.job_id)["status"]
        dead = record is not None or (status not in ("done", "failed")
                                      and d.attempts > self.sealed_delivery_limit())
        if dead:
            conf = self.stores.collections.conf(d.pair, record["gen"] if record else d.gen)
            error = (self.stores.r.hget(d.pair.checkpoint(d.checkpoint), "error") or b"").decode()
            why = (f"its jobs were delivered {d.attempts} times without it completing"
                   if record is None else (error or "its workers stopped while applying it"))
            self.stores.checkpointer.dead_letter(d.pair, conf, d.checkpoint, why)
            status = queue.status(d.job_id)["status"]
        if status in ("done", "failed"):
            queue.ack(d.stream, d.entry_id)
        self.returns.release(d)
        return "dead" if dead else "duplicate"
