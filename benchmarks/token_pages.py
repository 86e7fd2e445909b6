"""Concurrent token pages at the limit over HTTP: status and latency of each, the API's
RSS meanwhile, /healthz latency meanwhile, and the bytes Redis sent.

    python -m benchmarks.token_pages --url http://127.0.0.1:8080 --redis-url redis://... \
        --collection bbc --model smollm2 --layer 15 --pid <API pid>

Prints one JSON object (figures, no assertion).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import redis


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--collection", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--layer", type=int, default=15)
    ap.add_argument("--limit", type=int, default=10000)
    ap.add_argument("--concurrent", type=int, default=4)
    ap.add_argument("--pid", type=int, required=True, help="the API process")
    a = ap.parse_args()
    path = f"/v1/collections/{a.collection}/models/{a.model}/layers/{a.layer}/tokens?limit={a.limit}"
    r = redis.Redis.from_url(a.redis_url)
    done = threading.Event()
    rss, health = [], []

    def sample_rss():
        while not done.is_set():
            rss.append(rss_mb(a.pid))
            time.sleep(0.05)

    def poll_health():
        with httpx.Client(base_url=a.url, timeout=60) as c:
            while not done.is_set():
                t0 = time.perf_counter()
                code = c.get("/healthz").status_code
                health.append((time.perf_counter() - t0, code))
                time.sleep(0.1)

    def page(_):
        with httpx.Client(base_url=a.url, timeout=120) as c:
            t0 = time.perf_counter()
            resp = c.get(path)
            body = resp.json()
            return {"status": resp.status_code, "seconds": round(time.perf_counter() - t0, 2),
                    "tokens": len(body.get("tokens", [])), "type": body.get("type")}

    rss_before = rss_mb(a.pid)
    out_before = int(r.info("stats")["total_net_output_bytes"])
    watchers = [threading.Thread(target=sample_rss), threading.Thread(target=poll_health)]
    for w in watchers:
        w.start()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(a.concurrent) as pool:
        pages = list(pool.map(page, range(a.concurrent)))
    wall = time.perf_counter() - t0
    done.set()
    for w in watchers:
        w.join()
    moved = int(r.info("stats")["total_net_output_bytes"]) - out_before
    lat = sorted(h[0] for h in health)
    print(json.dumps({
        "pages": pages, "wall_seconds": round(wall, 2),
        "redis_bytes_sent_mb": round(moved / 1e6, 1),
        "redis_mb_per_page": round(moved / 1e6 / a.concurrent, 1),
        "api_rss_mb": {"before": round(rss_before), "peak": round(max(rss)), "after": round(rss_mb(a.pid))},
        "healthz": {"count": len(lat), "p50_ms": round(1000 * lat[len(lat) // 2], 1),
                    "max_ms": round(1000 * lat[-1], 1),
                    "non_200": sum(1 for h in health if h[1] != 200)},
    }, indent=1))


if __name__ == "__main__":
    main()
