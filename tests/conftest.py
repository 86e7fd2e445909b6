"""Shared fixtures: real Redis servers on free ports, real services, real corpora.

Nothing here touches the shared Redis on 127.0.0.1:6379: every test starts what it needs.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from embgeom.settings import Settings  # noqa: E402
from embgeom.store.server import RedisServer  # noqa: E402
from embgeom.testing.redis import private_redis  # noqa: E402
from embgeom.testing.serve import ServiceProcess  # noqa: E402
from tests.tiers import marks_of  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Each test's tier and ``fast`` markers, from tests/tiers.py (the one place they are set)."""
    for item in items:
        for mark in marks_of(item.path.name, getattr(item, "originalname", item.name)):
            item.add_marker(mark)


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    """A fresh redis-server (AOF, appendfsync always) in this test's tmp dir."""
    with private_redis(tmp_path) as server:
        yield server


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

    with private_redis(tmp_path_factory.mktemp("redis")) as server:
        settings = test_settings(server.url)
        with TestClient(create_app(settings), raise_server_exceptions=False) as c, \
                WorkerThread(settings):
            yield c


@pytest.fixture
def embedded_service(tmp_path) -> Iterator[tuple[str, Path]]:
    """``embgeom serve`` on its embedded default (own Redis + in-process worker)."""
    data = tmp_path / "data"
    proc = ServiceProcess.serve(data_dir=data, log_path=tmp_path / "serve.log").start()
    try:
        proc.wait_ready()
        yield proc.url, data
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
