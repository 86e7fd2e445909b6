"""The concurrency gate: how many comparisons may compute at once in one API process.

Every computation is CPU-bound and runs on a worker thread; beyond
``geometry_max_concurrent`` of them a request waits half a second for a slot, then is
refused with ``overloaded`` (429) rather than queued behind minutes of work.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

from embgeom.errors import Overloaded

__all__ = ["Gate"]

T = TypeVar("T")

# How long a request waits for a slot before it is refused.
WAIT_SECONDS = 0.5


class Gate:
    """At most ``max_concurrent`` calls of :meth:`run` at once."""

    def __init__(self, max_concurrent: int = 2):
        self._slots = threading.BoundedSemaphore(max_concurrent)

    def run(self, compute: Callable[[], T]) -> T:
        """``compute()`` in a slot; ``overloaded`` when none frees up in time."""
        if not self._slots.acquire(timeout=WAIT_SECONDS):
            raise Overloaded("too many geometry computations in progress; retry shortly")
        try:
            return compute()
        finally:
            self._slots.release()

