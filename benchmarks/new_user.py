"""The four measurements of the "runs for weeks" issue, over HTTP, as a new user meets them.

    python -m benchmarks.new_user [--only cycles,wide,pages,folder] [--json new_user.json]

Each starts ``embgeom serve`` on a fresh data folder (the embedded default: its own
``redis-server`` and worker, ``EMBGEOM_MAX_LOADED_MODELS=1``) and prints figures, with no
assertion (the tests pin each finding; this shows what a user sees):

- ``cycles``: DELETE and re-ingest 20 BBC sentences, alternating MiniLM and MPNet, six
  cycles; the worker's RSS and anonymous RSS after each (the issue: +415 MB a cycle).
- ``wide``: a 2-text SmolLM2 job's worker peak RSS on the fresh service, then again after
  2,000 MiniLM sentences (the issue: 3,771 -> 6,586 MB).
- ``pages``: four concurrent ``GET .../layers/15/tokens?limit=10000`` on a SmolLM2
  collection of 600 sentences (``benchmarks.token_pages``: status, seconds, API RSS,
  /healthz meanwhile; the issue: three 503s after 10 s, API 417 -> 2,848 MB).
- ``folder``: ``serve`` SIGKILLed: do its Redis and worker die with it? Then a second
  ``serve`` on the folder of a live one: refused, one ``redis-server`` there.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import httpx

from benchmarks.soak import process_memory
from embgeom.corpora import bbc_texts
from embgeom.store.server import free_port
from embgeom.testing.serve import ServiceProcess

REPO = Path(__file__).resolve().parent.parent
EMBGEOM = str(Path(sys.executable).with_name("embgeom"))


def sentences(count: int, skip: int = 0) -> list[str]:
    """BBC paragraphs of 40 to 200 characters, in corpus order (short, like sentences)."""
    short = [p for p in bbc_texts("paragraphs") if 40 <= len(p) <= 200]
    return short[skip:skip + count]


def children(pid: int) -> dict[str, int]:
    """The direct children of ``pid`` by role: ``redis`` (redis-server), ``worker``."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            out["redis" if "redis-server" in cmd else "worker" if "worker" in cmd else cmd] = int(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Serve:
    """One ``embgeom serve`` on ``data_dir``, its pid, its children, an HTTP client."""

    def __init__(self, data_dir: Path, port: Optional[int] = None):
        port = port or free_port()
        self.log_path = data_dir.parent / f"serve-{port}.log"
        self.service = ServiceProcess.serve(
            data_dir=data_dir, port=port, program=[EMBGEOM], cwd=data_dir.parent, log_path=self.log_path,
            env={"EMBGEOM_MAX_LOADED_MODELS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}).start()
        self.proc = self.service.process
        self.http = httpx.Client(base_url=self.service.url, timeout=120)

    def ready(self, timeout: float = 180) -> "Serve":
        """Ready, and its worker process started."""
        self.service.wait_ready(timeout, ready=lambda: "worker" in children(self.proc.pid))
        return self

    def worker(self) -> int:
        return children(self.proc.pid)["worker"]

    def ingest(self, collection: str, model: str, texts: list[str], timeout: float = 1800) -> dict:
        r = self.http.post("/v1/jobs", json={"collection": collection, "model": model, "texts": texts})
        r.raise_for_status()
        job_id, deadline = r.json()["job_id"], time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.http.get(f"/v1/jobs/{job_id}").json()
            if status["status"] in ("done", "failed"):
                return status
            time.sleep(0.2)
        raise TimeoutError(job_id)

    def close(self) -> None:
        self.http.close()
        self.service.terminate(60)


@contextmanager
def serve(tmp: Path, name: str) -> Iterator[Serve]:
    s = Serve(tmp / name)
    try:
        yield s.ready()
    finally:
        s.close()


class PeakRSS:
    """The largest VmRSS of ``pid`` while the block runs, sampled every 20 ms (MB)."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()

    def __enter__(self) -> "PeakRSS":
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            mem = process_memory(self.pid)
            if mem:
                self.peak = max(self.peak, mem["rss"])
            time.sleep(0.02)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def at_rest(pid: int, seconds: float = 12.0) -> dict:
    """The worker's memory after ``seconds`` idle (longer than its heap-trim period)."""
    time.sleep(seconds)
    mem = process_memory(pid) or {}
    return {"rss_mb": round(mem.get("rss", 0)), "anon_mb": round(mem.get("anon", 0))}


def cycles(tmp: Path) -> dict:
    rows = []
    with serve(tmp, "cycles") as s:
        texts = sentences(20)
        for cycle in range(6):
            model = ("minilm", "mpnet")[cycle % 2]
            s.http.delete("/v1/collections/cyc")
            status = s.ingest("cyc", model, texts)
            rows.append({"cycle": cycle + 1, "model": model, "status": status["status"], **at_rest(s.worker())})
            print(json.dumps(rows[-1]), flush=True)
    anon = [r["anon_mb"] for r in rows]
    return {"cycles": rows, "anon_growth_mb_cycle_2_to_6": anon[-1] - anon[1]}


def wide(tmp: Path) -> dict:
    with serve(tmp, "wide") as s:
        pair = sentences(2, skip=3100)
        with PeakRSS(s.worker()) as fresh:
            first = s.ingest("wide_fresh", "smollm2", pair)
        t0 = time.perf_counter()
        narrow = s.ingest("narrow", "minilm", sentences(2000, skip=100))
        narrow_s = time.perf_counter() - t0
        with PeakRSS(s.worker()) as after:
            second = s.ingest("wide_after", "smollm2", pair)
    out = {"fresh_peak_mb": round(fresh.peak), "after_narrow_peak_mb": round(after.peak),
           "statuses": [first["status"], narrow["status"], second["status"]],
           "narrow_2000_seconds": round(narrow_s, 1)}
    print(json.dumps(out), flush=True)
    return out


def pages(tmp: Path) -> dict:
    with serve(tmp, "pages") as s:
        t0 = time.perf_counter()
        status = s.ingest("pages", "smollm2", sentences(600, skip=2200))
        ingest_s = time.perf_counter() - t0
        # Redis rewrites its command line to ``redis-server host:port``.
        title = Path(f"/proc/{children(s.proc.pid)['redis']}/cmdline").read_bytes().decode()
        redis_url = "redis://" + title.split()[1].strip("\0")
        got = subprocess.run([sys.executable, "-m", "benchmarks.token_pages", "--url", str(s.http.base_url),
                              "--redis-url", redis_url, "--collection", "pages", "--model", "smollm2",
                              "--layer", "15", "--pid", str(s.proc.pid)],
                             cwd=REPO, capture_output=True, text=True, check=True)
    out = {"ingest": status["status"], "ingest_600_seconds": round(ingest_s, 1), **json.loads(got.stdout)}
    print(json.dumps(out), flush=True)
    return out


def folder(tmp: Path) -> dict:
    data = tmp / "folder"
    first = Serve(data).ready()
    kids = children(first.proc.pid)
    first.proc.kill()
    first.proc.wait()
    first.close()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(p) for p in kids.values()):
        time.sleep(0.2)
    survivors = {role: pid for role, pid in kids.items() if alive(pid)}
    again = Serve(data).ready()
    try:
        second = Serve(data)
        try:
            code = second.proc.wait(120)
        except subprocess.TimeoutExpired:
            code = None
        servers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _redis_on(p, data)]
        second.close()
    finally:
        again.close()
        for pid in survivors.values():  # the old behaviour's orphans: not left behind
            os.kill(pid, signal.SIGKILL)
    out = {"children_alive_after_serve_sigkill": survivors, "second_serve_exit_code": code,
           "second_serve_said": second.log_path.read_text().strip().splitlines()[-1:],
           "redis_servers_on_folder": len(servers)}
    print(json.dumps(out), flush=True)
    return out


def _redis_on(proc: Path, folder: Path) -> bool:
    """Whether ``proc`` is a live redis-server working in ``folder`` (it chdirs to its
    ``--dir`` and rewrites its command line to ``redis-server host:port``)."""
    try:
        return (proc / "comm").read_text().startswith("redis-server") and \
            os.readlink(proc / "cwd").startswith(str(folder)) and alive(int(proc.name))
    except OSError:
        return False


MEASUREMENTS = {"cycles": cycles, "wide": wide, "pages": pages, "folder": folder}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.new_user", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(MEASUREMENTS))
    ap.add_argument("--json", default=str(REPO / "new_user.json"))
    a = ap.parse_args(argv)
    res = {}
    with tempfile.TemporaryDirectory(prefix="embgeom-new-user-") as tmp:
        for name in a.only.split(","):
            print(f"== {name}", flush=True)
            t0 = time.perf_counter()
            res[name] = {**MEASUREMENTS[name](Path(tmp)), "seconds": round(time.perf_counter() - t0, 1)}
    Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
