"""``make soak``: the service run as a lab runs it, for minutes, with faults; then checked.

``python -m benchmarks.soak [--minutes 20] [--plan full|quick] [--json soak.json]``

What runs (all real processes, nothing mocked):

- a ``redis-server`` the harness starts (AOF on, ``appendfsync always``, a tmp folder, a
  free port: :class:`embgeom.store.server.RedisServer`);
- ``embgeom serve --redis-url`` (the API) and three ``embgeom worker`` processes, the third
  with ``EMBGEOM_MAX_WINDOW_TOKENS=64`` (:data:`SMALL_WINDOW`) so long texts are windowed
  differently from the others; leases of :data:`LEASE_S` seconds; the API's bounded
  caches small (:data:`API_CACHES`) so they are full before the RSS window;
- the packaged models and ``wide``: a random-weight GPT-2 of 17 hidden states x 2048
  (:func:`build_wide_model`, a 512-entry BPE vocabulary trained on BBC), built in the run's
  tmp folder and registered through ``EMBGEOM_MODELS``;
- collections of different settings (:data:`PLANS`: the paper preset, word unit, a layer
  subset, self-similarity off), jobs of random sizes from BBC (short sentences or
  paragraphs), and a DELETE of a collection right after a burst of jobs to it, while they
  are queued (the collection is PUT again after it);
- readers of every GET endpoint of the live OpenAPI document, filled from what the run
  made (token pages at ``limit=10000``, CSV exports, every figure, the report page,
  ``POST /v1/compare/global``); an endpoint the harness cannot fill is listed as not read;
- faults in the first third of the load (:data:`FAULTS`): a worker SIGKILLed (and
  restarted), Redis SIGKILLed and restarted from its AOF, ``serve`` SIGKILLed and
  restarted, another worker; then small jobs of every model until each worker holds its
  models again (as before the load: the RSS window starts from loaded workers).

What it measures (sampled every :data:`SAMPLE_S` seconds): memory of the API and of each
worker (:func:`process_memory`: RSS, its anonymous and file-backed parts, the resident
pages of mapped weight files), Redis ``used_memory`` and, once a minute and at the end,
``MEMORY USAGE`` over each pair's keys by family (per (type, kept layer) at the end); the
sealed checkpoints (``eg:{c:m}:inflight``, their owner); every response of 500 or more
(endpoint, body); the latency of every read by endpoint (p50, p99); and the machine
(:func:`benchmarks.run.machine`: cores, CPU, memory, GPU, Redis's persistence, versions).

At the end the load stops, every job is waited for, and the store is checked:

- counts: for every pair, each kept layer's ``n`` equals the count of the texts of its
  jobs that are ``done`` since the collection's last DELETE, computed here from the
  model's tokenizer under the collection's rules (:func:`expected_count`). The count of
  special tokens and of words depends on the window length (a window boundary adds
  special tokens and splits words): it must equal the count at *one* of the workers'
  window lengths, the same for the whole pair. Id-keyed token collections also compare
  each token type's ``n`` (the CSV export of the first kept layer).
- values: MiniLM pairs of id-keyed token collections whose texts fit every window:
  Q, M, V, V_W, V_B of up to three kept layers, and five tokens' n, Q, M, V per layer,
  against the float64 one-text-at-a-time reference (``tests/reference.py``) within the
  tolerances of ``tests/test_e2e_minilm.py``.

Acceptance, one PASS/FAIL line each: memory flat over the last two thirds of the load,
from when the restarted processes hold their models again (:func:`rss_growth`: growth <=
5% + 50 MB), compared at rest (:func:`at_rest`; every :data:`REST_EVERY_S` the load pauses
for at most :data:`REST_MAX_S` until the workers are done, then the readers too, for
longer than the processes' heap-trim period :data:`HEAP_TRIM_S`): the API's RSS; a
worker's anonymous RSS (no job, no window, nothing applying, no work between its
neighbouring samples) per set of models it held, and the resident pages of the weight
files it maps within the pool's bound (:func:`weights_check`); a worker's RSS at rest and
every process's samples while busy are kept as ``vmrss_at_rest`` and
``busy_included``), no checkpoint sealed longer than two leases
without progress (an adoption, or more pieces applied), no 5xx but 503 while Redis
was down (with requests sent then: a fault never falls inside a rest pause), every job
ended, no process died unless killed here, every count exact, values within tolerance.
The exit status is 1 when a line fails.

Timings and sizes depend on the machine and whatever else runs on it: a 2-core machine
shared with other work gives noisy latencies; the checks above do not depend on speed.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx
import numpy as np

from benchmarks.run import _env, e2e_texts, machine, machine_summary

REPO = Path(__file__).resolve().parent.parent
LEASE_S = 10.0            # workers' EMBGEOM_LEASE_SECONDS: take-overs within seconds
HEARTBEAT_S = 1.0
SMALL_WINDOW = 64         # EMBGEOM_MAX_WINDOW_TOKENS of the third worker
SAMPLE_S = 3.0            # RSS, Redis memory and in-flight checkpoints
MEMORY_EVERY_S = 60.0     # MEMORY USAGE over every key
REDIS_GRACE_S = 15.0      # after Redis answers again, 503s are still the outage's (store timeout 10 s)
RSS_SLACK = (0.05, 50.0)  # growth allowed over the last two thirds: 5% + 50 MB
REST_EVERY_S = 120.0      # the load pauses this often until every process is at rest ...
REST_MAX_S = 90.0         # ... for at most this long: memory is compared at rest
HEAP_TRIM_S = 10.0        # EMBGEOM_HEAP_TRIM_SECONDS of every process: at rest, trimmed within a pause
OUTSTANDING_JOBS = 6      # unfinished jobs the load keeps at most (a slow machine is not buried)
# The API's bounded caches, small: they fill before the RSS window, so what grows in it
# is what nothing bounds (defaults: 64 MB of figures, 256 MB of token matrices).
API_CACHES = {"EMBGEOM_RENDER_CACHE_MB": "16", "EMBGEOM_GEOMETRY_CACHE_MB": "32"}
# (share of the load, what is SIGKILLed): all in the first third, the RSS window is the rest.
FAULTS = [(0.05, "worker0"), (0.12, "redis"), (0.19, "serve"), (0.26, "worker2")]
WIDE_SHAPE = {"n_layer": 16, "n_embd": 2048, "n_head": 16, "n_inner": 256, "n_positions": 256}
WIDE_VOCAB = 512

# Model speed classes on a CPU: largest job (texts) per model; the weight of its choice.
JOB_TEXTS = {"minilm": 30, "mpnet": 10, "smollm2": 4, "gemma3": 4, "wide": 3}
WEIGHT = {"minilm": 4, "mpnet": 2, "smollm2": 1, "gemma3": 1, "wide": 2}

# collection -> (settings PUT, models, texts: "short" sentences or "long" paragraphs)
PLANS = {
    "full": {
        "soak_paper": ({"preset": "paper"}, ["minilm", "mpnet"], "long"),
        "soak_word": ({"unit": "word"}, ["minilm", "smollm2"], "long"),
        "soak_layers": ({"layers": [0, 3, 6]}, ["minilm", "gemma3", "wide"], "short"),
        "soak_nosim": ({"self_similarity": False}, ["minilm", "smollm2"], "short"),
    },
    "quick": {
        "soak_paper": ({"preset": "paper"}, ["minilm"], "long"),
        "soak_word": ({"unit": "word"}, ["minilm"], "long"),
        "soak_layers": ({"layers": [0, 3, 6]}, ["minilm", "wide"], "short"),
        "soak_nosim": ({"self_similarity": False}, ["minilm"], "short"),
    },
}
# The wide model only in the layer-subset collection: a checkpoint writes each kept
# layer's co-moment (2048^2 x 8 B = 33.5 MB) as a segment, through an AOF fsynced on
# every write; all 17 layers (570 MB a checkpoint, up to 8 segments before a fold) would
# make the soak a disk benchmark of a shared machine.


def _figure_names() -> dict[str, list[str]]:
    """The figures every read sweep asks, by path template: the names each route knows."""
    from embgeom import figures
    from embgeom.figures import geometry as geometry_figures

    return {"/v1/collections/{collection}/models/{model}/figures/{name}": list(figures.FIGURES),
            "/v1/collections/{collection}/models/{model}/layers/{layer}/figures/{name}":
                list(geometry_figures.LAYER_FIGURES),
            "/v1/compare/figures/{name}": list(geometry_figures.COMPARE_FIGURES)}


def collection_rules(settings: dict) -> dict:
    """The counting rules of a collection's PUT body (the paper preset resolved as the
    README states it: string keys, special tokens counted, token unit, all layers)."""
    if settings.get("preset") == "paper":
        return {"key": "string", "unit": "token", "include_special": True, "layers": None}
    return {"key": settings.get("key", "id"), "unit": settings.get("unit", "token"),
            "include_special": bool(settings.get("include_special", False)),
            "layers": settings.get("layers")}


# ------------------------------------------------------------------- the wide model


def build_wide_model(folder: Path, texts: list[str]) -> Path:
    """A random GPT-2 of :data:`WIDE_SHAPE` (17 hidden states x 2048) with a byte-level
    BPE tokenizer of :data:`WIDE_VOCAB` entries trained on ``texts``, in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from benchmarks.gpu import build_gpt2_random

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=WIDE_VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    tok_dir = folder / "tokenizer"
    fast.save_pretrained(tok_dir)
    return build_gpt2_random(folder / "wide", tok_dir, seed=0, **WIDE_SHAPE)


# ---------------------------------------------------------------------- processes


class Child:
    """A restartable child process (``embgeom serve`` or ``embgeom worker``), its own
    process group, output appended to ``log``."""

    def __init__(self, role: str, args: list[str], env: dict, log: Path, nice: int = 0):
        self.role, self.args, self.env, self.log, self.nice = role, args, env, log, nice
        self.proc: Optional[subprocess.Popen] = None
        self.started_at = 0.0
        self.killed_at: list[float] = []
        # The fault thread kills and restarts, the sampler restarts what died on its own:
        # without one lock the sampler saw a killed process as died on its own, mid-restart,
        # and started a second copy that nothing tracked.
        self.lock = threading.RLock()

    def start(self) -> "Child":
        nice = self.nice
        with self.lock, open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "embgeom.cli", "--log-level", "warning", *self.args],
                cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=(lambda: os.nice(nice)) if nice else None)
            self.started_at = time.time()
        return self

    def restart_if_died(self) -> Optional[int]:
        """Start it again if it exited without this harness killing it; its exit status."""
        with self.lock:
            if not self.died():
                return None
            code = self.proc.returncode
            self.start()
            return code

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def died(self) -> bool:
        """Exited without this harness killing or stopping it."""
        return self.proc is not None and self.proc.poll() is not None and \
            not (self.killed_at and self.killed_at[-1] >= self.started_at)

    def kill(self) -> None:
        """SIGKILL the process group: what an out-of-memory kill looks like."""
        with self.lock:
            if self.alive():
                self.killed_at.append(time.time())
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)

    def restart(self, pause: float = 0.0) -> None:
        """SIGKILL, ``pause`` seconds down, start again: one step, so the sampler never sees it
        half done."""
        with self.lock:
            self.kill()
            time.sleep(pause)
            self.start()

    def stop(self, timeout: float = 30) -> None:
        with self.lock:
            if self.alive():
                self.killed_at.append(time.time())
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    self.kill()


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def process_memory(pid: Optional[int]) -> Optional[dict]:
    """Memory of ``pid`` in MB, None if gone: ``rss`` (VmRSS), its anonymous part ``anon``
    (RssAnon: heap, tensors, windows) and file-backed part ``file`` (RssFile: shared
    libraries and memory-mapped model weights, page cache the kernel can reclaim), from
    /proc/<pid>/status; ``weights``, the resident pages of mapped weight files
    (:data:`WEIGHT_SUFFIXES`), and ``weight_files``, how many such files are mapped, from
    /proc/<pid>/smaps. safetensors weights stay mapped while a model is loaded, so a model
    kept after its eviction shows here, whatever the allocator does."""
    if pid is None:
        return None
    try:
        status = {}
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                status[key] = int(value.split()[0]) / 1024
        weights, files, path = 0.0, set(), None
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if line.startswith("Rss:"):
                    if path is not None:
                        weights += int(line.split()[1]) / 1024
                elif "-" in line.split(" ", 1)[0]:   # a mapping's header line
                    parts = line.split(maxsplit=5)
                    path = parts[5].strip() if len(parts) > 5 and parts[5].strip().endswith(WEIGHT_SUFFIXES) else None
                    if path is not None:
                        files.add(path)
    except OSError:
        return None
    if "VmRSS" not in status:
        return None
    return {"rss": round(status["VmRSS"], 1), "anon": round(status.get("RssAnon", 0.0), 1),
            "file": round(status.get("RssFile", 0.0), 1), "weights": round(weights, 1),
            "weight_files": len(files)}


def weight_bytes(path: str) -> int:
    """Bytes of the weight files (:data:`WEIGHT_SUFFIXES`) under a model's folder."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.name.endswith(WEIGHT_SUFFIXES))


# ------------------------------------------------------------------------- records


@dataclass
class Job:
    job_id: str
    collection: str
    model: str
    texts: list[str]
    epoch: int
    submitted: float
    status: str = "queued"
    error: Optional[str] = None


@dataclass
class Log:
    """Everything the threads record, under one lock."""

    start: float = field(default_factory=time.time)
    lock: threading.Lock = field(default_factory=threading.Lock)
    latency: dict = field(default_factory=lambda: defaultdict(list))   # endpoint -> [ms]
    statuses: dict = field(default_factory=lambda: defaultdict(Counter))  # endpoint -> status -> n
    errors_5xx: list = field(default_factory=list)
    requests_at: list = field(default_factory=list)  # when each request was sent (time.time())
    connect_errors: Counter = field(default_factory=Counter)
    rss: list = field(default_factory=list)          # (t, role, pid, process_memory(), loaded, at rest, work)
    redis_mem: list = field(default_factory=list)    # (t, used_memory MB, rss MB)
    redis_families: list = field(default_factory=list)  # (t, {pair: {family: bytes}})
    faults: list = field(default_factory=list)       # {"t", "what", "down_s"}
    outages: list = field(default_factory=list)      # (start, end) when Redis 503s are allowed
    checkpoints: dict = field(default_factory=dict)  # "pair/cp" -> record
    inflight_now: list = field(default_factory=list)  # checkpoints sealed at the last sample
    unexpected_exits: list = field(default_factory=list)
    events: list = field(default_factory=list)

    def t(self) -> float:
        return round(time.time() - self.start, 2)

    def note(self, text: str) -> None:
        with self.lock:
            self.events.append((self.t(), text))
        print(f"[soak {self.t():7.1f}s] {text}", flush=True)


class Http:
    """One client per thread: every response timed and recorded by endpoint; 5xx kept."""

    def __init__(self, url: str, log: Log, timeout: float = 120):
        self.client = httpx.Client(base_url=url, timeout=timeout)
        self.log = log

    def request(self, method: str, path: str, endpoint: str, **kw) -> Optional[httpx.Response]:
        start = time.perf_counter()
        with self.log.lock:
            self.log.requests_at.append(time.time())
        try:
            r = self.client.request(method, path, **kw)
        except httpx.HTTPError as exc:
            with self.log.lock:
                self.log.connect_errors[f"{endpoint}: {type(exc).__name__}"] += 1
            return None
        ms = (time.perf_counter() - start) * 1000
        with self.log.lock:
            self.log.latency[endpoint].append(ms)
            self.log.statuses[endpoint][r.status_code] += 1
            if r.status_code >= 500:
                self.log.errors_5xx.append({"t": self.log.t(), "at": time.time(), "endpoint": endpoint,
                                            "path": path, "status": r.status_code,
                                            "body": r.text[:500]})
        return r

    def close(self) -> None:
        self.client.close()


# -------------------------------------------------------------------------- the soak


class Soak:
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

    # ---------------------------------------------------------------- setup

    def texts(self, kind: str) -> list[str]:
        if kind not in getattr(self, "_texts", {}):
            from embgeom.corpora import bbc_texts

            self._texts = getattr(self, "_texts", {})
            self._texts["short"] = e2e_texts(5000, held_out=False)
            self._texts["long"] = [p for p in bbc_texts("paragraphs") if 200 <= len(p) <= 1200][:3000]
        return self._texts[kind]

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
        from embgeom.store.connection import redis_client

        self.machine = machine(redis_client(self.redis.url, socket_timeout=5), self.workdir / "redis")
        common = {**_env(), "EMBGEOM_MODELS": json.dumps(models_env),
                  "EMBGEOM_LEASE_SECONDS": str(LEASE_S), "EMBGEOM_HEARTBEAT_SECONDS": str(HEARTBEAT_S),
                  "EMBGEOM_HEAP_TRIM_SECONDS": str(HEAP_TRIM_S), **API_CACHES}
        for key in ("EMBGEOM_MAX_WINDOW_TOKENS", "EMBGEOM_REDIS_URL"):
            common.pop(key, None)
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
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if not self.api.alive():
                raise RuntimeError(f"embgeom serve exited: see {self.api.log}")
            time.sleep(0.2)
        raise TimeoutError("embgeom serve did not answer /healthz")

    def put_collection(self, http: Http, c: str, settings: dict) -> None:
        self.retry(http, "PUT", f"/v1/collections/{c}", "PUT /v1/collections/{collection}", json=settings)

    def retry(self, http: Http, method: str, path: str, endpoint: str, timeout: float = 300,
              **kw) -> Optional[httpx.Response]:
        """A write repeated until it is answered with a non-retryable status (retryable:
        no answer, 429, 5xx): the harness knows what the service acknowledged."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = http.request(method, path, endpoint, **kw)
            if r is not None and r.status_code < 500 and r.status_code != 429:
                if r.status_code >= 400:
                    self.log.note(f"{method} {path}: {r.status_code} {r.text[:300]}")
                return r
            time.sleep(1.0)
        return None

    # ------------------------------------------------------------------ load

    def pairs(self) -> list[tuple[str, str]]:
        return [(c, m) for c, (_, ms, _) in self.plan.items() for m in ms]

    def submit(self, http: Http, c: str, m: str, texts: list[str]) -> Optional[Job]:
        with self.submit_lock:
            return self._submit(http, c, m, texts)

    def _submit(self, http: Http, c: str, m: str, texts: list[str]) -> Optional[Job]:
        key = uuid.uuid4().hex
        r = self.retry(http, "POST", "/v1/jobs", "POST /v1/jobs",
                       json={"collection": c, "model": m, "texts": texts},
                       headers={"Idempotency-Key": key})
        if r is None:
            # Perhaps enqueued, perhaps not: this pair's expected count is unknown now.
            self.uncertain.append(f"{c}/{m}")
            self.log.note(f"a job of {c}/{m} was never acknowledged")
            return None
        if r.status_code >= 400:
            return None
        job = Job(r.json()["job_id"], c, m, texts, self.epochs[c], time.time())
        with self.jobs_lock:
            self.jobs[job.job_id] = job
        return job

    def random_job(self, http: Http, c: Optional[str] = None, m: Optional[str] = None) -> None:
        if c is None:
            pairs = self.pairs()
            c, m = self.rng.choices(pairs, weights=[WEIGHT.get(p[1], 1) for p in pairs])[0]
        kind = self.plan[c][2]
        most = JOB_TEXTS.get(m, 3) if kind == "short" else max(1, JOB_TEXTS.get(m, 3) // 2)
        pool = self.texts(kind)
        self.submit(http, c, m, [self.rng.choice(pool) for _ in range(self.rng.randint(1, most))])

    def unfinished(self) -> list[Job]:
        with self.jobs_lock:
            return [j for j in self.jobs.values() if j.status in ("queued", "running")]

    def poll(self, http: Http) -> None:
        pending = self.unfinished()
        for i in range(0, len(pending), 100):
            chunk = pending[i:i + 100]
            r = http.request("GET", "/v1/jobs", "GET /v1/jobs",
                             params={"ids": ",".join(j.job_id for j in chunk)})
            if r is None or r.status_code != 200:
                continue
            for job, s in zip(chunk, r.json()):
                job.status, job.error = s["status"], s.get("error")

    def delete_cycle(self, http: Http) -> None:
        """A burst of jobs to one collection, then its DELETE while they are queued, then
        its settings PUT again (a DELETE drops them) and a job per model, as a user
        re-ingesting would: every collection holds texts at the end, however late its
        DELETE fell."""
        c = self.rng.choice(list(self.plan))
        with self.submit_lock:
            self._delete_cycle(http, c)

    def _delete_cycle(self, http: Http, c: str) -> None:
        for m in self.plan[c][1]:
            for _ in range(2):
                self.random_job(http, c, m)
        queued = sum(j.collection == c and j.status == "queued" for j in self.unfinished())
        self.poll(http)
        r = self.retry(http, "DELETE", f"/v1/collections/{c}", "DELETE /v1/collections/{collection}")
        if r is None or r.status_code >= 400:
            self.log.note(f"DELETE {c} not done: {None if r is None else r.status_code}")
            return
        self.epochs[c] += 1
        self.deletes.append({"t": self.log.t(), "collection": c, "jobs_queued_then": queued})
        self.log.note(f"DELETE {c} with {queued} of its jobs queued")
        self.put_collection(http, c, self.plan[c][0])
        for m in self.plan[c][1]:
            self.random_job(http, c, m)

    def writer(self, load_seconds: float) -> None:
        http = Http(self.url, self.log)
        deletes_at = [load_seconds * f for f in (0.2, 0.45, 0.7)]
        start = time.time()
        next_rest = REST_EVERY_S
        try:
            while not self.stop_load.is_set():
                now = time.time() - start
                if now >= load_seconds:
                    break
                self.poll(http)
                if now >= next_rest:
                    with self.phase_lock:
                        self.pause_until_at_rest(http, min(REST_MAX_S, load_seconds - now))
                    next_rest = time.time() - start + REST_EVERY_S
                elif deletes_at and now >= deletes_at[0]:
                    deletes_at.pop(0)
                    self.delete_cycle(http)
                elif len(self.unfinished()) < OUTSTANDING_JOBS:
                    self.random_job(http)
                time.sleep(self.rng.uniform(0.5, 2.0))
        finally:
            http.close()

    def pause_until_at_rest(self, http: Http, timeout: float) -> None:
        """A rest pause of at most ``timeout`` seconds: no new jobs until every worker has
        been at rest in two samples in a row (its queue drained, its window applied), then
        no reads until every process has three samples at rest. Without such pauses a
        process busy at every sample has no memory at rest to compare."""
        begin, deadline = self.log.t(), time.monotonic() + timeout

        def resting(roles, since, n):
            with self.log.lock:
                recent = {role: [x[5] for x in self.log.rss if x[1] == role and x[0] > since][-n:]
                          for role in roles}
            return all(len(r) == n and all(r) for r in recent.values())

        workers = [w.role for w in self.workers]
        while not resting(workers, begin, 2):
            if time.monotonic() >= deadline or self.stop_load.is_set():
                self.log.note(f"load paused {self.log.t() - begin:.0f} s: not every worker came to rest")
                return
            self.poll(http)
            time.sleep(1.0)
        quiet = self.log.t()
        with self.reads_lock:
            self.reads_allowed.clear()
            if not self.reads_in_flight:
                self.api_quiet_since = time.time()
        try:
            while not resting([self.api.role, *workers], quiet, 3):
                if time.monotonic() >= deadline or self.stop_load.is_set():
                    self.log.note(f"load paused {self.log.t() - begin:.0f} s, reads {self.log.t() - quiet:.0f} s:"
                                  " not every process came to rest")
                    return
                time.sleep(1.0)
            self.log.note(f"load paused {self.log.t() - begin:.0f} s, reads {self.log.t() - quiet:.0f} s: "
                          "every process at rest")
        finally:
            with self.reads_lock:
                self.api_quiet_since = None
                self.reads_allowed.set()

    def warm_up(self, timeout: float = 180, after: float = 0.0) -> None:
        """Small jobs of every model until each worker has loaded them (at most its LRU
        bound): the RSS window then starts from workers holding their models. Only
        heartbeats sent after ``after`` count (a restarted worker's predecessor is heard
        of for a few seconds under the same id)."""
        from embgeom.store.connection import redis_client
        from embgeom.store.heartbeats import live_workers

        want = min(len(self.models), self.settings.max_loaded_models)
        client = redis_client(self.redis.url, socket_timeout=5)
        http = Http(self.url, self.log)
        deadline = time.monotonic() + timeout
        loaded: dict = {}
        try:
            # The API loads a model's tokenizer on its first read of that model (Gemma 3's
            # costs about 750 MB of RSS): GET /v1/models loads every one, so a restarted
            # API also holds them all before the RSS window.
            http.request("GET", "/v1/models", "GET /v1/models")
            while time.monotonic() < deadline and not self.stop_load.is_set():
                try:
                    workers = live_workers(client, 3 * HEARTBEAT_S + 2)
                except Exception:
                    workers = []
                loaded = {w["id"]: len(w.get("loaded") or []) for w in workers
                          if w.get("heartbeat", 0) >= after}
                if len(loaded) >= len(self.workers) and min(loaded.values()) >= want:
                    break
                if len(self.unfinished()) < 2 * len(self.workers):
                    for c, m in self.pairs():
                        if self.plan[c][2] == "short":
                            self.submit(http, c, m, [self.rng.choice(self.texts("short"))])
                self.poll(http)
                time.sleep(1.0)
            self.log.note(f"warm: workers loaded {loaded}")
        finally:
            http.close()
            client.close()

    # ---------------------------------------------------------------- readers

    def read_paths(self, spec: dict, rng: random.Random) -> list[tuple[str, str, dict]]:
        """(endpoint, path, params) for one sweep over every GET of the OpenAPI document,
        filled with a random pair of the plan; templates it cannot fill go to ``not_read``."""
        figures = _figure_names()
        c, m = rng.choice(self.pairs())
        layers = self.plan[c][0].get("layers") or list(range(self.model_layers[m]))
        layer = rng.choice(layers)
        other = [p for p in self.pairs() if p != (c, m)]
        oc, om = rng.choice(other) if other else (c, m)
        olayers = self.plan[oc][0].get("layers") or list(range(self.model_layers[om]))
        with self.jobs_lock:
            recent = [j.job_id for j in list(self.jobs.values())[-20:]]
        # A token id is filled in when the request is made (:meth:`sweep`): the sweep's
        # own token page may be the first to name one.
        values = {"collection": c, "model": m, "layer": layer, "token_id": "{token_id}",
                  "job_id": recent[-1] if recent else None}
        out = []
        for template, ops in spec.get("paths", {}).items():
            if "get" not in ops:
                continue
            names = [n for t, ns in figures.items() if t == template for n in ns] or [None]
            for name in names:
                path, missing = template, []
                for p in re.findall(r"{(\w+)}", template):
                    v = name if p == "name" else values.get(p)
                    if v is None:
                        missing.append(p)
                    path = path.replace("{" + p + "}", str(v))
                params = {}
                for prm in ops["get"].get("parameters", []):
                    if prm["in"] == "query" and prm.get("required"):
                        if prm["name"] == "ids" and recent:
                            params["ids"] = ",".join(recent)
                        elif prm["name"] in ("a", "b"):
                            params["a"] = f"{c}:{m}:{layer}"
                            params["b"] = f"{oc}:{om}:{rng.choice(olayers)}"
                        else:
                            missing.append(prm["name"])
                endpoint = template + (f" [{name}]" if name else "")
                if missing:
                    self.not_read.add(f"{endpoint} (no {', '.join(missing)} yet)")
                    continue
                if template.endswith("/tokens"):
                    params["limit"] = 10000
                if template.endswith("/export"):
                    params["format"] = "csv"
                if template.endswith("/figures/{name}") and name in ("vm_scatter", "frequency", "spectrum"):
                    params["layer"] = layer
                if template.endswith("/report"):
                    params["format"] = "svg"
                out.append((endpoint, path, params, (c, m)))
        rng.shuffle(out)
        return sorted(out, key=lambda x: "{token_id}" in x[1])  # token reads after the page

    def reader(self, index: int) -> None:
        rng = random.Random(1000 + index)
        http = Http(self.url, self.log)
        try:
            while not self.stop_load.is_set():
                self.sweep(http, rng)
                time.sleep(2.0)
        finally:
            http.close()

    def read(self, http: Http, method: str, path: str, endpoint: str, **kw) -> Optional[httpx.Response]:
        """One reader's request, once reads are allowed (not during a rest pause)."""
        while not self.reads_allowed.wait(1.0):
            if self.stop_load.is_set():
                return None
        with self.reads_lock:
            self.reads_in_flight += 1
        try:
            return http.request(method, path, endpoint, **kw)
        finally:
            with self.reads_lock:
                self.reads_in_flight -= 1
                if not self.reads_allowed.is_set() and not self.reads_in_flight:
                    self.api_quiet_since = time.time()

    def api_at_rest(self) -> bool:
        """No read in flight or allowed for longer than the API's heap-trim period (so what
        it holds is its caches and models, trimmed), plus a sample."""
        with self.reads_lock:
            quiet = self.api_quiet_since
            return (not self.reads_allowed.is_set() and not self.reads_in_flight and quiet is not None
                    and time.time() - quiet >= HEAP_TRIM_S + SAMPLE_S)

    def sweep(self, http: Http, rng: random.Random) -> None:
        """Every GET of the live OpenAPI document once (random pair, random order), then a
        global comparison; a read without an answer (the API restarting) waits a second."""
        spec = getattr(self, "_spec", None)
        if spec is None:
            r = http.request("GET", "/openapi.json", "GET /openapi.json")
            if r is None or r.status_code != 200:
                time.sleep(1)
                return
            spec = self._spec = r.json()
        for endpoint, path, params, where in self.read_paths(spec, rng):
            if self.stop_load.is_set():
                return
            if "{token_id}" in path:
                ids = self.token_ids.get(where)
                if not ids:
                    self.not_read.add(f"{endpoint} (no token page of the pair yet)")
                    continue
                path = path.replace("{token_id}", str(rng.choice(ids)))
            r = self.read(http, "GET", path, "GET " + endpoint, params=params)
            if r is None:
                time.sleep(1)
            elif r.status_code == 200 and endpoint.endswith("/tokens"):
                got = [t["token_id"] for t in r.json().get("tokens", [])]
                if got:
                    self.token_ids[where] = got
        (c, m), (oc, om) = rng.choice(self.pairs()), rng.choice(self.pairs())

        def layer(cc, mm):
            return rng.choice(self.plan[cc][0].get("layers") or list(range(self.model_layers[mm])))

        self.read(http, "POST", "/v1/compare/global", "POST /v1/compare/global",
                     json={"a": {"collection": c, "model": m, "layer": layer(c, m)},
                           "b": {"collection": oc, "model": om, "layer": layer(oc, om)},
                           "min_count": 2})

    # ---------------------------------------------------------------- sampler

    def sampler(self) -> None:
        from embgeom.store.checkpoints import Checkpointer
        from embgeom.store.connection import redis_client
        from embgeom.store.keys import PairKeys

        client = None
        last_memory = 0.0
        while not self.stop_all.is_set():
            t = self.log.t()
            loaded = self.worker_states(client)
            api_rest = self.api_at_rest()
            for child in [self.api, *self.workers]:
                with child.lock:
                    pid = child.pid if child.alive() else None
                mem = process_memory(pid)
                if mem is not None:
                    with self.log.lock:
                        state = (None, api_rest, None, None) if child is self.api else \
                            loaded.get(child.role, (None, None, None, None))
                        if state[3]:  # the worker's C heap (embgeom.heap.usage), beside its RSS
                            mem["heap"] = state[3]
                        self.log.rss.append((t, child.role, pid, mem, *state[:3]))
                    continue
                code = child.restart_if_died()
                if code is not None:
                    # Died on its own (the kernel's OOM killer, a crash): keep the soak going.
                    self.log.unexpected_exits.append({"t": t, "role": child.role, "returncode": code})
                    self.log.note(f"{child.role} exited with {code}: restarted")
            try:
                if client is None:
                    client = redis_client(self.redis.url, socket_timeout=5)
                    checkpoints = Checkpointer(client, "soak-sampler")
                info = client.info("memory")
                with self.log.lock:
                    self.log.redis_mem.append((t, round(info["used_memory"] / 2**20, 1),
                                               round(info["used_memory_rss"] / 2**20, 1)))
                now_ms = _redis_ms(client)
                seen = []
                for c, m in self.pairs():
                    keys = PairKeys(c, m)
                    for cp, sealed in client.zrange(keys.inflight, 0, -1, withscores=True):
                        cp = cp.decode() if isinstance(cp, bytes) else cp
                        # An adoption counts a try: a worker restarted under the same id
                        # adopts its predecessor's checkpoint without changing the owner.
                        owner, tries = client.hmget(keys.checkpoint(cp), ["owner", "tries"])
                        owner = None if owner is None else f"{owner.decode()} (run {int(tries or 1)})"
                        record = checkpoints.record(keys, cp)
                        progress = checkpoints.progress(keys, record) if record else -1
                        self.track_checkpoint(f"{c}/{m}/{cp}", sealed, owner, now_ms, progress)
                        seen.append(f"{c}/{m}/{cp}")
                with self.log.lock:
                    self.log.inflight_now = seen
                if time.time() - last_memory >= MEMORY_EVERY_S:
                    last_memory = time.time()
                    fam = memory_by_family(client, [f"{c}:{m}" for c, m in self.pairs()], samples=5)
                    with self.log.lock:
                        self.log.redis_families.append((t, fam))
            except Exception as exc:  # Redis down (a fault) or restarting
                if client is not None:
                    client.close()
                client = None
                with self.log.lock:
                    self.log.connect_errors[f"sampler: {type(exc).__name__}"] += 1
            self.stop_all.wait(SAMPLE_S)
        if client is not None:
            client.close()

    def worker_states(self, client) -> dict[str, tuple]:
        """role -> (the models each worker's last heartbeat says it holds, whether it was at
        rest: no job, no window, nothing applying, what it has done: jobs, checkpoints and
        seconds of work so far, its C heap) ({} without Redis)."""
        from embgeom.store.heartbeats import live_workers

        if client is None:
            return {}
        try:
            beats = live_workers(client, 3 * HEARTBEAT_S + 2)
        except Exception:
            return {}
        by_id = {w["id"]: (tuple(sorted(w.get("loaded") or [])), bool(w.get("at_rest")),
                           (w.get("jobs_done"), w.get("checkpoints"),
                            round(sum((w.get("stage_seconds") or {}).values()), 3)), w.get("heap"))
                 for w in beats}
        return {c.role: by_id[c.args[c.args.index("--worker-id") + 1]] for c in self.workers
                if c.args[c.args.index("--worker-id") + 1] in by_id}

    def track_checkpoint(self, name: str, sealed_ms: float, owner, now_ms: float, progress: int = -1) -> None:
        """Progress of a sealed checkpoint is a new owner or run (an adoption) or more of it
        applied (pieces, layer parts); ``stalled_s`` is the longest time without either."""
        owner = owner.decode() if isinstance(owner, bytes) else owner
        with self.log.lock:
            rec = self.log.checkpoints.get(name)
            if rec is None:
                rec = self.log.checkpoints[name] = {"sealed_ms": sealed_ms, "owner": owner,
                                                    "owner_since_ms": sealed_ms, "owners": 1,
                                                    "progress": progress, "stalled_s": 0.0}
            # Up to this sample: progress seen now happened at most this long after the last.
            rec["stalled_s"] = max(rec["stalled_s"], round((now_ms - rec["owner_since_ms"]) / 1000, 2))
            if owner != rec["owner"]:
                rec["owner"], rec["owner_since_ms"], rec["owners"] = owner, now_ms, rec["owners"] + 1
            if progress > rec.get("progress", -1):
                rec["progress"], rec["owner_since_ms"] = progress, now_ms
            rec["last_ms"] = now_ms
            rec["sealed_s"] = round((now_ms - sealed_ms) / 1000, 2)

    # ----------------------------------------------------------------- faults

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

    # ------------------------------------------------------------------- run

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

    # ----------------------------------------------------------------- checks

    def verify(self) -> dict:
        from embgeom.store.connection import redis_client

        http = Http(self.url, self.log)
        counts, values = [], []
        try:
            for c, m in self.pairs():
                counts.append(self.check_counts(http, c, m))
            for c, m in self.pairs():
                if m == "minilm":
                    values.append(self.check_values(http, c, m))
        finally:
            http.close()
        client = redis_client(self.redis.url, socket_timeout=30)
        try:
            families = memory_by_family(client, [f"{c}:{m}" for c, m in self.pairs()], samples=0)
        finally:
            client.close()
        return {"counts": counts, "values": [v for v in values if v is not None],
                "redis_families_end": families}

    def acknowledged(self, c: str, m: str) -> list[str]:
        """Texts of the pair's jobs done since the collection's last DELETE, in order."""
        with self.jobs_lock:
            jobs = [j for j in self.jobs.values() if j.collection == c and j.model == m
                    and j.epoch == self.epochs[c] and j.status == "done"]
        return [t for j in jobs for t in j.texts]

    def windows(self, m: str) -> list[int]:
        """Window lengths the workers use for ``m``: the model's maximum, and the third
        worker's cap."""
        full = self.registry.info(m).max_length
        return sorted({full, min(full, SMALL_WINDOW)})

    def check_counts(self, http: Http, c: str, m: str) -> dict:
        rules = collection_rules(self.plan[c][0])
        texts = self.acknowledged(c, m)
        tok = self.registry.tokenizer(m)
        expected = {w: expected_count(tok, texts, rules, w) for w in self.windows(m)}
        kept = rules["layers"] or list(range(self.model_layers[m]))
        out = {"pair": f"{c}/{m}", "texts": len(texts), "expected": expected, "ok": False}
        r = http.request("GET", f"/v1/collections/{c}/models/{m}/layers", "verify layers")
        if r is None or r.status_code not in (200, 404):
            out["error"] = f"layers: {None if r is None else r.status_code}"
            return out
        rows = r.json().get("layers", []) if r.status_code == 200 else []
        got = {row["layer"]: row["n"] for row in rows}
        out["num_types"] = max((row["num_types"] for row in rows), default=0)
        out["observed"] = sorted(set(got.values())) if got else [0]
        if not texts:
            out["ok"] = not any(got.values())
            return out
        if sorted(got) != sorted(kept):
            out["error"] = f"layers {sorted(got)} != kept {sorted(kept)}"
            return out
        matched = [w for w, n in expected.items() if all(v == n for v in got.values())]
        out["window"] = matched[0] if matched else None
        out["ok"] = bool(matched)
        if f"{c}/{m}" in self.uncertain:
            out["note"] = "a job was never acknowledged (its texts may or may not count)"
        if rules["key"] == "id" and rules["unit"] == "token" and not rules["include_special"] and out["ok"]:
            per_type = Counter(i for t in texts for i in tok(t, add_special_tokens=False)["input_ids"])
            r = http.request("GET", f"/v1/collections/{c}/models/{m}/layers/{kept[0]}/export",
                             "verify export", params={"format": "csv"})
            if r is None or r.status_code != 200:
                out["ok"], out["error"] = False, f"export: {None if r is None else r.status_code}"
                return out
            exported = {int(row["token_id"]): int(row["n"])
                        for row in csv.DictReader(io.StringIO(r.text))}
            wrong = {k: (exported.get(k), per_type.get(k)) for k in set(exported) | set(per_type)
                     if exported.get(k) != per_type.get(k)}
            out["types"] = len(per_type)
            if wrong:
                out["ok"], out["error"] = False, f"{len(wrong)} token types off, e.g. {list(wrong.items())[:3]}"
        return out

    def check_values(self, http: Http, c: str, m: str) -> Optional[dict]:
        """MiniLM against the float64 one-text-at-a-time reference; only where every text
        fits every window (a windowed text has other contexts) and keys are vocabulary ids."""
        import torch
        from transformers import AutoModel

        from tests import reference as R
        from tests.test_e2e_minilm import TOL

        rules = collection_rules(self.plan[c][0])
        texts = self.acknowledged(c, m)
        tok = self.registry.tokenizer(m)
        if rules["key"] != "id" or rules["unit"] != "token" or not texts:
            return None
        if max(len(tok(t)["input_ids"]) for t in texts) > min(self.windows(m)):
            return None
        if not hasattr(self, "_ref_model"):
            self._ref_model = AutoModel.from_pretrained(self.registry.path(m), dtype=torch.float32).eval()
        raw = R.raw_hidden_states(self._ref_model, tok, texts, include_special=rules["include_special"])
        kept = rules["layers"] or list(range(self.model_layers[m]))
        sample = sorted({kept[0], kept[len(kept) // 2], kept[-1]})
        out = {"pair": f"{c}/{m}", "texts": len(texts), "layers": sample, "checked": 0,
               "worst": 0.0, "tol": TOL, "problems": []}
        r = http.request("GET", f"/v1/collections/{c}/models/{m}/layers", "verify layers")
        rows = {row["layer"]: row for row in r.json()["layers"]} if r is not None and r.status_code == 200 else {}
        rng = random.Random(7)
        for layer in sample:
            ref = R.decomposition(raw.ids, raw.states[layer])
            row = rows.get(layer)
            if row is None:
                out["problems"].append(f"layer {layer} missing")
                continue
            for q in ("Q", "M", "V", "V_W", "V_B"):
                err = abs(row[q] - ref[q]) / ref["Q"]
                out["worst"], out["checked"] = max(out["worst"], err), out["checked"] + 1
                if not err <= TOL:
                    out["problems"].append(f"L{layer} {q}: {row[q]!r} vs {ref[q]!r}")
            types = ref["types"]
            order = np.argsort(-types["n"])
            picks = list(order[:2]) + rng.sample(list(order[2:]), min(3, max(0, len(order) - 2)))
            for j in picks:
                tid = int(types["ids"][j])
                t = http.request("GET", f"/v1/collections/{c}/models/{m}/layers/{layer}/tokens/{tid}",
                                 "verify token")
                if t is None or t.status_code != 200:
                    out["problems"].append(f"L{layer} token {tid}: {None if t is None else t.status_code}")
                    continue
                got = t.json()
                if got["n"] != int(types["n"][j]):
                    out["problems"].append(f"L{layer} token {tid}: n {got['n']} vs {int(types['n'][j])}")
                for q in ("Q", "M", "V"):
                    err = abs(got[q] - float(types[q][j])) / float(types["Q"][j])
                    out["worst"], out["checked"] = max(out["worst"], err), out["checked"] + 1
                    if not err <= TOL:
                        out["problems"].append(f"L{layer} token {tid} {q}: {got[q]!r} vs {float(types[q][j])!r}")
        return out

    # -------------------------------------------------------------- summary

    def summarize(self, results: dict) -> dict:
        log = self.log
        # The last two thirds, from when the restarted processes hold their models again
        # (a restart's warm-up is not growth); later on a run too short for its faults.
        third = self.load_start + (self.load_end - self.load_start) / 3
        window = (max(third, getattr(self, "warm_after_faults", third)), self.load_end)
        rss = {}
        for child in [self.api, *self.workers]:
            mine = [(t + log.start, mem, loaded, rest, work) for t, role, pid, mem, loaded, rest, work in log.rss
                    if role == child.role and pid == child.pid]
            rest = at_rest(mine)
            if child is self.api:
                # Its RSS while reading follows the largest answer being built, which grows
                # with the collections (a report over more types): compared at rest, readers
                # paused for longer than its heap-trim period; all samples kept beside.
                got = rss_growth([(t, mem["rss"]) for t, mem, _ in rest], *window)
                got["measure"], got["rest_samples"], got["samples_all"] = "VmRSS at rest", len(rest), len(mine)
                got["busy_included"] = rss_growth([(t, mem["rss"]) for t, mem, *_ in mine], *window)
                rss[child.role] = got
                continue
            # A busy worker's memory follows the window it holds (hundreds of MB, by the jobs
            # it drew): it is compared at rest, after two samples at rest in a row (the
            # worker hands its window's pages back when a checkpoint completes). Its
            # anonymous memory is what a leak of objects, tensors or windows grows; the
            # file-backed rest is libraries and the mapped weights of the models it holds,
            # whose resident pages follow what the forwards touched (an embedding's rows)
            # and what the kernel reclaimed: those are bounded by the pool instead.
            got = rss_growth([(t, mem["anon"], loaded) for t, mem, loaded in rest], *window)
            got["measure"] = "RssAnon at rest"
            got["rest_samples"], got["samples_all"] = len(rest), len(mine)
            got["busy_included"] = rss_growth([(t, mem["anon"], loaded) for t, mem, loaded, *_ in mine], *window)
            got["vmrss_at_rest"] = rss_growth([(t, mem["rss"], loaded) for t, mem, loaded in rest], *window)
            # Where a growth lies: the C heap the program holds (in use) or keeps free.
            heaps = [(t, mem["heap"], loaded) for t, mem, loaded in rest if mem.get("heap")]
            if heaps:
                got["heap_at_rest"] = {part: rss_growth([(t, h[part], loaded) for t, h, loaded in heaps], *window)
                                       for part in ("in_use_mb", "free_mb", "mmap_mb")}
                got["heap_at_rest"]["arenas"] = max(h["arenas"] for _, h, _ in heaps)
            got["weights"] = weights_check([mem for _, mem, _ in rest], self.weight_mb,
                                           self.settings.max_loaded_models)
            got["ok"] = got["ok"] and got["weights"]["ok"]
            rss[child.role] = got
        allowed = [e for e in log.errors_5xx if e["status"] == 503
                   and any(a <= e["at"] <= b for a, b in log.outages)]
        bad = [e for e in log.errors_5xx if e not in allowed]
        # Requests sent while Redis was down (its restart's grace included): an outage no
        # request saw would leave the line below proving nothing.
        during_outage = sum(any(a <= t <= b for a, b in log.outages) for t in log.requests_at)
        limit = 2 * LEASE_S
        stalled = max((r["stalled_s"] for r in log.checkpoints.values()), default=0.0)
        sealed = max((r.get("sealed_s", 0.0) for r in log.checkpoints.values()), default=0.0)
        still = list(log.inflight_now)
        with self.jobs_lock:
            status = Counter(j.status for j in self.jobs.values())
            failed = [{"job": j.job_id, "pair": f"{j.collection}/{j.model}", "error": j.error}
                      for j in self.jobs.values() if j.status == "failed"]
        unfinished = [j.job_id for j in self.unfinished()]
        latency = {e: {"n": len(v), "p50_ms": round(float(np.percentile(v, 50)), 1),
                       "p99_ms": round(float(np.percentile(v, 99)), 1),
                       "statuses": dict(log.statuses[e])}
                   for e, v in sorted(log.latency.items()) if v}
        per_type_layer = per_type_layer_bytes(results["redis_families_end"], results["counts"],
                                              {f"{c}/{m}": len(self.plan[c][0].get("layers")
                                                               or range(self.model_layers[m]))
                                               for c, m in self.pairs()})
        acceptance = [
            ("memory flat over the last two thirds (growth <= 5% + 50 MB: the API's RSS at rest; workers' "
             "anonymous RSS at rest per set of loaded models, mapped weights within the pool's bound)",
             all(r["ok"] for r in rss.values()),
             "; ".join(f"{k} {r['growth_mb']:+.0f} MB (limit {r['limit_mb']:.0f}, {r['rest_samples']} samples at rest"
                       + (f"; weights {r['weights']['max_mb']:.0f} MB of {r['weights']['bound_mb']:.0f}"
                          if "weights" in r else "") + ")"
                       for k, r in rss.items())),
            (f"no checkpoint sealed longer than two leases ({limit:g} s) without progress (a new owner or more applied)",
             stalled <= limit and not still,
             f"longest without progress {stalled:.1f} s, longest sealed {sealed:.1f} s"
             + (f"; still sealed at the end: {still}" if still else "")),
            ("no 5xx but 503 during the Redis outage", not bad and (during_outage > 0 or not log.outages),
             f"{len(bad)} other 5xx; {during_outage} requests during the outage, {len(allowed)} of them 503"),
            ("every job ended", not unfinished, f"{len(unfinished)} unfinished; {dict(status)}"),
            ("no process died unless killed here", not log.unexpected_exits,
             f"{len(log.unexpected_exits)} unexpected exits"),
            ("every count exact", bool(results["counts"]) and all(x["ok"] for x in results["counts"]),
             f"{sum(x['ok'] for x in results['counts'])} of {len(results['counts'])} pairs"),
            ("values within tolerance of the float64 reference",
             bool(results["values"]) and all(not v["problems"] for v in results["values"]),
             f"{sum(v['checked'] for v in results['values'])} values, worst "
             f"{max((v['worst'] for v in results['values']), default=float('nan')):.1e} of Q"),
        ]
        return {
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(log.start)),
            "minutes": self.minutes, "plan": self.plan_name, "cpus": os.cpu_count(),
            "machine": {**self.machine, "load_average_end": list(os.getloadavg())},
            "models": self.models, "collections": {c: {"settings": s, "models": ms, "texts": k}
                                                   for c, (s, ms, k) in self.plan.items()},
            "lease_s": LEASE_S, "small_window": SMALL_WINDOW,
            "jobs": dict(status), "texts_done": sum(len(j.texts) for j in self.jobs.values()
                                                    if j.status == "done"),
            "failed_jobs": failed[:50], "unfinished_jobs": unfinished, "deletes": self.deletes,
            "faults": log.faults, "unexpected_exits": log.unexpected_exits,
            "rss": rss, "rss_window_s": [round(w - log.start, 1) for w in window], "rss_series": log.rss, "redis_memory_series": log.redis_mem,
            "redis_families_series": log.redis_families, "redis_families_end": results["redis_families_end"],
            "redis_bytes_per_type_layer": per_type_layer,
            "checkpoints": {"longest_sealed_s": sealed, "longest_without_progress_s": stalled,
                            "count": len(log.checkpoints),
                            "worst": sorted(log.checkpoints.items(), key=lambda kv: -kv[1]["stalled_s"])[:5]},
            "errors_5xx": log.errors_5xx, "errors_5xx_not_allowed": bad,
            "requests_during_outage": during_outage,
            "connect_errors": dict(log.connect_errors), "latency": latency,
            "not_read": sorted(e for e in self.not_read if "GET " + e.split(" (")[0] not in latency),
            "counts": results["counts"], "values": results["values"],
            "events": log.events,
            "acceptance": [{"check": name, "ok": ok, "detail": detail} for name, ok, detail in acceptance],
        }


def _redis_ms(client) -> float:
    sec, usec = client.time()
    return sec * 1000 + usec / 1000


def expected_count(tokenizer, texts: list[str], rules: dict, window: int) -> int:
    """Units counted per layer for ``texts`` under a collection's ``rules``, each text cut
    into windows of ``window`` tokens the way the README states it, computed here from
    the tokenizer alone (not from :mod:`embgeom.compute.positions`):

    - a text's own tokens: ``tokenizer(text, add_special_tokens=False)``, all counted;
    - windows of ``window - s`` of them, ``s`` the special tokens added around each
      (``num_special_tokens_to_add``), at least one window per text; with
      ``include_special`` each window adds ``s``;
    - ``unit="word"``: a unit is a maximal run of one word id inside one window.
    """
    specials = tokenizer.num_special_tokens_to_add(pair=False)
    room = window - specials
    total = 0
    for text in texts:
        enc = tokenizer(text, add_special_tokens=False)
        ids = enc["input_ids"]
        n_windows = max(1, math.ceil(len(ids) / room))
        if rules["unit"] == "word":
            words = enc.word_ids()
            for w in range(n_windows):
                part = words[w * room:(w + 1) * room]
                total += sum(1 for i, x in enumerate(part) if i == 0 or x is None or x != part[i - 1])
        else:
            total += len(ids)
        if rules["include_special"]:
            total += n_windows * specials
    return total


def rss_growth(series: list[tuple], start: float, end: float) -> dict:
    """Growth of one process's RSS over [start, end]: the largest sample of the last
    quarter minus the largest of the first half (largest: a model loaded for a job and let
    go again is the plateau, not growth; a half: such peaks recur within it); allowed
    :data:`RSS_SLACK`, 5% of the first half's largest + 50 MB.

    ``series``: (t, MB) or (t, MB, loaded) samples, ``loaded`` the models the process held
    then (a worker's LRU keeps two of five: holding two large ones is a GB above two small
    ones, by design). With ``loaded``, like is compared with like: the rule above is applied
    to the samples of each set of loaded models seen in both parts of the window, and every
    such set must pass; a leak grows across the recurrences of a set. The comparison over
    all samples is kept as ``overall`` (and is the check when no set recurs)."""
    overall = _growth([(t, mb) for t, mb, *_ in series], start, end)
    keyed = [x for x in series if len(x) > 2 and x[2] is not None]
    by_loaded = {}
    for loaded in sorted({x[2] for x in keyed}):
        got = _growth([(t, mb) for t, mb, k in keyed if k == loaded], start, end)
        if "note" not in got:
            by_loaded["+".join(loaded) or "(none)"] = got
    if not by_loaded:
        return overall
    worst = max(by_loaded.values(), key=lambda g: g["growth_mb"] - g["limit_mb"])
    return {**worst, "ok": all(g["ok"] for g in by_loaded.values()),
            "compared": "per set of loaded models", "by_loaded": by_loaded, "overall": overall}


def at_rest(samples: list[tuple]) -> list[tuple]:
    """The samples ``(t, memory, loaded, rest, work)`` of one process taken at rest:
    the middle of three in a row that say they are at rest, hold the same models, and
    between whose first and last no work was done (``work``, a worker's count of jobs,
    checkpoints and seconds of work, unchanged; None for the API, whose ``rest`` is exact).
    A heartbeat is up to a period old: a job started and ended between two of them shows
    as a spike of a sample "at rest" without the third condition. Returns (t, memory,
    loaded)."""
    return [(t, mem, loaded) for (_, _, l0, r0, w0), (t, mem, loaded, r, _), (_, _, l2, r2, w2)
            in zip(samples, samples[1:], samples[2:])
            if r0 and r and r2 and l0 == loaded == l2 and w0 == w2]


def weights_check(samples: list[dict], weight_mb: dict[str, float], max_models: int) -> dict:
    """The model pool's bound, seen from outside: at rest a worker maps the weight files
    of at most ``max_models`` models, so their resident pages stay within the sum of the
    ``max_models`` largest weight files (``weight_mb``: model -> MB) plus 1% (page
    rounding). A model kept after its eviction (an engine cache that never lets go) maps
    one more file and grows past the bound within a cycle of the models.

    ``samples``: :func:`process_memory` dicts of the worker at rest."""
    bound = sum(sorted(weight_mb.values(), reverse=True)[:max_models]) * 1.01
    top = max((m["weights"] for m in samples), default=float("nan"))
    files = max((m["weight_files"] for m in samples), default=0)
    return {"ok": bool(samples) and top <= bound and files <= max_models, "max_mb": top,
            "bound_mb": round(bound, 1), "max_files": files, "max_models": max_models}


def _growth(series: list[tuple[float, float]], start: float, end: float) -> dict:
    inside = [(t, mb) for t, mb in series if start <= t <= end]
    half = [mb for t, mb in inside if t <= start + (end - start) / 2]
    last = [mb for t, mb in inside if t >= end - (end - start) / 4]
    if not half or not last:
        return {"ok": False, "growth_mb": float("nan"), "limit_mb": float("nan"),
                "note": "too few samples in the window", "samples": len(inside)}
    first, final = max(half), max(last)
    limit = RSS_SLACK[0] * first + RSS_SLACK[1]
    return {"ok": final - first <= limit, "first_mb": first, "last_mb": final,
            "growth_mb": round(final - first, 1), "limit_mb": round(limit, 1),
            "max_mb": max(mb for _, mb in inside), "samples": len(inside)}


def _family(key: str) -> Optional[tuple[str, str]]:
    """``(pair "c:m", family)`` of a key of the service's layout: ``eg:{c:m}:inflight`` ->
    ("c:m", "control:inflight"); ``eg:{c:m:g:s3}:rec`` (and ``s3l1``, layer group 1) ->
    ("c:m", "shard:rec");
    ``eg:{c:m:g:L2c0}:seg`` -> ("c:m", "chunk:seg"); ``h`` -> head."""
    m = re.match(r"eg:\{([^}]*)\}:?(.*)$", key)
    if not m:
        return None
    parts = m.group(1).split(":")
    if len(parts) < 2:
        return None
    suffix = re.sub(r":.*", "", m.group(2)) or "-"
    if len(parts) == 2:
        return ":".join(parts), f"control:{suffix}"
    tag = parts[-1]
    kind = "shard" if tag.startswith("s") else "head" if tag == "h" else "chunk" if tag.startswith("L") else tag
    return ":".join(parts[:2]), f"{kind}:{suffix}"


def memory_by_family(client, pairs: list[str], samples: int = 5) -> dict:
    """``MEMORY USAGE`` of every key of each pair (``eg:{c:m...``), summed by family
    (:func:`_family`); ``samples=0`` counts every field of a hash exactly."""
    out: dict = {}
    for pair in pairs:
        fam: Counter = Counter()
        for key in client.scan_iter(match=f"eg:{{{pair}*", count=1000):
            key = key.decode() if isinstance(key, bytes) else key
            got = _family(key)
            if got is None or got[0] != pair:
                continue
            fam[got[1]] += client.memory_usage(key, samples=samples) or 0
        out[pair.replace(":", "/")] = dict(fam)
    return out


def per_type_layer_bytes(families: dict, counts: list[dict], layers: dict) -> dict:
    """Bytes of a pair's token shards per (token type, kept layer): shard families over
    types (the largest ``num_types`` of its layers) x kept layers."""
    types = {c["pair"]: c.get("num_types") for c in counts}
    out = {}
    for pair, fam in families.items():
        shard = sum(v for k, v in fam.items() if k.startswith("shard:"))
        out[pair] = {"bytes": sum(fam.values()), "shard_bytes": shard,
                     "per_type_layer": round(shard / (types[pair] * layers[pair]), 1)
                     if types.get(pair) else None}
    return out


# -------------------------------------------------------------------------- output


def table(res: dict) -> str:
    lines = [f"soak: {res['minutes']:g} min, plan {res['plan']}, models {', '.join(res['models'])}, "
             f"{res['cpus']} CPUs; jobs {res['jobs']}, texts done {res['texts_done']}, "
             f"DELETEs {len(res['deletes'])}",
             f"machine: {machine_summary(res.get('machine') or {})}",
             "faults: " + "; ".join(f"{f['what']} at {f['t']:.0f} s (back after {f['down_s']:.0f} s)"
                                    for f in res["faults"]), "",
             f"memory (MB) over {res['rss_window_s'][0]:.0f}-{res['rss_window_s'][1]:.0f} s (the last two thirds, "
             "from the end of the restarts' warm-up): largest of its first half -> largest of its last "
             "quarter; the API's RSS at rest (busy: rss.api.busy_included); workers' anonymous RSS at rest per set of loaded models (the worst "
             "set shown; all: rss.by_loaded), their RSS at rest beside, and the mapped weights' largest "
             "resident size against the pool's bound"]
    for role, r in res["rss"].items():
        sets = f"  ({len(r['by_loaded'])} sets; worst {max(r['by_loaded'], key=lambda k: r['by_loaded'][k]['growth_mb'] - r['by_loaded'][k]['limit_mb'])})" \
            if r.get("by_loaded") else ""
        lines.append(f"  {role:<8} {r['measure']:<16} {r.get('first_mb', float('nan')):8.0f} -> "
                     f"{r.get('last_mb', float('nan')):8.0f}  growth {r['growth_mb']:+7.0f}  limit {r['limit_mb']:6.0f}"
                     f"  max {r.get('max_mb', float('nan')):6.0f}{sets}")
        if "weights" in r:
            v, w = r["vmrss_at_rest"], r["weights"]
            lines.append(f"  {'':<8} {'VmRSS at rest':<16} {v.get('first_mb', float('nan')):8.0f} -> "
                         f"{v.get('last_mb', float('nan')):8.0f}  growth {v['growth_mb']:+7.0f}   "
                         f"weights {w['max_mb']:.0f} MB in {w['max_files']} files (bound {w['bound_mb']:.0f} MB, "
                         f"{w['max_models']} models)  {r['rest_samples']} samples at rest")
        if "heap_at_rest" in r:
            h = r["heap_at_rest"]
            lines.append(f"  {'':<8} {'C heap at rest':<16} " + "  ".join(
                f"{part[:-3].replace('_', ' ')} {h[part].get('first_mb', float('nan')):.0f} -> "
                f"{h[part].get('last_mb', float('nan')):.0f}" for part in ("in_use_mb", "free_mb", "mmap_mb"))
                + f"  arenas {h['arenas']}")
    mem = res["redis_memory_series"]
    if mem:
        lines.append(f"Redis used_memory {mem[0][1]:.0f} -> {mem[-1][1]:.0f} MB (RSS {mem[-1][2]:.0f} MB)")
    lines.append("Redis bytes per pair (end): total, token shards per (type, kept layer)")
    for pair, v in res["redis_bytes_per_type_layer"].items():
        lines.append(f"  {pair:<22} {v['bytes'] / 2**20:8.1f} MB  {v['per_type_layer'] or '-':>10}")
    cp = res["checkpoints"]
    lines.append(f"checkpoints: {cp['count']} sealed seen; longest sealed {cp['longest_sealed_s']:.1f} s, "
                 f"longest without progress (a new owner or more applied) {cp['longest_without_progress_s']:.1f} s")
    lines.append(f"5xx: {len(res['errors_5xx'])} ({len(res['errors_5xx_not_allowed'])} outside the Redis outage)")
    for e in res["errors_5xx_not_allowed"][:8]:
        lines.append(f"  {e['t']:7.1f}s {e['status']} {e['endpoint']}: {e['body'][:150]}")
    if res["connect_errors"]:
        kinds = Counter()
        for k, v in res["connect_errors"].items():
            kinds[k.rsplit(": ", 1)[-1]] += v
        lines.append("requests without an answer (API or Redis down): "
                     + ", ".join(f"{k} x{v}" for k, v in kinds.most_common()))
    lines += ["", f"{'read latency by endpoint':<96} {'n':>5} {'p50 ms':>8} {'p99 ms':>8}  statuses"]
    for e, v in res["latency"].items():
        lines.append(f"  {e[:94]:<94} {v['n']:>5} {v['p50_ms']:>8.1f} {v['p99_ms']:>8.1f}  "
                     + ",".join(f"{k}:{n}" for k, n in sorted(v["statuses"].items())))
    if res["not_read"]:
        lines.append("not read: " + "; ".join(res["not_read"]))
    lines += ["", "counts (per kept layer) against the tokenizer:"]
    for c in res["counts"]:
        exp = ", ".join(f"W={w}: {n}" for w, n in c["expected"].items())
        lines.append(f"  {'ok ' if c['ok'] else 'BAD'} {c['pair']:<22} texts {c['texts']:>5}  observed "
                     f"{c.get('observed')}  expected {exp}" + (f"  ({c['error']})" if c.get("error") else ""))
    lines.append("values against the float64 reference:")
    for v in res["values"]:
        lines.append(f"  {'ok ' if not v['problems'] else 'BAD'} {v['pair']:<22} layers {v['layers']} "
                     f"{v['checked']} values, worst {v['worst']:.1e} of Q (tol {v['tol']:g})"
                     + (f"  {v['problems'][:3]}" if v["problems"] else ""))
    lines += ["", "acceptance:"]
    for a in res["acceptance"]:
        lines.append(f"  {'PASS' if a['ok'] else 'FAIL'}  {a['check']}: {a['detail']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=float(os.environ.get("SOAK_MINUTES", 20)))
    parser.add_argument("--plan", choices=sorted(PLANS), default="full")
    parser.add_argument("--json", default=os.environ.get("SOAK_JSON", str(REPO / "soak.json")))
    parser.add_argument("--keep", action="store_true", help="keep the tmp folder (logs, AOF)")
    args = parser.parse_args(argv)
    # SIGTERM ends the run like Ctrl-C: the children (own sessions) are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    res = run(args.minutes, args.plan, Path(args.json), keep=args.keep)
    print(table(res))
    print(f"\nwrote {args.json}")
    return 0 if all(a["ok"] for a in res["acceptance"]) else 1


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


if __name__ == "__main__":
    sys.exit(main())
