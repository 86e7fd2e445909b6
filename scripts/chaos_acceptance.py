#!/usr/bin/env python
"""Chaos acceptance run: exactly-once counting under worker and Redis crashes.

    python scripts/chaos_acceptance.py --jobs 40 --texts-per-job 25

1. Reference: a fresh Redis, an ``embgeom serve --redis-url`` process and ONE worker
   process ingest a held-out slice of BBC paragraphs (``--jobs`` jobs of
   ``--texts-per-job`` paragraphs), with no fault.
2. Chaos: another fresh Redis, an API process and ``--workers`` (3) worker processes
   ingest the same jobs, submitted a few at a time (with Idempotency-Keys, retried on
   503/connection errors) while a chaos thread SIGKILLs workers at random moments (mostly
   one that is mid-job) and starts replacements, and SIGKILLs the redis-server once,
   restarting it on the same port and data folder (AOF, appendfsync always).
3. Every acknowledged job (202) must end ``done``; the collection must hold exactly the
   jobs' token occurrences (checked against the tokenizer, independently of the
   pipeline); every per-token count of every layer (the whole ``/tokens`` listing walked
   with its cursor) must equal the reference exactly, and every value (Q, M, V per token;
   the ``/layers`` rows) within ``--rel-tol`` (1e-5) relative.

Prints the fault log (which kill when, and what was in flight), job and token counts,
attempts per job and the largest relative errors; exits 1 on any mismatch.
Nothing touches 127.0.0.1:6379: every Redis and service listens on a free port.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import httpx  # noqa: E402
import redis  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from embgeom.store import keys as K  # noqa: E402
from embgeom.corpora import bbc_texts, split  # noqa: E402
from embgeom.store.server import RedisServer, free_port  # noqa: E402

MODEL = "minilm"
COLLECTION = "chaos"
T0 = time.monotonic()


def now() -> float:
    return time.monotonic() - T0


def say(msg: str) -> None:
    print(f"[{now():7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------- processes


class Proc:
    """An ``embgeom`` child process in its own process group, logging to a file."""

    def __init__(self, name: str, args: list[str], env: dict, log_dir: Path):
        self.name = name
        self.log = log_dir / f"{name}.log"
        with open(self.log, "ab") as out:
            self.p = subprocess.Popen([sys.executable, "-m", "embgeom.cli", *args], cwd=REPO,
                                      env={**os.environ, **env}, stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.p.poll() is None

    def sigkill(self) -> None:
        if self.alive():
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait(timeout=30)

    def sigterm(self, timeout: float = 60) -> None:
        if self.alive():
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.sigkill()


class Cluster:
    """One Redis, one API process and any number of worker processes."""

    def __init__(self, name: str, root: Path, env: dict):
        self.name = name
        self.dir = root / name
        self.dir.mkdir(parents=True)
        self.env = env
        self.redis = RedisServer(self.dir / "redis").start(timeout=300)
        self.port = free_port()
        self.api = Proc(f"{name}-api", ["serve", "--port", str(self.port), "--redis-url",
                                        self.redis.url], env, self.dir)
        self.base = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.base, timeout=120)
        self.workers: dict[str, Proc] = {}
        self._n = 0

    def start_worker(self) -> str:
        self._n += 1
        wid = f"{self.name}-w{self._n}"
        self.workers[wid] = Proc(wid, ["worker", "--redis-url", self.redis.url, "--worker-id", wid],
                                 self.env, self.dir)
        return wid

    def live_workers(self) -> list[str]:
        return [w for w, p in self.workers.items() if p.alive()]

    def restart_redis(self) -> float:
        t = time.monotonic()
        self.redis = RedisServer(self.redis.data_dir, port=self.redis.port).start(timeout=600)
        return time.monotonic() - t

    def wait_api(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.api.alive():
                raise RuntimeError(f"API exited; see {self.api.log}")
            try:
                if self.http.get("/healthz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("API did not come up")

    def close(self) -> None:
        for p in self.workers.values():
            p.sigkill()
        self.api.sigterm(timeout=20)
        self.http.close()
        self.redis.kill()


# ---------------------------------------------------------------------------- API calls


def post_job(http: httpx.Client, texts: list[str], key: str, stop: threading.Event) -> str:
    """POST until acknowledged (202); the same Idempotency-Key on every retry."""
    body = {"collection": COLLECTION, "model": MODEL, "texts": texts}
    while not stop.is_set():
        try:
            r = http.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
            if r.status_code == 202:
                return r.json()["job_id"]
            if r.status_code not in (429, 500, 502, 503):
                raise RuntimeError(f"POST /v1/jobs: {r.status_code} {r.text}")
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("stopped before the job was acknowledged")


def job_status(http: httpx.Client, job_id: str):
    try:
        r = http.get(f"/v1/jobs/{job_id}")
        return r.json() if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def walk_tokens(http: httpx.Client, layer: int) -> dict[int, tuple]:
    out, cursor = {}, None
    while True:
        params = {"limit": 5000, **({"cursor": cursor} if cursor else {})}
        r = http.get(f"/v1/collections/{COLLECTION}/models/{MODEL}/layers/{layer}/tokens", params=params)
        r.raise_for_status()
        body = r.json()
        for t in body["tokens"]:
            if t["token_id"] in out:
                raise AssertionError(f"token {t['token_id']} served twice by the cursor walk")
            out[t["token_id"]] = (t["n"], t["Q"], t["M"], t["V"])
        cursor = body["next_cursor"]
        if cursor is None:
            if len(out) != body["total"]:
                raise AssertionError(f"cursor walk saw {len(out)} tokens of {body['total']}")
            return out


def snapshot(http: httpx.Client) -> dict:
    r = http.get(f"/v1/collections/{COLLECTION}/models/{MODEL}/layers")
    r.raise_for_status()
    layers = r.json()["layers"]
    return {"layers": layers, "tokens": {row["layer"]: walk_tokens(http, row["layer"]) for row in layers}}


# ---------------------------------------------------------------------------- the runs


def ingest(cluster: Cluster, jobs: list[list[str]], window: int, stop: threading.Event,
           acked: dict) -> None:
    """Submit the jobs keeping at most ``window`` unfinished; ``acked``: index -> job id."""
    for i, texts in enumerate(jobs):
        while not stop.is_set():
            unfinished = [j for j in acked.values()
                          if (s := job_status(cluster.http, j)) is None or s["status"] not in ("done", "failed")]
            if len(unfinished) < window:
                break
            time.sleep(0.3)
        acked[i] = post_job(cluster.http, texts, f"{COLLECTION}-{i}", stop)


def wait_all(cluster: Cluster, acked: dict, total: int, stop: threading.Event,
             timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    final: dict[int, dict] = {}
    while len(final) < total:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{total - len(final)} jobs not finished after {timeout}s")
        for i, job_id in list(acked.items()):
            if i in final:
                continue
            s = job_status(cluster.http, job_id)
            if s is not None and s["status"] in ("done", "failed"):
                final[i] = s
        time.sleep(0.5)
    stop.set()
    return final


def run_reference(root: Path, jobs, env, window: int, timeout: float) -> tuple[dict, dict]:
    say(f"reference: 1 worker, {len(jobs)} jobs")
    c = Cluster("reference", root, env)
    try:
        c.start_worker()
        c.wait_api()
        stop, acked = threading.Event(), {}
        t = threading.Thread(target=ingest, args=(c, jobs, window, stop, acked), daemon=True)
        t.start()
        final = wait_all(c, acked, len(jobs), stop, timeout)
        t.join()
        bad = {i: s for i, s in final.items() if s["status"] != "done"}
        if bad:
            raise AssertionError(f"reference jobs not done: {bad}")
        snap = snapshot(c.http)
        say(f"reference done: {sum(s['tokens'] for s in final.values())} tokens")
        return snap, final
    finally:
        c.close()
        shutil.rmtree(c.dir / "redis", ignore_errors=True)


def chaos_monkey(c: Cluster, acked: dict, total_jobs: int, rng: random.Random, args,
                 stop: threading.Event, faults: list) -> None:
    """SIGKILL workers at random moments (and Redis once) until every job ended."""
    redis_killed = False
    redis_at = args.redis_kill_at * total_jobs
    while not stop.is_set():
        if stop.wait(rng.uniform(args.kill_min, args.kill_max)):
            return
        statuses = {i: job_status(c.http, j) for i, j in list(acked.items())}
        done = sum(1 for s in statuses.values() if s and s["status"] == "done")
        running = [s for s in statuses.values() if s and s["status"] == "running" and s["worker"]]
        if not redis_killed and done >= redis_at:
            in_flight = [f"{s['job_id'][:8]}@{s['progress']:.2f}" for s in running]
            c.redis.kill()
            faults.append((now(), "SIGKILL redis-server",
                           f"{done}/{total_jobs} jobs done, {len(acked)} acknowledged, in flight: {in_flight}"))
            say(f"chaos: SIGKILL redis ({done} done, in flight {in_flight})")
            down = rng.uniform(1.0, 4.0)
            time.sleep(down)
            took = c.restart_redis()
            faults.append((now(), "redis-server restarted", f"down {down:.1f}s + {took:.1f}s AOF load"))
            say(f"chaos: redis back (AOF loaded in {took:.1f}s)")
            redis_killed = True
            continue
        live = c.live_workers()
        if not live:
            continue
        busy = [s["worker"] for s in running if s["worker"] in live]
        # Mostly kill a worker that is mid-job, sometimes an idle one.
        victim = rng.choice(busy) if busy and rng.random() < 0.8 else rng.choice(live)
        job = next((s for s in running if s["worker"] == victim), None)
        c.workers[victim].sigkill()
        what = f"mid-job {job['job_id'][:8]} progress {job['progress']:.2f}" if job else "idle / between jobs"
        faults.append((now(), f"SIGKILL worker {victim}", what))
        say(f"chaos: SIGKILL {victim} ({what})")
        if stop.wait(rng.uniform(0.5, 3.0)):
            return
        new = c.start_worker()
        faults.append((now(), f"started worker {new}", ""))
    if not redis_killed:
        faults.append((now(), "note", "all jobs ended before the Redis kill point"))


def run_chaos(root: Path, jobs, env, args, rng) -> tuple[dict, dict, list, Cluster]:
    say(f"chaos: {args.workers} workers, {len(jobs)} jobs")
    c = Cluster("chaos", root, env)
    faults: list = []
    for _ in range(args.workers):
        c.start_worker()
    c.wait_api()
    stop, acked = threading.Event(), {}
    submitter = threading.Thread(target=ingest, args=(c, jobs, args.window, stop, acked), daemon=True)
    monkey = threading.Thread(target=chaos_monkey, args=(c, acked, len(jobs), rng, args, stop, faults),
                              daemon=True)
    submitter.start()
    monkey.start()
    try:
        final = wait_all(c, acked, len(jobs), stop, args.timeout)
    finally:
        stop.set()
        monkey.join(timeout=120)
        submitter.join(timeout=60)
    snap = snapshot(c.http)
    return snap, final, faults, c


# ---------------------------------------------------------------------------- checks


def rel(a: float, b: float) -> float:
    return 0.0 if a == b else abs(a - b) / max(abs(a), abs(b), 1e-300)


def compare(ref: dict, got: dict, rel_tol: float) -> tuple[list[str], dict]:
    problems: list[str] = []
    worst = {"token Q": 0.0, "token M": 0.0, "token V": 0.0, "layer rows": 0.0}
    for layer, a in ref["tokens"].items():
        b = got["tokens"].get(layer, {})
        if a.keys() != b.keys():
            problems.append(f"layer {layer}: {len(a.keys() - b.keys())} tokens missing, "
                            f"{len(b.keys() - a.keys())} extra")
        diff = [(t, a[t][0], b[t][0]) for t in a.keys() & b.keys() if a[t][0] != b[t][0]]
        if diff:
            problems.append(f"layer {layer}: counts differ for {len(diff)} tokens, e.g. {diff[:5]}")
        for t in a.keys() & b.keys():
            for name, x, y in zip(("token Q", "token M", "token V"), a[t][1:], b[t][1:]):
                worst[name] = max(worst[name], rel(x, y) if max(abs(x), abs(y)) > 1e-12 * abs(a[t][1]) else 0.0)
    for ra, rb in zip(ref["layers"], got["layers"]):
        if (ra["n"], ra["num_types"]) != (rb["n"], rb["num_types"]):
            problems.append(f"layer {ra['layer']}: n/num_types {ra['n']}/{ra['num_types']} "
                            f"vs {rb['n']}/{rb['num_types']}")
        for f in ("Q", "M", "V", "V_W", "V_B", "cv_Q", "slope", "r2"):
            worst["layer rows"] = max(worst["layer rows"], rel(ra[f], rb[f]))
    for name, err in worst.items():
        if err > rel_tol:
            problems.append(f"{name}: max relative error {err:.2e} > {rel_tol:.0e}")
    return problems, worst


def expected_counts(texts: list[str]) -> Counter:
    from transformers import AutoTokenizer

    from embgeom.sources import minilm_path

    tok = AutoTokenizer.from_pretrained(str(minilm_path()))
    counts: Counter = Counter()
    for ids in tok(texts, add_special_tokens=False)["input_ids"]:
        counts.update(ids)
    return counts


# ---------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=40)
    ap.add_argument("--texts-per-job", type=int, default=25)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--held-out", type=float, default=0.2, help="held-out fraction of BBC paragraphs")
    ap.add_argument("--window", type=int, default=8, help="unfinished jobs kept submitted at a time")
    ap.add_argument("--kill-min", type=float, default=4.0, help="seconds between worker kills, low")
    ap.add_argument("--kill-max", type=float, default=10.0, help="seconds between worker kills, high")
    ap.add_argument("--redis-kill-at", type=float, default=0.4,
                    help="kill Redis once this fraction of the jobs is done")
    ap.add_argument("--token-budget", type=int, default=2048)
    ap.add_argument("--lease", type=float, default=3.0)
    ap.add_argument("--max-attempts", type=int, default=10,
                    help="deliveries before dead-lettering; chaos kills count as attempts")
    ap.add_argument("--rel-tol", type=float, default=1e-5)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--keep", action="store_true", help="keep the data and logs folder")
    args = ap.parse_args(argv)

    rng = random.Random(args.seed)
    paragraphs = bbc_texts("paragraphs")
    held_out = split(paragraphs, args.held_out, seed=args.seed).held_out
    need = args.jobs * args.texts_per_job
    if need > len(held_out):
        ap.error(f"{need} texts asked, the held-out slice has {len(held_out)}")
    texts = held_out[:need]
    jobs = [texts[i * args.texts_per_job:(i + 1) * args.texts_per_job] for i in range(args.jobs)]
    env = {
        "EMBGEOM_LEASE_SECONDS": str(args.lease),
        "EMBGEOM_HEARTBEAT_SECONDS": str(max(args.lease / 6, 0.1)),
        "EMBGEOM_TOKEN_BUDGET": str(args.token_budget),
        "EMBGEOM_MAX_ATTEMPTS": str(args.max_attempts),
        "EMBGEOM_LOG_LEVEL": "info",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    root = Path(tempfile.mkdtemp(prefix="embgeom-chaos-"))
    say(f"{args.jobs} jobs x {args.texts_per_job} held-out BBC paragraphs "
        f"({sum(len(t.encode()) for t in texts)} bytes); logs in {root}")

    chaos = None
    try:
        t = time.monotonic()
        ref, ref_final = run_reference(root, jobs, env, args.window, args.timeout)
        ref_seconds = time.monotonic() - t
        t = time.monotonic()
        got, final, faults, chaos = run_chaos(root, jobs, env, args, rng)
        chaos_seconds = time.monotonic() - t

        problems: list[str] = []
        not_done = {i: (s["status"], s["error"]) for i, s in final.items() if s["status"] != "done"}
        if not_done:
            problems.append(f"acknowledged jobs not done: {not_done}")
        rdb = redis.Redis.from_url(chaos.redis.url)
        committed = rdb.scard(K.PairKeys(COLLECTION, MODEL).committed)
        if committed != args.jobs:
            problems.append(f"{committed} jobs in the committed set, {args.jobs} expected")
        stream = K.PairKeys(COLLECTION, MODEL).jobs
        stream_len = rdb.xlen(stream)
        pending = rdb.xpending(stream, K.GROUP)["pending"]
        if stream_len or pending:
            problems.append(f"stream not drained: {stream_len} entries, {pending} pending")
        want = expected_counts(texts)
        for snap, name in ((ref, "reference"), (got, "chaos")):
            for layer, toks in snap["tokens"].items():
                if Counter({t: v[0] for t, v in toks.items()}) != want:
                    problems.append(f"{name} layer {layer}: counts differ from the tokenizer's")
                    break
        job_tokens = [final[i]["tokens"] for i in range(args.jobs)]
        if job_tokens != [ref_final[i]["tokens"] for i in range(args.jobs)]:
            problems.append("per-job token counts differ from the reference")
        cmp_problems, worst = compare(ref, got, args.rel_tol)
        problems += cmp_problems

        print("\n=== fault log ===")
        for t_, what, detail in faults:
            print(f"  {t_:7.1f}s  {what:32s} {detail}")
        kills = sum(1 for _, w, _ in faults if w.startswith("SIGKILL worker"))
        print("\n=== figures ===")
        print(f"  jobs acknowledged / done       {len(final)} / {sum(s['status'] == 'done' for s in final.values())}")
        print(f"  texts                          {len(texts)}")
        print(f"  tokens counted (per layer)     {sum(job_tokens)} (tokenizer: {sum(want.values())})")
        print(f"  token types (layer 0)          {len(got['tokens'][0])}")
        print(f"  layers compared                {len(got['tokens'])}")
        print(f"  worker SIGKILLs                {kills} "
              f"(mid-job: {sum(1 for _, w, d in faults if w.startswith('SIGKILL worker') and d.startswith('mid-job'))})")
        print(f"  redis SIGKILLs                 {sum(1 for _, w, _ in faults if w == 'SIGKILL redis-server')}")
        print(f"  attempts per job               {dict(sorted(Counter(s['attempts'] for s in final.values()).items()))}")
        print(f"  workers that committed jobs    {len({s['worker'] for s in final.values()})}")
        print(f"  reference run                  {ref_seconds:.0f}s (1 worker)")
        print(f"  chaos run                      {chaos_seconds:.0f}s ({args.workers} workers)")
        for name, err in worst.items():
            print(f"  max relative error {name:11s} {err:.3e}")
        if problems:
            print("\nFAIL")
            for p in problems:
                print("  - " + p)
            return 1
        print("\nPASS: every acknowledged job counted exactly once; counts equal the reference "
              f"at every layer; values within {args.rel_tol:g}")
        return 0
    finally:
        if chaos is not None:
            chaos.close()
        if args.keep:
            print(f"(kept {root})")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
