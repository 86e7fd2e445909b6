"""The soak's checks: counts against the tokenizer alone (:func:`expected_count`), values
against the float64 reference (:mod:`embgeom.testing.reference`), and the memory rules
(:func:`rss_growth`, :func:`at_rest`, :func:`weights_check`)."""

from __future__ import annotations

import csv
import io
import math
import random
from collections import Counter
from typing import Optional

import numpy as np

from benchmarks.soak.plan import RSS_SLACK, SMALL_WINDOW, collection_rules
from benchmarks.soak.records import Http
from benchmarks.soak.sampler import memory_by_family


class Checks:
    """The checks after the load (the harness's state: see ``Soak.__init__``)."""

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

        from embgeom.testing import reference as R
        from embgeom.testing.reference import TOL

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
