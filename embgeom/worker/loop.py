"""The :class:`Worker`: its parts wired together, and its main loop."""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from typing import Callable, Optional

import redis

from embgeom import heap
from embgeom.compute.catalogue import ModelRegistry
from embgeom.compute.models import ModelPool
from embgeom.errors import StoreUnavailable
from embgeom.settings import Settings
from embgeom.store import keys as K
from embgeom.store.checkpoints import Checkpointer
from embgeom.store.collections import Collections
from embgeom.store.conf import PairConf
from embgeom.store.delivery import WorkerQueue
from embgeom.store.jobs import Delivery
from embgeom.worker.adoption import Adoption
from embgeom.worker.checkpointing import Checkpointing
from embgeom.worker.clock import StageClock
from embgeom.worker.feeder import Feeder, Prepared
from embgeom.worker.heartbeat import Heartbeat
from embgeom.worker.holdings import Holdings
from embgeom.worker.pairs import Pairs
from embgeom.worker.returns import Returns
from embgeom.worker.runner import WindowRunner
from embgeom.worker.stop import StopRequest
from embgeom.worker.stores import Stores
from embgeom.worker.windows import Window, WindowPolicy

log = logging.getLogger(__name__)


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Worker:
    """One worker: the main thread runs jobs into the window (:class:`WindowRunner`) and
    checkpoints; the :class:`Feeder`, the applier (:class:`Checkpointing`) and the
    :class:`Heartbeat` run on threads of their own."""

    def __init__(self, client: redis.Redis, settings: Settings,
                 registry: Optional[ModelRegistry] = None, pool: Optional[ModelPool] = None,
                 worker_id: Optional[str] = None,
                 engine_factory: Optional[Callable[[PairConf, str], object]] = None):
        self.settings = settings
        self.registry = registry or ModelRegistry.from_settings(settings)
        self.pool = pool or ModelPool.from_settings(self.registry, settings)
        self.id = worker_id or new_worker_id()
        self.models = list(settings.worker_models or self.registry.names())
        self.stores = Stores.open(client, settings, self.id)
        self.clock = StageClock()
        self.stop = StopRequest()
        self.stop_event = self.stop.event
        self.holdings = Holdings()
        self.returns = Returns(self.stores, self.holdings, settings.max_attempts)
        self.pairs = Pairs(self.stores, settings, self.registry, self.pool, engine_factory)
        self.window_policy = WindowPolicy(settings)
        self.feeder = Feeder(self.id, self.models, settings, self.stores, self.stop,
                             self.holdings, self.returns, self.pairs, self.clock)
        self.checkpointing = Checkpointing(self.id, settings, self.stores, self.pool,
                                           self.holdings, self.returns, self.clock)
        self.adoption = Adoption(self.id, settings, self.stores, self.pool, self.pairs,
                                 self.window_policy, self.returns, self.checkpointing)
        self.runner = WindowRunner(self.pool, self.holdings, self.returns, self.window_policy,
                                   self.checkpointing, self.adoption, self.feeder, self.stop,
                                   self.clock)
        self.heartbeat = Heartbeat(self.id, self.models, settings, self.stores, self.pool,
                                   self.holdings, self.feeder, self.checkpointing, self.clock,
                                   window_open=lambda: self.runner.window is not None)
        self._recover_pending = True

    # ------------------------------------------------------- the shared parts
    @property
    def r(self) -> redis.Redis:
        return self.stores.r

    @property
    def queue(self) -> WorkerQueue:
        return self.stores.queue

    @queue.setter
    def queue(self, queue: WorkerQueue) -> None:
        self.stores.queue = queue  # every part reads it from there

    @property
    def collections(self) -> Collections:
        return self.stores.collections

    @property
    def checkpointer(self) -> Checkpointer:
        return self.stores.checkpointer

    @property
    def window(self) -> Optional[Window]:
        return self.runner.window

    @property
    def jobs_done(self) -> int:
        return self.checkpointing.jobs_done

    @property
    def checkpoints(self) -> int:
        return self.checkpointing.checkpoints

    def pair_conf(self, pair: K.PairKeys, gen: int) -> PairConf:
        return self.pairs.conf(pair, gen)

    def engine(self, conf: PairConf, model: str):
        return self.pairs.engine(conf, model)

    def process(self, item: Prepared) -> str:
        return self.runner.process(item)

    def checkpoint(self, background: bool = False) -> str:
        return self.runner.checkpoint(background)

    def adopt(self, d: Delivery) -> str:
        return self.adoption.adopt(d)

    def heartbeat_details(self) -> dict:
        return self.heartbeat.details()

    # ---------------------------------------------------------------- control
    def request_stop(self, grace_seconds: float = 30.0) -> None:
        """Finish the current job if it ends within ``grace_seconds``, else hand it back."""
        self.stop.request(grace_seconds)

    def run(self) -> None:
        log.info("worker %s serving %s", self.id, ", ".join(self.models))
        heap.limit_arenas(self.settings.malloc_arenas)  # before its threads start
        beat = threading.Thread(target=self.heartbeat.loop, name=f"heartbeat-{self.id}", daemon=True)
        feeder = threading.Thread(target=self.feeder.loop, name=f"feeder-{self.id}", daemon=True)
        applier = threading.Thread(target=self.checkpointing.applier_loop, name=f"applier-{self.id}",
                                   daemon=True)
        beat.start()
        applier.start()
        trimmer = heap.HeapTrimmer(self.settings.heap_trim_seconds, f"heap-{self.id}").start()
        try:
            self.queue.prune_consumers(self.models)
        except redis.RedisError as exc:
            log.debug("could not prune idle consumers: %s", exc)
        self._recover_pending = True
        self._recover_own()
        feeder.start()
        try:
            while not self.stop.is_set():
                try:
                    if self._recover_pending:
                        self._recover_own()
                    self.step()
                except (redis.ConnectionError, redis.TimeoutError, StoreUnavailable) as exc:
                    log.warning("worker %s lost Redis (%s); retrying", self.id, exc)
                    self.runner.drop(hand_back=False)  # the jobs stay pending under our id
                    self.feeder.drain(hand_back=False)  # and so do the prepared ones: recovered below
                    self.queue.forget_groups()  # a restarted Redis may have lost them
                    self.stop.wait(0.5)
                    self._recover_pending = True
                except Exception as exc:
                    # Never let one bad moment end the worker: the window's jobs go back to
                    # the queue, this time as a failed attempt (a job that always breaks
                    # the worker ends dead-lettered, not in an endless loop).
                    log.exception("worker %s: unexpected error; continuing", self.id)
                    self.runner.drop(hand_back=True, error=exc)
                    self.stop.wait(1.0)
            self._finish()
        finally:
            self.stop.set()
            feeder.join(timeout=30)
            self.feeder.drain(hand_back=True)
            self.checkpointing.stop_applier()
            applier.join(timeout=600)
            self.heartbeat.stop()
            beat.join(timeout=5)
            trimmer.stop()
            try:
                self.r.zrem(K.WORKERS, self.id)
                self.r.delete(K.worker(self.id))
            except redis.RedisError:
                pass

    def step(self) -> None:
        """One turn of the main loop: run the next prepared job, or checkpoint when
        nothing more is coming for the open window."""
        item = self.feeder.next(timeout=0.02)
        if item is None:
            if self.window is not None and (self.feeder.idle.is_set() or self.runner.due()):
                self.checkpoint(background=True)
            return
        self.process(item)
        if self.window is not None and self.runner.due():
            self.checkpoint(background=True)

    def _finish(self) -> None:
        """After a stop request: checkpoint what is done (a sealed window is applied even
        past the grace period: it can no longer be handed back), and wait for it."""
        if self.window is not None:
            if self.stop.past_deadline():
                self.runner.drop(hand_back=True)
            else:
                self.checkpoint()
        self.checkpointing.idle.wait()

    def _recover_own(self) -> None:
        """Entries this worker id holds from before (a restart with the same id, or a
        reconnect): delivered again, with new epochs. Tried again at every turn of the
        main loop until Redis answers."""
        try:
            while not self.stop.is_set():
                item = self.feeder.take_own()
                if item is None:
                    self._recover_pending = False
                    return
                self.process(item)
                if self.window is not None:
                    self.checkpoint()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.debug("could not recover own entries yet: %s", exc)
            self.stop.wait(0.2)
