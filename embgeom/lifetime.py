"""Child processes that do not outlive the process that started them.

An embedded ``serve`` starts a ``redis-server`` and worker processes. Killed with SIGKILL
(the kernel's out-of-memory killer sends it), it runs no cleanup of its own: its children
would be reparented to init and keep running, holding the data folder. Two guards:

* Linux: the child asks the kernel for a signal when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``, set between fork and exec and kept across exec). The
  kernel sends it when the *thread* that forked the child ends, not the process: every
  child is therefore forked by one thread of this module that lives as long as the
  process, never by a request, pool or lifespan thread that may end first.
* Elsewhere (no ``prctl``): a watchdog process, itself a child of the parent, polls its
  own parent id; once it changes (the parent is gone, the watchdog was reparented) it
  signals the child and ends. It also ends when the child is gone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Optional

__all__ = ["Child", "spawn", "parent_death_signal_available", "watch", "in_spawner_thread",
           "die_with_parent"]

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _load_prctl():
    """libc's ``prctl``, resolved in the parent (a forked child only calls it); None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _load_prctl()


def parent_death_signal_available() -> bool:
    """Whether the kernel can signal a child when its parent dies (Linux ``prctl``)."""
    return _PRCTL is not None


def _in_child(parent: int, death_signal: Optional[int], nice: Optional[int]) -> None:
    """Runs in the forked child before exec (``preexec_fn``): no locks, no imports."""
    if death_signal is not None:
        if _PRCTL(PR_SET_PDEATHSIG, death_signal, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:
            # The parent died between fork and prctl: nobody would send the signal.
            os.kill(os.getpid(), death_signal)
    if nice:
        os.nice(nice)


class Child(subprocess.Popen):
    """A ``Popen`` whose watchdog (fallback mode only) is ended when the child is reaped."""

    watchdog: Optional[subprocess.Popen] = None

    def wait(self, timeout=None):
        code = super().wait(timeout)
        if self.watchdog is not None and self.watchdog.poll() is None:
            self.watchdog.kill()
            self.watchdog.wait()
        return code


class _Spawner:
    """One daemon thread that forks every child: it ends only with the process."""

    def __init__(self):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def popen(self, cls, args, kwargs) -> subprocess.Popen:
        return self.call(cls, args, **kwargs)

    def call(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` run on the spawner thread; its result or exception."""
        with self._lock:
            # is_alive() is False in a forked copy of this process: it gets its own thread.
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="embgeom-spawner",
                                                daemon=True)
                self._thread.start()
        done: Future = Future()
        self._requests.put((fn, args, kwargs, done))
        return done.result()

    def _loop(self) -> None:
        while True:
            fn, args, kwargs, done = self._requests.get()
            try:
                done.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to the caller's thread
                done.set_exception(exc)


_SPAWNER = _Spawner()


def spawn(args: list[str], *, death_signal: int = signal.SIGTERM, nice: Optional[int] = None,
          watchdog: Optional[bool] = None, **popen_kwargs) -> Child:
    """Start ``args`` as a child that gets ``death_signal`` when this process dies.

    ``watchdog``: None picks ``prctl`` where available, else a watchdog process; True forces
    the watchdog (tests of the fallback). Other keywords go to ``subprocess.Popen``.
    """
    use_watchdog = (not parent_death_signal_available()) if watchdog is None else watchdog
    parent = os.getpid()
    preexec = functools.partial(_in_child, parent, None if use_watchdog else int(death_signal), nice)
    child = _SPAWNER.popen(Child, args, {**popen_kwargs, "preexec_fn": preexec})
    if use_watchdog:
        child.watchdog = _SPAWNER.popen(
            subprocess.Popen,
            [sys.executable, "-m", "embgeom.lifetime", str(parent), str(child.pid), str(int(death_signal))],
            {"stdin": subprocess.DEVNULL, "start_new_session": True})
    return child


def in_spawner_thread(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, run on the thread that forks every child of this module.

    A process that ``fn`` starts (a process pool's child, started on its first submit) is
    then signalled by :func:`die_with_parent` when this *process* dies, not when the
    request or pool thread that happened to start it ends.
    """
    return _SPAWNER.call(fn, *args, **kwargs)


def die_with_parent(parent: int, death_signal: int = signal.SIGKILL) -> None:
    """Called in a child (a pool's initializer): get ``death_signal`` once ``parent`` dies.

    ``prctl(PR_SET_PDEATHSIG)`` where available (the child must have been started by
    :func:`in_spawner_thread`), else a daemon thread polling the parent id as :func:`watch`.
    """
    if parent_death_signal_available():
        _in_child(parent, int(death_signal), None)
        return
    threading.Thread(target=watch, args=(parent, os.getpid(), int(death_signal)),
                     name="embgeom-parent-watch", daemon=True).start()


def watch(parent: int, child: int, death_signal: int, period: float = 0.2) -> int:
    """Send ``death_signal`` to ``child`` once this process's parent is no longer ``parent``;
    return when that is done or the child is gone."""
    while True:
        if os.getppid() != parent:
            try:
                os.kill(child, death_signal)
            except ProcessLookupError:
                pass
            return 0
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return 0
        time.sleep(period)


if __name__ == "__main__":
    sys.exit(watch(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
