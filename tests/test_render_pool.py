"""The render processes (:mod:`embgeom.render_pool`): owned by the API process (they
outlive the request thread that started them, not the process), and single flight.

The process test reads ``/proc`` (Linux, where the parent-death signal is used).
"""

from __future__ import annotations

import os
import textwrap
import threading
import time

import pytest

from embgeom.errors import Overloaded
from embgeom.render_pool import RenderPool, SingleFlight
from tests.test_lifetime import alive, assert_child_outlives_its_thread_not_its_parent, wait_gone


def pid_job(read, reader) -> int:
    """A render job that answers the process it ran in."""
    return os.getpid()


PARENT = textwrap.dedent("""
    import sys, threading, time
    from embgeom.render_pool import RenderPool
    from tests.test_render_pool import pid_job

    pool = RenderPool(1, "redis://127.0.0.1:9/0", 1.0)
    out = {}
    # A short-lived thread (as a request thread) starts the render process.
    t = threading.Thread(target=lambda: out.update(pid=pool.run(pid_job)))
    t.start(); t.join()
    print(out["pid"], flush=True)
    time.sleep(600)
""")


def test_a_render_process_outlives_its_request_thread_but_not_the_api():
    assert_child_outlives_its_thread_not_its_parent(PARENT)


def test_no_render_processes_runs_jobs_inline():
    pool = RenderPool(0, "redis://127.0.0.1:9/0", 1.0, read="read", reader="reader")
    assert pool.run(lambda read, reader, x: (read, reader, x, os.getpid()), 1) == \
        ("read", "reader", 1, os.getpid())
    assert pool.pids() == []


def test_drawings_beyond_the_bound_are_overloaded_and_the_bound_frees_up():
    """max_queued=2: two drawings running or waiting, a third is 429 overloaded at once
    (render_queue_full); once they end, drawings are taken again."""
    release = threading.Event()
    pool = RenderPool(0, "redis://127.0.0.1:9/0", 1.0, max_queued=2)
    blocked = [threading.Thread(target=pool.run, args=(lambda read, reader: release.wait(10),))
               for _ in range(2)]
    for t in blocked:
        t.start()
    deadline = time.monotonic() + 10
    while pool.queued < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(Overloaded) as refused:
        pool.run(lambda read, reader: "drawn")
    assert refused.value.detail.get("reason") == "render_queue_full"
    release.set()
    for t in blocked:
        t.join()
    assert pool.queued == 0 and pool.run(lambda read, reader: "drawn") == "drawn"


def test_single_flight_runs_one_call_per_key_at_a_time():
    flight = SingleFlight()
    calls, barrier = [], threading.Barrier(6)
    results = [None] * 6

    def make():
        calls.append(1)
        time.sleep(0.3)  # the others arrive meanwhile
        return object()

    def ask(i):
        barrier.wait()
        results[i] = flight.do("k", make)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and flight.shared == 5
    assert all(r is results[0] for r in results)
    # Once it returned nothing is kept: the next call runs again.
    assert flight.do("k", make) is not results[0] and len(calls) == 2


def test_single_flight_hands_the_error_to_every_waiter():
    flight = SingleFlight()
    barrier = threading.Barrier(3)
    errors = []

    def make():
        time.sleep(0.3)
        raise ValueError("drawing failed")

    def ask():
        barrier.wait()
        try:
            flight.do("k", make)
        except ValueError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == ["drawing failed"] * 3


def test_the_pool_ends_its_processes_on_close():
    pool = RenderPool(1, "redis://127.0.0.1:9/0", 1.0)
    pid = pool.run(pid_job)
    assert pid != os.getpid() and alive(pid)
    pool.close()
    assert not wait_gone([pid], timeout=10)
