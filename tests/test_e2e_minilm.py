"""End to end: real BBC paragraphs -> HTTP -> `embgeom serve` (embedded Redis + worker,
a real child process) running the packaged all-MiniLM-L6-v2 -> every read endpoint,
checked against embgeom/testing/reference.py on the same weights (one text at a time, no padding,
no batching, two-pass float64 over the raw hidden states).

One service serves every check (starting it and loading the model is the slow part), so
the whole scenario is one test; its checks are soft: every problem is collected and the
test fails once, listing all of them, with a table of the measured errors (``-s``).

Tolerances (why these numbers)
------------------------------
The service runs the model on padded batches of windows; the reference runs each text
alone. In float32 the two give hidden states that differ in the last bits (~1e-6
relative: different GEMM shapes sum in a different order). Every statistic is then
accumulated in float64, so the float64 arithmetic adds ~1e-13 and the float32 forward
dominates. We allow:

* counts (n, num_types, per-token n): exact. They are integers and depend only on the
  tokenizer and the counting rules.
* Q, M, V, V_W, V_B of a layer: ``|got - ref| <= 1e-4 * Q_ref``. Q is the natural scale
  (every term is a part of Q, and V or V_B alone can be small next to M); measured errors
  are ~1e-7, so 1e-4 is ~100x headroom while any counting or merge error (a dropped
  token, a padded row, a wrong weight) moves them by >= 1/n ~ 1e-4..1e-1.
* per-token Q, M, V: ``<= 1e-4 * Q_t`` (same reasoning, per type).
* cv_Q, slope, r2 (fits over thousands of types): ``|got - ref| <= 1e-3 * max(1, |ref|)``;
  they are smooth functions of the per-type values and inherit their ~1e-6 noise, but a
  fit over n_t = 1 types can amplify it, hence the looser bound.
* the same texts ingested in other jobs, in another order (other batch shapes): layer
  values (Q, M, V, V_W, V_B, cv_Q, slope, r2) within 1e-5 relative to themselves
  (measured ~1e-8: float32 forward noise averaged over ~16k tokens). Per-token values of
  the two collections are compared like the reference, within 1e-4 of Q_t: a type seen
  once averages nothing, and the float32 noise of one hidden state through six
  LayerNorm'd blocks was measured up to ~5e-6 of its squared norm, too close to 1e-5.
"""

from __future__ import annotations

import math
import time
import random
from collections import Counter

import httpx
import numpy as np
import pytest
import torch

from embgeom.corpora import bbc_texts
from embgeom.sources import minilm_path
from embgeom.testing import reference as R
from embgeom.testing.reference import TOL  # decomposition and per-token values, relative to Q
from tests.reference import summary
from tests.conftest import wait_for_jobs

pytestmark = pytest.mark.slow

MODEL = "minilm"
NUM_LAYERS = 7  # hidden_states of a 6-block BERT: embedding output + 6 blocks
N_TEXTS = 200
TOL_SUMMARY = 1e-3  # cv_Q, slope, r2
TOL_RECHUNK = 1e-5  # same texts, other jobs and order
FILTER = {"min_count": 2, "max_count": 1000}


# ----------------------------------------------------------------------------- helpers


class Checks:
    """Soft assertions and the largest error seen per quantity."""

    def __init__(self):
        self.problems: list[str] = []
        self.max_err: dict[str, float] = {}
        self.worst: dict[str, str] = {}

    def fail(self, msg: str) -> None:
        if len(self.problems) < 200:
            self.problems.append(msg)

    def equal(self, label: str, got, want) -> None:
        if got != want:
            self.fail(f"{label}: {got!r} != {want!r}")

    def close(self, quantity: str, label: str, got, want, scale: float, tol: float) -> None:
        if got is None or want is None:
            if got is not want:
                self.fail(f"{label}: {got!r} vs {want!r}")
            return
        err = abs(float(got) - float(want)) / scale
        if err >= self.max_err.get(quantity, 0.0):
            self.max_err[quantity], self.worst[quantity] = err, label
        if not err <= tol:  # also catches NaN
            self.fail(f"{label}: {got!r} vs {want!r} (error {err:.3g} of scale, tol {tol:g})")

    def report(self, title: str) -> None:
        print(f"\n{title}: max errors (relative to the scale stated in the module docstring)")
        for name in sorted(self.max_err):
            print(f"  {name:<40s} {self.max_err[name]:.3e}   at {self.worst[name]}")


def fits(tokenizer, texts):
    return all(len(tokenizer(t)["input_ids"]) <= tokenizer.model_max_length for t in texts)


def submit(client: httpx.Client, collection: str, chunks, include_special=False) -> list[str]:
    ids = []
    for chunk in chunks:
        r = client.post("/v1/jobs", json={"collection": collection, "model": MODEL,
                                          "texts": list(chunk), "include_special": include_special})
        assert r.status_code == 202, r.text
        ids.append(r.json()["job_id"])
    return ids


def chunked(seq, sizes):
    out, i = [], 0
    for s in sizes:
        out.append(seq[i:i + s])
        i += s
    assert i == len(seq)
    return out


def base(collection: str) -> str:
    return f"/v1/collections/{collection}/models/{MODEL}"


def all_tokens(client, collection, layer) -> dict[int, dict]:
    r = client.get(f"{base(collection)}/layers/{layer}/tokens", params={"limit": 10000})
    assert r.status_code == 200, r.text
    page = r.json()
    assert page["next_cursor"] is None, "more than 10000 types: use a smaller corpus"
    return {t["token_id"]: t for t in page["tokens"]}


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from transformers import AutoModel, AutoTokenizer

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    path = str(minilm_path())
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def corpus(model_and_tokenizer):
    _, tok = model_and_tokenizer
    paragraphs = bbc_texts("paragraphs")
    texts = paragraphs[:N_TEXTS]
    assert fits(tok, texts), "every reference text must fit 512 tokens"
    special = paragraphs[N_TEXTS:N_TEXTS + 20]
    assert fits(tok, special) and not any("[SEP]" in t or "[CLS]" in t for t in special)
    # A text longer than the model's 512 tokens: consecutive paragraphs, joined.
    long_text, i = "", N_TEXTS + 20
    while len(tok(long_text, add_special_tokens=False)["input_ids"]) < 1300:
        long_text = (long_text + " " + paragraphs[i]).strip()
        i += 1
    return {"texts": texts, "special": special, "long": long_text}


# ----------------------------------------------------------------------------- the test


def test_minilm_end_to_end_against_reference(embedded_service, model_and_tokenizer, corpus):
    url, _ = embedded_service
    model, tok = model_and_tokenizer
    texts, special, long_text = corpus["texts"], corpus["special"], corpus["long"]
    c = Checks()
    t0 = time.monotonic()

    def phase(name):
        print(f"[{time.monotonic() - t0:6.1f}s] {name}")

    with httpx.Client(base_url=url, timeout=120) as client:
        models = {m["name"]: m for m in client.get("/v1/models").json()}
        assert models[MODEL]["num_layers"] == NUM_LAYERS - 1

        # --- submit everything up front; the worker runs while the reference computes
        main_jobs = submit(client, "bbc", chunked(texts, [50, 50, 50, 50]))
        shuffled = texts[:]
        random.Random(1234).shuffle(shuffled)
        rechunk_jobs = submit(client, "bbc_rechunk", chunked(shuffled, [7, 61, 1, 33, 45, 20, 33]))
        special_jobs = submit(client, "special", [special], include_special=True)
        long_jobs = submit(client, "long", [[long_text]])
        long_special_jobs = submit(client, "long_special", [[long_text]], include_special=True)

        phase("submitted")
        raw = R.raw_hidden_states(model, tok, texts)
        raw_special = R.raw_hidden_states(model, tok, special, include_special=True)

        statuses = wait_for_jobs(client, main_jobs + rechunk_jobs + special_jobs + long_jobs
                                 + long_special_jobs, timeout=900)
        phase("reference computed, jobs done")
        for s in statuses:
            c.equal(f"job {s['job_id']} status", (s["status"], s["error"]), ("done", None))
            c.equal(f"job {s['job_id']} progress", s["progress"], 1.0)

        n_total = len(raw.ids)
        main_status = statuses[:len(main_jobs)]
        c.equal("sum of job tokens", sum(s["tokens"] for s in main_status), n_total)
        c.equal("job texts", [s["texts"] for s in main_status], [50, 50, 50, 50])

        cols = {x["name"]: x["models"] for x in client.get("/v1/collections").json()}
        for name in ("bbc", "bbc_rechunk", "special", "long", "long_special"):
            c.equal(f"collection {name}", cols.get(name), [MODEL])

        # --- per-layer decomposition and summary, unfiltered and filtered
        check_layers(c, client, "bbc", raw, {})
        check_layers(c, client, "bbc", raw, FILTER)

        phase("layers checked")
        # --- every type of every layer through the token list; a sample through /tokens/{id}
        ref_types = [R.token_stats(raw.ids, raw.states[l]) for l in range(NUM_LAYERS)]
        listed = [all_tokens(client, "bbc", l) for l in range(NUM_LAYERS)]
        for layer in range(NUM_LAYERS):
            check_token_values(c, f"bbc L{layer} list", listed[layer], ref_types[layer], tok)
        check_token_detail(c, client, "bbc", ref_types, tok)

        phase("tokens checked")
        # --- pagination: every type exactly once, in order, for every order and direction
        check_pagination(c, client, "bbc", layer=4, ref=ref_types[4])

        # --- ?token=<string>
        check_token_lookup(c, client, "bbc", ref_types, tok)

        phase("pagination and lookup checked")
        # --- the same texts, other jobs, other order
        check_rechunked(c, client, "bbc", "bbc_rechunk")

        # --- include_special: [CLS]/[SEP] count, n grows by 2 per window
        check_special(c, client, special, raw_special, tok)

        # --- a text longer than 512 tokens: windows, every token counted once
        check_long_text(c, client, model, tok, long_text)

        phase("rechunk, include_special, long text checked")
    c.report("MiniLM end to end")
    assert not c.problems, f"{len(c.problems)} problems:\n" + "\n".join(c.problems)


# ----------------------------------------------------------------------------- checks


def check_layers(c: Checks, client, collection, raw, params):
    tag = "filtered" if params else "unfiltered"
    r = client.get(f"{base(collection)}/layers", params=params)
    assert r.status_code == 200, r.text
    body = r.json()
    rows = body["layers"]
    c.equal(f"{tag} layer numbers", [row["layer"] for row in rows], list(range(NUM_LAYERS)))
    for layer, row in enumerate(rows):
        ref = R.decomposition(raw.ids, raw.states[layer], **params)
        summ = summary(ref["types"])
        label = f"{collection} {tag} L{layer}"
        c.equal(f"{label} n", row["n"], ref["n"])
        c.equal(f"{label} num_types", row["num_types"], ref["num_types"])
        # Each against the reference computed point by point from the raw states: its V_B
        # is the spread of the per-token means (embgeom/testing/reference.py), never V - V_W.
        for q in ("Q", "M", "V", "V_W", "V_B"):
            c.close(f"layer {q} ({tag})", f"{label} {q}", row[q], ref[q], ref["Q"], TOL)
        for q in ("cv_Q", "slope", "r2"):
            c.close(f"summary {q} ({tag})", f"{label} {q}", row[q], summ[q],
                    max(1.0, abs(summ[q])), TOL_SUMMARY)
        # /decomposition agrees with /layers (same snapshot, nothing committed since)
        d = client.get(f"{base(collection)}/layers/{layer}/decomposition", params=params).json()
        for q in ("n", "num_types", "Q", "M", "V", "V_W", "V_B"):
            c.close(f"decomposition vs layers ({tag})", f"{label} decomposition {q}", d[q], row[q],
                    max(abs(row["Q"]), 1.0), 1e-12)


def check_token_values(c: Checks, label, listed: dict, ref: dict, tok):
    ids = ref["ids"].tolist()
    c.equal(f"{label} type set", sorted(listed), ids)
    strings = tok.convert_ids_to_tokens(ids)
    for j, token_id in enumerate(ids):
        got = listed.get(token_id)
        if got is None:
            continue
        c.equal(f"{label} {token_id} n", got["n"], int(ref["n"][j]))
        c.equal(f"{label} {token_id} token", got["token"], strings[j])
        q = float(ref["Q"][j])
        for name in ("Q", "M", "V"):
            c.close(f"per-token {name} (list)", f"{label} {strings[j]!r} {name}", got[name],
                    float(ref[name][j]), q, TOL)


def sample_ids(ref: dict, k: int = 24) -> list[int]:
    """The most and least frequent types and some in between (deterministic)."""
    order = np.lexsort((ref["ids"], -ref["n"]))
    ids = ref["ids"][order]
    picks = list(ids[:8]) + list(ids[-8:]) + list(ids[np.linspace(8, len(ids) - 9, k - 16).astype(int)])
    return sorted({int(i) for i in picks})


def check_token_detail(c: Checks, client, collection, ref_types, tok):
    ids = sample_ids(ref_types[0])
    for layer in range(NUM_LAYERS):
        ref = ref_types[layer]
        pos = {int(t): j for j, t in enumerate(ref["ids"])}
        for token_id in ids:
            r = client.get(f"{base(collection)}/layers/{layer}/tokens/{token_id}")
            if r.status_code != 200:
                c.fail(f"/tokens/{token_id} at L{layer}: {r.status_code} {r.text[:200]}")
                continue
            got, j = r.json(), pos[token_id]
            label = f"detail L{layer} {got['token']!r}"
            c.equal(f"{label} token_id", got["token_id"], token_id)
            c.equal(f"{label} token", got["token"], tok.convert_ids_to_tokens(token_id))
            c.equal(f"{label} n", got["n"], int(ref["n"][j]))
            for name in ("Q", "M", "V"):
                c.close(f"per-token {name} (detail)", f"{label} {name}", got[name],
                        float(ref[name][j]), float(ref["Q"][j]), TOL)


def check_pagination(c: Checks, client, collection, layer, ref):
    all_ids = sorted(int(i) for i in ref["ids"])
    for order_by in ("n", "Q", "M", "V"):
        for desc in (True, False):
            label = f"pages L{layer} order_by={order_by} desc={desc}"
            seen, values, cursor, pages = [], [], None, 0
            while True:
                params = {"order_by": order_by, "desc": str(desc).lower(), "limit": 257}
                if cursor is not None:
                    params["cursor"] = cursor
                r = client.get(f"{base(collection)}/layers/{layer}/tokens", params=params)
                if r.status_code != 200:
                    c.fail(f"{label}: {r.status_code} {r.text[:200]}")
                    break
                page = r.json()
                pages += 1
                c.equal(f"{label} total", page["total"], len(all_ids))
                if len(page["tokens"]) > 257:
                    c.fail(f"{label}: page of {len(page['tokens'])} > limit")
                seen += [t["token_id"] for t in page["tokens"]]
                values += [(t[order_by], t["token_id"]) for t in page["tokens"]]
                cursor = page["next_cursor"]
                if cursor is None or pages > 100:
                    break
            c.equal(f"{label} each type exactly once", len(seen), len(set(seen)))
            c.equal(f"{label} every type", sorted(seen), all_ids)
            c.equal(f"{label} pages", pages, math.ceil(len(all_ids) / 257))
            sign = -1 if desc else 1
            keys = [(sign * v, i) for v, i in values]
            if keys != sorted(keys):
                bad = next(k for k in range(len(keys) - 1) if keys[k] > keys[k + 1])
                c.fail(f"{label}: out of order at {bad}: {values[bad]} then {values[bad + 1]}")
    # min_count on the list: only types with n >= 5, all of them
    page = client.get(f"{base(collection)}/layers/{layer}/tokens",
                      params={"min_count": 5, "limit": 10000}).json()
    want = sorted(int(i) for i, n in zip(ref["ids"], ref["n"]) if n >= 5)
    c.equal(f"L{layer} min_count=5 list", sorted(t["token_id"] for t in page["tokens"]), want)


def check_token_lookup(c: Checks, client, collection, ref_types, tok):
    vocab = tok.get_vocab()
    for string in ("the", ",", "said", "##s"):
        token_id = vocab[string]
        for layer in (0, 3, 6):
            ref = ref_types[layer]
            j = int(np.searchsorted(ref["ids"], token_id))
            page = client.get(f"{base(collection)}/layers/{layer}/tokens", params={"token": string}).json()
            if ref["ids"][j] != token_id:
                c.fail(f"test corpus lacks {string!r}")
                continue
            c.equal(f"?token={string!r} L{layer} ids", [t["token_id"] for t in page.get("tokens", [])],
                    [token_id])
            if page.get("tokens"):
                got = page["tokens"][0]
                c.equal(f"?token={string!r} L{layer} n", got["n"], int(ref["n"][j]))
                c.equal(f"?token={string!r} L{layer} token", got["token"], string)
                for name in ("Q", "M", "V"):
                    c.close(f"per-token {name} (?token=)", f"?token={string!r} L{layer} {name}",
                            got[name], float(ref[name][j]), float(ref["Q"][j]), TOL)
    # a vocabulary string never seen: an empty page, not an error
    seen_ids = set(ref_types[0]["ids"].tolist())
    unseen = next(s for s, i in sorted(vocab.items(), key=lambda kv: kv[1])
                  if i > 2000 and i not in seen_ids)
    page = client.get(f"{base(collection)}/layers/1/tokens", params={"token": unseen})
    c.equal(f"?token={unseen!r} (unseen)", (page.status_code, page.json().get("tokens"), page.json().get("total")),
            (200, [], 0))


def check_rechunked(c: Checks, client, a, b):
    for params in ({}, FILTER):
        tag = "filtered" if params else "unfiltered"
        ra = client.get(f"{base(a)}/layers", params=params).json()["layers"]
        rb = client.get(f"{base(b)}/layers", params=params).json()["layers"]
        for x, y in zip(ra, rb):
            label = f"rechunk {tag} L{x['layer']}"
            c.equal(f"{label} n", y["n"], x["n"])
            c.equal(f"{label} num_types", y["num_types"], x["num_types"])
            for q in ("Q", "M", "V", "V_W", "V_B"):
                c.close(f"rechunk layer {q}", f"{label} {q}", y[q], x[q], abs(x[q]), TOL_RECHUNK)
            for q in ("cv_Q", "slope", "r2"):
                c.close(f"rechunk summary {q}", f"{label} {q}", y[q], x[q], max(1.0, abs(x[q])), TOL_RECHUNK)
    for layer in range(NUM_LAYERS):
        ta, tb = all_tokens(client, a, layer), all_tokens(client, b, layer)
        c.equal(f"rechunk L{layer} type set", sorted(tb), sorted(ta))
        for token_id, x in ta.items():
            y = tb.get(token_id)
            if y is None:
                continue
            c.equal(f"rechunk L{layer} {token_id} n", y["n"], x["n"])
            for name in ("Q", "M", "V"):
                c.close(f"rechunk per-token {name}", f"rechunk L{layer} {x['token']!r} {name}",
                        y[name], x[name], x["Q"], TOL)


def check_special(c: Checks, client, texts, raw_special, tok):
    content = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts)
    rows = client.get(f"{base('special')}/layers").json()["layers"]
    for layer, row in enumerate(rows):
        c.equal(f"special L{layer} n", row["n"], content + 2 * len(texts))
        ref = R.decomposition(raw_special.ids, raw_special.states[layer])
        c.equal(f"special L{layer} n (reference)", row["n"], ref["n"])
        for q in ("Q", "M", "V", "V_W", "V_B"):
            c.close(f"include_special layer {q}", f"special L{layer} {q}", row[q], ref[q], ref["Q"], TOL)
        types = R.token_stats(raw_special.ids, raw_special.states[layer])
        for special_id in (tok.cls_token_id, tok.sep_token_id):
            got = client.get(f"{base('special')}/layers/{layer}/tokens/{special_id}").json()
            j = int(np.searchsorted(types["ids"], special_id))
            c.equal(f"special L{layer} {special_id} n", got.get("n"), len(texts))
            for name in ("Q", "M", "V"):
                c.close(f"include_special per-token {name}", f"special L{layer} {got.get('token')} {name}",
                        got.get(name), float(types[name][j]), float(types["Q"][j]), TOL)


def check_long_text(c: Checks, client, model, tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    per_window = 512 - 2
    windows = math.ceil(len(ids) / per_window)
    assert windows >= 3
    # An independent windowing: consecutive chunks of 510 ids, [CLS] ... [SEP] around each,
    # each run on its own.
    states = [[] for _ in range(NUM_LAYERS)]
    with torch.inference_mode():
        for k in range(windows):
            chunk = ids[k * per_window:(k + 1) * per_window]
            x = torch.tensor([[tok.cls_token_id, *chunk, tok.sep_token_id]])
            out = model(input_ids=x, attention_mask=torch.ones_like(x), output_hidden_states=True)
            for layer, h in enumerate(out.hidden_states):
                states[layer].append(h[0, 1:-1].float().numpy())
    ref_ids = np.asarray(ids)
    counts = Counter(ids)
    for collection, extra in (("long", 0), ("long_special", 2 * windows)):
        rows = client.get(f"{base(collection)}/layers").json()["layers"]
        for layer, row in enumerate(rows):
            c.equal(f"{collection} L{layer} n", row["n"], len(ids) + extra)
    rows = client.get(f"{base('long')}/layers").json()["layers"]
    for layer, row in enumerate(rows):
        ref = R.decomposition(ref_ids, np.concatenate(states[layer]))
        c.equal(f"long L{layer} num_types", row["num_types"], len(counts))
        for q in ("Q", "M", "V", "V_W", "V_B"):
            c.close(f"long text layer {q}", f"long L{layer} {q}", row[q], ref[q], ref["Q"], TOL)
    listed = all_tokens(client, "long", 2)
    c.equal("long: per-token n = occurrences in the text",
            {i: t["n"] for i, t in listed.items()}, dict(counts))
    special_listed = all_tokens(client, "long_special", 2)
    c.equal("long_special [CLS] n", special_listed.get(tok.cls_token_id, {}).get("n"), windows)
    c.equal("long_special [SEP] n", special_listed.get(tok.sep_token_id, {}).get("n"), windows)
