"""What the app holds while it runs: Redis clients, the model registry, the queue, the
collections and the reader, and in embedded mode the Redis server process and the worker
processes. Opened and closed by the app's lifespan; routes get them through
``service.deps``.

In embedded mode the workers are separate ``embgeom worker`` processes, as in
production: a worker's forward passes and merges never hold this process's interpreter,
so reads stay fast while ingestion runs. They and the Redis server die with this process,
SIGKILL included (``embgeom.lifetime``), and a worker is given only the settings a worker
reads (``Settings.worker_environment``: no API keys).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import redis
from starlette.concurrency import run_in_threadpool

from embgeom.compute.catalogue import ModelInfo, ModelRegistry
from embgeom.heap import HeapTrimmer, limit_arenas
from embgeom.lifetime import spawn
from embgeom.render_pool import RenderPool
from embgeom.renders import RenderCache, Renderer
from embgeom.settings import Settings
from embgeom.store.collections import Collections
from embgeom.store.connection import async_redis_client, redis_client
from embgeom.store.heartbeats import live_workers
from embgeom.store.reader import Reader, run_async, run_sync
from embgeom.store.server import RedisServer
from embgeom.store.submission import JobSubmitter
from service.limits import SyncRuns
from service.sync_models import SyncModels

if TYPE_CHECKING:  # the pool is torch's: imported on the first synchronous model run
    from embgeom.compute.models import ModelPool

log = logging.getLogger(__name__)


def settings_environment(settings: Settings) -> dict[str, str]:
    """``EMBGEOM_*`` variables that reproduce ``settings`` in a child process."""
    return settings.environment()


@dataclass
class Runtime:
    settings: Settings
    redis: redis.Redis
    aredis: object
    registry: ModelRegistry
    queue: JobSubmitter
    collections: Collections
    reader: Reader
    server: Optional[RedisServer] = None
    redis_url: str = ""  # what the render processes connect to
    workers: list = field(default_factory=list)   # embedded worker processes
    heap_trimmer: Optional[HeapTrimmer] = None
    _sync_pool: Optional[ModelPool] = None
    _sync_models: Optional[SyncModels] = None
    # Makes the sync pool and its loader once: two first requests made two pools (and
    # loaded the model twice) when the pool was made lazily without it.
    _sync_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _sync_runs: Optional[SyncRuns] = None
    _renderer: Optional[Renderer] = None

    async def read(self, plan):
        """Run a read plan on the async client (within ``store_timeout_seconds``)."""
        return await run_async(self.aredis, plan, self.settings.store_timeout_seconds)

    # A model's first read waits for its configuration and tokenizer (a child reads them:
    # seconds). On the event loop that stalled every request meanwhile, /healthz included;
    # these wait on the thread pool instead, and answer from the registry's cache after.
    async def model_info(self, model: str) -> ModelInfo:
        if self.registry.info_loaded(model):
            return self.registry.info(model)
        return await run_in_threadpool(self.registry.info, model)

    async def vocabulary(self, model: str):
        """What reads need of ``model``'s tokenizer (:meth:`ModelRegistry.vocabulary`)."""
        if self.registry.vocabulary_loaded(model):
            return self.registry.vocabulary(model)
        return await run_in_threadpool(self.registry.vocabulary, model)

    def read_sync(self, plan):
        """Run a read plan on the sync client (CPU-heavy reads, on the thread pool)."""
        return run_sync(self.redis, plan)

    @property
    def embedded(self) -> bool:
        return self.server is not None

    def live_workers(self) -> list[dict]:
        """Heartbeat details of the workers heard from within the silence window."""
        return live_workers(self.redis, self.settings.worker_silence_seconds)

    @property
    def sync_pool(self) -> ModelPool:
        """Models for synchronous requests (probe, isotropy sample, geometry), one pool
        per process, made on first use."""
        if self._sync_pool is None:
            from embgeom.compute.models import ModelPool  # torch, only once a model runs here

            with self._sync_lock:
                if self._sync_pool is None:
                    self._sync_pool = ModelPool.from_settings(self.registry, self.settings)
        return self._sync_pool

    @property
    def sync_models(self) -> SyncModels:
        """The way requests get a model of :attr:`sync_pool`: loaded, or loaded on first
        use while the request waits (``model_load_wait_seconds``; 503 ``model_loading``
        past it)."""
        if self._sync_models is None:
            with self._sync_lock:
                if self._sync_models is None:
                    self._sync_models = SyncModels(lambda: self.sync_pool,
                                                   self.settings.model_load_wait_seconds)
        return self._sync_models

    @property
    def sync_runs(self) -> SyncRuns:
        """The bound on synchronous model runs at once (``max_sync_runs``; 429 beyond)."""
        if self._sync_runs is None:
            self._sync_runs = SyncRuns(self.settings.max_sync_runs)
        return self._sync_runs

    @property
    def renderer(self) -> Renderer:
        """Figures and report pages: the render cache and the processes that draw
        (``render_cache_mb``, ``render_processes``, ``render_wait_seconds``,
        ``render_max_stale_seconds``), made on first use, ended by :meth:`close`."""
        if self._renderer is None:
            with self._sync_lock:
                if self._renderer is None:
                    s = self.settings
                    pool = RenderPool(s.render_processes, self.redis_url, s.store_timeout_seconds,
                                      s.render_nice, read=self.read_sync, reader=self.reader,
                                      max_queued=s.render_max_queued)
                    self._renderer = Renderer(RenderCache(s.render_cache_mb << 20), pool,
                                              s.render_max_stale_seconds, s.render_wait_seconds)
        return self._renderer

    @classmethod
    def open(cls, settings: Settings) -> "Runtime":
        server = None
        url = settings.redis_url
        if url is None:
            server = RedisServer(settings.data_dir / "redis").start()
            url = server.url
            log.info("embedded Redis on %s, data in %s", url, server.data_dir)
        # The sync client serves the thread-pool routes: a command Redis does not answer
        # within store_timeout_seconds is a 503 there too, as on the async reads.
        client = redis_client(url, socket_timeout=settings.store_timeout_seconds)
        # A model's files are read in a child: transformers holds the GIL while it reads a
        # tokenizer, which stalled every request on the event loop (embgeom.compute.catalogue).
        registry = ModelRegistry.from_settings(settings, files_in_child=True)
        rt = cls(
            settings=settings, redis=client, aredis=async_redis_client(url), registry=registry,
            queue=JobSubmitter(client, settings.max_pending_jobs, settings.idempotency_ttl_seconds),
            collections=Collections(client), reader=Reader(), server=server, redis_url=url,
        )
        limit_arenas(settings.malloc_arenas)
        rt.heap_trimmer = HeapTrimmer(settings.heap_trim_seconds, "api-heap-trimmer").start()
        if server is not None:
            env = {**settings.worker_environment(), "EMBGEOM_REDIS_URL": url}
            for i in range(settings.embedded_workers):
                # SIGKILL when this process dies: its Redis is stopping too, so there is
                # nothing to hand back; the jobs it held are taken over after their lease.
                # --no-env-file: every setting it reads is in env, and .env holds keys.
                rt.workers.append(spawn(
                    [sys.executable, "-m", "embgeom.cli", "worker", "--no-env-file",
                     "--redis-url", url],
                    death_signal=signal.SIGKILL, nice=settings.embedded_worker_nice,
                    env=env, start_new_session=True))
        return rt

    def close(self) -> None:
        if self.heap_trimmer is not None:
            self.heap_trimmer.stop()
        if self._renderer is not None:
            self._renderer.close()
        for proc in self.workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.workers:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.redis.close()
        if self.server is not None:
            self.server.stop()
