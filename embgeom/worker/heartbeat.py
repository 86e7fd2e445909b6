"""The heartbeat: keeps the worker visible (``/readyz``), keeps the leases of every job it
holds, publishes progress and renews the lease of a checkpoint being applied."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable

import redis

from embgeom import heap
from embgeom.compute.models import ModelPool
from embgeom.settings import Settings
from embgeom.store.heartbeats import publish_heartbeat
from embgeom.worker.checkpointing import Checkpointing
from embgeom.worker.clock import StageClock
from embgeom.worker.feeder import Feeder
from embgeom.worker.holdings import Holdings
from embgeom.worker.stores import Stores

log = logging.getLogger(__name__)


class Heartbeat:
    """Beats every ``heartbeat_seconds`` until :meth:`stop`: that is when the worker's loop
    has ended, not at the stop request (a worker finishing its job during its SIGTERM
    grace must keep its leases)."""

    def __init__(self, worker_id: str, models: list[str], settings: Settings, stores: Stores,
                 pool: ModelPool, holdings: Holdings, feeder: Feeder,
                 checkpointing: Checkpointing, clock: StageClock,
                 window_open: Callable[[], bool]):
        self.worker_id = worker_id
        self.models = models
        self.settings = settings
        self.stores = stores
        self.pool = pool
        self.holdings = holdings
        self.feeder = feeder
        self.checkpointing = checkpointing
        self.clock = clock
        self.window_open = window_open
        self._stop = threading.Event()

    def details(self) -> dict:
        held, current, _, sealed = self.holdings.snapshot()
        return {"id": self.worker_id, "models": self.models, "loaded": self.pool.loaded(),
                "job": current.job_id if current else None, "heartbeat": time.time(),
                "jobs_done": self.checkpointing.jobs_done,
                "checkpoints": self.checkpointing.checkpoints,
                "held": len(held), "applying": len(sealed),
                # No job in hand, none being prepared (the feeder loads the next job's
                # model: the soak saw a third weight file mapped "at rest"), no window
                # open, nothing being applied: the process holds its models and caches alone.
                "at_rest": (current is None and not self.window_open() and not sealed
                            and self.feeder.at_rest()),
                # Where its RSS grows: allocated (in use) or kept free in the arenas.
                "heap": heap.usage(),
                "stage_seconds": {k: round(v, 6) for k, v in self.clock.seconds.items()}}

    def loop(self) -> None:
        """The heartbeat thread."""
        period = self.settings.heartbeat_seconds
        # The details must outlive the window in which readers still count the worker.
        details_ttl = math.ceil(self.settings.worker_silence_seconds) + 1
        while True:
            try:
                self._beat(details_ttl)
            except redis.RedisError as exc:
                log.debug("heartbeat failed: %s", exc)
            if self._stop.wait(period):
                return

    def stop(self) -> None:
        self._stop.set()

    def _beat(self, details_ttl: int) -> None:
        publish_heartbeat(self.stores.r, self.worker_id, self.details(),
                          self.settings.worker_silence_seconds, details_ttl)
        held, current, progress, sealed = self.holdings.snapshot()
        for d, ok in zip(held, self.stores.queue.refresh_many(held, self.worker_id)):
            if not ok:
                self.holdings.mark_lost(d.job_id)
        if current is not None and progress is not None and not self.holdings.is_lost(current.job_id):
            self.stores.queue.progress(current, *progress)
        for cp, (pair, until) in sealed:
            if time.monotonic() < until:
                self.stores.checkpointer.renew(pair, cp)
