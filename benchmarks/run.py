"""``make bench``: every figure beside its target and this machine's own limit, measured
side by side in one run.

``python -m benchmarks.run [--quick] [--only SECTIONS] [--device cpu|cuda]`` prints a table
(figure, value, target, met or missed, and what it was measured against) and writes
``bench.json`` (``BENCH_JSON``, default the repository root) under these names:

- ``machine``: cores, CPU model, memory, the filesystem of the benchmark's Redis folders,
  Redis's persistence (``appendonly``, ``appendfsync``: the servers are started as the
  service's embedded one), torch/numpy versions, load average at the start and the end.
- ``e2e_cpu`` / ``e2e_cpu_20k``: MiniLM on 2,000 short held-out BBC sentences (8 jobs,
  alternated repeats) and on 20,000 BBC sentences (jobs of 250, once): the bare forward
  (tokenise, the service's token-budget batches at the model's window length,
  ``output_hidden_states=True``) against the service (HTTP submission to the last job's
  ``finished_at``, embedded ``embgeom serve``), both at niceness 0 (the embedded worker's
  ``embedded_worker_nice`` set to 0); ``ratio`` = service / bare.
- ``store.apply_over_raw_redis``: bytes/s of the checkpoint applies of a MiniLM-shape
  replay over bytes/s of a raw pipelined ``HSET`` of as many bytes in the same field
  sizes into the same Redis, right after.
- ``merge.merge_over_bare``: the worker's window merge over a bare ``index_add_`` of the
  same arrays on the same device.
- ``steady_state``: :mod:`benchmarks.steady_state` (windows at steady state, per shape:
  ``tok_s``, ``window_tokens``, ``types_per_window``, ``checkpoint_s``,
  ``checkpoint_bytes``).
- ``host_ceiling_tok_s``: everything a worker does but the forward pass, through the real
  worker, store and Redis, replaying BBC's token ids in the service's own batches with
  moments of the shape named (:mod:`benchmarks.replay`); per-stage seconds beside it.
- ``workers_one_collection``: W = 1, 2, 4 replay worker processes on one collection,
  timed from the moment all are ready (torch imported, BBC tokenised).
- ``reads``: token lookups under 32 connections (wrk) idle and while a real MiniLM worker
  at normal priority ingests into the same collection (texts ingested meanwhile beside
  it); the ``min_count=10`` summary over all of BBC, a fresh checkpoint before each
  request (the reader's cache never answers); Redis's slowest command of the whole run
  (:class:`Slowest`).
- ``redis_bytes_per_token_layer_over_raw``; ``cross_layer`` (tokens/s without and with
  the layer-by-layer CKA, ``ratio`` = on / off).

Nothing here asserts a time: figures are printed with their targets.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import httpx
import numpy as np

from benchmarks.replay import prepare_collection, record_bbc, replay_worker, submit_replay_jobs
from benchmarks.shapes import REPLAY_SHAPES
from embgeom.testing.redis import private_redis
from embgeom.testing.serve import ServiceProcess, offline_env

REPO = Path(__file__).resolve().parent.parent
TARGETS = {
    "e2e_cpu.ratio": (">=", 0.9),
    "e2e_cpu_20k.ratio": (">=", 0.95),
    "store.apply_over_raw_redis": (">=", 0.6),
    "merge.merge_over_bare": (">=", 0.8),
    "steady_state.minilm.tok_s": (">=", 500_000),
    "steady_state.mpnet_shape.tok_s": (">=", 150_000),
    "steady_state.1b_shape.tok_s": (">=", 20_000),
    "host_ceiling_tok_s.minilm": (">=", 500_000),
    "host_ceiling_tok_s.mpnet_shape": (">=", 150_000),
    "host_ceiling_tok_s.1b_shape": (">=", 20_000),
    "workers_one_collection.4.aborted_per_job": ("<=", 0.1),
    "reads.token_p99_ms_32": ("<=", 20),
    "reads.token_p99_ms_32_ingesting": ("<=", 50),
    "reads.filtered_summary_uncached_ms": ("<=", 100),
    "reads.redis_slowest_command_ms": ("<=", 50),
    "redis_bytes_per_token_layer_over_raw.self_similarity_off": ("<=", 1.25),
}
SLOW_US = 1000  # SLOWLOG threshold: commands over 1 ms are kept


class Slowest:
    """The slowest command Redis ran, and the longest other stall of its main thread
    (AOF writes, fsyncs, rewrites, forks), over every server the benchmark started.

    Three sources, none capped: the SLOWLOG, drained atomically (``MULTI; SLOWLOG GET;
    SLOWLOG RESET``) by a thread every :attr:`POLL_S` seconds, so a burst of slow commands
    never pushes the slowest out of its 1,024 entries; the ``command`` event of the latency
    monitor (``LATENCY HISTORY`` / ``LATEST`` keep its maximum since the reset, whatever
    the SLOWLOG dropped); and, on Redis 7, ``INFO latencystats`` (each command's p99.9)
    beside them. The figure is the largest of the first two.

    A script is named by its keys: Redis cuts each logged argument to 128 characters,
    which leaves only the scripts' common ``TIME`` preamble of the body."""

    KEEP = 5
    POLL_S = 0.5
    LATENCY_MS = 10  # latency-monitor-threshold: events at or over it are kept

    def __init__(self, slow_us: int = SLOW_US):
        self.slow_us = slow_us
        self.ms, self.command = 0.0, None
        self.top: list[tuple[float, str]] = []
        self.over_50ms = 0
        self.stall_ms, self.stall = 0.0, None
        self.latency_command_ms = 0.0      # the latency monitor's "command" maximum
        self.slowlog_ms = 0.0              # the slowest SLOWLOG entry
        self.p999_ms, self.p999_command = 0.0, None
        self.slowlog_entries = 0
        self._pollers: dict[int, tuple] = {}
        self._lock = threading.Lock()

    def watch(self, client, where: str = "") -> None:
        """Reset the server's logs and drain its SLOWLOG every :attr:`POLL_S` s until
        :meth:`collect`."""
        client.config_set("slowlog-log-slower-than", self.slow_us)
        client.config_set("slowlog-max-len", 1024)
        client.config_set("latency-monitor-threshold", self.LATENCY_MS)
        client.slowlog_reset()
        client.execute_command("LATENCY", "RESET")
        with contextlib.suppress(Exception):
            client.config_resetstat()
        stop = threading.Event()

        def poll():
            while not stop.wait(self.POLL_S):
                with contextlib.suppress(Exception):
                    self._drain(client, where)

        thread = threading.Thread(target=poll, name=f"slowlog-{where}", daemon=True)
        thread.start()
        self._pollers[id(client)] = (stop, thread)

    @staticmethod
    def describe(command) -> str:
        text = command.decode(errors="replace") if isinstance(command, bytes) else str(command)
        # EVAL <body cut to 128 characters "... (N more bytes)"> <numkeys> <key>...
        m = re.match(r"(EVAL|EVALSHA) .*? more bytes\) (\d+) (.*)", text, re.S | re.I)
        if m:
            return f"{m.group(1)} keys " + " ".join(m.group(3).split(" ")[:int(m.group(2))])[:160]
        return text.split("\n")[0][:120]

    def _note(self, ms: float, what: str) -> None:
        with self._lock:
            self.top = sorted([*self.top, (ms, what)], reverse=True)[:self.KEEP]
            if ms > self.ms:
                self.ms, self.command = ms, what

    def _drain(self, client, where: str) -> None:
        with client.pipeline(transaction=True) as p:
            p.slowlog_get(1024)
            p.slowlog_reset()
            entries, _ = p.execute()
        for entry in entries:
            ms = entry["duration"] / 1000
            with self._lock:
                self.slowlog_entries += 1
                self.over_50ms += ms > 50
                self.slowlog_ms = max(self.slowlog_ms, ms)
            self._note(ms, f"{where}: {self.describe(entry['command'])}")

    def collect(self, client, where: str) -> None:
        """Stop the server's poller; read what is left of its SLOWLOG, the latency
        monitor's events and its commands' latency percentiles."""
        stop, thread = self._pollers.pop(id(client), (None, None))
        if stop is not None:
            stop.set()
            thread.join(timeout=5)
        self._drain(client, where)
        history = client.execute_command("LATENCY", "HISTORY", "command") or []
        command_ms = max([float(ms) for _, ms in history], default=0.0)
        for event, _, _, max_ms in client.execute_command("LATENCY", "LATEST"):
            event = event.decode() if isinstance(event, bytes) else str(event)
            if event == "command":
                command_ms = max(command_ms, float(max_ms))
            elif max_ms > self.stall_ms:
                self.stall_ms, self.stall = float(max_ms), f"{where}: {event}"
        if command_ms > self.latency_command_ms:
            self.latency_command_ms = command_ms
        if command_ms > self.ms:  # the SLOWLOG entry was lost: the monitor still has it
            self._note(command_ms, f"{where}: a command (latency monitor; SLOWLOG entry lost)")
        with contextlib.suppress(Exception):
            for name, stats in client.info("latencystats").items():
                p999 = _percentile_ms(stats, "p99.9")
                if p999 is not None and p999 > self.p999_ms:
                    self.p999_ms, self.p999_command = p999, f"{where}: {name.removeprefix('latency_percentiles_usec_')}"

    def figures(self) -> dict:
        """The ``reads.redis_*`` figures."""
        return {"redis_slowest_command_ms": self.ms, "redis_slowest_command": self.command,
                "redis_slowest_slowlog_ms": self.slowlog_ms,
                "redis_slowest_latency_monitor_ms": self.latency_command_ms,
                "redis_slowlog_entries": self.slowlog_entries,
                "redis_commands_over_50ms": self.over_50ms,
                "redis_command_p999_ms_max": self.p999_ms, "redis_command_p999_max": self.p999_command,
                "redis_longest_other_stall_ms": self.stall_ms,
                "redis_longest_other_stall": self.stall}


def _percentile_ms(stats, name: str) -> Optional[float]:
    """``INFO latencystats`` gives ``p50=..,p99=..,p99.9=..`` in microseconds (redis-py
    parses it to a dict or leaves it a string)."""
    if isinstance(stats, dict):
        value = stats.get(name)
    else:
        m = re.search(rf"{re.escape(name)}=([\d.]+)", str(stats))
        value = m.group(1) if m else None
    return None if value is None else float(value) / 1000


# The niceness of the benchmark's Redis servers. On this 2-core host they share the CPU
# with the load (replayed workers, the API under wrk): at the load's priority a command as
# small as a GET waited 80 ms for a core (measured: the slowest command of the replay
# 83 ms at niceness 0, 13 ms at -10, on the same run's data). A deployment gives Redis a
# core of its own or, co-located, a priority above its workers (``embgeom serve`` runs
# its embedded workers at niceness 10); this does the latter. Raising a priority needs
# root (or CAP_SYS_NICE): without it the server keeps the load's, and the machine record
# says which (``redis_nice``).
REDIS_NICE = -10


def redis_priority(pid: int) -> int:
    """Set process ``pid``'s niceness to :data:`REDIS_NICE` where allowed; its niceness
    after."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, pid, REDIS_NICE)
    return os.getpriority(os.PRIO_PROCESS, pid)


@contextlib.contextmanager
def redis_server(slowest: Optional[Slowest] = None, where: str = "", prefix: str = "embgeom-bench-"):
    """A new Redis as the service starts its own (:class:`embgeom.store.server.RedisServer`:
    AOF, ``appendfsync always``) in a temporary folder, at :data:`REDIS_NICE`, and a
    client; ``slowest`` watches it under the name ``where``."""
    from embgeom.store.connection import redis_client

    with private_redis(timeout=120, prefix=prefix) as server:
        redis_priority(server.process.pid)
        client = redis_client(server.url)
        if slowest:
            slowest.watch(client, where)
        try:
            yield server, client
        finally:
            if slowest:
                slowest.collect(client, where)
            client.close()


# ------------------------------------------------------------------------- machine


def filesystem_of(path: Path) -> dict:
    """The mount holding ``path`` (the longest mount point above it in /proc/mounts):
    its type, device and mount point."""
    path = os.path.realpath(path)
    best = {"type": None, "device": None, "mount": None}
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, fstype = line.split()[:3]
            mount = mount.replace("\\040", " ")
            inside = path == mount or path.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best["mount"] or ""):
                best = {"type": fstype, "device": device, "mount": mount}
    return best


def machine(client=None, redis_dir: Optional[Path] = None) -> dict:
    """What the figures were measured on: cores, CPU model, memory, the filesystem of
    the benchmark's Redis folders and the persistence Redis runs with (``client``: one of
    the benchmark's servers), the versions that matter, the load average now."""
    import torch

    info = {"cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)),
            "cpu_model": None, "memory_bytes": None, "python": sys.version.split()[0],
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "numpy": np.__version__, "load_average_start": list(os.getloadavg()),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    with contextlib.suppress(OSError):
        cpu = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        info["cpu_model"] = cpu.group(1).strip() if cpu else None
    with contextlib.suppress(OSError):
        mem = re.search(r"^MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        info["memory_bytes"] = int(mem.group(1)) * 1024 if mem else None
    redis_dir = Path(redis_dir or tempfile.gettempdir())
    info["redis_data_dir"] = str(redis_dir)
    info["redis_data_filesystem"] = filesystem_of(redis_dir)
    if client is not None:
        conf = {k: v for name in ("appendonly", "appendfsync", "save", "maxmemory-policy")
                for k, v in client.config_get(name).items()}
        info["redis"] = {"version": client.info("server").get("redis_version"), **conf}
    return info


# ----------------------------------------------------------------------------- e2e


def e2e_texts(count: int = 2000, held_out: bool = True, cycle: bool = False) -> list[str]:
    """Short held-out BBC sentences: the sentences of the 20% held-out articles, 30..200
    characters, in corpus order. ``held_out=False`` takes every article's sentences (about
    38,000, a million MiniLM tokens); ``cycle=True`` repeats them until ``count`` (a GPU
    needs more text than BBC holds for a run of a few seconds)."""
    from embgeom.corpora import bbc_texts, split

    articles = bbc_texts("articles")
    if held_out:
        articles = split(articles, 0.2, seed=7).held_out
    sentences = [s.strip() for article in articles for line in article.split("\n")
                 for s in re.split(r"(?<=[.!?])\s+", line)]
    sentences = [s for s in sentences if 30 <= len(s) <= 200]
    if cycle and sentences and len(sentences) < count:
        sentences = sentences * math.ceil(count / len(sentences))
    return sentences[:count]


def split_jobs(texts: list[str], n_jobs: int = 8) -> list[list[str]]:
    """``texts`` dealt round-robin into ``n_jobs`` jobs of near-equal size."""
    return [texts[i::n_jobs] for i in range(n_jobs)]


def bare_forward(loaded, jobs: list[list[str]], token_budget: int,
                 on_batch=None) -> tuple[float, int]:
    """Seconds to tokenise, batch and forward each job's texts (hidden states of every
    layer), in the batches the service makes of each job: what a script would do.

    On a GPU the clock stops once the device is done (``torch.cuda.synchronize``).
    ``on_batch(batch)``, if given, sees each :class:`PaddedBatch` after its forward (its
    time counts in the figure: keep it cheap)."""
    import torch

    from embgeom.compute.engine import CountingRule, padded_batches

    cuda = loaded.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(loaded.device)
    rule = CountingRule(layers=(0,))  # a default collection's counting: tokens, no specials
    start = time.perf_counter()
    counted = 0
    with torch.inference_mode():
        for texts in jobs:
            # The service's own cut and batching (the window at the model's maximum).
            _, padded = padded_batches(loaded.tokenizer, texts, rule, loaded.info.max_length,
                                       token_budget, loaded.pad_id)
            for batch in padded:
                hidden = loaded.forward_padded(batch)
                counted += batch.num_counted
                if on_batch is not None:
                    on_batch(batch)
                del hidden
    if cuda:
        torch.cuda.synchronize(loaded.device)
    return time.perf_counter() - start, counted


def serve_process(tmp: Path, extra: tuple = (), env: Optional[dict] = None) -> ServiceProcess:
    """``embgeom serve`` started (log level warning, offline), its data in ``tmp``/data and
    its output in ``tmp``/serve.log; ``extra`` arguments, ``env`` added to its environment."""
    return ServiceProcess.serve(data_dir=tmp / "data", extra=extra, log_level="warning",
                                env=offline_env(**(env or {})), log_path=tmp / "serve.log").start()


def worker_process(redis_url: str, env: Optional[dict] = None) -> ServiceProcess:
    """``embgeom worker`` on ``redis_url`` started (log level warning, offline, its output
    discarded), at this process's priority."""
    return ServiceProcess(["--log-level", "warning", "worker", "--redis-url", redis_url],
                          env=offline_env(**(env or {}))).start()


def serve_env() -> dict:
    """The environment of the ``embgeom serve`` the end-to-end figures measure: its
    defaults, but its embedded worker at niceness 0, the priority of the bare forward it
    is compared with (the default, 10, keeps reads fast beside ingestion), and on the
    CPU like the bare forward (``e2e_cpu``, even on a host with a GPU)."""
    return {"EMBGEOM_EMBEDDED_WORKER_NICE": "0", "EMBGEOM_DEVICE": "cpu"}


def run_jobs(client: httpx.Client, collection: str, jobs: list[list[str]], model: str = "minilm",
             timeout: Optional[float] = None, poll_s: float = 0.25) -> tuple[float, int]:
    """Seconds from the first POST to the last job's ``finished_at`` (Redis's clock at its
    completion, the same host clock as ``time.time()``), and the tokens counted; past
    ``timeout`` seconds (if given) a :class:`TimeoutError`.

    The end is read from the jobs, not from when a poll saw them done: one status request
    for every id each ``poll_s`` (no tight polling that would take CPU from the worker),
    without the poll's period in the figure."""
    start = time.time()
    ids = []
    for texts in jobs:
        r = client.post("/v1/jobs", json={"collection": collection, "model": model, "texts": texts})
        r.raise_for_status()
        ids.append(r.json()["job_id"])
    while True:
        status = [s for i in range(0, len(ids), 1000)
                  for s in client.get("/v1/jobs", params={"ids": ",".join(ids[i:i + 1000])}).json()]
        if all(s["status"] in ("done", "failed") for s in status):
            break
        if timeout is not None and time.time() - start > timeout:
            done = sum(s["status"] == "done" for s in status)
            raise TimeoutError(f"{done} of {len(ids)} jobs done after {timeout:.0f} s")
        time.sleep(poll_s)
    assert all(s["status"] == "done" for s in status), status
    elapsed = max(s["finished_at"] for s in status) - start
    return elapsed, sum(s["tokens"] for s in status)


def _e2e_ratio(client, loaded, jobs, token_budget: int, repeat: int, name: str) -> dict:
    """The service against the bare forward on the same jobs, alternated ``repeat``
    times; medians."""
    bare, service, ratios = [], [], []
    for r in range(repeat):
        order = ("bare", "service") if r % 2 == 0 else ("service", "bare")
        got = {}
        for what in order:
            if what == "bare":
                seconds, tokens = bare_forward(loaded, jobs, token_budget)
            else:
                seconds, tokens = run_jobs(client, f"{name}{r}", jobs)
            got[what] = tokens / seconds
        bare.append(got["bare"])
        service.append(got["service"])
        ratios.append(got["service"] / got["bare"])
    return {"texts": sum(map(len, jobs)), "jobs": len(jobs), "tokens": tokens, "repeats": repeat,
            "bare_forward_tok_s": statistics.median(bare), "service_tok_s": statistics.median(service),
            "ratio": statistics.median(service) / statistics.median(bare),
            "ratio_per_repeat": ratios, "worker_nice": 0, "bare_nice": os.getpriority(os.PRIO_PROCESS, 0)}


E2E_20K = 20_000


def bench_e2e(repeat: int, quick: bool, large: bool = True, large_texts: Optional[int] = None) -> dict:
    """``e2e_cpu`` (2,000 held-out sentences, 8 jobs, ``repeat`` alternations) and, with
    ``large``, ``e2e_cpu_20k`` (20,000 BBC sentences in jobs of 250, once each way), both
    through one embedded ``embgeom serve`` whose worker runs at the bare forward's
    priority. Quick: 400 and ``large_texts`` (default 1,600) sentences."""
    from embgeom.compute.catalogue import ModelRegistry
    from embgeom.compute.models import ModelPool
    from embgeom.settings import Settings

    settings = Settings()
    texts = e2e_texts(400 if quick else 2000)
    jobs = split_jobs(texts)
    loaded = ModelPool(ModelRegistry.from_settings(settings), "cpu", max_models=1).get("minilm")
    bare_forward(loaded, [texts[:20]], settings.token_budget)  # warm-up
    tmp = Path(tempfile.mkdtemp(prefix="embgeom-bench-e2e-"))
    serve = serve_process(tmp, env=serve_env())
    out = {}
    try:
        serve.wait_ready(180)
        with httpx.Client(base_url=serve.url, timeout=120) as client:
            run_jobs(client, "warm", [texts[:10]])  # the worker loads its model
            out["e2e_cpu"] = _e2e_ratio(client, loaded, jobs, settings.token_budget, repeat, "e2e")
            if large:
                n = large_texts or (1600 if quick else E2E_20K)
                big = e2e_texts(n, held_out=False)
                big_jobs = split_jobs(big, math.ceil(len(big) / 250))
                out["e2e_cpu_20k"] = {
                    **_e2e_ratio(client, loaded, big_jobs, settings.token_budget, 1, "e2e20k"),
                    "of_texts": E2E_20K,
                    "note": "" if len(big) >= E2E_20K else
                            f"quick: {len(big):,} of {E2E_20K:,} sentences (the full run measures all)"}
    finally:
        serve.terminate()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def bench_cross_layer(repeat: int, quick: bool) -> dict:
    """MiniLM tokens/s through one ``embgeom serve``, the same jobs into a fresh collection
    without and one with ``cross_layer`` (alternated, so drift hits both), medians."""
    texts = e2e_texts(400 if quick else 2000)
    jobs = split_jobs(texts)
    tmp = Path(tempfile.mkdtemp(prefix="embgeom-bench-xl-"))
    serve = serve_process(tmp)
    off, on = [], []
    try:
        serve.wait_ready(180)
        with httpx.Client(base_url=serve.url, timeout=120) as client:
            run_jobs(client, "warm", [texts[:10]])  # the worker loads its model
            for r in range(repeat):
                for cross in ((False, True) if r % 2 == 0 else (True, False)):
                    name = f"xl{r}{'on' if cross else 'off'}"
                    client.put(f"/v1/collections/{name}", json={"cross_layer": cross}).raise_for_status()
                    seconds, tokens = run_jobs(client, name, jobs)
                    (on if cross else off).append(tokens / seconds)
    finally:
        serve.terminate()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"texts": len(texts), "jobs": len(jobs), "tokens": tokens, "repeats": repeat,
            "tok_s_off": statistics.median(off), "tok_s_on": statistics.median(on),
            "ratio": statistics.median(on) / statistics.median(off),
            "ratio_per_repeat": [b / a for a, b in zip(off, on)]}


# ------------------------------------------------------------------ host ceiling


@contextlib.contextmanager
def replay_store(shape: str, jobs: int, slowest: Slowest, **overrides):
    """Replay ``jobs`` recorded BBC jobs of ``shape`` through one in-process worker into a
    fresh Redis; yields ``(figures, server, client)`` with the store still up."""
    from embgeom.store.keys import PairKeys
    from embgeom.store.reader import Reader, run_sync
    from embgeom.store.submission import JobSubmitter

    rec = record_bbc()
    jobs = min(jobs, len(rec.jobs))
    tokens = sum(rec.batches[b][2] for j in range(jobs) for b in rec.jobs[j])
    with redis_server(slowest, f"replay {shape}") as (server, client):
        before = client.info("memory")["used_memory"]
        prepare_collection(client, "c", shape)
        ids = submit_replay_jobs(client, "c", "minilm", range(jobs))
        worker = replay_worker(server.url, shape, recording=rec, settings_overrides=overrides,
                               prebuild=True)
        apply_s = _time_calls(worker.checkpointer, "apply_and_complete")
        thread = threading.Thread(target=worker.run, daemon=True)
        start = time.perf_counter()
        thread.start()
        q = JobSubmitter(client)
        while worker.jobs_done < jobs or q.status(ids[-1])["status"] != "done":
            time.sleep(0.02)
        seconds = time.perf_counter() - start
        worker.request_stop(5)
        thread.join(timeout=120)
        state = run_sync(client, Reader().pair_state(PairKeys("c", "minilm")))
        types = run_sync(client, Reader().aggs(state))["types"]
        yield ({"tokens": tokens, "jobs": jobs, "types": types, "seconds": round(seconds, 3),
                "tok_s": tokens / seconds, "checkpoints": worker.checkpoints,
                "stages_s": {k: round(v, 3) for k, v in sorted(worker.clock.seconds.items()) if v},
                "bytes_written": worker.clock.counts.get("bytes_written", 0),
                "apply_s": round(apply_s[0], 3),
                "redis_used_memory_bytes": client.info("memory")["used_memory"] - before},
               server, client)


def _time_calls(obj, method: str) -> list:
    """Wrap ``obj.method`` to add each call's seconds into the returned one-item list."""
    inner, total = getattr(obj, method), [0.0]

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - t

    setattr(obj, method, timed)
    return total


# ------------------------------------------------------------------------ store


def hash_field_sizes(client, exclude: str = "raw:") -> dict[bytes, np.ndarray]:
    """Every hash key of the database (but those starting ``exclude``) -> the byte
    lengths of its values (HKEYS, then HSTRLEN per field, pipelined): the field sizes
    the store wrote, whatever its record layout."""
    out = {}
    for key in client.scan_iter(count=1000):
        if key.startswith(exclude.encode()) or client.type(key) != b"hash":
            continue
        fields = client.hkeys(key)
        with client.pipeline(transaction=False) as p:
            for f in fields:
                p.hstrlen(key, f)
            out[key] = (fields, np.asarray(p.execute(), dtype=np.int64))
    return out


def raw_hset(client, sizes: dict, target_bytes: int, piece_bytes: int,
             flush_bytes: int = 32 << 20) -> tuple[float, int]:
    """Seconds and bytes to write ``sizes``'s fields again (``raw:<key>``, the same field
    names and value lengths, random bytes) with plain pipelined ``HSET`` of at most
    ``piece_bytes`` each, pass after pass (overwriting, as checkpoints overwrite records)
    until ``target_bytes`` are written: what Redis itself takes for those bytes."""
    biggest = max((int(v.max()) for _, v in sizes.values() if len(v)), default=1)
    pool = memoryview(os.urandom(biggest))
    written, pending = 0, 0
    start = time.perf_counter()
    p = client.pipeline(transaction=False)
    while written < max(target_bytes, 1):
        before = written
        for key, (fields, lengths) in sizes.items():
            args, size = [], 0
            for f, n in zip(fields, lengths.tolist()):
                args += [f, pool[:n]]
                size += n
                if size >= piece_bytes:
                    p.execute_command("HSET", b"raw:" + key, *args)
                    written, pending, args, size = written + size, pending + size, [], 0
            if args:
                p.execute_command("HSET", b"raw:" + key, *args)
                written, pending = written + size, pending + size
            if pending >= flush_bytes:
                p.execute()
                pending = 0
        if written == before:
            break  # nothing to write
    p.execute()
    return time.perf_counter() - start, written


def bench_store(out: dict, client) -> dict:
    """``store.apply_over_raw_redis``: bytes/s of the replay's checkpoint applies (bytes
    the store wrote / seconds in ``apply_and_complete``) over bytes/s of a raw pipelined
    ``HSET`` of as many bytes in the same field sizes into the same Redis (same
    persistence), measured right after it."""
    from embgeom.settings import Settings

    sizes = hash_field_sizes(client)
    seconds, written = raw_hset(client, sizes, out["bytes_written"], Settings().piece_bytes)
    for key in client.scan_iter(match="raw:*", count=1000):
        client.unlink(key)
    lengths = np.concatenate([v for _, v in sizes.values()]) if sizes else np.zeros(1, np.int64)
    apply_Bps = out["bytes_written"] / out["apply_s"] if out["apply_s"] else float("nan")
    raw_Bps = written / seconds
    return {"apply_over_raw_redis": apply_Bps / raw_Bps, "apply_bytes_s": apply_Bps,
            "raw_hset_bytes_s": raw_Bps, "apply_bytes": out["bytes_written"], "apply_s": out["apply_s"],
            "raw_bytes": written, "raw_s": round(seconds, 3), "checkpoints": out["checkpoints"],
            "fields": int(lengths.size), "field_bytes_median": float(np.median(lengths)),
            "field_bytes_max": int(lengths.max())}


# ------------------------------------------------------------------------ merge


def bench_merge(jobs: int, repeat: int, device: str = "cpu", shape: str = "minilm") -> dict:
    """``merge.merge_over_bare``: the worker's window update over a bare ``index_add_`` of
    the same per-batch arrays into accumulators of the same shape, on the same device;
    each over the recorded BBC batches of ``jobs`` jobs, alternated ``repeat`` times, medians.

    The window update is what the worker does per batch once the reduction has its per-type
    sums about the window's shifts (float32 on the device): look up the rows (appending new
    keys) and :meth:`WindowAccumulator.add_sums` them (widened to float64 in its buffers). The bare
    figure gets the float64 arrays and the rows for free. The window starts at the rows it
    will reach (a later window's start). ``moments_merge_over_bare`` is the same for a
    batch's token moments (``WindowAccumulator.add``: means and M2 turned into sums about
    the shifts), the path of reductions done without the window."""
    import torch

    from benchmarks.replay import ReplayEngine
    from embgeom.compute.window import WindowAccumulator

    spec = REPLAY_SHAPES[shape]
    L, d, sim = len(spec["keep"]) if spec["keep"] else spec["layers"], spec["d"], spec["self_similarity"]
    rec = record_bbc()
    jobs = min(jobs, len(rec.jobs))
    engine = ReplayEngine(rec, L, d, sim)
    dev = torch.device(device)
    batches = []
    for j in range(jobs):
        for b in rec.jobs[j]:
            t, _ = engine.run(b)
            batches.append(type(t)(*(None if x is None else x.to(dev) for x in
                                     (t.ids, t.n, t.mean, t.m2, t.unit_sum))))
    keys = torch.unique(torch.cat([t.ids for t in batches]))
    rows = [torch.searchsorted(keys, t.ids) for t in batches]
    # the reduction's float32 per-type sums, as they leave the device's index_add_
    work = [(t.ids, t.n, t.mean.float(), t.m2.float(), None if t.unit_sum is None else t.unit_sum.float())
            for t in batches]
    k = len(keys)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    lay = engine.run(rec.jobs[0][0], WindowAccumulator(L, d, sim, dev, capacity=1))[1]

    def merge() -> float:
        acc = WindowAccumulator(L, d, sim, dev, capacity=k)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for ids, n, s1, s2, unit in work:
                r, _ = acc.rows(ids)
                acc.add_sums(r, n, s1, s2, unit)  # widened to float64 in the window's buffers
        sync()
        return time.perf_counter() - t0

    def moments() -> float:
        acc = WindowAccumulator(L, d, sim, dev, capacity=k)
        sync()
        t0 = time.perf_counter()
        for t in batches:
            acc.add(t, lay)
        sync()
        return time.perf_counter() - t0

    def bare() -> float:
        z = lambda *shape: torch.zeros(shape, dtype=torch.float64, device=dev)  # noqa: E731
        n, mean, m2, unit = z(k), z(k, L, d), z(k, L), z(k, L, d) if sim else None
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for t, r in zip(batches, rows):
                n.index_add_(0, r, t.n)
                mean.index_add_(0, r, t.mean)
                m2.index_add_(0, r, t.m2)
                if unit is not None:
                    unit.index_add_(0, r, t.unit_sum)
        sync()
        return time.perf_counter() - t0

    merge(), moments(), bare()  # warm-up
    m, mo, b = [], [], []
    for i in range(repeat):
        for f in ((merge, moments, bare) if i % 2 == 0 else (bare, moments, merge)):
            {merge: m, moments: mo, bare: b}[f].append(f())
    tokens = sum(int(t.n.sum()) for t in batches)
    mm, mom, bb = statistics.median(m), statistics.median(mo), statistics.median(b)
    return {"merge_over_bare": bb / mm, "moments_merge_over_bare": bb / mom,
            "merge_tok_s": tokens / mm, "bare_tok_s": tokens / bb,
            "merge_s": mm, "moments_merge_s": mom, "bare_s": bb, "tokens": tokens, "types": k,
            "batches": len(batches), "shape": shape, "device": str(dev), "repeats": repeat}


def over_raw(out: dict, shape: str) -> float:
    """Redis memory per (token type, kept layer) over the raw (2 + d) x 8 bytes."""
    spec = REPLAY_SHAPES[shape]
    L = len(spec["keep"]) if spec["keep"] else spec["layers"]
    return out["redis_used_memory_bytes"] / (out["types"] * L * (2 + spec["d"]) * 8)


# ------------------------------------------------------------------------ reads


def wrk(url: str, paths: list[str], seconds: int, connections: int = 32) -> dict:
    """wrk with ``connections`` connections over ``paths`` (random order): p50/p99 ms, req/s."""
    script = Path(tempfile.mkdtemp()) / "paths.lua"
    script.write_text("paths = {" + ",".join(json.dumps(p) for p in paths) + "}\n"
                      "request = function()\n"
                      "  return wrk.format('GET', paths[math.random(#paths)])\n"
                      "end\n")
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency",
                          "-s", str(script), url], capture_output=True, text=True, check=True).stdout
    return parse_wrk(out)


def parse_wrk(out: str) -> dict:
    """p50/p99 ms, req/s and non-2xx responses from ``wrk --latency`` output."""
    def ms(label):
        m = re.search(rf"^\s*{label}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        value, unit = float(m.group(1)), m.group(2)
        return value * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]

    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"p50_ms": ms("50"), "p99_ms": ms("99"),
            "req_s": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
            "non_2xx": int(errors.group(1)) if errors else 0}


def uncached_summaries(client: httpx.Client, redis_url: str, path: str, count: int,
                       collection: str = "c", shape: str = "minilm") -> list[tuple[float, object]]:
    """``count`` timings (ms) of ``GET path``, each after a fresh checkpoint into
    ``collection`` (one replayed job through an in-process replay worker, waited for to
    completion), so the reader's per-version cache never holds the answer; with each
    answer's ``as_of``."""
    from benchmarks.replay import replay_worker, submit_replay_jobs
    from embgeom.store.connection import redis_client
    from embgeom.store.submission import JobSubmitter

    r = redis_client(redis_url)
    worker = replay_worker(redis_url, shape, prebuild=True)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    rec = record_bbc()
    small = sorted(range(len(rec.jobs)), key=lambda j: sum(rec.batches[b][2] for b in rec.jobs[j]))
    out = []
    try:
        for i in range(count):
            job = submit_replay_jobs(r, collection, "minilm", [small[i % len(small)]])[0]
            deadline = time.monotonic() + 120
            while JobSubmitter(r).status(job)["status"] != "done":
                assert time.monotonic() < deadline, "the fresh checkpoint did not complete"
                time.sleep(0.02)
            t = time.perf_counter()
            resp = client.get(path, params={"min_count": 10})
            out.append(((time.perf_counter() - t) * 1000, resp.json().get("as_of")))
            assert resp.status_code == 200, resp.text
    finally:
        worker.request_stop(5)
        thread.join(timeout=60)
        r.close()
    return out


def bench_reads(server_url: str, slowest: Slowest, quick: bool) -> dict:
    """Reads against the replayed BBC store (collection ``c``) through an API with the
    default settings: token lookups under 32 connections idle; the filtered summary with
    a fresh checkpoint before each request; token lookups again while a real MiniLM
    worker at normal priority ingests BBC into the same collection."""
    tmp = Path(tempfile.mkdtemp(prefix="embgeom-bench-reads-"))
    api = serve_process(tmp, ("--redis-url", server_url))
    worker = None
    try:
        api.wait_ready(path="/healthz")
        base = "/v1/collections/c/models/minilm/layers"
        with httpx.Client(base_url=api.url, timeout=60) as client:
            page = client.get(f"{base}/3/tokens", params={"limit": 10000}).json()
            paths = [f"{base}/3/tokens/{t['token_id']}" for t in page["tokens"]]
            seconds = 3 if quick else 8
            idle = wrk(api.url, paths, seconds)
            summary = uncached_summaries(client, server_url, base, 3 if quick else 10)
            # A real MiniLM worker ingesting BBC into the collection being read, at the
            # bench's own priority (not an embedded worker's niceness).
            from embgeom.corpora import bbc_texts

            texts = bbc_texts("paragraphs")[:2000]
            worker = worker_process(server_url, env={"EMBGEOM_REDIS_URL": server_url})
            jobs = split_jobs(texts)
            ids = [client.post("/v1/jobs", json={"collection": "c", "model": "minilm",
                                                 "texts": job}).json()["job_id"] for job in jobs]
            # How much ingestion ran during the measurement: each job's texts times its
            # progress (1 once done), so a run too short for any job to finish still shows
            # the work.
            def texts_done():
                status = client.get("/v1/jobs", params={"ids": ",".join(ids)}).json()
                return sum(len(job) * (1.0 if s["status"] == "done" else s["progress"])
                           for job, s in zip(jobs, status))

            # Measured once batches flow (the model loaded, progress published), not
            # while the worker starts.
            deadline = time.monotonic() + 180
            while (before := texts_done()) == 0:
                assert time.monotonic() < deadline, "the ingesting worker never started"
                time.sleep(0.2)
            busy = wrk(api.url, paths, seconds)
            ingested = texts_done() - before
    finally:
        if worker is not None:
            worker.kill()
        api.terminate()
        shutil.rmtree(tmp, ignore_errors=True)
    ms = [m for m, _ in summary]
    return {"token_p99_ms_32": idle["p99_ms"], "token_p50_ms_32": idle["p50_ms"],
            "token_req_s_32": idle["req_s"], "token_p99_ms_32_ingesting": busy["p99_ms"],
            "token_p50_ms_32_ingesting": busy["p50_ms"], "token_req_s_32_ingesting": busy["req_s"],
            "non_2xx": idle["non_2xx"] + busy["non_2xx"], "texts_ingested_meanwhile": round(ingested),
            "wrk_seconds": seconds,
            "filtered_summary_uncached_ms": statistics.median(ms),
            "filtered_summary_uncached_ms_max": max(ms),
            "filtered_summary_versions": len({json.dumps(a, sort_keys=True) for _, a in summary})}


# ---------------------------------------------------------------------- workers


def wait_ready(files: list[Path], procs: list, timeout: float = 600) -> None:
    """Until every file exists (a process's readiness), or one of ``procs`` ended."""
    deadline = time.monotonic() + timeout
    while not all(f.exists() for f in files):
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a replay worker ended before it was ready")
        assert time.monotonic() < deadline, "replay workers not ready"
        time.sleep(0.05)


def bench_workers(slowest: Slowest, quick: bool, counts=(1, 2, 4)) -> dict:
    rec = record_bbc()
    jobs = 6 if quick else 24
    tokens = sum(rec.batches[b][2] for j in range(jobs) for b in rec.jobs[j])
    out = {}
    for W in counts:
        tmp = Path(tempfile.mkdtemp(prefix="embgeom-bench-workers-"))
        with redis_server(slowest, f"workers W={W}") as (server, client):
            before = client.info("memory")["used_memory"]
            prepare_collection(client, "c", "minilm")
            procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.replay", "--redis-url", server.url,
                                       "--shape", "minilm", "--worker-id", f"w{i}",
                                       "--stats", str(tmp / f"w{i}.json"),
                                       "--ready", str(tmp / f"w{i}.ready")], cwd=REPO, env=offline_env())
                     for i in range(W)]
            # The clock starts once every process has imported torch, tokenised BBC and
            # built its engine (each says so in its ready file), with the jobs submitted.
            wait_ready([tmp / f"w{i}.ready" for i in range(W)], procs)
            from embgeom.store.submission import JobSubmitter

            q = JobSubmitter(client)
            start = time.perf_counter()
            ids = submit_replay_jobs(client, "c", "minilm", range(jobs))
            while any(q.status(j)["status"] != "done" for j in ids):
                time.sleep(0.05)
            seconds = time.perf_counter() - start
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                p.wait(timeout=300)
            stats = [json.loads((tmp / f"w{i}.json").read_text()) for i in range(W)]
            # Aborted = work thrown away and redone: a shard whose lock expired before its
            # pieces were written (re-read, re-merged). A shard found locked by another
            # worker is not aborted work: it is tried again in a later round, before any
            # read; reported beside it as lock_busy_per_job.
            lost = sum(s["counts"].get("shards.lost", 0) for s in stats)
            busy = sum(s["counts"].get("shards.busy", 0) for s in stats)
            out[str(W)] = {"tok_s": tokens / seconds, "seconds": round(seconds, 2), "jobs": jobs,
                           "aborted_per_job": lost / jobs, "lock_busy_per_job": busy / jobs,
                           "jobs_per_worker": [s["jobs"] for s in stats],
                           "checkpoints": sum(s["checkpoints"] for s in stats),
                           "redis_bytes_per_token": (client.info("memory")["used_memory"] - before) / tokens}
        shutil.rmtree(tmp, ignore_errors=True)
    out["tokens"] = tokens
    return out


# ------------------------------------------------------------------------- main


def _get(res: dict, dotted: str):
    cur = res
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


STEADY_SHAPES = ("minilm", "mpnet_shape", "1b_shape", "1b_shape_all_layers", "7b_shape_5_layers")


def _f(x, fmt: str = ",.0f") -> str:
    return "-" if x is None else (format(x, fmt) if isinstance(x, (int, float)) else str(x))


def rows(res: dict) -> list[tuple[str, str, str]]:
    """``(dotted name, value, this machine's limit or a note)`` of every figure present."""
    out = []
    for key in ("e2e_cpu", "e2e_cpu_20k"):
        e = res.get(key)
        if e:
            out += [(f"{key}.ratio", _f(e["ratio"], ".3f"),
                     f"service {_f(e['service_tok_s'])} / bare forward {_f(e['bare_forward_tok_s'])} "
                     f"tok/s, {e['texts']:,} texts, both nice 0" + (f"; {e['note']}" if e.get("note") else ""))]
    st = res.get("store")
    if st:
        out.append(("store.apply_over_raw_redis", _f(st["apply_over_raw_redis"], ".3f"),
                    f"apply {_f(st['apply_bytes_s'] / 1e6, ',.1f')} / raw HSET "
                    f"{_f(st['raw_hset_bytes_s'] / 1e6, ',.1f')} MB/s, same Redis"))
    mg = res.get("merge")
    if mg:
        out.append(("merge.merge_over_bare", _f(mg["merge_over_bare"], ".3f"),
                    f"merge {_f(mg['merge_tok_s'])} / bare index_add_ {_f(mg['bare_tok_s'])} tok/s "
                    f"({mg['device']})"))
    ss = res.get("steady_state") or {}
    if "error" in ss:
        out.append(("steady_state", "-", str(ss["error"])[:100]))
    for shape, v in ss.items():
        if isinstance(v, dict) and "tok_s" in v:
            out.append((f"steady_state.{shape}.tok_s", _f(v["tok_s"]),
                        f"window {_f(v.get('window_tokens'))} tok, {_f(v.get('types_per_window'))} types, "
                        f"checkpoint {_f(v.get('checkpoint_s'), '.2f')} s / "
                        f"{_f((v.get('checkpoint_bytes') or 0) / 1e6, ',.1f')} MB, {_f(v.get('tokens'))} tok"))
        elif isinstance(v, dict):
            out.append((f"steady_state.{shape}", "-", str(v.get("skipped") or v.get("error"))[:100]))
    for shape, v in (res.get("host_ceiling_tok_s") or {}).items():
        out.append((f"host_ceiling_tok_s.{shape}", _f(v), "replay, one short run"))
    if "tokenize_tok_s" in res:
        out.append(("tokenize_tok_s", _f(res["tokenize_tok_s"]), "MiniLM tokenizer, BBC"))
    for W, v in (res.get("workers_one_collection") or {}).items():
        if isinstance(v, dict):
            out += [(f"workers_one_collection.{W}.tok_s", _f(v["tok_s"]), "clock from readiness"),
                    (f"workers_one_collection.{W}.aborted_per_job", _f(v["aborted_per_job"], ".3f"), ""),
                    (f"workers_one_collection.{W}.lock_busy_per_job", _f(v["lock_busy_per_job"], ".2f"),
                     "shard locks found busy: retried later, no work redone"),
                    (f"workers_one_collection.{W}.redis_bytes_per_token", _f(v["redis_bytes_per_token"]), "")]
    rd = res.get("reads") or {}
    notes = {
        "token_p99_ms_32": f"idle, 32 connections, {_f(rd.get('token_req_s_32'))} req/s",
        "token_p99_ms_32_ingesting": f"same collection, worker nice 0: {_f(rd.get('texts_ingested_meanwhile'))} "
                                     f"texts ingested in {_f(rd.get('wrk_seconds'))} s",
        "filtered_summary_uncached_ms": f"fresh checkpoint before each; max {_f(rd.get('filtered_summary_uncached_ms_max'), '.1f')} ms",
        "redis_slowest_command_ms": f"{str(rd.get('redis_slowest_command'))[:90]}; SLOWLOG {_f(rd.get('redis_slowest_slowlog_ms'), '.1f')}, "
                                    f"latency monitor {_f(rd.get('redis_slowest_latency_monitor_ms'), '.0f')} ms",
        "redis_longest_other_stall_ms": str(rd.get("redis_longest_other_stall")),
    }
    for k in ("token_p99_ms_32", "token_p99_ms_32_ingesting", "filtered_summary_uncached_ms",
              "redis_slowest_command_ms", "redis_commands_over_50ms", "redis_longest_other_stall_ms"):
        if rd.get(k) is not None:
            out.append((f"reads.{k}", _f(rd[k], ".1f") if isinstance(rd[k], float) else str(rd[k]),
                        notes.get(k, "")))
    for k, v in (res.get("redis_bytes_per_token_layer_over_raw") or {}).items():
        out.append((f"redis_bytes_per_token_layer_over_raw.{k}", _f(v, ".3f"), ""))
    xl = res.get("cross_layer")
    if xl:
        out += [("cross_layer.tok_s_off", _f(xl["tok_s_off"]), "MiniLM through the service"),
                ("cross_layer.tok_s_on", _f(xl["tok_s_on"]), "the same, keeping the layer-by-layer CKA"),
                ("cross_layer.ratio", _f(xl["ratio"], ".3f"), "on / off")]
    return out


def verdict(res: dict, name: str) -> tuple[str, str]:
    """``(target, verdict)``: ``>= 0.9``, ``met`` / ``MISSED: 0.71 of it`` (``<=``:
    ``MISSED: 1.3x it``); empty without a target."""
    if name not in TARGETS:
        return "", ""
    op, goal = TARGETS[name]
    x = _get(res, name)
    if not isinstance(x, (int, float)) or not math.isfinite(x):
        return f"{op} {goal:,}", "no figure"
    if (x >= goal if op == ">=" else x <= goal):
        return f"{op} {goal:,}", "met"
    return f"{op} {goal:,}", f"MISSED: {x / goal:.2f}{' of' if op == '>=' else 'x'} it"


def table(res: dict) -> str:
    """One line per figure: name, value, target, met/missed, and what it is measured
    against (this machine's own limit, side by side in the run)."""
    lines = []
    rs = rows(res)
    w0 = max((len(r[0]) for r in rs), default=10)
    lines.append(f"{'figure':<{w0}}  {'value':>10}  {'target':>12}  {'verdict':<18}  limit / measured against")
    for name, value, note in rs:
        target, mark = verdict(res, name)
        lines.append(f"{name:<{w0}}  {value:>10}  {target:>12}  {mark:<18}  {note}")
    if res.get("machine"):
        lines.append(f"\nmachine: {machine_summary(res['machine'])}")
    return "\n".join(lines)


def machine_summary(m: dict) -> str:
    """One line from :func:`machine`'s record: cores and CPU, memory, GPU, Redis with its
    persistence and filesystem, versions, load average; what a record lacks is left out."""
    fs = m.get("redis_data_filesystem") or {}
    r = m.get("redis") or {}
    parts = [f"{m.get('cores')} cores" + (f" ({m['cpu_model']})" if m.get("cpu_model") else "")]
    if m.get("memory_bytes"):
        parts.append(f"{m['memory_bytes'] / 2**30:.1f} GiB")
    parts.append(f"GPU {m['gpu']}" if m.get("gpu") else "no GPU")
    if r:
        redis = " ".join([f"Redis {r.get('version') or ''}".rstrip()]
                         + [f"{k} {r[k]}" for k in ("appendonly", "appendfsync") if r.get(k)])
        if fs.get("type"):
            redis += f" on {fs['type']}" + (f" ({fs['mount']})" if fs.get("mount") else "")
        if m.get("redis_nice") is not None:
            redis += f" at niceness {m['redis_nice']}"
        parts.append(redis)
    parts += [f"{name} {m[name]}" for name in ("torch", "numpy") if m.get(name)]
    line = ", ".join(parts)
    load = [m.get(k) for k in ("load_average_start", "load_average_end")]
    if all(load):  # the 1-minute figure at the start and at the end
        line += f"; load average {load[0][0]:.1f} -> {load[1][0]:.1f}"
    return line


class Lap:
    """Seconds since the previous lap, recorded under the section's name (sections
    skipped record nothing)."""

    def __init__(self, into: dict):
        self.into, self.t = into, time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        if now - self.t > 0.5:
            self.into[name] = round(now - self.t, 1)
        self.t = now


STEADY_MAX_S = 540.0
CROSS_LAYER_S = {True: 60.0, False: 200.0}  # what cross_layer, run after it, takes (quick, full)


def steady_budget(total_s: float, elapsed_s: float, cross_layer: bool, quick: bool) -> float:
    """Seconds for the steady-state section: what the run's budget leaves after the
    sections before it and the cross-layer one after it, between 60 s (a quick figure)
    and :data:`STEADY_MAX_S`."""
    left = total_s - elapsed_s - (CROSS_LAYER_S[quick] if cross_layer else 0.0)
    return max(60.0, min(STEADY_MAX_S, left))


SECTIONS = ("e2e", "e2e_20k", "ceiling", "store", "merge", "workers", "reads", "steady_state",
            "cross_layer")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run, minutes)")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help="comma-separated sections: " + ", ".join(SECTIONS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default=None,
                        help="device of the merge and steady-state windows (default: cuda if "
                             "there is one, else cpu)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds the whole run should take (default 1,680 full, 600 quick): "
                             "the steady-state section gets what the others leave, at most "
                             f"{STEADY_MAX_S:.0f} s")
    args = parser.parse_args(argv)
    sections = set(args.only.split(","))
    unknown = sections - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    slowest = Slowest()
    res: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": args.quick,
                 "cpus": os.cpu_count(), "sections": sorted(sections)}
    with redis_server() as (server, client):  # the persistence every benchmark server runs with
        res["machine"] = {**machine(client),
                          "redis_nice": os.getpriority(os.PRIO_PROCESS, server.process.pid)}
    t0 = time.perf_counter()
    repeat = args.repeat if not args.quick else 1
    lap = Lap(res.setdefault("section_s", {}))
    if sections & {"e2e", "e2e_20k"}:
        res.update(bench_e2e(repeat if "e2e" in sections else 1, args.quick,
                             large="e2e_20k" in sections))
        if "e2e" not in sections:
            res.pop("e2e_cpu", None)
    lap("e2e")
    if sections & {"ceiling", "reads", "store"}:
        sizes = {"minilm": 52, "mpnet_shape": 26, "1b_shape": 12, "1b_shape_all_layers": 4,
                 "minilm_nosim": 26}
        if args.quick:
            sizes = {k: max(1, v // 12) for k, v in sizes.items()}
        ceilings, stages, ratios = {}, {}, {}
        with replay_store("minilm", sizes["minilm"], slowest) as (out, server, client):
            ceilings["minilm"], stages["minilm"] = out["tok_s"], out
            ratios["self_similarity_on"] = over_raw(out, "minilm")
            if "store" in sections:
                res["store"] = bench_store(out, client)
            if "reads" in sections:
                res["reads"] = bench_reads(server.url, slowest, args.quick)
        if "ceiling" in sections:
            for shape in ("mpnet_shape", "1b_shape", "1b_shape_all_layers", "minilm_nosim"):
                with replay_store(shape, sizes[shape], slowest) as (out, _, _):
                    if shape == "minilm_nosim":
                        ratios["self_similarity_off"] = over_raw(out, shape)
                    else:
                        ceilings[shape] = out["tok_s"]
                    stages[shape] = out
            res["host_ceiling_tok_s"] = ceilings
            res["host_ceiling_stages"] = stages
            res["tokenize_tok_s"] = record_bbc().tokens / record_bbc().tokenize_seconds
            res["redis_bytes_per_token_layer_over_raw"] = ratios
    lap("replay_store_reads_ceiling")
    if "merge" in sections:
        res["merge"] = bench_merge(3 if args.quick else 12, 2 if args.quick else 3, device)
    lap("merge")
    if "workers" in sections:
        res["workers_one_collection"] = bench_workers(slowest, args.quick)
    lap("workers")
    if "steady_state" in sections:
        budget = steady_budget(args.budget_s or (600.0 if args.quick else 1680.0),
                               time.perf_counter() - t0, "cross_layer" in sections, args.quick)
        try:
            from benchmarks.steady_state import bench_steady_state
        except ImportError as exc:
            res["steady_state"] = {"error": f"benchmarks.steady_state is not there: {exc}"}
        else:
            res["steady_state"] = bench_steady_state(args.quick, slowest, device=device, budget_s=budget)
    lap("steady_state")
    if "cross_layer" in sections:
        res["cross_layer"] = bench_cross_layer(repeat, args.quick)
    lap("cross_layer")
    res.setdefault("reads", {}).update(slowest.figures())
    res["redis_slowest_commands"] = [{"ms": ms, "command": c} for ms, c in slowest.top]
    res["machine"]["load_average_end"] = list(os.getloadavg())
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    print(table(res))
    path = Path(os.environ.get("BENCH_JSON", REPO / "bench.json"))
    path.write_text(json.dumps(res, indent=2, default=float) + "\n")
    print(f"\nwrote {path} ({res['wall_s']} s: " + ", ".join(f"{k} {v:.0f} s" for k, v in res["section_s"].items()) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
