"""How a job leaves one worker's hands: released, handed back, or failed as an attempt."""

from __future__ import annotations

import logging

import redis

from embgeom.errors import EmbgeomError
from embgeom.store.jobs import Delivery
from embgeom.worker.holdings import Holdings
from embgeom.worker.stores import Stores

log = logging.getLogger(__name__)


class Returns:
    """Released: left pending under this worker, its lease runs out (or it is recovered).
    Handed back: queued again, the attempt not counted. Failed: the attempt counts; its
    last one fails the job."""

    def __init__(self, stores: Stores, holdings: Holdings, max_attempts: int):
        self.stores = stores
        self.holdings = holdings
        self.max_attempts = max_attempts

    def release(self, d: Delivery) -> None:
        self.holdings.release(d)

    def hand_back(self, d: Delivery) -> None:
        """Give a job back to the queue without counting the attempt."""
        try:
            self.stores.queue.retry_later(d, "", attempt_counts=False)
        except redis.RedisError as exc:
            log.debug("could not hand back %s: %s", d.job_id, exc)
        self.release(d)

    def fail_attempt(self, d: Delivery, exc: BaseException) -> None:
        error = exc.message if isinstance(exc, EmbgeomError) else f"{type(exc).__name__}: {exc}"
        if d.attempts >= self.max_attempts:
            self.stores.queue.fail(d.pair, d.job_id, d.stream, d.entry_id,
                                   f"failed after {d.attempts} attempts: {error}", epoch=d.epoch)
        else:
            self.stores.queue.retry_later(d, error)
        self.release(d)
