"""The worker's stop request, seen by every thread."""

from __future__ import annotations

import threading
import time
from typing import Optional


class StopRequest:
    """Set once. With a grace period (a SIGTERM), the current job is finished if it ends
    before the deadline; past it, jobs not yet sealed are handed back."""

    def __init__(self):
        self.event = threading.Event()
        self.deadline: Optional[float] = None

    def request(self, grace_seconds: float) -> None:
        self.deadline = time.monotonic() + grace_seconds
        self.event.set()

    def set(self) -> None:
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()

    def wait(self, seconds: float) -> bool:
        return self.event.wait(seconds)

    def past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline
