"""Handing freed heap memory back to the system, so a long-lived process's RSS follows
what it holds rather than the most it ever held.

glibc's malloc keeps freed chunks in its arenas for reuse and returns memory only from
the top of a heap. A service that allocates reply buffers, arrays and windows of varying
sizes from several threads fragments its arenas: measured in the soak (the API's
``malloc_info`` every 90 s over 7 minutes), the bytes in use stayed at about 305 MB
while the free bytes kept in the arenas grew from 403 to 431 MB, and the RSS with them.
``malloc_trim(0)`` gives every whole free page inside those arenas back (``madvise``),
whatever its place in the heap. :class:`HeapTrimmer` calls it every few seconds from a
thread of its own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import threading
import time
from typing import Optional

__all__ = ["trim", "HeapTrimmer"]

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """libc's ``malloc_trim``, or None where the C library has none (not glibc)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def trim() -> bool:
    """Return the free pages of every malloc arena to the system; False where the C
    library cannot (then nothing is done)."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


class HeapTrimmer:
    """A daemon thread calling :func:`trim` every ``seconds`` (0: never), until
    :meth:`stop`. Its owner is the process's runtime (the API's, a worker's)."""

    def __init__(self, seconds: float, name: str = "heap-trimmer"):
        self.seconds = float(seconds)
        self.trims = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._name = name

    def start(self) -> "HeapTrimmer":
        if self.seconds > 0 and _malloc_trim() is not None and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.seconds):
            t0 = time.perf_counter()
            trim()
            self.trims += 1
            log.debug("malloc_trim took %.1f ms", 1000 * (time.perf_counter() - t0))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
