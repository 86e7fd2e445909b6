"""The soak: its processes started, its threads run, its checks made (:class:`Soak`), and
one run of it (:func:`run`)."""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from benchmarks.soak.checks import Checks
from benchmarks.soak.faults import Child, Faults
from benchmarks.soak.load import Load
from benchmarks.soak.plan import (API_CACHES, HEAP_TRIM_S, HEARTBEAT_S, LEASE_S, PLANS, SMALL_WINDOW,
                                  build_wide_model)
from benchmarks.soak.readers import Readers
from benchmarks.soak.records import Http, Job, Log
from benchmarks.soak.report import Report
from benchmarks.soak.sampler import Sampler, weight_bytes
from embgeom.testing.serve import offline_env, wait_ready


class Soak(Load, Readers, Sampler, Faults, Checks, Report):
    """One soak: the plan's processes, the threads that load, read, sample and fault them,
    and the checks; each concern's methods are in its own module."""

    def __init__(self, minutes: float, plan: str, workdir: Path, seed: int = 0):
        self.minutes, self.plan_name, self.plan = minutes, plan, PLANS[plan]
        self.workdir, self.rng = workdir, random.Random(seed)
        self.log = Log()
        self.models = sorted({m for _, ms, _ in self.plan.values() for m in ms})
        self.jobs: dict[str, Job] = {}
        self.jobs_lock = threading.Lock()
        # A job's generation is known only if no DELETE of its collection runs between its
        # POST and its record: submissions and DELETEs take this lock.
        self.submit_lock = threading.RLock()
        self.epochs = {c: 0 for c in self.plan}
        self.deletes: list[dict] = []
        self.uncertain: list[str] = []
        self.stop_load = threading.Event()
        self.stop_all = threading.Event()
        # Readers read while this is set; the rest pauses clear it. ``reads_in_flight``
        # and ``api_quiet_since`` (when the last read of a pause returned) tell the sampler
        # when the API is at rest.
        self.reads_allowed = threading.Event()
        self.reads_allowed.set()
        self.reads_lock = threading.Lock()
        self.reads_in_flight = 0
        # A fault and a rest pause never overlap: a fault strikes while jobs and readers
        # run (a Redis outage inside a pause would test no read), a pause sees no restart.
        self.phase_lock = threading.Lock()
        self.api_quiet_since: Optional[float] = None
        self.redis = None
        self.api: Optional[Child] = None
        self.workers: list[Child] = []
        self.token_ids: dict = {}   # (collection, model) -> token ids seen on a page (any layer)
        self.model_layers: dict[str, int] = {}
        self.not_read: set = set()

    def setup(self) -> None:
        from embgeom.store.server import RedisServer, free_port

        self.log.note(f"plan {self.plan_name}: {len(self.plan)} collections, models {', '.join(self.models)}")
        models_env = {}
        if "wide" in self.models:
            t0 = time.time()
            path = build_wide_model(self.workdir / "wide_model", self.texts("short")[:3000])
            models_env["wide"] = {"source": str(path), "description": "random GPT-2, 17 x 2048, soak"}
            self.log.note(f"built the wide model in {time.time() - t0:.0f} s: {path}")
        self.redis = RedisServer(self.workdir / "redis").start(timeout=120)
        from benchmarks.run import machine
        from embgeom.store.connection import redis_client

        self.machine = machine(redis_client(self.redis.url, socket_timeout=5), self.workdir / "redis")
        common = {**offline_env(), "EMBGEOM_MODELS": json.dumps(models_env),
                  "EMBGEOM_LEASE_SECONDS": str(LEASE_S), "EMBGEOM_HEARTBEAT_SECONDS": str(HEARTBEAT_S),
                  "EMBGEOM_HEAP_TRIM_SECONDS": str(HEAP_TRIM_S), **API_CACHES,
                  # None: not inherited from this process (each child's environment is its own)
                  "EMBGEOM_MAX_WINDOW_TOKENS": None, "EMBGEOM_REDIS_URL": None}
        self.env = common
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api = Child("api", ["serve", "--port", str(self.port), "--redis-url", self.redis.url],
                         common, self.workdir / "serve.log")
        for i in range(3):
            env = dict(common)
            if i == 2:
                env["EMBGEOM_MAX_WINDOW_TOKENS"] = str(SMALL_WINDOW)
            # Workers at the niceness an embedded serve gives its own: reads stay served.
            self.workers.append(Child(f"worker{i}", ["worker", "--redis-url", self.redis.url,
                                                     "--worker-id", f"soak-w{i}"],
                                      env, self.workdir / f"worker{i}.log", nice=10))
        self.api.start()
        for w in self.workers:
            w.start()
        self.wait_api()
        from embgeom.compute.catalogue import ModelRegistry
        from embgeom.settings import ModelSource, Settings

        self.settings = Settings(models={k: ModelSource(**v) for k, v in models_env.items()},
                                 max_window_tokens=None)
        self.registry = ModelRegistry.from_settings(self.settings)
        for m in self.models:
            self.model_layers[m] = self.registry.info(m).num_layers + 1
        self.weight_mb = {m: weight_bytes(self.registry.path(m)) / 2**20 for m in self.models}
        http = Http(self.url, self.log)
        for c, (settings, _, _) in self.plan.items():
            self.put_collection(http, c, settings)
        http.close()

    def wait_api(self, timeout: float = 180) -> None:
        """The API answers ``/healthz`` (its workers are separate processes here)."""
        wait_ready(self.url, timeout, process=self.api, path="/healthz")

    def run(self) -> dict:
        load_seconds = self.minutes * 60
        self.setup()
        threads = [threading.Thread(target=self.sampler, daemon=True)]
        threads[0].start()
        self.warm_up()
        http = Http(self.url, self.log)
        self.sweep(http, random.Random(3))  # the API warm too: figures, tokenizers, caches
        http.close()
        self.load_start = time.time()
        load = [threading.Thread(target=self.writer, args=(load_seconds,), daemon=True),
                threading.Thread(target=self.faults, args=(load_seconds,), daemon=True),
                *[threading.Thread(target=self.reader, args=(i,), daemon=True) for i in range(2)]]
        for th in load:
            th.start()
        self.log.note(f"load for {self.minutes:g} min")
        load[0].join()
        self.stop_load.set()
        for th in load[1:]:
            th.join(timeout=300)
        self.load_end = time.time()
        self.log.note("load over: waiting for every job")
        self.drain(timeout=max(300.0, load_seconds / 2))
        results = self.verify()
        self.stop_all.set()
        threads[0].join(timeout=30)
        return self.summarize(results)

    def drain(self, timeout: float) -> None:
        http = Http(self.url, self.log)
        deadline = time.monotonic() + timeout
        while self.unfinished() and time.monotonic() < deadline:
            self.poll(http)
            time.sleep(1)
        http.close()

    def close(self) -> None:
        self.stop_load.set()
        self.stop_all.set()
        for child in [*self.workers, self.api]:
            if child is not None:
                child.stop(timeout=20)
        if self.redis is not None:
            self.redis.kill()


def run(minutes: float, plan: str, json_path: Optional[Path] = None, keep: bool = False) -> dict:
    """One soak; the results (also written to ``json_path``)."""
    workdir = Path(tempfile.mkdtemp(prefix="embgeom-soak-"))
    soak = Soak(minutes, plan, workdir)
    try:
        res = soak.run()
    finally:
        soak.close()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    res["workdir"] = str(workdir) if keep else None
    if json_path is not None:
        Path(json_path).write_text(json.dumps(res, indent=1, default=float) + "\n")
    return res
