"""Handing freed heap memory back to the system, so a long-lived process's RSS follows
what it holds rather than the most it ever held.

glibc's malloc keeps freed chunks in its arenas for reuse and returns memory only from
the top of a heap. A service that allocates reply buffers, arrays and windows of varying
sizes from several threads fragments its arenas: the bytes in use stay flat while the
free bytes kept in the arenas grow, and the RSS with them (the soak's heap probe shows it).
``malloc_trim(0)`` gives every whole free page inside those arenas back (``madvise``),
whatever its place in the heap. :class:`HeapTrimmer` calls it every few seconds from a
thread of its own. :func:`limit_arenas` keeps a process's threads on a few arenas, so free
memory is reused rather than kept in one arena per thread, and :func:`usage` tells what
the program holds from what the arenas keep free (the soak records it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import re
import threading
import time
from typing import Optional

__all__ = ["trim", "limit_arenas", "HeapTrimmer", "usage", "parse_malloc_info"]

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _libc():
    """glibc, with the types of the functions this module calls; None where the C library
    lacks one of them (not glibc: musl has no ``malloc_trim`` nor ``malloc_info``)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        for name in ("malloc_trim", "mallopt", "malloc_info", "open_memstream", "fclose", "free"):
            getattr(libc, name)
    except (OSError, AttributeError):
        return None
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.open_memstream.restype = ctypes.c_void_p
    libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def trim() -> bool:
    """Return the free pages of every malloc arena to the system; False where the C
    library cannot (then nothing is done)."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)


def limit_arenas(count: int) -> bool:
    """Cap the number of glibc malloc arenas at ``count`` (``mallopt(M_ARENA_MAX)``); 0
    leaves glibc's default (8 per core: 16 on two cores). Call it before the process
    starts its threads: arenas made before stay.

    Under the default each new thread that allocates gets an arena of its own, and free
    memory in one arena serves no other: a worker (a forward thread, a checkpoint applier,
    a feeder, torch's threads) gets about a dozen arenas whose free part grows at rest
    while what it holds stays flat. Returns False where it cannot (not glibc)."""
    libc = _libc()
    if libc is None or count <= 0:
        return False
    return bool(libc.mallopt(M_ARENA_MAX, int(count)))


_MB = 1 << 20


def parse_malloc_info(xml: str) -> dict:
    """Totals of glibc's ``malloc_info`` XML, in MB (floats) and counts.

    ``arenas``: the number of ``<heap>`` elements (malloc arenas); ``system_mb``: bytes the
    arenas hold from the system (``<system type="current">``); ``free_mb``: free chunks
    kept in them (``<total type="fast">`` + ``<total type="rest">``; trimmed pages of
    those chunks count here though they are no longer resident); ``in_use_mb``: system
    minus free, what the program has allocated; ``mmap_mb``: chunks served by their own
    ``mmap`` (``<total type="mmap">``), outside the arenas."""
    totals = xml[xml.rfind("</heap>"):] if "</heap>" in xml else xml

    def size(kind: str, typ: str) -> int:
        m = re.search(rf'<{kind} type="{typ}"[^>]*?size="(\d+)"', totals)
        return int(m.group(1)) if m else 0

    system = size("system", "current")
    free = size("total", "fast") + size("total", "rest")
    return {"arenas": len(re.findall(r"<heap nr=", xml)),
            "system_mb": round(system / _MB, 1), "free_mb": round(free / _MB, 1),
            "in_use_mb": round((system - free) / _MB, 1), "mmap_mb": round(size("total", "mmap") / _MB, 1)}


def usage() -> Optional[dict]:
    """The C heap of this process now (:func:`parse_malloc_info`), or None where the C
    library has no ``malloc_info``. Where RSS grows, this says whether the program holds
    more (``in_use_mb``) or the arenas keep more free memory (fragmentation, ``free_mb``)."""
    libc = _libc()
    if libc is None:
        return None
    buf, length = ctypes.c_void_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(length))
    if not stream:
        return None
    try:
        libc.malloc_info(0, stream)
    finally:
        libc.fclose(stream)  # flushes: buf and length are valid from here
    try:
        xml = ctypes.string_at(buf, length.value).decode("ascii", "replace")
    finally:
        libc.free(buf)
    return parse_malloc_info(xml)


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
        if self.seconds > 0 and _libc() is not None and self._thread is None:
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
