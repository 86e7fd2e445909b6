"""Running prepared jobs into the open window, and closing it: checkpointed, or dropped
with its jobs handed back."""

from __future__ import annotations

import logging
from typing import Optional

import redis

from embgeom.compute.models import ModelPool
from embgeom.errors import JobFenced
from embgeom.store.checkpoints import Held
from embgeom.store.jobs import Delivery
from embgeom.worker.adoption import Adoption
from embgeom.worker.checkpointing import Checkpointing
from embgeom.worker.clock import StageClock
from embgeom.worker.feeder import Feeder, Prepared
from embgeom.worker.holdings import Holdings
from embgeom.worker.returns import Returns
from embgeom.worker.stop import StopRequest
from embgeom.worker.windows import Window, WindowPolicy

log = logging.getLogger(__name__)


class HandBack(Exception):
    """Raised inside a job when the worker must stop before finishing it."""


class WindowRunner:
    """Owns the open :attr:`window` (one pair's jobs since its last checkpoint), on the
    main thread. While it is open, the feeder takes its pair's jobs only."""

    def __init__(self, pool: ModelPool, holdings: Holdings, returns: Returns,
                 windows: WindowPolicy, checkpointing: Checkpointing, adoption: Adoption,
                 feeder: Feeder, stop: StopRequest, clock: StageClock):
        self.pool = pool
        self.holdings = holdings
        self.returns = returns
        self.windows = windows
        self.checkpointing = checkpointing
        self.adoption = adoption
        self.feeder = feeder
        self.stop = stop
        self.clock = clock
        self.window: Optional[Window] = None

    def process(self, item: Prepared) -> str:
        """Run one prepared job into the window (or adopt its checkpoint)."""
        d = item.delivery
        if d.checkpoint is not None:
            return self.adoption.adopt(d)
        if item.error is not None:
            self.returns.fail_attempt(d, item.error)
            return "failed"
        w = self.window
        if w is not None and (w.pair.pair != d.pair.pair or w.conf.gen != item.conf.gen
                              or w.conf != item.conf):
            self.checkpoint()
            w = None
        if w is None:
            w = self._open(d, item)
        self.holdings.start_job(d)
        try:
            batches = item.job.batches
            for i, batch in enumerate(batches):
                with self.clock.timed("forward_reduce"):  # the batch's sums go into the window
                    w.acc.add(*item.engine.run(batch, w.acc))
                self._on_progress((i + 1) / max(len(batches), 1), None)
        except HandBack:
            self.drop(hand_back=True)
            return "handed_back"
        except JobFenced:
            log.warning("job %s was taken over mid-way; dropping the window", d.job_id)
            self.drop(hand_back=True)
            return "fenced"
        except (redis.ConnectionError, redis.TimeoutError):
            # Redis is gone: the job stays pending under this worker, no longer refreshed;
            # it comes back (to us by the recovery of our own entries, or elsewhere after
            # its lease).
            self.returns.release(d)
            raise
        except Exception as exc:  # the window holds part of this job: drop it all
            log.exception("job %s failed", d.job_id)
            self.drop(hand_back=True, failed=d)
            self.returns.fail_attempt(d, exc)
            return "failed"
        finally:
            self.holdings.start_job(None)
        w.held.append(Held(d.job_id, d.entry_id, d.epoch, item.job.counted))
        w.deliveries.append(d)
        w.names.update(item.job.names)
        return "merged"

    def _open(self, d: Delivery, item: Prepared) -> Window:
        self.window = Window(d.pair, d.stream, item.conf, item.engine,
                             self.windows.accumulator(item.conf, item.engine))
        self.feeder.affinity = d.stream
        return self.window

    def _close(self) -> Optional[Window]:
        w, self.window, self.feeder.affinity = self.window, None, None
        return w

    def _on_progress(self, fraction: float, tokens: Optional[int]) -> None:
        if self.holdings.progress(fraction, tokens):
            # Another worker owns the job now: the seal would be refused anyway.
            raise JobFenced("the job was taken over by a newer delivery")
        if self.stop.past_deadline():
            raise HandBack()

    def due(self) -> bool:
        """The open window's budget is spent (:meth:`WindowPolicy.due`)."""
        return self.windows.due(self.window, not self.checkpointing.idle.is_set(),
                                self.checkpointing.last_apply_seconds)

    def checkpoint(self, background: bool = False) -> str:
        """Seal the window's jobs into one checkpoint, apply it, complete it, ack them.

        With ``background``, the sealed checkpoint is applied by the applier thread while
        the device goes on with the next window (returns "sealed"); a second one waits
        for the first."""
        w = self._close()
        if w is None or not w.held:
            return "empty"
        self.windows.remember(w.acc)
        return self.checkpointing.seal(w, background)

    def drop(self, hand_back: bool, failed: Optional[Delivery] = None,
             error: Optional[BaseException] = None) -> None:
        """Forget the open window; its jobs go back to the queue (unless Redis is gone:
        then they stay pending under this worker and come back by the recovery of its own
        entries). With ``error``, each counts a failed attempt."""
        w = self._close()
        if w is None:
            return
        w.acc = w.engine = None
        self.pool.release_evicted()
        for d in w.deliveries:
            if hand_back and not self.holdings.is_lost(d.job_id):
                if error is not None:
                    self.returns.fail_attempt(d, error)
                else:
                    self.returns.hand_back(d)
            else:
                self.returns.release(d)
        current = self.holdings.current()
        if current is not None and current is not failed:
            if hand_back:
                self.returns.hand_back(current)
            else:
                self.returns.release(current)
