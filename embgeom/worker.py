"""The worker: take jobs -> forward -> reduce into the window -> checkpoint + ack.

Any number of workers, in any number of processes or machines, share one Redis (or one
Redis Cluster). Each loads the models its jobs ask for on demand and keeps, per
(collection, model) pair it is working on, a *window*: the float64 moments of every job
since its last checkpoint, on the model's device (:mod:`embgeom.compute.window`). The
window is checkpointed in one exactly-once step (:mod:`embgeom.store.checkpoints`) when
its budget is reached (tokens, bytes or seconds), when nothing more is queued for its
pair (so a lone job is never held back), when a job of another pair comes, or when the
worker stops.

Threads: the main thread runs the device (forward, reduction into the window) and checkpoints; a
*feeder* thread takes the next job and prepares it (tokenise, batch, pin) meanwhile; a
heartbeat thread keeps the worker visible (``/readyz``), keeps the leases of every job it
holds, publishes progress and renews the lease of a checkpoint being applied.

SIGTERM finishes the current job and checkpoints the window (or, past the grace period,
hands every job not yet sealed back to the queue) and stops.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue as queue_mod
import socket
import threading
import time
import uuid
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

import redis

from embgeom.compute.engine import CountingRule, Engine
from embgeom.compute.catalogue import ModelRegistry
from embgeom.compute.models import ModelPool
from embgeom.compute.reduce import PRECISIONS
from embgeom.compute.window import WindowAccumulator
from embgeom.errors import EmbgeomError, JobFenced, StoreUnavailable
from embgeom import heap
from embgeom.settings import Settings
from embgeom.stats import WindowMoments
from embgeom.store import keys as K
from embgeom.store.checkpoints import Checkpointer, Held, new_checkpoint_id
from embgeom.store.collections import Collections
from embgeom.store.conf import PairConf
from embgeom.store.connection import redis_client
from embgeom.store.delivery import WorkerQueue
from embgeom.store.heartbeats import publish_heartbeat
from embgeom.store.jobs import Delivery
from embgeom.store.shards import piece_tokens_for

log = logging.getLogger(__name__)

__all__ = ["Worker", "redis_client", "new_worker_id"]


class HandBack(Exception):
    """Raised inside a job when the worker must stop before finishing it."""


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class Prepared:
    """A delivered job, tokenised and batched by the feeder (or the error doing so)."""

    delivery: Delivery
    conf: Optional[PairConf] = None
    engine: Optional[object] = None
    job: Optional[object] = None
    error: Optional[BaseException] = None


@dataclass
class Window:
    pair: K.PairKeys
    stream: str
    conf: PairConf
    engine: Optional[object]                          # both None once the window closed:
    acc: Optional[WindowAccumulator]                  # device memory and model let go
    held: list = field(default_factory=list)          # Held
    deliveries: list = field(default_factory=list)    # Delivery, same order
    names: dict = field(default_factory=dict)         # hashed word key -> name
    started: float = field(default_factory=time.monotonic)


class StageClock:
    """Seconds spent per stage (published in the heartbeat, read by the benchmarks)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, stage: str, seconds: float, count: int = 1) -> None:
        self.seconds[stage] += seconds
        self.counts[stage] += count

    def timed(self, stage: str):
        clock = self

        class _T:
            def __enter__(self):
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                clock.add(stage, time.perf_counter() - self.t)

        return _T()


class Worker:
    IDLE_WAIT_MS = 500

    def __init__(self, client: redis.Redis, settings: Settings,
                 registry: Optional[ModelRegistry] = None, pool: Optional[ModelPool] = None,
                 worker_id: Optional[str] = None,
                 engine_factory: Optional[Callable[[PairConf, str], object]] = None):
        self.r = client
        self.settings = settings
        self.registry = registry or ModelRegistry.from_settings(settings)
        self.pool = pool or ModelPool.from_settings(self.registry, settings)
        self.id = worker_id or new_worker_id()
        self.queue = WorkerQueue(client, settings.max_attempts, retention_seconds=settings.retention_seconds)
        self.collections = Collections(client)
        self.checkpointer = Checkpointer(
            client, self.id, piece_bytes=settings.piece_bytes,
            lock_ms=int(settings.lease_seconds * 1000),
            horizon_ms=int(settings.checkpoint_horizon_seconds * 1000),
            lease_ms=int(settings.lease_seconds * 1000), max_segments=settings.max_segments,
            retention_seconds=settings.retention_seconds)
        self.models = list(settings.worker_models or self.registry.names())
        # None: engines are built on the pool's models and owned by the pool (they leave
        # with their model). A given factory owns whatever its engines hold.
        self._engine_factory = engine_factory
        self.clock = StageClock()
        self.window: Optional[Window] = None
        self.stop_event = threading.Event()
        # The heartbeat stops only when the loop has ended, not at the stop request: a
        # worker finishing its job during its SIGTERM grace must keep its leases.
        self._beat_stop = threading.Event()
        self._stop_deadline: Optional[float] = None
        self._lock = threading.Lock()
        self._held: dict[str, Delivery] = {}          # every delivery this worker holds
        self._lost: set[str] = set()                  # held jobs another delivery took over
        self._current: Optional[Delivery] = None
        self._progress: Optional[tuple[float, int]] = None
        self._sealed: dict[str, tuple] = {}  # checkpoints being applied -> (pair, renew until)
        self._ready: queue_mod.Queue = queue_mod.Queue(maxsize=max(1, settings.prefetch_jobs))
        self._affinity: Optional[str] = None          # the stream whose window is open
        self._feeder_idle = threading.Event()
        self._notified: dict = {}                     # last notification id per stream
        self.jobs_done = 0
        self.checkpoints = 0
        # Rows each window shape (L, d, self-similarity) last reached: a new window of that
        # shape starts there (growing by doubling copies everything), and no other does.
        self._window_rows: OrderedDict[tuple, int] = OrderedDict()
        self._last_apply_seconds = 0.0
        self._applying: queue_mod.Queue = queue_mod.Queue(maxsize=1)
        self._applier_idle = threading.Event()
        self._applier_idle.set()

    # ---------------------------------------------------------------- control
    def request_stop(self, grace_seconds: float = 30.0) -> None:
        """Finish the current job if it ends within ``grace_seconds``, else hand it back."""
        self._stop_deadline = time.monotonic() + grace_seconds
        self.stop_event.set()

    def run(self) -> None:
        log.info("worker %s serving %s", self.id, ", ".join(self.models))
        heap.limit_arenas(self.settings.malloc_arenas)  # before its threads start
        beat = threading.Thread(target=self._heartbeat_loop, name=f"heartbeat-{self.id}", daemon=True)
        feeder = threading.Thread(target=self._feeder_loop, name=f"feeder-{self.id}", daemon=True)
        applier = threading.Thread(target=self._applier_loop, name=f"applier-{self.id}", daemon=True)
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
            while not self.stop_event.is_set():
                try:
                    if self._recover_pending:
                        self._recover_own()
                    self.step()
                except (redis.ConnectionError, redis.TimeoutError, StoreUnavailable) as exc:
                    log.warning("worker %s lost Redis (%s); retrying", self.id, exc)
                    self._drop_window(hand_back=False)  # the jobs stay pending under our id
                    self._drain_ready(hand_back=False)  # and so do the prepared ones: recovered below
                    self.queue.forget_groups()  # a restarted Redis may have lost them
                    self.stop_event.wait(0.5)
                    self._recover_pending = True
                except Exception as exc:
                    # Never let one bad moment end the worker: the window's jobs go back to
                    # the queue, this time as a failed attempt (a job that always breaks
                    # the worker ends dead-lettered, not in an endless loop).
                    log.exception("worker %s: unexpected error; continuing", self.id)
                    self._drop_window(hand_back=True, error=exc)
                    self.stop_event.wait(1.0)
            self._finish()
        finally:
            self.stop_event.set()
            feeder.join(timeout=30)
            self._drain_ready(hand_back=True)
            self._applying.put(None)
            applier.join(timeout=600)
            self._beat_stop.set()
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
        try:
            item = self._ready.get(timeout=0.02)
        except queue_mod.Empty:
            item = None
        if item is None:
            if self.window is not None and (self._feeder_idle.is_set() or self._window_due()):
                self.checkpoint(background=True)
            return
        self.process(item)
        if self.window is not None and self._window_due():
            self.checkpoint(background=True)

    def _finish(self) -> None:
        """After a stop request: checkpoint what is done (a sealed window is applied even
        past the grace period: it can no longer be handed back), and wait for it."""
        if self.window is not None:
            if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
                self._drop_window(hand_back=True)
            else:
                self.checkpoint()
        self._applier_idle.wait()

    # ------------------------------------------------------------------ feeder
    def _feeder_loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                only = self._affinity
                delivery = self.queue.take(self.id, self.models, self.settings.lease_seconds,
                                           block_ms=0, only=only)
                if delivery is None:
                    self._feeder_idle.set()
                    if only:
                        self.stop_event.wait(0.02)
                    else:
                        # Nothing anywhere: sleep until a submission says there is, or
                        # a while (expired leases are found by polling).
                        self.queue.note(self.queue.wait_for_work(self.models, self.IDLE_WAIT_MS,
                                                                 self._notified))
                    continue
                self._feeder_idle.clear()
                with self._lock:
                    self._held[delivery.job_id] = delivery
                try:
                    item = self._prepare(delivery)
                except BaseException:
                    # Not ours to keep: unrefreshed, its lease expires and it is delivered
                    # again (to us, or elsewhere).
                    self._release(delivery)
                    raise
                while not self.stop_event.is_set():
                    try:
                        self._ready.put(item, timeout=0.1)
                        break
                    except queue_mod.Full:
                        continue
                else:
                    self._hand_back(delivery)
                # Not kept while idle: a prepared job holds its engine (and so its model,
                # evicted or not) and its pinned batches.
                item = delivery = None
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.debug("feeder lost Redis: %s", exc)
                self.queue.forget_groups()
                self.stop_event.wait(0.5)
            except Exception:
                log.exception("feeder of %s: unexpected error", self.id)
                self.stop_event.wait(1.0)

    def _prepare(self, delivery: Delivery) -> Prepared:
        """Host work for a job: its pair's configuration, tokenisation, batches."""
        item = Prepared(delivery)
        if delivery.checkpoint is not None:
            return item  # adopted as a whole checkpoint by the main thread
        try:
            with self.clock.timed("prepare"):
                item.conf = self.pair_conf(delivery.pair, delivery.gen)
                item.engine = self.engine(item.conf, delivery.pair.model)
                item.job = item.engine.prepare(delivery.texts)
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except Exception as exc:  # a job that cannot be prepared fails as an attempt
            item.error = exc
        return item

    def _recover_own(self) -> None:
        """Entries this worker id holds from before (a restart with the same id, or a
        reconnect): delivered again, with new epochs. Tried again at every turn of the
        main loop until Redis answers."""
        try:
            while not self.stop_event.is_set():
                delivery = self.queue.own_pending(self.id, self.models)
                if delivery is None:
                    self._recover_pending = False
                    return
                with self._lock:
                    self._held[delivery.job_id] = delivery
                self.process(self._prepare(delivery))
                if self.window is not None:
                    self.checkpoint()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.debug("could not recover own entries yet: %s", exc)
            self.stop_event.wait(0.2)

    # -------------------------------------------------------------- pair state
    def pair_conf(self, pair: K.PairKeys, gen: int) -> PairConf:
        conf = self.collections.conf(pair, gen)
        if conf is not None:
            return conf
        settings = self.collections.ensure(pair.collection)
        info = self.registry.info(pair.model)
        # The window length (this worker's registry: the model's maximum capped by its
        # max_window_tokens) is pinned here: it decides counts, for every later worker.
        return self.collections.ensure_conf(pair, PairConf.resolve(
            settings, gen, info.num_layers + 1, info.hidden_size, info.tokenizer_size,
            self.settings.shards, self.settings.chunk_bytes, info.architecture, time.time(),
            window_tokens=info.max_length, record_bytes=self.settings.record_bytes))

    def engine(self, conf: PairConf, model: str):
        """The engine of ``model`` under the pair's counting rule (cheap: built once per
        rule and kept by the model pool with the model it runs)."""
        if self._engine_factory is not None:
            return self._engine_factory(conf, model)
        rule = CountingRule(conf.layers, conf.key, conf.include_special, conf.self_similarity,
                            conf.unit, conf.window_tokens)
        budget, precision = self.settings.token_budget, self.settings.reduce_precision
        return self.pool.engine(model, (rule, budget, precision),
                                lambda loaded: Engine(loaded, rule, budget, precision))

    MAX_WINDOW_SHAPES = 32
    FIRST_WINDOW_ROWS = 1024
    FIRST_WINDOW_BYTES = 64 << 20  # a 17 x 2048 model's 1024 rows would be 570 MB

    def _accumulator(self, conf: PairConf, engine) -> WindowAccumulator:
        """A new window: at the rows its shape reached last time (the first time,
        :attr:`FIRST_WINDOW_ROWS` within :attr:`FIRST_WINDOW_BYTES`), never more than the
        byte budget holds."""
        device = getattr(getattr(engine, "loaded", None), "device", "cpu")
        shape = (conf.L, conf.d, conf.self_similarity)
        max_rows = WindowAccumulator.rows_within(conf.L, conf.d, conf.self_similarity,
                                                 self.settings.checkpoint_bytes)
        first = min(self.FIRST_WINDOW_ROWS, WindowAccumulator.rows_within(
            conf.L, conf.d, conf.self_similarity, self.FIRST_WINDOW_BYTES))
        rows = self._window_rows.get(shape, first)
        return WindowAccumulator(conf.L, conf.d, conf.self_similarity, device,
                                 capacity=min(rows, max_rows), max_capacity=max_rows,
                                 cross_layer=conf.cross_layer,
                                 shift_dtype=PRECISIONS[getattr(engine, "precision", "fp32")])

    def _remember_window(self, acc: WindowAccumulator) -> None:
        """Note the rows a closing window reached, for the next one of its shape (a
        bounded LRU of shapes)."""
        shape = (acc.num_layers, acc.dim, acc.self_similarity)
        self._window_rows[shape] = max(len(acc), self._window_rows.get(shape, 0))
        self._window_rows.move_to_end(shape)
        while len(self._window_rows) > self.MAX_WINDOW_SHAPES:
            self._window_rows.popitem(last=False)

    # ------------------------------------------------------------------- jobs
    def process(self, item: Prepared) -> str:
        """Run one prepared job into the window (or adopt its checkpoint)."""
        d = item.delivery
        if d.checkpoint is not None:
            return self.adopt(d)
        if item.error is not None:
            self._fail_attempt(d, item.error)
            return "failed"
        w = self.window
        if w is not None and (w.pair.pair != d.pair.pair or w.conf.gen != item.conf.gen
                              or w.conf != item.conf):
            self.checkpoint()
            w = None
        if w is None:
            w = self.window = Window(d.pair, d.stream, item.conf, item.engine,
                                     self._accumulator(item.conf, item.engine))
            self._affinity = d.stream
        with self._lock:
            self._current, self._progress = d, None
        try:
            batches = item.job.batches
            for i, batch in enumerate(batches):
                with self.clock.timed("forward_reduce"):  # the batch's sums go into the window
                    w.acc.add(*item.engine.run(batch, w.acc))
                self._on_progress((i + 1) / max(len(batches), 1), None)
        except HandBack:
            self._drop_window(hand_back=True)
            return "handed_back"
        except JobFenced:
            log.warning("job %s was taken over mid-way; dropping the window", d.job_id)
            self._drop_window(hand_back=True)
            return "fenced"
        except (redis.ConnectionError, redis.TimeoutError):
            # Redis is gone: the job stays pending under this worker, no longer refreshed;
            # it comes back (to us by _recover_own, or elsewhere after its lease).
            self._release(d)
            raise
        except Exception as exc:  # the window holds part of this job: drop it all
            log.exception("job %s failed", d.job_id)
            self._drop_window(hand_back=True, failed=d)
            self._fail_attempt(d, exc)
            return "failed"
        finally:
            with self._lock:
                self._current, self._progress = None, None
        w.held.append(Held(d.job_id, d.entry_id, d.epoch, item.job.counted))
        w.deliveries.append(d)
        w.names.update(item.job.names)
        return "merged"

    def _window_due(self) -> bool:
        """The window's budget is spent. While the previous checkpoint is still being
        applied, the window keeps growing (up to its byte budget, or four times its time
        budget): Redis is the bottleneck then, and a larger window writes fewer bytes per
        token (Heaps' law)."""
        w, s = self.window, self.settings
        if w is None:
            return False
        if w.acc.nbytes >= s.checkpoint_bytes or w.acc.tokens >= s.checkpoint_tokens:
            return True
        age = time.monotonic() - w.started
        # At least checkpoint_seconds, and long enough that the last checkpoint took at
        # most checkpoint_max_share of the window's time.
        due = max(s.checkpoint_seconds, self._last_apply_seconds / s.checkpoint_max_share)
        if not self._applier_idle.is_set():
            due = max(due, 4 * s.checkpoint_seconds)
        return age >= due

    def _on_progress(self, fraction: float, tokens: Optional[int]) -> None:
        with self._lock:
            self._progress = (fraction, tokens or 0)
            lost = self._current is not None and self._current.job_id in self._lost
        if lost:  # another worker owns the job now: the seal would be refused anyway
            raise JobFenced("the job was taken over by a newer delivery")
        if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
            raise HandBack()

    def _fail_attempt(self, d: Delivery, exc: BaseException) -> None:
        error = exc.message if isinstance(exc, EmbgeomError) else f"{type(exc).__name__}: {exc}"
        if d.attempts >= self.settings.max_attempts:
            self.queue.fail(d.pair, d.job_id, d.stream, d.entry_id,
                            f"failed after {d.attempts} attempts: {error}", epoch=d.epoch)
        else:
            self.queue.retry_later(d, error)
        self._release(d)

    def _hand_back(self, d: Delivery) -> None:
        """Give a job back to the queue without counting the attempt."""
        try:
            self.queue.retry_later(d, "", attempt_counts=False)
        except redis.RedisError as exc:
            log.debug("could not hand back %s: %s", d.job_id, exc)
        self._release(d)

    def _release(self, d: Delivery) -> None:
        with self._lock:
            self._held.pop(d.job_id, None)
            self._lost.discard(d.job_id)

    def _drop_window(self, hand_back: bool, failed: Optional[Delivery] = None,
                     error: Optional[BaseException] = None) -> None:
        """Forget the open window; its jobs go back to the queue (unless Redis is gone:
        then they stay pending under this worker and come back by ``_recover_own``).
        With ``error``, each counts a failed attempt."""
        w, self.window, self._affinity = self.window, None, None
        if w is None:
            return
        w.acc = w.engine = None
        self.pool.release_evicted()
        for d in w.deliveries:
            if hand_back and d.job_id not in self._lost:
                if error is not None:
                    self._fail_attempt(d, error)
                else:
                    self._hand_back(d)
            else:
                self._release(d)
        current = self._current
        if current is not None and current is not failed:
            if hand_back:
                self._hand_back(current)
            else:
                self._release(current)

    def _drain_ready(self, hand_back: bool) -> None:
        """Empty the prepared-jobs queue: hand them back, or (Redis lost) just stop
        holding them: they stay pending under this worker id."""
        while True:
            try:
                item = self._ready.get_nowait()
            except queue_mod.Empty:
                return
            (self._hand_back if hand_back else self._release)(item.delivery)

    # ------------------------------------------------------------- checkpoint
    def checkpoint(self, background: bool = False) -> str:
        """Seal the window's jobs into one checkpoint, apply it, complete it, ack them.

        With ``background``, the sealed checkpoint is applied by the applier thread while
        the device goes on with the next window (returns "sealed"); a second one waits
        for the first."""
        w, self.window, self._affinity = self.window, None, None
        if w is None or not w.held:
            return "empty"
        self._remember_window(w.acc)
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
                sealed = self.checkpointer.seal(w.pair, w.conf.gen, cp, w.held, w.stream,
                                                piece_tokens)
        except (redis.ConnectionError, redis.TimeoutError, StoreUnavailable):
            # Sealed or not, the jobs stay pending under this worker id: no longer held
            # (nor refreshed), they come back by _recover_own or, after their lease, by a
            # rescan; a sealed checkpoint is then adopted.
            for d in w.deliveries:
                self._release(d)
            raise
        if sealed.status == "void":
            for d in w.deliveries:
                self.queue.fail(d.pair, d.job_id, d.stream, d.entry_id,
                                "the collection was deleted while the job was running", epoch=d.epoch)
                self._release(d)
            return "void"
        if sealed.status in ("lost", "duplicate"):
            # Another delivery owns (or has counted) that job: this window cannot be
            # committed as it is; its other jobs go back to the queue, uncounted.
            log.warning("job %s was %s before this window's checkpoint; its other jobs go back "
                        "to the queue", sealed.lost,
                        "counted by another delivery" if sealed.status == "duplicate" else "taken over")
            for d in w.deliveries:
                if d.job_id == sealed.lost or d.job_id in self._lost:
                    self._release(d)
                else:
                    self._hand_back(d)
            return sealed.status
        args = (w.pair, w.conf, cp, moments, w.held, w.stream, piece_tokens, w.deliveries)
        if not background:
            self._applier_idle.wait()
            return self._apply_sealed(*args)
        with self.clock.timed("wait_applier"):
            self._applier_idle.wait()
        self._applier_idle.clear()
        self._applying.put(args)
        return "sealed"

    def _applier_loop(self) -> None:
        """Applies sealed checkpoints handed over by the main thread, one at a time."""
        while True:
            args = self._applying.get()
            if args is None:
                return
            try:
                self._apply_sealed(*args)
            except Exception:
                # _apply_sealed gives a checkpoint up itself; this is a failure of the
                # bookkeeping after it (the ack): its jobs' entries come back, find their
                # jobs done, and are acknowledged then.
                log.exception("worker %s: checkpoint %s could not be acknowledged", self.id, args[2])
            finally:
                # The sealed window's moments go with ``args``: hand their pages back now
                # rather than at the next periodic trim (a worker at rest holds its models
                # and caches, not its last window).
                args = None
                heap.trim()
                self._applier_idle.set()

    # Errors after which the same checkpoint is tried again on this worker (with backoff,
    # up to checkpoint_apply_seconds): the store may come back. Anything else (a
    # CheckpointRefused, a CheckTooOld, a bug) gives it up at once: a retry meets it again.
    TRANSIENT = (redis.ConnectionError, redis.TimeoutError, StoreUnavailable)

    def _apply_sealed(self, pair, conf, cp, moments, held, stream, piece_tokens, deliveries) -> str:
        """Drive a sealed checkpoint to completion (it can no longer be handed back), or
        give it up with a reason (returns "abandoned" or "dead"): transient errors are
        retried with backoff for ``checkpoint_apply_seconds``, others not at all."""
        s = self.settings
        deadline = time.monotonic() + s.checkpoint_apply_seconds
        with self._lock:
            # The heartbeat renews the lease until a little after the deadline, never
            # longer: a stuck applier must not keep the checkpoint from an adopter.
            self._sealed[cp] = (pair, deadline + s.lease_seconds)
        try:
            delay, retries = 0.2, 0
            while True:
                try:
                    out = self.checkpointer.apply_and_complete(pair, conf, cp, moments, held, piece_tokens)
                    break
                except self.TRANSIENT as exc:
                    if time.monotonic() + delay >= deadline:
                        return self._give_up(pair, conf, cp, exc, retries)
                    log.warning("checkpoint %s interrupted (%s); resuming", cp, exc)
                    retries += 1
                    time.sleep(delay)
                    delay = min(5.0, delay * 2)
                except Exception as exc:
                    return self._give_up(pair, conf, cp, exc, retries)
            if retries:
                self.checkpointer.count(retries=retries)
            self._last_apply_seconds = sum(out.seconds.values())
            for stage, seconds in out.seconds.items():
                self.clock.add(stage, seconds)
            for stage, seconds in out.shards.seconds.items():
                self.clock.add(f"shards.{stage}", seconds)
            self.clock.add("shards.busy", 0, out.shards.busy)
            self.clock.add("shards.lost", 0, out.shards.lost)
            self.clock.add("bytes_written", 0, out.shards.bytes_written + out.layer_bytes)
            with self.clock.timed("ack"):
                self.queue.ack_many(stream, [h.entry_id for h in held])
                self.queue.retire_refs([h.job_id for h in held])
            if out.status == "completed":
                self.checkpoints += 1
                self.jobs_done += len(held)
                # After the completion, in the directory's own slot: undoes a concurrent
                # DELETE's SREM that would otherwise hide these new data.
                self.r.sadd(K.PAIRS, pair.pair)
            if self.checkpoints % 16 == 1:
                self.checkpointer.prune(pair, conf)
            return out.status
        finally:
            with self._lock:
                self._sealed.pop(cp, None)
            for d in deliveries:
                self._release(d)

    def _give_up(self, pair, conf, cp, exc: BaseException, retries: int = 0) -> str:
        """Stop working on a sealed checkpoint: no more lease renewals; its failure (and
        lease) recorded so the next delivery of a job adopts it, or, its tries spent, it
        is dead-lettered. Its jobs are released (not refreshed): they come back after
        their lease. Returns "abandoned" or "dead"."""
        with self._lock:
            self._sealed.pop(cp, None)
        reason = exc.message if isinstance(exc, EmbgeomError) else f"{type(exc).__name__}: {exc}"
        log.error("worker %s gives checkpoint %s of %s up after %d retries: %s", self.id, cp,
                  pair.pair, retries, reason, exc_info=not isinstance(exc, (EmbgeomError, redis.RedisError)))
        try:
            if retries:
                self.checkpointer.count(retries=retries)
            status = self.checkpointer.give_up(pair, conf, cp, reason, self.settings.checkpoint_apply_attempts)
        except redis.RedisError as again:
            # Not even that could be written: the lease runs out by itself (no renewal).
            log.warning("could not record giving checkpoint %s up (%s)", cp, again)
            return "abandoned"
        return "dead" if status == "dead" else "abandoned"

    def _sealed_delivery_limit(self) -> int:
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
        spent, or its jobs came back too often (:meth:`_sealed_delivery_limit`)."""
        status = self.queue.status(d.job_id)["status"]
        dead = record is not None or (status not in ("done", "failed")
                                      and d.attempts > self._sealed_delivery_limit())
        if dead:
            conf = self.collections.conf(d.pair, record["gen"] if record else d.gen)
            error = (self.r.hget(d.pair.checkpoint(d.checkpoint), "error") or b"").decode()
            why = (f"its jobs were delivered {d.attempts} times without it completing"
                   if record is None else (error or "its workers stopped while applying it"))
            self.checkpointer.dead_letter(d.pair, conf, d.checkpoint, why)
            status = self.queue.status(d.job_id)["status"]
        if status in ("done", "failed"):
            self.queue.ack(d.stream, d.entry_id)
        self._release(d)
        return "dead" if dead else "duplicate"

    def adopt(self, d: Delivery) -> str:
        """A delivered job already sealed into a checkpoint: take the checkpoint over,
        recompute its jobs, apply what is missing, complete it. A checkpoint whose tries
        are spent is dead-lettered instead."""
        try:
            record = self.checkpointer.adopt(d.pair, d.checkpoint, self.settings.checkpoint_apply_attempts)
            if record is None or record["status"] == "exhausted":
                return self._not_adopted(d, record)
        except redis.RedisError as exc:
            # Refused (out of memory...) or Redis is gone: not ours; its lease runs out
            # and it is delivered again.
            self._release(d)
            if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
                raise
            log.error("worker %s could not adopt checkpoint %s: %s", self.id, d.checkpoint, exc)
            return "deferred"
        log.info("adopting checkpoint %s of %s (%d jobs)", d.checkpoint, d.pair.pair, len(record["jobs"]))
        try:
            self.queue.claim(record["stream"], self.id, record["entries"])
            conf = self.pair_conf(d.pair, record["gen"])
            engine = self.engine(conf, d.pair.model)
            acc = self._accumulator(conf, engine)
            payloads = [self.r.get(d.pair.payload(j)) for j in record["jobs"]]
            held, names = [], {}
            for job_id, entry, epoch, payload in zip(record["jobs"], record["entries"],
                                                     record["epochs"], payloads):
                job = engine.prepare(json.loads(payload))
                for batch in job.batches:
                    acc.add(*engine.run(batch, acc))
                held.append(Held(job_id, entry, epoch, job.counted))
                names.update(job.names)
            tokens, layers = acc.export()
            acc = engine = None  # not held while the checkpoint is applied
        except (redis.ConnectionError, redis.TimeoutError):
            self._release(d)  # the lease runs out; the next delivery adopts it again
            raise
        except Exception as exc:
            # It cannot even be recomputed here (a missing payload, a model that fails):
            # this try counts; the next delivery adopts it again, or dead-letters it.
            self._release(d)
            return self._give_up(d.pair, self.collections.conf(d.pair, record["gen"]), d.checkpoint, exc)
        self.pool.release_evicted()
        moments = WindowMoments(tokens, layers, {h.job_id: h.tokens for h in held}, names)
        return self._apply_sealed(d.pair, conf, d.checkpoint, moments, held, record["stream"],
                                  record["piece_tokens"], [d])

    # -------------------------------------------------------------- heartbeat
    def heartbeat_details(self) -> dict:
        with self._lock:
            current = self._current
            sealed = len(self._sealed)
        return {"id": self.id, "models": self.models, "loaded": self.pool.loaded(),
                "job": current.job_id if current else None, "heartbeat": time.time(),
                "jobs_done": self.jobs_done, "checkpoints": self.checkpoints,
                "held": len(self._held), "applying": sealed,
                # No job in hand, none being prepared (the feeder loads the next job's
                # model: the soak saw a third weight file mapped "at rest"), no window
                # open, nothing being applied: the process holds its models and caches alone.
                "at_rest": (current is None and self.window is None and not sealed
                            and self._feeder_idle.is_set() and self._ready.empty()),
                # Where its RSS grows: allocated (in use) or kept free in the arenas.
                "heap": heap.usage(),
                "stage_seconds": {k: round(v, 6) for k, v in self.clock.seconds.items()}}

    def _heartbeat_loop(self) -> None:
        period = self.settings.heartbeat_seconds
        # The details must outlive the window in which readers still count the worker.
        details_ttl = math.ceil(self.settings.worker_silence_seconds) + 1
        while True:
            try:
                publish_heartbeat(self.r, self.id, self.heartbeat_details(),
                                  self.settings.worker_silence_seconds, details_ttl)
                with self._lock:
                    held = list(self._held.values())
                    current, progress = self._current, self._progress
                    sealed = list(self._sealed.items())
                for d, ok in zip(held, self.queue.refresh_many(held, self.id)):
                    if not ok:
                        with self._lock:
                            self._lost.add(d.job_id)
                if current is not None and progress is not None and current.job_id not in self._lost:
                    self.queue.progress(current, *progress)
                for cp, (pair, until) in sealed:
                    if time.monotonic() < until:
                        self.checkpointer.renew(pair, cp)
            except redis.RedisError as exc:
                log.debug("heartbeat failed: %s", exc)
            if self._beat_stop.wait(period):
                return
