"""Seconds spent per stage of the worker (published in its heartbeat, read by the benchmarks)."""

from __future__ import annotations

import time
from collections import defaultdict


class StageClock:
    """Seconds and counts per stage, added up over the worker's life."""

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
