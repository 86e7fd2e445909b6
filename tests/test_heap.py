"""Freed heap memory goes back to the system (embgeom.heap): without it, the RSS of a
long-lived process that fragments its malloc arenas only grows (the soak's API did)."""

import gc
import time

import pytest

from embgeom import heap


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024


def fragment(mb: int = 200) -> list:
    """Fill the heap with 64 KiB blocks (below the mmap threshold), then free all but
    every 64th: the survivors pin the heap's top, so only trimming inside it frees the
    rest. Returns the survivors (keep them alive)."""
    blocks = [bytearray(64 << 10) for _ in range(mb * 16)]  # touched: zero-filled
    keep = blocks[::64]
    del blocks
    gc.collect()
    return keep


@pytest.mark.skipif(not heap.trim(), reason="not glibc: malloc_trim does not exist here")
def test_trim_returns_the_free_pages_of_a_fragmented_heap():
    keep = fragment()
    before = rss_mb()
    heap.trim()
    after = rss_mb()
    # 200 MB allocated, 197 MB freed but pinned under the survivors: trimming hands back
    # most of it (pages of a free chunk, not the chunk headers beside the survivors).
    assert before - after > 100, (before, after)
    del keep


@pytest.mark.skipif(not heap.trim(), reason="not glibc: malloc_trim does not exist here")
def test_the_trimmer_thread_hands_back_memory_on_its_own_and_stops():
    """The heap fragmented first, the trimmer started after: the RSS falls by most of the
    197 MB freed without anyone calling trim. Measured as a fall from the fragmented high
    (not as a level against a base taken before), so memory other threads of the test
    process take meanwhile can only hide the fall, not fake it."""
    heap.trim()
    keep = fragment()
    high = rss_mb()
    trimmer = heap.HeapTrimmer(0.2).start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and high - rss_mb() < 100:
            time.sleep(0.1)
        assert high - rss_mb() > 100, "the trimmer did not hand the freed pages back"
    finally:
        trimmer.stop()
    # Counted once stopped: the fall shows while the thread is still inside its trim.
    assert trimmer.trims >= 1 and trimmer._thread is None
    del keep


def test_a_trimmer_of_zero_seconds_starts_no_thread():
    trimmer = heap.HeapTrimmer(0).start()
    assert trimmer._thread is None
    trimmer.stop()
