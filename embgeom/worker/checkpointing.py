"""Checkpointing a window: sealed into one checkpoint, then applied (here, or by the
applier thread while the device fills the next window), its jobs acknowledged."""

from __future__ import annotations

import logging
import queue as queue_mod
import threading
import time

import redis

from embgeom import heap
from embgeom.compute.models import ModelPool
from embgeom.errors import EmbgeomError, StoreUnavailable
from embgeom.settings import Settings
from embgeom.stats import WindowMoments
from embgeom.store import keys as K
from embgeom.store.checkpoints import new_checkpoint_id
from embgeom.store.shards import piece_tokens_for
from embgeom.worker.clock import StageClock
from embgeom.worker.holdings import Holdings
from embgeom.worker.returns import Returns
from embgeom.worker.stores import Stores
from embgeom.worker.windows import Window

log = logging.getLogger(__name__)


class Checkpointing:
    """Seals closed windows and drives sealed checkpoints to completion, one at a time;
    counts the checkpoints and jobs it completed."""

    # Errors after which the same checkpoint is tried again on this worker (with backoff,
    # up to checkpoint_apply_seconds): the store may come back. Anything else (a
    # CheckpointRefused, a CheckTooOld, a bug) gives it up at once: a retry meets it again.
    TRANSIENT = (redis.ConnectionError, redis.TimeoutError, StoreUnavailable)

    def __init__(self, worker_id: str, settings: Settings, stores: Stores, pool: ModelPool,
                 holdings: Holdings, returns: Returns, clock: StageClock):
        self.worker_id = worker_id
        self.settings = settings
        self.stores = stores
        self.pool = pool
        self.holdings = holdings
        self.returns = returns
        self.clock = clock
        self.jobs_done = 0
        self.checkpoints = 0
        self.last_apply_seconds = 0.0
        self._applying: queue_mod.Queue = queue_mod.Queue(maxsize=1)
        self.idle = threading.Event()  # set while the applier has nothing in hand
        self.idle.set()

    def seal(self, w: Window, background: bool) -> str:
        """Seal the closed window ``w``'s jobs into one checkpoint, apply it, complete it,
        ack them. With ``background``, the applier thread applies it (returns "sealed");
        a second one waits for the first."""
        with self.clock.timed("export"):
            tokens, layers = w.acc.export()
        # The window's device memory and its engine go now, before the checkpoint is
        # written: an evicted model it ran on can be released.
        w.acc = w.engine = None
        self.pool.release_evicted()
        moments = WindowMoments(tokens, layers, {h.job_id: h.tokens for h in w.held}, w.names)
        cp = new_checkpoint_id()
        piece_tokens = piece_tokens_for(w.conf, self.settings.piece_bytes)
        try:
            with self.clock.timed("seal"):
                sealed = self.stores.checkpointer.seal(w.pair, w.conf.gen, cp, w.held, w.stream,
                                                       piece_tokens)
        except (redis.ConnectionError, redis.TimeoutError, StoreUnavailable):
            # Sealed or not, the jobs stay pending under this worker id: no longer held
            # (nor refreshed), they come back by the recovery of its own entries or, after
            # their lease, by a rescan; a sealed checkpoint is then adopted.
            for d in w.deliveries:
                self.returns.release(d)
            raise
        if sealed.status == "void":
            for d in w.deliveries:
                self.stores.queue.fail(d.pair, d.job_id, d.stream, d.entry_id,
                                       "the collection was deleted while the job was running",
                                       epoch=d.epoch)
                self.returns.release(d)
            return "void"
        if sealed.status in ("lost", "duplicate"):
            # Another delivery owns (or has counted) that job: this window cannot be
            # committed as it is; its other jobs go back to the queue, uncounted.
            log.warning("job %s was %s before this window's checkpoint; its other jobs go back "
                        "to the queue", sealed.lost,
                        "counted by another delivery" if sealed.status == "duplicate" else "taken over")
            for d in w.deliveries:
                if d.job_id == sealed.lost or self.holdings.is_lost(d.job_id):
                    self.returns.release(d)
                else:
                    self.returns.hand_back(d)
            return sealed.status
        args = (w.pair, w.conf, cp, moments, w.held, w.stream, piece_tokens, w.deliveries)
        if not background:
            self.idle.wait()
            return self.apply_sealed(*args)
        with self.clock.timed("wait_applier"):
            self.idle.wait()
        self.idle.clear()
        self._applying.put(args)
        return "sealed"

    def applier_loop(self) -> None:
        """The applier thread: applies sealed checkpoints handed over by the main thread,
        one at a time, until :meth:`stop_applier`."""
        while True:
            args = self._applying.get()
            if args is None:
                return
            try:
                self.apply_sealed(*args)
            except Exception:
                # apply_sealed gives a checkpoint up itself; this is a failure of the
                # bookkeeping after it (the ack): its jobs' entries come back, find their
                # jobs done, and are acknowledged then.
                log.exception("worker %s: checkpoint %s could not be acknowledged", self.worker_id, args[2])
            finally:
                # The sealed window's moments go with ``args``: hand their pages back now
                # rather than at the next periodic trim (a worker at rest holds its models
                # and caches, not its last window).
                args = None
                heap.trim()
                self.idle.set()

    def stop_applier(self) -> None:
        """The applier thread ends after what it was handed."""
        self._applying.put(None)

    def apply_sealed(self, pair, conf, cp, moments, held, stream, piece_tokens, deliveries) -> str:
        """Drive a sealed checkpoint to completion (it can no longer be handed back), or
        give it up with a reason (returns "abandoned" or "dead"): transient errors are
        retried with backoff for ``checkpoint_apply_seconds``, others not at all."""
        s = self.settings
        checkpointer = self.stores.checkpointer
        deadline = time.monotonic() + s.checkpoint_apply_seconds
        # The heartbeat renews the lease until a little after the deadline, never
        # longer: a stuck applier must not keep the checkpoint from an adopter.
        self.holdings.applying(cp, pair, deadline + s.lease_seconds)
        try:
            delay, retries = 0.2, 0
            while True:
                try:
                    out = checkpointer.apply_and_complete(pair, conf, cp, moments, held, piece_tokens)
                    break
                except self.TRANSIENT as exc:
                    if time.monotonic() + delay >= deadline:
                        return self.give_up(pair, conf, cp, exc, retries)
                    log.warning("checkpoint %s interrupted (%s); resuming", cp, exc)
                    retries += 1
                    time.sleep(delay)
                    delay = min(5.0, delay * 2)
                except Exception as exc:
                    return self.give_up(pair, conf, cp, exc, retries)
            if retries:
                checkpointer.count(retries=retries)
            self._record(out)
            with self.clock.timed("ack"):
                self.stores.queue.ack_many(stream, [h.entry_id for h in held])
                self.stores.queue.retire_refs([h.job_id for h in held])
            if out.status == "completed":
                self.checkpoints += 1
                self.jobs_done += len(held)
                # After the completion, in the directory's own slot: undoes a concurrent
                # DELETE's SREM that would otherwise hide these new data.
                self.stores.r.sadd(K.PAIRS, pair.pair)
            if self.checkpoints % 16 == 1:
                checkpointer.prune(pair, conf)
            return out.status
        finally:
            self.holdings.applied(cp)
            for d in deliveries:
                self.returns.release(d)

    def _record(self, out) -> None:
        """An applied checkpoint's seconds per stage, shard rounds and bytes, on the clock."""
        self.last_apply_seconds = sum(out.seconds.values())
        for stage, seconds in out.seconds.items():
            self.clock.add(stage, seconds)
        for stage, seconds in out.shards.seconds.items():
            self.clock.add(f"shards.{stage}", seconds)
        self.clock.add("shards.busy", 0, out.shards.busy)
        self.clock.add("shards.lost", 0, out.shards.lost)
        self.clock.add("bytes_written", 0, out.shards.bytes_written + out.layer_bytes)

    def give_up(self, pair, conf, cp, exc: BaseException, retries: int = 0) -> str:
        """Stop working on a sealed checkpoint: no more lease renewals; its failure (and
        lease) recorded so the next delivery of a job adopts it, or, its tries spent, it
        is dead-lettered. Its jobs are released (not refreshed): they come back after
        their lease. Returns "abandoned" or "dead"."""
        self.holdings.applied(cp)
        reason = exc.message if isinstance(exc, EmbgeomError) else f"{type(exc).__name__}: {exc}"
        log.error("worker %s gives checkpoint %s of %s up after %d retries: %s", self.worker_id, cp,
                  pair.pair, retries, reason, exc_info=not isinstance(exc, (EmbgeomError, redis.RedisError)))
        checkpointer = self.stores.checkpointer
        try:
            if retries:
                checkpointer.count(retries=retries)
            status = checkpointer.give_up(pair, conf, cp, reason, self.settings.checkpoint_apply_attempts)
        except redis.RedisError as again:
            # Not even that could be written: the lease runs out by itself (no renewal).
            log.warning("could not record giving checkpoint %s up (%s)", cp, again)
            return "abandoned"
        return "dead" if status == "dead" else "abandoned"
