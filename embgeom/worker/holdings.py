"""What one worker holds, under one lock: the heartbeat thread reads it while the main,
feeder and applier threads change it."""

from __future__ import annotations

import threading
from typing import Optional

from embgeom.store import keys as K
from embgeom.store.jobs import Delivery


class Holdings:
    """Every delivery the worker holds (the heartbeat keeps their leases), those another
    delivery took over, the job in hand and its progress, and the checkpoints being
    applied (the heartbeat renews their leases until a time)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: dict[str, Delivery] = {}
        self._lost: set[str] = set()
        self._current: Optional[Delivery] = None
        self._progress: Optional[tuple[float, int]] = None
        self._sealed: dict[str, tuple[K.PairKeys, float]] = {}  # checkpoint -> (pair, renew until)

    # ------------------------------------------------------------- deliveries
    def hold(self, d: Delivery) -> None:
        with self._lock:
            self._held[d.job_id] = d

    def release(self, d: Delivery) -> None:
        """No longer held (nor refreshed): its lease runs out unless it is acknowledged."""
        with self._lock:
            self._held.pop(d.job_id, None)
            self._lost.discard(d.job_id)

    def mark_lost(self, job_id: str) -> None:
        with self._lock:
            self._lost.add(job_id)

    def is_lost(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._lost

    # ------------------------------------------------------------ job in hand
    def start_job(self, d: Optional[Delivery]) -> None:
        """The job in hand (None: none), its progress not yet known."""
        with self._lock:
            self._current, self._progress = d, None

    def current(self) -> Optional[Delivery]:
        with self._lock:
            return self._current

    def progress(self, fraction: float, tokens: Optional[int]) -> bool:
        """Record the job in hand's progress; True when another delivery took it over."""
        with self._lock:
            self._progress = (fraction, tokens or 0)
            return self._current is not None and self._current.job_id in self._lost

    # ---------------------------------------------------- checkpoints applied
    def applying(self, cp: str, pair: K.PairKeys, renew_until: float) -> None:
        with self._lock:
            self._sealed[cp] = (pair, renew_until)

    def applied(self, cp: str) -> None:
        with self._lock:
            self._sealed.pop(cp, None)

    def snapshot(self) -> tuple[list[Delivery], Optional[Delivery], Optional[tuple[float, int]],
                                list[tuple[str, tuple[K.PairKeys, float]]]]:
        """At one instant: the deliveries held, the job in hand, its progress, the
        checkpoints being applied."""
        with self._lock:
            return (list(self._held.values()), self._current, self._progress,
                    list(self._sealed.items()))
