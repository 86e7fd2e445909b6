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

If its worker dies, the next delivery of any of its jobs finds the job tagged and *adopts*
the whole checkpoint (:meth:`Checkpointer.adopt` bumps every job's epoch, fencing the old
owner): the adopter recomputes the same jobs and applies only the pieces and segments not
applied yet, then completes. A delivery that finds its job done acknowledges it and counts
nothing.

A checkpoint that cannot finish ends, with a reason. Its owner retries transient errors
(lost connection, timeouts, LOADING/BUSY replies) for a bounded time and gives up at once
on a refusal that a retry would meet again (:class:`~embgeom.errors.CheckpointRefused`:
a script error, WRONGTYPE, OOM; a :class:`~embgeom.errors.CheckTooOld`). Giving up
(:meth:`Checkpointer.give_up`) records the error and releases the lease, so another worker
adopts it; every run counts a *try* (the seal is the first), and an adoption that finds
more of it applied than the last one starts the count again: a run that was killed or lost
its lease on a slow host after applying pieces was not stuck. Once its tries are spent it
is *dead-lettered* (:meth:`Checkpointer.dead_letter`): it leaves ``inflight`` (readers'
``applying`` goes back down) for the pair's ``deadletter`` set, its jobs fail with an error
that says how much of it was applied, their entries are acknowledged. Pieces applied
before it stopped stay in the counts (they are not rolled back: an un-merge would cancel
catastrophically, see DESIGN.md); the record, the payloads and the applied markers are
kept, so :meth:`Checkpointer.retry_dead` resumes it: its jobs are queued again, adopted,
and only the missing pieces are applied (idempotent per checkpoint, as for any adopter).

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
from embgeom.store import keys as K
from embgeom.store.conf import PairConf, shard_of
from embgeom.store.keys import PairKeys
from embgeom.store.layers import LayerWriter, layer_parts
from embgeom.store.piece_writes import refusal
from embgeom.store.scripts import (ADOPT, CHECK, COMPLETE, DEAD_LETTER, GIVE_UP, NOW, RENEW,
                                   REVIVE, SEAL)
from embgeom.store.shards import ApplyStats, ShardWriter

log = logging.getLogger(__name__)

__all__ = ["Held", "SealResult", "CommitResult", "CheckpointGone", "Checkpointer", "new_checkpoint_id",
           "checkpoint_health"]


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


def checkpoint_health(client: redis.Redis) -> dict:
    """What ``/metrics`` shows of the checkpoints: the fleet-wide counters
    (``eg:stats:checkpoints``) and, per pair with data or jobs, the checkpoints in flight,
    the seal time (Redis ms) of the oldest one, and the dead-lettered ones. One pipeline."""
    counters = {k.decode(): int(v) for k, v in client.hgetall(K.CHECKPOINT_STATS).items()}
    pairs = sorted(p.decode() for p in client.smembers(K.PAIRS))
    with client.pipeline(transaction=False) as p:
        for name in pairs:
            keys = PairKeys(*K.split_pair(name))
            p.zrange(keys.inflight, 0, 0, withscores=True)
            p.zcard(keys.inflight)
            p.zcard(keys.deadletter)
        replies = p.execute() if pairs else []
    out = {}
    for i, name in enumerate(pairs):
        oldest, in_flight, dead = replies[3 * i:3 * i + 3]
        out[name] = {"in_flight": int(in_flight), "dead": int(dead),
                     "oldest_sealed_ms": int(oldest[0][1]) if oldest else None}
    return {"counters": counters, "pairs": out}


class Checkpointer:
    def __init__(self, client: redis.Redis, worker_id: str, piece_bytes: int = 1 << 20,
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

    def adopt(self, pair: PairKeys, cp: str, max_tries: int = 0) -> Optional[dict]:
        """Take over a sealed checkpoint whose owner went silent (or gave it up): returns
        its record with the jobs' new epochs (``status`` "adopted"), or None (completed,
        dead-lettered, or its owner is alive). With ``max_tries``, a checkpoint already
        tried that often *without progress* is not taken: its record comes back with
        ``status`` "exhausted", for the caller to dead-letter. Progress is what of it is
        applied (:meth:`applied`): a run that applied pieces before it was killed, or
        that was slow enough to lose its lease on a loaded host, is not a failed try (the
        soak dead-lettered a healthy checkpoint that way, its pieces counted, its jobs
        failed)."""
        record = self.record(pair, cp)
        if record is None:
            return None
        out = ADOPT(self.r, [pair.checkpoint(cp)] + [pair.job(j) for j in record["jobs"]],
                    [self.worker_id, self.lease_ms, max_tries, self.progress(pair, record)])
        if out[0] == -2:
            record.update(status="exhausted", tries=int(out[1]))
            return record
        if out[0] != 1:
            return None
        record.update(status="adopted", epochs=[int(e) for e in out[1:]])
        self.count(adopted=1)
        return record

    def progress(self, pair: PairKeys, record: dict) -> int:
        """Token pieces plus layer parts of checkpoint ``record`` applied so far; -1 when
        its generation's config is gone (a DELETE: nothing to compare)."""
        raw = self.r.get(pair.conf(record["gen"]))
        if raw is None:
            return -1
        pieces, _, heads = self.applied(pair, PairConf.from_json(raw), record["cp"])
        return pieces + heads

    def renew(self, pair: PairKeys, cp: str) -> bool:
        return RENEW(self.r, [pair.checkpoint(cp)], [self.worker_id, self.lease_ms]) == 1

    # ------------------------------------------------------- giving up, dead letters
    def give_up(self, pair: PairKeys, conf: Optional[PairConf], cp: str, error: str,
                max_tries: int) -> str:
        """The owner stops trying: records ``error``, releases the lease; dead-letters the
        checkpoint once ``max_tries`` runs have failed. Returns "abandoned" (another
        delivery adopts it), "dead", or "gone" (not ours, or no longer in flight)."""
        ok, tries = GIVE_UP(self.r, [pair.checkpoint(cp), pair.inflight],
                            [self.worker_id, cp, error])
        if int(ok) != 1:
            return "gone"
        self.count(abandoned=1)
        if int(tries) >= max_tries:
            return "dead" if self.dead_letter(pair, conf, cp, error, int(tries)) else "gone"
        return "abandoned"

    def dead_letter(self, pair: PairKeys, conf: Optional[PairConf], cp: str, error: str,
                    tries: Optional[int] = None) -> bool:
        """Take a checkpoint out of flight for good (until :meth:`retry_dead`): its jobs
        fail with ``error`` and what of it had been applied. False if it was not in flight."""
        record = self.record(pair, cp)
        if record is None:
            return False
        tries = tries if tries is not None else int(self.r.hget(pair.checkpoint(cp), "tries") or 1)
        message = f"checkpoint {cp} given up after {tries} tries: {error}. "
        try:
            pieces, shards, heads = self.applied(pair, conf, cp) if conf is not None else (0, 0, 0)
        except redis.RedisError:
            pieces = shards = heads = -1
        if pieces < 0:
            message += "What of it was applied could not be read"
        elif pieces == 0 and heads == 0:
            message += "None of it was applied: these jobs count nothing"
        else:
            message += (f"{pieces} token pieces in {shards} shards and {heads} layer parts of it "
                        "were applied before it stopped: those embeddings stay counted")
        message += ("; retrying the checkpoint completes it (only what is missing is applied), "
                    "deleting the collection discards it")
        keys = [pair.inflight, pair.checkpoint(cp), pair.deadletter, record["stream"], pair.meta]
        keys += [pair.job(j) for j in record["jobs"]]
        done = DEAD_LETTER(self.r, keys, [cp, message, K.GROUP, *record["entries"]]) == 1
        if done:
            log.error("%s: %s", pair.pair, message)
            self.count(dead_lettered=1)
        return done

    def applied(self, pair: PairKeys, conf: PairConf, cp: str) -> tuple[int, int, int]:
        """``(pieces, shards, layer parts)`` of the stores holding part of checkpoint ``cp``
        (its applied markers and segments; one pipeline, across slots). Pieces count once
        per layer group they were applied to; shards once however many groups hold them."""
        parts = pair.parts(conf.gen)
        targets = layer_parts(parts, conf)
        token_parts = parts.shard_parts(conf)
        with self.r.pipeline(transaction=False) as p:
            for *_, keys in token_parts:
                p.hget(keys.applied, cp)
            for *_, keys in targets:
                p.hexists(keys.seg, cp)
                p.hexists(keys.folded, cp)
            replies = p.execute()
        marks = replies[:len(token_parts)]
        flags = replies[len(token_parts):]
        heads = sum(bool(a or b) for a, b in zip(flags[0::2], flags[1::2]))
        pieces = sum(len(m.split(b",")) for m in marks if m)
        shards = len({s for (s, _, _), m in zip(token_parts, marks) if m})
        return pieces, shards, heads

    def retry_dead(self, pair: PairKeys, cp: str) -> str:
        """Put a dead-lettered checkpoint back in flight (after its cause was fixed): its
        jobs are queued again and their next delivery adopts and completes it. Returns
        "queued", "not_dead" or "deleted" (its collection was deleted since)."""
        record = self.record(pair, cp)
        if record is None:
            return "not_dead"
        keys = [pair.inflight, pair.checkpoint(cp), pair.deadletter, record["stream"], pair.gen]
        keys += [pair.job(j) for j in record["jobs"]]
        out = int(REVIVE(self.r, keys, [cp, pair.pair]))
        if out == 1:
            self.count(retried_dead=1)
        return {1: "queued", 0: "not_dead", -1: "deleted"}[out]

    def dead_letters(self, pair: PairKeys) -> list[dict]:
        """The pair's dead-lettered checkpoints: id, time (ms), jobs, error."""
        out = []
        for raw, at in self.r.zrange(pair.deadletter, 0, -1, withscores=True):
            cp = raw.decode()
            record = self.record(pair, cp)
            if record is not None:
                error = self.r.hget(pair.checkpoint(cp), "error")
                out.append({"cp": cp, "at_ms": int(at), "jobs": record["jobs"],
                            "error": (error or b"").decode()})
        return out

    def count(self, **fields: int) -> None:
        """Fleet-wide counters in ``eg:stats:checkpoints`` (best effort: a counter must
        not fail the step it counts)."""
        try:
            with self.r.pipeline(transaction=False) as p:
                for name, n in fields.items():
                    p.hincrby(K.CHECKPOINT_STATS, name, n)
                p.execute()
        except redis.RedisError as exc:
            log.debug("could not count %s: %s", fields, exc)

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
        except redis.ResponseError as exc:  # transient (LOADING, BUSY...) or refused for good
            raise refusal(exc) from exc
        touched = sorted(set(shard_of(window.tokens.ids, conf.shards).tolist()))
        try:
            status, version = self.complete(pair, conf, cp, jobs, touched)
        except redis.ResponseError as exc:
            raise refusal(exc, "the checkpoint's completion") from exc
        t3 = time.perf_counter()
        result.status, result.version = status, version
        if status == "completed" and due:
            try:
                result.folded = self.layers.fold(conf, due)
            except redis.ResponseError as exc:
                # Compaction only: the checkpoint is complete; a later one folds again.
                log.warning("checkpoint %s: folding layer segments was refused: %s", cp, exc)
        result.seconds = {"shards": t1 - t0, "layers": t2 - t1, "complete": t3 - t2,
                          "fold": time.perf_counter() - t3}
        return result

    def complete(self, pair: PairKeys, conf: PairConf, cp: str, jobs: list[Held],
                 touched: list[int]) -> tuple[str, int]:
        member = json.dumps({"cp": cp, "gen": conf.gen, "shards": touched,
                             "groups": len(conf.groups)}, separators=(",", ":"))
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
                    # A member written before groups: its generation has one group.
                    for g in range(m.get("groups", 1)):
                        p.hdel(parts.shard(s, g).applied, m["cp"])
                if m["gen"] == conf.gen:
                    for *_, keys in layer_parts(parts, conf):
                        p.hdel(keys.folded, m["cp"])
            p.execute()
        self.r.zrem(pair.done, *due)
        return len(due)
