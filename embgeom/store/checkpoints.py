"""The exactly-once checkpoint: a window of jobs folded into the store, counted once.

Like a Flink or Kafka Streams commit of state with offsets, one checkpoint covers every
job of a worker's window::

    seal       control slot, atomic (Lua): every job still owned by this delivery (epoch),
               same generation -> record the checkpoint (its jobs, their stream entries,
               its piece size), tag each job with it, add it to ``inflight``
    apply      the token shards (:mod:`embgeom.store.shards`: per piece, idempotent) and
               the layer segments (:mod:`embgeom.store.layers`: per checkpoint id,
               idempotent), in parallel across slots and nodes
    complete   control slot, atomic: jobs done, payloads dropped, ``version`` + 1, the
               checkpoint leaves ``inflight`` -- once, whoever gets there first
    ack        XACK + XDEL of every job's stream entry

A sealed checkpoint is never abandoned. If its worker dies, the next delivery of any of
its jobs finds the job tagged and *adopts* the whole checkpoint (:meth:`Checkpointer.adopt`
bumps every job's epoch, fencing the old owner): the adopter recomputes the same jobs and
applies only the pieces and segments not applied yet, then completes. A delivery that
finds its job done acknowledges it and counts nothing.

Markers (which pieces a shard holds, which segments a part folded) outlive completion by
``horizon_ms`` and are then pruned (:meth:`Checkpointer.prune`); a write is refused when
its in-flight check is older than half the horizon, so a worker paused mid-checkpoint
cannot write after its markers are gone.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

import redis

from embgeom.errors import EmbgeomError, GenerationDeleted
from embgeom.stats import WindowMoments
from embgeom.store.conf import PairConf, shard_of
from embgeom.store.keys import PairKeys
from embgeom.store.layers import LayerWriter, layer_parts
from embgeom.store.scripts import ADOPT, CHECK, COMPLETE, NOW, RENEW, SEAL
from embgeom.store.shards import ApplyStats, ShardWriter

log = logging.getLogger(__name__)

__all__ = ["Held", "SealResult", "CommitResult", "CheckpointGone", "Checkpointer", "new_checkpoint_id"]


class CheckpointGone(EmbgeomError):
    """The checkpoint is no longer in flight: another worker completed it."""

    type = "checkpoint_gone"


@dataclass(frozen=True)
class Held:
    """A job a worker holds in its window: its delivery, and what it counted."""

    job_id: str
    entry_id: str
    epoch: int
    tokens: int = 0


@dataclass(frozen=True)
class SealResult:
    status: str            # "sealed" | "lost" | "duplicate" | "void"
    lost: Optional[str] = None  # the job no longer ours


@dataclass
class CommitResult:
    status: str            # "completed" | "already" | "void"
    version: int = 0
    shards: ApplyStats = field(default_factory=ApplyStats)
    layer_bytes: int = 0
    folded: int = 0
    seconds: dict = field(default_factory=dict)


def new_checkpoint_id() -> str:
    """Unique and time-ordered: milliseconds, then randomness."""
    return f"{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:16]}"


class Checkpointer:
    def __init__(self, client: redis.Redis, worker_id: str, piece_bytes: int = 2 << 20,
                 lock_ms: int = 30_000, horizon_ms: int = 3_600_000, lease_ms: int = 60_000,
                 max_segments: int = 8, retention_seconds: int = 7 * 24 * 3600):
        self.r = client
        self.retention_seconds = retention_seconds
        self.worker_id = worker_id
        self.piece_bytes = piece_bytes
        self.horizon_ms = horizon_ms
        self.lease_ms = lease_ms
        max_age = max(1, horizon_ms // 2)
        self.shards = ShardWriter(client, worker_id, lock_ms=lock_ms, max_age_ms=max_age)
        self.layers = LayerWriter(client, worker_id, max_age_ms=max_age, max_segments=max_segments)

    # ------------------------------------------------------------------ seal
    def seal(self, pair: PairKeys, gen: int, cp: str, jobs: list[Held], stream: str,
             piece_tokens: int) -> SealResult:
        record = json.dumps({"jobs": [j.job_id for j in jobs], "entries": [j.entry_id for j in jobs],
                             "tokens": [j.tokens for j in jobs], "stream": stream,
                             "piece_tokens": piece_tokens})
        keys = [pair.gen, pair.inflight, pair.checkpoint(cp)] + [pair.job(j.job_id) for j in jobs]
        status, arg = SEAL(self.r, keys, [cp, gen, record, self.worker_id, self.lease_ms,
                                          *[j.epoch for j in jobs]])
        if status == 1:
            return SealResult("sealed")
        if status == -1:
            return SealResult("void")
        return SealResult("duplicate" if status == 2 else "lost", jobs[int(arg) - 1].job_id)

    def record(self, pair: PairKeys, cp: str) -> Optional[dict]:
        raw = self.r.hgetall(pair.checkpoint(cp))
        if not raw:
            return None
        out = json.loads(raw[b"record"])
        out.update(gen=int(raw[b"gen"]), owner=raw[b"owner"].decode(), cp=cp)
        return out

    def adopt(self, pair: PairKeys, cp: str) -> Optional[dict]:
        """Take over a sealed checkpoint whose owner went silent: returns its record with
        the jobs' new epochs, or None (completed, or its owner is alive)."""
        record = self.record(pair, cp)
        if record is None:
            return None
        out = ADOPT(self.r, [pair.checkpoint(cp)] + [pair.job(j) for j in record["jobs"]],
                    [self.worker_id, self.lease_ms])
        if out[0] != 1:
            return None
        record["epochs"] = [int(e) for e in out[1:]]
        return record

    def renew(self, pair: PairKeys, cp: str) -> bool:
        return RENEW(self.r, [pair.checkpoint(cp)], [self.worker_id, self.lease_ms]) == 1

    # ---------------------------------------------------------------- commit
    def _check(self, pair: PairKeys, cp: str) -> int:
        """Still in flight? Returns Redis's time (ms) of the check."""
        live, now = CHECK(self.r, [pair.inflight], [cp])
        if not live:
            raise CheckpointGone(f"checkpoint {cp} is no longer in flight")
        return int(now)

    def apply_and_complete(self, pair: PairKeys, conf: PairConf, cp: str, window: WindowMoments,
                           jobs: list[Held], piece_tokens: int) -> CommitResult:
        """Apply a sealed checkpoint's parts and complete it (idempotent throughout)."""
        result = CommitResult("completed")
        parts = pair.parts(conf.gen)
        t0 = time.perf_counter()
        try:
            result.shards = self.shards.apply(parts, conf, cp, window.tokens, piece_tokens,
                                              lambda: self._check(pair, cp), window.names)
            t1 = time.perf_counter()
            due, result.layer_bytes = self.layers.put(parts, conf, cp, window.layers,
                                                      self._check(pair, cp))
            t2 = time.perf_counter()
        except CheckpointGone:
            return CommitResult("already")
        except GenerationDeleted:
            # The collection was deleted meanwhile: what was written went to dead parts;
            # the completion voids the jobs.
            status, _ = self.complete(pair, conf, cp, jobs, [])
            return CommitResult(status if status != "completed" else "void")
        touched = sorted(set(shard_of(window.tokens.ids, conf.shards).tolist()))
        status, version = self.complete(pair, conf, cp, jobs, touched)
        t3 = time.perf_counter()
        result.status, result.version = status, version
        if status == "completed" and due:
            result.folded = self.layers.fold(conf, due)
        result.seconds = {"shards": t1 - t0, "layers": t2 - t1, "complete": t3 - t2,
                          "fold": time.perf_counter() - t3}
        return result

    def complete(self, pair: PairKeys, conf: PairConf, cp: str, jobs: list[Held],
                 touched: list[int]) -> tuple[str, int]:
        member = json.dumps({"cp": cp, "gen": conf.gen, "shards": touched}, separators=(",", ":"))
        keys = [pair.gen, pair.inflight, pair.checkpoint(cp), pair.meta, pair.done]
        keys += [pair.job(j.job_id) for j in jobs] + [pair.payload(j.job_id) for j in jobs]
        status, version = COMPLETE(self.r, keys, [cp, member, self.retention_seconds,
                                                  *[j.tokens for j in jobs]])
        return {1: "completed", 0: "already", -1: "void"}[int(status)], int(version)

    # ----------------------------------------------------------------- prune
    def prune(self, pair: PairKeys, conf: PairConf, limit: int = 64) -> int:
        """Drop the markers of checkpoints completed more than the horizon ago."""
        now = int(NOW(self.r, [pair.done], []))
        due = self.r.zrangebyscore(pair.done, "-inf", now - self.horizon_ms, start=0, num=limit)
        if not due:
            return 0
        with self.r.pipeline(transaction=False) as p:
            for raw in due:
                m = json.loads(raw)
                parts = pair.parts(m["gen"])
                for s in m["shards"]:
                    p.hdel(parts.shard(s).applied, m["cp"])
                if m["gen"] == conf.gen:
                    for *_, keys in layer_parts(parts, conf):
                        p.hdel(keys.folded, m["cp"])
            p.execute()
        self.r.zrem(pair.done, *due)
        return len(due)
