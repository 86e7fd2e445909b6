"""The store clients one worker's parts share."""

from __future__ import annotations

from dataclasses import dataclass

import redis

from embgeom.settings import Settings
from embgeom.store.checkpoints import Checkpointer
from embgeom.store.collections import Collections
from embgeom.store.delivery import WorkerQueue


@dataclass
class Stores:
    """One object for all the parts, read at each call: a client replaced on it (a test's
    queue that fails on purpose) is the one every part uses."""

    r: redis.Redis
    queue: WorkerQueue
    collections: Collections
    checkpointer: Checkpointer

    @classmethod
    def open(cls, client: redis.Redis, settings: Settings, worker_id: str) -> "Stores":
        lease_ms = int(settings.lease_seconds * 1000)
        return cls(
            client,
            WorkerQueue(client, settings.max_attempts, retention_seconds=settings.retention_seconds),
            Collections(client),
            Checkpointer(client, worker_id, piece_bytes=settings.piece_bytes, lock_ms=lease_ms,
                         horizon_ms=int(settings.checkpoint_horizon_seconds * 1000),
                         lease_ms=lease_ms, max_segments=settings.max_segments,
                         retention_seconds=settings.retention_seconds))
