"""The worker loop: take a job -> forward -> reduce -> merge locally -> commit + ack.

Any number of workers, in any number of processes or machines, share one Redis. Each
loads the models its jobs ask for on demand. A heartbeat thread keeps the worker
visible (``/readyz``), keeps its current job's stream entry from being taken over and
publishes progress. SIGTERM finishes the current job (or hands it back after a grace
period) and stops.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from typing import Optional

import redis

from embgeom import keys as K
from embgeom.errors import JobFenced
from embgeom.models import ModelPool, ModelRegistry
from embgeom.pipeline import accumulate_texts
from embgeom.queue import Delivery, JobQueue
from embgeom.settings import Settings
from embgeom.store import AccumulatorStore

log = logging.getLogger(__name__)

__all__ = ["Worker", "redis_client", "new_worker_id"]


class HandBack(Exception):
    """Raised inside a job when the worker must stop before finishing it."""


CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def redis_client(url: str) -> redis.Redis:
    """A client for ``url``: ``redis://`` / ``rediss://`` / ``unix://`` for one Redis,
    ``redis+cluster://host:port`` (or ``rediss+cluster://``) for a Redis Cluster, given
    any one of its nodes (the others are discovered with CLUSTER SLOTS)."""
    scheme, sep, rest = url.partition("://")
    if sep and scheme in CLUSTER_SCHEMES:
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(f"{CLUSTER_SCHEMES[scheme]}://{rest}", socket_timeout=60,
                                     socket_connect_timeout=5, health_check_interval=10)
    return redis.Redis.from_url(url, socket_timeout=60, socket_connect_timeout=5,
                                health_check_interval=10)


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Worker:
    def __init__(self, client: redis.Redis, settings: Settings,
                 registry: Optional[ModelRegistry] = None, pool: Optional[ModelPool] = None,
                 worker_id: Optional[str] = None):
        self.r = client
        self.settings = settings
        self.registry = registry or ModelRegistry.from_settings(settings)
        self.pool = pool or ModelPool.from_settings(self.registry, settings)
        self.id = worker_id or new_worker_id()
        self.queue = JobQueue(client, settings.max_attempts)
        self.store = AccumulatorStore(client)
        self.models = list(settings.worker_models or self.registry.names())
        self.stop_event = threading.Event()
        # The heartbeat stops only when the loop has ended, not at the stop request: a
        # worker finishing its job during its SIGTERM grace must keep its lease (else the
        # job is taken over and its own commit fenced) and stay visible in /readyz.
        self._beat_stop = threading.Event()
        self._lost: Optional[Delivery] = None  # the current delivery, once taken over
        self._stop_deadline: Optional[float] = None
        self._current: Optional[Delivery] = None
        self._progress: Optional[tuple[float, int]] = None
        self._lock = threading.Lock()
        self.jobs_done = 0

    # ---------------------------------------------------------------- control
    def request_stop(self, grace_seconds: float = 30.0) -> None:
        """Finish the current job if it ends within ``grace_seconds``, else hand it back."""
        self._stop_deadline = time.monotonic() + grace_seconds
        self.stop_event.set()

    def run(self) -> None:
        log.info("worker %s serving %s", self.id, ", ".join(self.models))
        beat = threading.Thread(target=self._heartbeat_loop, name=f"heartbeat-{self.id}", daemon=True)
        beat.start()
        try:
            self.queue.prune_consumers(self.models)
        except redis.RedisError as exc:
            log.debug("could not prune idle consumers: %s", exc)
        try:
            while not self.stop_event.is_set():
                try:
                    # Our own unacknowledged entries first: one read of several streams
                    # can hand us more than one job, and after a reconnect the job we
                    # were running is still ours.
                    delivery = self.queue.own_pending(self.id, self.models)
                    if delivery is None:
                        delivery = self.queue.take(self.id, self.models, self.settings.lease_seconds,
                                                   block_ms=500)
                    if delivery is not None:
                        self.process(delivery)
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    log.warning("worker %s lost Redis (%s); retrying", self.id, exc)
                    self.queue.forget_groups()  # a restarted Redis may have lost them
                    self.stop_event.wait(0.5)
                except Exception:
                    # Never let one bad moment end the worker: the job, if any, stays
                    # pending and is delivered again (here or elsewhere).
                    log.exception("worker %s: unexpected error; continuing", self.id)
                    self.stop_event.wait(1.0)
        finally:
            self.stop_event.set()
            self._beat_stop.set()
            beat.join(timeout=5)
            try:
                self.r.zrem(K.WORKERS, self.id)
                self.r.delete(K.worker(self.id))
            except redis.RedisError:
                pass

    # ------------------------------------------------------------------- jobs
    def process(self, delivery: Delivery) -> str:
        """Run one delivered job to its end; returns what happened to it."""
        with self._lock:
            self._current, self._progress = delivery, None
        try:
            try:
                loaded = self.pool.get(delivery.pair.model)
                moments = accumulate_texts(
                    loaded, delivery.texts, delivery.include_special,
                    self.settings.token_budget, on_progress=self._on_progress,
                )
            except HandBack:
                self._hand_back(delivery)
                return "handed_back"
            except JobFenced:
                log.warning("job %s was taken over mid-way; dropping this delivery", delivery.job_id)
                return "fenced"
            except (redis.ConnectionError, redis.TimeoutError):
                raise
            except Exception as exc:  # a failed attempt: retry or dead-letter
                log.exception("job %s failed", delivery.job_id)
                error = f"{type(exc).__name__}: {exc}"
                if delivery.attempts >= self.settings.max_attempts:
                    self.queue.fail(delivery.pair, delivery.job_id, delivery.stream,
                                    delivery.entry_id,
                                    f"failed after {delivery.attempts} attempts: {error}",
                                    epoch=delivery.epoch)
                else:
                    self.queue.retry_later(delivery, error)
                return "failed"
            with self._lock:
                self._progress = None  # no more job-hash writes: they would abort the commit
            info = loaded.info
            done = {"status": "done", "progress": 1.0, "tokens": moments.counted,
                    "finished_at": repr(time.time()), "error": ""}
            try:
                outcome = self.store.commit_job(
                    delivery.pair, delivery.job_id, delivery.epoch, moments,
                    info.num_layers + 1, info.hidden_size, done,
                )
            except JobFenced:
                log.warning("job %s was taken over; dropping this delivery", delivery.job_id)
                return "fenced"
            except redis.ResponseError as exc:
                # Redis refused the write (e.g. "OOM command not allowed" under noeviction):
                # nothing was applied; record why and let the job be tried again.
                log.error("commit of job %s refused by Redis: %s", delivery.job_id, exc)
                self.queue.retry_later(delivery, f"commit refused by Redis: {exc}")
                return "failed"
            if outcome == "committed":
                # After the EXEC, in the directory's own slot: undoes a concurrent
                # DELETE's SREM that would otherwise hide these new data.
                self.r.sadd(K.PAIRS, delivery.pair.pair)
            if outcome == "void":
                self.queue.fail(delivery.pair, delivery.job_id, delivery.stream, delivery.entry_id,
                                "the collection was deleted while the job was queued or running",
                                epoch=delivery.epoch)
                return "void"
            self.queue.ack(delivery.stream, delivery.entry_id)
            self.jobs_done += outcome == "committed"
            return outcome
        finally:
            with self._lock:
                self._current, self._progress, self._lost = None, None, None

    def _on_progress(self, fraction: float, tokens: int) -> None:
        with self._lock:
            self._progress = (fraction, tokens)
            lost = self._current is not None and self._lost is self._current
        if lost:  # another worker owns the job now: its commit would be fenced anyway
            raise JobFenced("the job was taken over by a newer delivery")
        if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
            raise HandBack()

    def _hand_back(self, delivery: Delivery) -> None:
        """Give the job back to the queue without counting the attempt."""
        self.queue.retry_later(delivery, "", attempt_counts=False)

    # -------------------------------------------------------------- heartbeat
    def _heartbeat_loop(self) -> None:
        period = self.settings.heartbeat_seconds
        # The details must outlive the window in which readers still count the worker.
        details_ttl = math.ceil(self.settings.worker_silence_seconds) + 1
        while True:
            try:
                with self._lock:
                    current, progress = self._current, self._progress
                now = time.time()
                details = {"id": self.id, "models": self.models, "loaded": self.pool.loaded(),
                           "job": current.job_id if current else None, "heartbeat": now,
                           "jobs_done": self.jobs_done}
                with self.r.pipeline(transaction=False) as p:
                    p.zadd(K.WORKERS, {self.id: now})
                    p.set(K.worker(self.id), json.dumps(details), ex=details_ttl)
                    p.execute()
                if current is not None:
                    if not self.queue.refresh(current, self.id):
                        with self._lock:
                            if self._current is current:
                                self._lost = current
                    elif progress is not None:
                        with self._lock:  # re-check: the commit must not race this write
                            still = self._current is current and self._progress is not None
                        if still:
                            self.queue.progress(current, *progress)
            except redis.RedisError as exc:
                log.debug("heartbeat failed: %s", exc)
            if self._beat_stop.wait(period):
                return


def live_workers(client: redis.Redis, silence_seconds: float) -> list[dict]:
    """Workers whose heartbeat is younger than ``silence_seconds``."""
    ids = client.zrangebyscore(K.WORKERS, time.time() - silence_seconds, "+inf")
    if not ids:
        return []
    # One GET each, pipelined (an MGET of keys in several slots fails on a cluster).
    with client.pipeline(transaction=False) as p:
        for i in ids:
            p.get(K.worker(i.decode()))
        raws = p.execute()
    return [json.loads(raw) for raw in raws if raw]
