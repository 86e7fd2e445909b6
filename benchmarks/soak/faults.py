"""The soak's faults: its restartable child processes (:class:`Child`) and the SIGKILLs of
:data:`~benchmarks.soak.plan.FAULTS`, all in the first third of the load."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Optional

from benchmarks.soak.plan import FAULTS, REDIS_GRACE_S
from embgeom.testing.serve import ServiceProcess


class Child(ServiceProcess):
    """A restartable child process (``embgeom serve`` or ``embgeom worker``, log level
    warning), its own process group, output appended to ``log``, killed with the harness;
    it knows whether it exited on its own or because the harness killed or stopped it."""

    def __init__(self, role: str, args: list[str], env: dict, log: Path, nice: int = 0):
        super().__init__(["--log-level", "warning", *args], env=env, log_path=log, nice=nice)
        self.role = role
        self.started_at = 0.0
        self.killed_at: list[float] = []
        # The fault thread kills and restarts, the sampler restarts what died on its own:
        # without one lock the sampler saw a killed process as died on its own, mid-restart,
        # and started a second copy that nothing tracked.
        self.lock = threading.RLock()

    @property
    def log(self) -> Path:
        return self.log_path

    def start(self) -> "Child":
        with self.lock:
            super().start()
            self.started_at = time.time()
        return self

    def restart_if_died(self) -> Optional[int]:
        """Start it again if it exited without this harness killing it; its exit status."""
        with self.lock:
            if not self.died():
                return None
            code = self.process.returncode
            self.start()
            return code

    def died(self) -> bool:
        """Exited without this harness killing or stopping it."""
        return self.process is not None and self.process.poll() is not None and \
            not (self.killed_at and self.killed_at[-1] >= self.started_at)

    def kill(self) -> None:
        """SIGKILL the process group: what an out-of-memory kill looks like."""
        with self.lock:
            if self.alive():
                self.killed_at.append(time.time())
                super().kill()

    def restart(self, pause: float = 0.0) -> None:
        """SIGKILL, ``pause`` seconds down, start again: one step, so the sampler never sees it
        half done."""
        with self.lock:
            self.kill()
            time.sleep(pause)
            self.start()

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM, SIGKILL after ``timeout``."""
        with self.lock:
            if self.alive():
                self.killed_at.append(time.time())
                self.terminate(timeout)


class Faults:
    """The fault thread (the harness's state: see ``Soak.__init__``)."""

    def faults(self, load_seconds: float) -> None:
        """The faults, all in the first third of the load (the RSS window is the rest)."""
        start = time.time()
        for frac, what in FAULTS:
            if self.stop_load.wait(max(0.0, start + frac * load_seconds - time.time())):
                return
            with self.phase_lock:
                t0 = time.time()
                if what.startswith("worker"):
                    self.workers[int(what[-1])].restart(pause=2)
                elif what == "redis":
                    self.redis.kill()
                    time.sleep(3)
                    self.redis.start(timeout=180)
                    with self.log.lock:
                        self.log.outages.append((t0, time.time() + REDIS_GRACE_S))
                elif what == "serve":
                    self.api.restart()
                    self.wait_api()
                with self.log.lock:
                    self.log.faults.append({"t": round(t0 - self.log.start, 1), "what": f"SIGKILL {what}",
                                            "down_s": round(time.time() - t0, 1)})
                self.log.note(f"SIGKILL {what}: back after {time.time() - t0:.1f} s")
        # Restarted workers load their models again before the RSS window starts.
        self.warm_up(timeout=120, after=time.time())
        self.warm_after_faults = time.time()
