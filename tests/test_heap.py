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


@pytest.mark.skipif(heap.usage() is None, reason="not glibc: malloc_info does not exist here")
def test_usage_tells_memory_held_from_memory_kept_free():
    """The soak's probe: 200 MB of 64 KiB blocks show as in use; freed under the survivors
    (fragmented), they move to the arenas' free part, which RSS alone cannot tell apart."""
    heap.trim()
    base = heap.usage()
    blocks = [bytearray(64 << 10) for _ in range(200 * 16)]
    full = heap.usage()
    keep = blocks[::64]
    del blocks
    gc.collect()
    fragmented = heap.usage()
    assert full["in_use_mb"] - base["in_use_mb"] > 180, (base, full)
    assert full["in_use_mb"] - fragmented["in_use_mb"] > 180, (full, fragmented)
    # Against the full heap, not the base: in a process whose arenas already kept free
    # chunks (the whole suite's), the blocks were carved from those.
    assert fragmented["free_mb"] - full["free_mb"] > 180, (full, fragmented)
    assert fragmented["arenas"] >= 1
    del keep


def test_parse_malloc_info_reads_glibcs_totals():
    """The totals after the last ``</heap>``, not a heap's own (its sizes come first)."""
    xml = ('<malloc version="1"><heap nr="0"><sizes></sizes><total type="fast" count="1" size="999"/>'
           '<total type="rest" count="1" size="999"/><system type="current" size="999"/></heap>'
           '<heap nr="1"><total type="fast" count="0" size="0"/></heap>'
           f'<total type="fast" count="3" size="{1 << 20}"/><total type="rest" count="4" size="{3 << 20}"/>'
           f'<total type="mmap" count="2" size="{5 << 20}"/><system type="current" size="{10 << 20}"/>'
           '<system type="max" size="99999999"/></malloc>')
    assert heap.parse_malloc_info(xml) == {"arenas": 2, "system_mb": 10.0, "free_mb": 4.0,
                                           "in_use_mb": 6.0, "mmap_mb": 5.0}


ARENAS_CHILD = """
import sys, threading
from embgeom import heap
if int(sys.argv[1]):
    assert heap.limit_arenas(int(sys.argv[1]))
go = threading.Barrier(8)
def churn():
    go.wait()  # all at once: each thread meets a busy arena and, uncapped, makes its own
    for _ in range(20000):
        bytearray(4096)
threads = [threading.Thread(target=churn) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
print(heap.usage()["arenas"])
"""


@pytest.mark.skipif(heap.usage() is None, reason="not glibc: malloc_info does not exist here")
def test_limit_arenas_caps_the_arenas_threads_make():
    """Eight threads allocating at once spread over several arenas under glibc's default
    (8 per core); capped at 2 (EMBGEOM_MALLOC_ARENAS' default) they share two. Each in a
    fresh process: the cap applies to arenas made after it."""
    import subprocess
    import sys

    def arenas(cap: int) -> int:
        out = subprocess.run([sys.executable, "-c", ARENAS_CHILD, str(cap)], capture_output=True,
                             text=True, timeout=120, check=True)
        return int(out.stdout.split()[-1])

    assert arenas(2) <= 2
    assert arenas(0) > 2
