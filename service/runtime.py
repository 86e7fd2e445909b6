"""What the app holds while it runs: Redis, the model registry, the queue and store, and
(in embedded mode) the Redis server process and in-process workers. Opened and closed by
the app's lifespan; routes get them through ``service.deps``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Optional

import redis

from embgeom.models import ModelPool, ModelRegistry
from embgeom.queue import JobQueue
from embgeom.redis_server import RedisServer
from embgeom.settings import Settings
from embgeom.store import AccumulatorStore
from embgeom.worker import Worker, live_workers, redis_client

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    settings: Settings
    redis: redis.Redis
    registry: ModelRegistry
    queue: JobQueue
    store: AccumulatorStore
    server: Optional[RedisServer] = None
    workers: list[Worker] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    _sync_pool: Optional[ModelPool] = None

    @property
    def embedded(self) -> bool:
        return self.server is not None

    def live_workers(self) -> list[dict]:
        """Heartbeat details of the workers heard from within the silence window."""
        return live_workers(self.redis, self.settings.worker_silence_seconds)

    @property
    def sync_pool(self) -> ModelPool:
        """Models for synchronous requests (probe, isotropy sample), loaded on demand."""
        if self._sync_pool is None:
            if self.workers:  # embedded: share the worker's models
                self._sync_pool = self.workers[0].pool
            else:
                self._sync_pool = ModelPool.from_settings(self.registry, self.settings)
        return self._sync_pool

    @classmethod
    def open(cls, settings: Settings) -> "Runtime":
        server = None
        url = settings.redis_url
        if url is None:
            server = RedisServer(settings.data_dir / "redis").start()
            url = server.url
            log.info("embedded Redis on %s, data in %s", url, server.data_dir)
        client = redis_client(url)
        registry = ModelRegistry.from_settings(settings)
        rt = cls(
            settings=settings, redis=client, registry=registry,
            queue=JobQueue(client, settings.max_attempts, settings.max_pending_jobs,
                           settings.idempotency_ttl_seconds),
            store=AccumulatorStore(client), server=server,
        )
        if server is not None:
            for i in range(settings.embedded_workers):
                pool = rt.workers[0].pool if rt.workers else None
                worker = Worker(redis_client(url), settings, registry, pool=pool)
                thread = threading.Thread(target=worker.run, name=f"worker-{i}", daemon=True)
                rt.workers.append(worker)
                rt.threads.append(thread)
                thread.start()
        return rt

    def close(self) -> None:
        for worker in self.workers:
            worker.request_stop(grace_seconds=10)
        for thread in self.threads:
            thread.join(timeout=30)
        self.redis.close()
        if self.server is not None:
            self.server.stop()
