"""Shared fixtures: real Redis servers on free ports, real services, real corpora.

Nothing here touches the shared Redis on 127.0.0.1:6379: every test starts what it needs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from embgeom.store.server import RedisServer, free_port  # noqa: E402
from embgeom.settings import Settings  # noqa: E402
from tests.tiers import marks_of  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config, items):
    """Each test's tier and ``fast`` markers, from tests/tiers.py (the one place they are set)."""
    for item in items:
        for mark in marks_of(item.path.name, getattr(item, "originalname", item.name)):
            item.add_marker(mark)


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    """A fresh redis-server (AOF, appendfsync always) in this test's tmp dir."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.kill()


def test_settings(redis_url: str, **overrides) -> Settings:
    """Settings for tests: short leases so take-overs happen in seconds."""
    values = dict(redis_url=redis_url, lease_seconds=3.0, heartbeat_seconds=0.5,
                  cache_dir=Path(os.environ.get("EMBGEOM_CACHE_DIR", Path.home() / ".cache" / "embgeom")))
    values.update(overrides)
    return Settings(**values)


test_settings.__test__ = False  # a helper, not a test, when imported into a test module


class WorkerThread:
    """An in-process worker on its own thread (the embedded mode's worker)."""

    def __init__(self, settings: Settings):
        from embgeom.worker import Worker, redis_client

        self.worker = Worker(redis_client(settings.redis_url), settings)
        self.thread = threading.Thread(target=self.worker.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self.worker

    def __exit__(self, *exc):
        self.worker.request_stop(grace_seconds=5)
        self.thread.join(timeout=60)


@contextlib.contextmanager
def app_with_worker(tmp_path_factory) -> Iterator:
    """A TestClient of the app on a fresh redis-server, with an in-process worker."""
    from fastapi.testclient import TestClient

    from service.app import create_app

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    settings = test_settings(server.url)
    try:
        with TestClient(create_app(settings), raise_server_exceptions=False) as c, \
                WorkerThread(settings):
            yield c
    finally:
        server.kill()


class ServiceProcess:
    """``embgeom serve`` (or ``embgeom worker``) as a real child process."""

    def __init__(self, args: list[str], env: dict | None = None, log_path: Path | None = None):
        self.args = args
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self) -> "ServiceProcess":
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen([sys.executable, "-m", "embgeom.cli", *self.args],
                                        cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        return self

    def terminate(self, timeout: float = 60) -> int:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode if self.process else 0

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)


def wait_ready(url: str, timeout: float = 120, process: ServiceProcess | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.process.poll() is not None:
            raise RuntimeError(f"service exited with {process.process.returncode}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout}s")


@pytest.fixture
def embedded_service(tmp_path) -> Iterator[tuple[str, Path]]:
    """``embgeom serve`` on its embedded default (own Redis + in-process worker)."""
    port = free_port()
    data = tmp_path / "data"
    proc = ServiceProcess(["serve", "--port", str(port), "--data-dir", str(data)],
                          log_path=tmp_path / "serve.log").start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process=proc)
        yield url, data
    finally:
        proc.terminate()


def wait_for_jobs(client: httpx.Client, job_ids, timeout: float = 600) -> list[dict]:
    """Poll until every job is done or failed; returns their final status."""
    deadline = time.monotonic() + timeout
    pending = list(job_ids)
    final = {}
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs not finished: {pending}")
        still = []
        for job_id in pending:
            status = client.get(f"/v1/jobs/{job_id}").json()
            if status["status"] in ("done", "failed"):
                final[job_id] = status
            else:
                still.append(job_id)
        pending = still
        if pending:
            time.sleep(0.2)
    return [final[j] for j in job_ids]
