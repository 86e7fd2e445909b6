"""The soak's writer: jobs of random sizes to every pair of the plan, DELETE cycles, the
rest pauses that let every process come to rest, and the warm-up until each worker holds
its models. Methods of :class:`benchmarks.soak.harness.Soak`."""

from __future__ import annotations

import time
import uuid
from typing import Optional

import httpx

from benchmarks.run import e2e_texts
from benchmarks.soak.plan import HEARTBEAT_S, JOB_TEXTS, OUTSTANDING_JOBS, REST_EVERY_S, REST_MAX_S, WEIGHT
from benchmarks.soak.records import Http, Job


class Load:
    """Submitting jobs and waiting for them (the harness's state: see ``Soak.__init__``)."""

    def texts(self, kind: str) -> list[str]:
        if kind not in getattr(self, "_texts", {}):
            from embgeom.corpora import bbc_texts

            self._texts = getattr(self, "_texts", {})
            self._texts["short"] = e2e_texts(5000, held_out=False)
            self._texts["long"] = [p for p in bbc_texts("paragraphs") if 200 <= len(p) <= 1200][:3000]
        return self._texts[kind]

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
