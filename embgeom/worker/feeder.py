"""The feeder: takes the next job and prepares it on the host (tokenise, batch, pin)
while the main thread runs the device."""

from __future__ import annotations

import logging
import queue as queue_mod
import threading
from dataclasses import dataclass
from typing import Optional

import redis

from embgeom.settings import Settings
from embgeom.store.conf import PairConf
from embgeom.store.jobs import Delivery
from embgeom.worker.clock import StageClock
from embgeom.worker.holdings import Holdings
from embgeom.worker.pairs import Pairs
from embgeom.worker.returns import Returns
from embgeom.worker.stop import StopRequest
from embgeom.worker.stores import Stores

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A delivered job, tokenised and batched by the feeder (or the error doing so)."""

    delivery: Delivery
    conf: Optional[PairConf] = None
    engine: Optional[object] = None
    job: Optional[object] = None
    error: Optional[BaseException] = None


class Feeder:
    """Fills :attr:`ready` with prepared jobs, ``prefetch_jobs`` ahead. While a window is
    open (:attr:`affinity`: its stream), it takes that pair's jobs only. :attr:`idle` is
    set while it finds no job."""

    IDLE_WAIT_MS = 500

    def __init__(self, worker_id: str, models: list[str], settings: Settings, stores: Stores,
                 stop: StopRequest, holdings: Holdings, returns: Returns, pairs: Pairs,
                 clock: StageClock):
        self.worker_id = worker_id
        self.models = models
        self.settings = settings
        self.stores = stores
        self.stop = stop
        self.holdings = holdings
        self.returns = returns
        self.pairs = pairs
        self.clock = clock
        self.ready: queue_mod.Queue = queue_mod.Queue(maxsize=max(1, settings.prefetch_jobs))
        self.idle = threading.Event()
        self.affinity: Optional[str] = None           # the stream whose window is open
        self._notified: dict = {}                     # last notification id per stream

    def loop(self) -> None:
        """The feeder thread, until the stop request."""
        while not self.stop.is_set():
            try:
                self._feed_one()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.debug("feeder lost Redis: %s", exc)
                self.stores.queue.forget_groups()
                self.stop.wait(0.5)
            except Exception:
                log.exception("feeder of %s: unexpected error", self.worker_id)
                self.stop.wait(1.0)

    def _feed_one(self) -> None:
        queue = self.stores.queue
        only = self.affinity
        delivery = queue.take(self.worker_id, self.models, self.settings.lease_seconds,
                              block_ms=0, only=only)
        if delivery is None:
            self.idle.set()
            if only:
                self.stop.wait(0.02)
            else:
                # Nothing anywhere: sleep until a submission says there is, or
                # a while (expired leases are found by polling).
                queue.note(queue.wait_for_work(self.models, self.IDLE_WAIT_MS, self._notified))
            return
        self.idle.clear()
        self.holdings.hold(delivery)
        try:
            item = self.prepare(delivery)
        except BaseException:
            # Not ours to keep: unrefreshed, its lease expires and it is delivered
            # again (to us, or elsewhere).
            self.returns.release(delivery)
            raise
        while not self.stop.is_set():
            try:
                self.ready.put(item, timeout=0.1)
                break
            except queue_mod.Full:
                continue
        else:
            self.returns.hand_back(delivery)
        # Returning lets go of both: a prepared job kept while idle would hold its engine
        # (and so its model, evicted or not) and its pinned batches.

    def prepare(self, delivery: Delivery) -> Prepared:
        """Host work for a job: its pair's configuration, tokenisation, batches."""
        item = Prepared(delivery)
        if delivery.checkpoint is not None:
            return item  # adopted as a whole checkpoint by the main thread
        try:
            with self.clock.timed("prepare"):
                item.conf = self.pairs.conf(delivery.pair, delivery.gen)
                item.engine = self.pairs.engine(item.conf, delivery.pair.model)
                item.job = item.engine.prepare(delivery.texts)
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except Exception as exc:  # a job that cannot be prepared fails as an attempt
            item.error = exc
        return item

    def take_own(self) -> Optional[Prepared]:
        """The next entry this worker id holds from before (a restart with the same id, or
        a reconnect), delivered again with a new epoch and prepared; None when none is
        left. Called by the main thread, which runs it."""
        delivery = self.stores.queue.own_pending(self.worker_id, self.models)
        if delivery is None:
            return None
        self.holdings.hold(delivery)
        return self.prepare(delivery)

    def next(self, timeout: float) -> Optional[Prepared]:
        try:
            return self.ready.get(timeout=timeout)
        except queue_mod.Empty:
            return None

    def drain(self, hand_back: bool) -> None:
        """Empty the prepared-jobs queue: hand them back, or (Redis lost) just stop
        holding them: they stay pending under this worker id."""
        while True:
            try:
                item = self.ready.get_nowait()
            except queue_mod.Empty:
                return
            (self.returns.hand_back if hand_back else self.returns.release)(item.delivery)

    def at_rest(self) -> bool:
        """No job being prepared, none waiting prepared."""
        return self.idle.is_set() and self.ready.empty()
