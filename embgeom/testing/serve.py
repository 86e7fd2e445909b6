"""``embgeom serve`` (or ``embgeom worker``) as a child process, and the wait for it.

A child is started through :func:`embgeom.lifetime.spawn`: it gets SIGTERM when the
process that started it dies (a test run or a benchmark killed half way leaves no
``serve`` holding a port, a data folder and its own Redis and workers). It runs in a
session of its own, so :meth:`ServiceProcess.kill` takes its whole process group.

:func:`wait_ready` is the one bounded wait for a service to answer: ``/readyz`` (Redis
reachable and a live worker) by default, ``/healthz`` where no worker is expected yet.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import httpx

from embgeom.lifetime import spawn
from embgeom.store.server import free_port

__all__ = ["REPO", "offline_env", "ServiceProcess", "wait_ready"]

REPO = Path(__file__).resolve().parents[2]
CLI = (sys.executable, "-m", "embgeom.cli")


def offline_env(**extra: str) -> dict:
    """This process's environment with the model hub off and this checkout first on the
    path (a child's ``-m embgeom.cli`` imports this tree, whatever its cwd)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}


def wait_ready(url: str, timeout: float = 120, process: Optional["ServiceProcess"] = None,
               path: str = "/readyz", ready: Optional[Callable[[], bool]] = None,
               poll: float = 0.2) -> None:
    """Return once ``GET url + path`` answers 200 (and ``ready()``, if given, is true);
    :class:`RuntimeError` as soon as ``process`` has exited, :class:`TimeoutError` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and not process.alive():
            where = f": see {process.log_path}" if process.log_path else ""
            raise RuntimeError(f"service exited with {process.returncode}{where}")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200 and (ready is None or ready()):
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    raise TimeoutError(f"{url}{path} not ready after {timeout:g}s")


class ServiceProcess:
    """``embgeom <args>`` as a child process that dies with this one, its output appended
    to ``log_path`` (discarded without one).

    ``env`` is added to this process's environment (a value None leaves a variable out); ``cwd`` is this checkout unless given;
    ``nice`` lowers the child's priority; ``program`` replaces ``python -m embgeom.cli``
    (the installed ``embgeom`` script, say). :meth:`start` may be called again after the
    child exited (a restart)."""

    def __init__(self, args: Sequence[str], env: Optional[dict] = None, log_path: Optional[Path] = None,
                 *, cwd: Optional[Path] = None, nice: Optional[int] = None,
                 program: Optional[Sequence[str]] = None):
        self.args = list(args)
        self.env = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
        self.log_path = log_path
        self.cwd = cwd or REPO
        self.nice = nice
        self.program = list(program or CLI)
        self.process: Optional[subprocess.Popen] = None
        self.url: Optional[str] = None

    @classmethod
    def serve(cls, *, data_dir: Optional[Path] = None, redis_url: Optional[str] = None,
              port: Optional[int] = None, extra: Sequence[str] = (), log_level: Optional[str] = None,
              **kwargs) -> "ServiceProcess":
        """``embgeom serve`` on ``port`` (a free one by default), embedded on ``data_dir`` or
        on ``redis_url``; ``url`` is where it answers. Not started yet."""
        port = port or free_port()
        args = ["--log-level", log_level] if log_level else []
        args += ["serve", "--port", str(port)]
        if data_dir is not None:
            args += ["--data-dir", str(data_dir)]
        if redis_url is not None:
            args += ["--redis-url", redis_url]
        proc = cls([*args, *extra], **kwargs)
        proc.port, proc.url = port, f"http://127.0.0.1:{port}"
        return proc

    def start(self) -> "ServiceProcess":
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.process = spawn([*self.program, *self.args], nice=self.nice or None, cwd=self.cwd,
                                 env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()  # the child holds its own copy
        return self

    def wait_ready(self, timeout: float = 120, path: str = "/readyz",
                   ready: Optional[Callable[[], bool]] = None) -> "ServiceProcess":
        """:func:`wait_ready` on this service's ``url`` (a ``serve`` made by :meth:`serve`)."""
        wait_ready(self.url, timeout, process=self, path=path, ready=ready)
        return self

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid if self.process else None

    @property
    def returncode(self) -> Optional[int]:
        return self.process.poll() if self.process else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM (a graceful stop), SIGKILL to the process group after ``timeout``."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode if self.process else 0

    def kill(self) -> None:
        """SIGKILL to the process group: what an out-of-memory kill looks like."""
        if self.alive():
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
