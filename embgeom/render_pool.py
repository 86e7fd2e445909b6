"""Figures and report pages drawn off the API's interpreter, each once.

    RenderPool(processes, redis_url, store_timeout, nice).run(job, *args) -> job's result
    SingleFlight().do(key, make)                                   -> make()'s result

Why: a cold report page is seconds of Redis reads, numpy and matplotlib (cProfile;
docs/figures_report.md), nearly all of it Python holding the GIL; drawn on the API's
thread pool it would stall every request of the process, token reads and ``/healthz``
included, and concurrent requests for the same page would each draw it.

A job is a module-level function ``job(read, reader, *args)`` (``read`` runs a read plan,
``reader`` is a :class:`~embgeom.store.reader.Reader`): :class:`RenderPool` runs it in a
child process with the child's own Redis client and reader, so the API thread that
waits for it holds no GIL; with ``processes=0`` it runs in the caller's thread on the
API's client (tests, a machine where processes cannot be started).

Children: ``processes`` of them at most (spawn: no copy of the API's threads, sockets
or models), started on first use from :func:`embgeom.lifetime.in_spawner_thread` and
signalled SIGKILL when the API process dies (:func:`embgeom.lifetime.die_with_parent`),
at niceness ``nice``: where cores are short, the API's reads come before drawing (as
they come before an embedded worker's forward passes).
A child that dies (the out-of-memory killer) breaks its pool: the job is retried once on
a new pool, and a second break is 429 ``overloaded`` (Retry-After), never a 500.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Hashable, Optional

from embgeom.errors import Overloaded
from embgeom.lifetime import die_with_parent, in_spawner_thread

__all__ = ["RenderPool", "SingleFlight"]

# The child's read runner and reader (set by _child_init, once per child).
_CHILD: dict = {}


def _child_init(parent: int, redis_url: str, store_timeout: float, nice: int) -> None:
    """A pool child's start: die with the API, yield the CPU to it, open its own client,
    load matplotlib."""
    die_with_parent(parent, signal.SIGKILL)
    if nice:
        os.nice(nice)
    from embgeom import renders  # noqa: F401  (matplotlib before the first job, not in it)
    from embgeom.store.connection import redis_client
    from embgeom.store.reader import Reader, run_sync

    client = redis_client(redis_url, socket_timeout=store_timeout)
    _CHILD["read"] = lambda plan: run_sync(client, plan)
    _CHILD["reader"] = Reader()


def _run_in_child(job: Callable, args: tuple) -> Any:
    return job(_CHILD["read"], _CHILD["reader"], *args)


class RenderPool:
    """At most ``processes`` child processes that run render jobs; 0 runs them inline
    with ``read`` and ``reader`` (the API's own). At most ``max_queued`` jobs run or wait
    at once (0: no bound); one more is ``overloaded`` (429), so a burst of distinct
    requests cannot queue drawings without end."""

    def __init__(self, processes: int, redis_url: str, store_timeout: float, nice: int = 0,
                 read: Optional[Callable] = None, reader: Any = None, max_queued: int = 0):
        self.processes = processes
        self.max_queued = max_queued
        self.queued = 0  # jobs running or waiting
        self._init_args = (os.getpid(), redis_url, store_timeout, nice)
        self._read, self._reader = read, reader
        self._pool: Optional[ProcessPoolExecutor] = None
        self._lock = threading.Lock()
        self._closed = False

    def run(self, job: Callable, *args) -> Any:
        """``job(read, reader, *args)`` in a child (or inline); its result or exception."""
        with self._lock:
            if self.max_queued and self.queued >= self.max_queued:
                raise Overloaded(f"{self.queued} drawings are in progress or waiting; retry shortly",
                                 reason="render_queue_full")
            self.queued += 1
        try:
            return self._run(job, args)
        finally:
            with self._lock:
                self.queued -= 1

    def _run(self, job: Callable, args: tuple) -> Any:
        if self.processes <= 0:
            return job(self._read, self._reader, *args)
        for attempt in range(2):
            pool = self._current()
            try:
                # Submitted from the spawner thread: a child the pool starts on this
                # submit is then signalled by the process's death, not this thread's end.
                future: Future = in_spawner_thread(pool.submit, _run_in_child, job, args)
                return future.result()
            except BrokenProcessPool:
                self._discard(pool)
        raise Overloaded("the figure process ended while drawing; retry",
                         reason="render_process_ended")

    def pids(self) -> list[int]:
        """Process ids of the children started so far (tests)."""
        pool = self._pool
        return [p.pid for p in (getattr(pool, "_processes", None) or {}).values()] if pool else []

    def _current(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise Overloaded("the service is stopping", reason="stopping")
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    self.processes, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_child_init, initargs=self._init_args)
            return self._pool

    def _discard(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """End the children (jobs not started are cancelled)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


class SingleFlight:
    """Concurrent calls with one key share one ``make()``: the first caller runs it, the
    others wait for its result (or its exception). Nothing is kept once it returns."""

    def __init__(self):
        self._calls: dict[Hashable, Future] = {}
        self._lock = threading.Lock()
        self.shared = 0  # calls that waited for another's result

    def do(self, key: Hashable, make: Callable[[], Any]) -> Any:
        with self._lock:
            call = self._calls.get(key)
            leader = call is None
            if leader:
                call = self._calls[key] = Future()
            else:
                self.shared += 1
        if not leader:
            return call.result()
        try:
            result = make()
        except BaseException as exc:
            call.set_exception(exc)
            raise
        else:
            call.set_result(result)
            return result
        finally:
            with self._lock:
                del self._calls[key]
