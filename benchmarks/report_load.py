"""Report pages and token reads under load: one API (``embgeom serve --redis-url``) against
a real MiniLM store, for each source tree given, side by side on the same store.

``python -m benchmarks.report_load [--texts 400] [--tree DIR ...] [--json out.json]``

The store: BBC paragraphs ingested by one ``embgeom worker`` into collection ``c``
(``cross_layer``, so the page has every figure). Per tree (``--tree``, default this
repository; its ``serve`` runs with that tree first on ``PYTHONPATH``):

- ``token_*_32``: wrk, 32 connections, GET of a token's stats (layer 3), idle;
- ``report_cold_s``: one report page (SVG, as the soak asks for it), each of a count
  filter not drawn before (nothing cached), one at a time: median;
- ``report_identical_8``: 8 clients at once asking for one page not drawn yet: their
  latencies (p50, max) and how many draws the API made (``X-Embgeom-Cache``);
- ``report_hit_8``: 8 clients, 10 requests each, of a page drawn: p50, p99;
- ``token_*_32_drawing`` and ``healthz_max_ms_drawing``: wrk again while one client asks
  for pages never drawn, one after another, and another polls ``/healthz`` every 50 ms;
- ``report_ingesting``: a worker ingests into ``c`` (a new version every checkpoint) while
  two clients ask for one page every half second, as the soak's readers do: p50, p99, max
  and how the answers came (``X-Embgeom-Cache``: miss, hit, stale).

Prints one JSON object; figures, not assertions.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.run import REPO, serve_process, worker_process, wrk
from embgeom.testing.redis import private_redis
from embgeom.testing.serve import ServiceProcess, offline_env

BASE = "/v1/collections/c/models/minilm"
LAYER = 3


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def build_store(url: str, texts: int, tmp: Path) -> None:
    """Ingest ``texts`` BBC paragraphs into ``c``/minilm through a real worker process."""
    from embgeom.corpora import bbc_texts

    api = serve_process(tmp, ("--redis-url", url))
    worker = worker_process(url)
    try:
        api.wait_ready(path="/healthz")
        paras = [p for p in bbc_texts("paragraphs") if 40 <= len(p) <= 400][:texts]
        with httpx.Client(base_url=api.url, timeout=60) as client:
            assert client.put("/v1/collections/c", json={"cross_layer": True}).status_code == 201
            ids = [client.post("/v1/jobs", json={"collection": "c", "model": "minilm",
                                                 "texts": paras[i:i + 50]}).json()["job_id"]
                   for i in range(0, len(paras), 50)]
            while any(s["status"] not in ("done", "failed") for s in
                      client.get("/v1/jobs", params={"ids": ",".join(ids)}).json()):
                time.sleep(0.5)
    finally:
        worker.kill()
        api.terminate()


class Counter:
    """A fresh count filter per call: a page no one has drawn yet."""

    def __init__(self, start: int):
        self.next = start

    def __call__(self) -> int:
        self.next += 1
        return self.next


def report(client: httpx.Client, min_count: int) -> tuple[float, httpx.Response]:
    t = time.perf_counter()
    r = client.get(f"{BASE}/report", params={"format": "svg", "min_count": min_count}, timeout=600)
    assert r.status_code == 200, r.text[:300]
    return time.perf_counter() - t, r


def measure(url: str, tree: Path, tmp: Path, seconds: int) -> dict:
    """Every figure of the module docstring for one tree's API."""
    api = _serve(tree, url, tmp)
    out: dict = {"tree": str(tree)}
    fresh = Counter(1000)
    try:
        api.wait_ready(path="/healthz")
        with httpx.Client(base_url=api.url, timeout=60) as client:
            page = client.get(f"{BASE}/layers/{LAYER}/tokens", params={"limit": 10000}).json()
            paths = [f"{BASE}/layers/{LAYER}/tokens/{t['token_id']}" for t in page["tokens"]]
            idle = wrk(api.url, paths, seconds)
            out.update(token_p50_ms_32=idle["p50_ms"], token_p99_ms_32=idle["p99_ms"],
                       token_req_s_32=idle["req_s"])
            # The first page also starts the render processes: kept apart.
            out["report_first_s"] = report(client, fresh())[0]
            out["report_cold_s"] = statistics.median(report(client, fresh())[0] for _ in range(3))

            k, lat, caches = fresh(), [], []
            barrier = threading.Barrier(8)

            def one():
                barrier.wait()
                s, r = report(client, k)
                lat.append(s)
                caches.append(r.headers.get("x-embgeom-cache"))

            threads = [threading.Thread(target=one) for _ in range(8)]
            [t.start() for t in threads]
            [t.join() for t in threads]
            out["report_identical_8"] = {"p50_s": statistics.median(lat), "max_s": max(lat),
                                         "misses": caches.count("miss")}
            hits = []

            def many():
                for _ in range(10):
                    hits.append(report(client, k)[0])

            threads = [threading.Thread(target=many) for _ in range(8)]
            [t.start() for t in threads]
            [t.join() for t in threads]
            out["report_hit_8"] = {"p50_ms": 1000 * statistics.median(hits), "p99_ms": 1000 * _pct(hits, 0.99)}

            stop, drawn, health = threading.Event(), [], []

            def drawing():
                while not stop.is_set():
                    drawn.append(report(client, fresh())[0])

            def healthz():
                while not stop.is_set():
                    t = time.perf_counter()
                    client.get("/healthz")
                    health.append(1000 * (time.perf_counter() - t))
                    time.sleep(0.05)

            threads = [threading.Thread(target=drawing), threading.Thread(target=healthz)]
            [t.start() for t in threads]
            time.sleep(1.0)  # a draw under way
            busy = wrk(api.url, paths, seconds)
            stop.set()
            [t.join() for t in threads]
            out.update(token_p50_ms_32_drawing=busy["p50_ms"], token_p99_ms_32_drawing=busy["p99_ms"],
                       token_req_s_32_drawing=busy["req_s"], pages_drawn_meanwhile=len(drawn),
                       healthz_max_ms_drawing=max(health), healthz_p50_ms_drawing=statistics.median(health))
            out["report_ingesting"] = pages_while_ingesting(client, url, seconds * 4)
    finally:
        api.terminate()
    return out


def pages_while_ingesting(client: httpx.Client, url: str, seconds: float) -> dict:
    """Two readers of one page while a worker ingests 20 paragraphs a job into ``c``."""
    from embgeom.corpora import bbc_texts

    paras = [p for p in bbc_texts("paragraphs") if 40 <= len(p) <= 400]
    worker = worker_process(url)
    stop, lat, caches, jobs = threading.Event(), [], [], []

    def feed():
        i = 0
        while not stop.is_set():
            batch = [paras[(i + j) % len(paras)] for j in range(20)]
            jobs.append(client.post("/v1/jobs", json={"collection": "c", "model": "minilm",
                                                      "texts": batch}).json()["job_id"])
            i += 20
            time.sleep(1.0)

    def read():
        while not stop.is_set():
            s, r = report(client, 1)
            lat.append(s)
            caches.append(r.headers.get("x-embgeom-cache"))
            time.sleep(0.5)

    try:
        report(client, 1)  # drawn once before the load, as the soak's first read is
        threads = [threading.Thread(target=feed)] + [threading.Thread(target=read) for _ in range(2)]
        [t.start() for t in threads]
        time.sleep(seconds)
        stop.set()
        [t.join() for t in threads]
    finally:
        worker.kill()
    return {"pages": len(lat), "p50_s": statistics.median(lat), "p99_s": _pct(lat, 0.99),
            "max_s": max(lat), "jobs": len(jobs),
            **{f"answers_{k}": caches.count(k) for k in ("miss", "hit", "stale")}}


def _serve(tree: Path, url: str, tmp: Path) -> ServiceProcess:
    """``embgeom serve --redis-url url`` of ``tree`` (its cwd and first on the path: ``-m``
    imports from the cwd first), started."""
    return ServiceProcess.serve(redis_url=url, log_level="warning", cwd=tree,
                                env=offline_env(PYTHONPATH=str(tree)), log_path=tmp / "serve.log").start()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=400)
    ap.add_argument("--tree", action="append", type=Path, help="source tree of the API (repeatable)")
    ap.add_argument("--seconds", type=int, default=8, help="each wrk run")
    ap.add_argument("--repeat", type=int, default=1, help="rounds over the trees")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    trees = args.tree or [REPO]
    tmp = Path(tempfile.mkdtemp(prefix="embgeom-report-load-"))
    results = []
    try:
        with private_redis(tmp) as server:
            t = time.perf_counter()
            build_store(server.url, args.texts, tmp)
            print(f"store: {args.texts} texts in {time.perf_counter() - t:.0f} s", file=sys.stderr)
            for round_ in range(args.repeat):
                for tree in trees:
                    res = measure(server.url, tree.resolve(), tmp, args.seconds)
                    res["round"] = round_
                    print(json.dumps(res), file=sys.stderr, flush=True)
                    results.append(res)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
