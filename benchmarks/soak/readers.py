"""The soak's readers: every GET of the live OpenAPI document, filled from what the run
made, and a global comparison, paused while the processes come to rest. Methods of
:class:`benchmarks.soak.harness.Soak`."""

from __future__ import annotations

import random
import re
import time
from typing import Optional

import httpx

from benchmarks.soak.plan import HEAP_TRIM_S, SAMPLE_S, figure_names
from benchmarks.soak.records import Http


class Readers:
    """Reading every endpoint while the load runs (the harness's state: see ``Soak.__init__``)."""

    def read_paths(self, spec: dict, rng: random.Random) -> list[tuple[str, str, dict]]:
        """(endpoint, path, params) for one sweep over every GET of the OpenAPI document,
        filled with a random pair of the plan; templates it cannot fill go to ``not_read``."""
        figures = figure_names()
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
            if r is not None and r.status_code == 200 and endpoint.endswith("/report"):
                # A person reloading the page: answered from a drawing already made (a
                # hit, or stale while the next one is drawn), the case of the page's target.
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
