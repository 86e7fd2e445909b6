"""Word-unit collections (``{"unit": "word"}``): the pooling of pieces into words, the
names of hashed word keys in the store, and, through the real service (the app on a real
Redis with a worker thread running the packaged all-MiniLM-L6-v2), every count and value
against an independent float64 reference.

The reference runs the model on one text at a time (no padding, no windows), finds the
words from that text's own tokenizer call (``word_ids()``: a run of positions with one word
id), averages each word's pieces in float64, names a word by the text it covers (offsets,
normalised) or, for a one-piece word, by its token, and computes every statistic two-pass
in float64 (``tests/paper_reference.py``: :func:`key_stats`, :func:`layer_summary`).

Tolerances (why these numbers)
------------------------------
* counts: exact (integers fixed by the tokenizer and the rule).
* per-word Q, M, V: ``|got - ref| <= 2e-5 * Q_ref``. The forward is float32 in both, on
  padded batches in the service and alone in the reference: hidden states differ in the
  last bits, and the service pools and reduces in float32 on centred data. Measured at
  most 4.4e-6 of Q_t over every word at every layer (``-s`` prints it), at the last layer
  for a word seen once, whose Q is one pooled state's squared norm: pure forward noise
  (tests/test_e2e_minilm.py saw up to ~5e-6 for single tokens). 2e-5 is ~5x that, while a
  wrong grouping (a piece missed or counted twice, a word split) moves a word's mean by a
  whole piece, ~1e-2..1e-1 of Q_t.
* per-layer fits over the words with 2 <= n_t <= 1000 (cv_Q, slope, intercept relative
  to themselves, r2 absolute) and the filtered decomposition (relative to Q): ``1e-6``;
  measured 6e-8 (the per-word noise averages out over ~1,000 words).
"""

from __future__ import annotations

import csv
import io
import time

import numpy as np
import pytest
import torch
from redis.crc import key_slot

from embgeom.compute.engine import pool_words
from embgeom.compute.positions import WORD_KEY_BASE, string_hashes, word_key_of_hash
from embgeom.corpora import bbc_texts
from embgeom.sources import minilm_path
from embgeom.stats import WindowMoments
from embgeom.store import keys as K
from embgeom.store.checkpoints import Checkpointer, new_checkpoint_id
from embgeom.store.collections import Collections
from embgeom.store.connection import redis_client
from embgeom.store.reader import Reader, run_sync
from tests import paper_reference as P
from tests.conftest import app_with_worker, wait_for_jobs
from tests.test_store import held_jobs, make_conf, points_window

MODEL = "minilm"
N_TEXTS = 50
TOL = 2e-5           # per-word Q, M, V, relative to Q_t
TOL_LAYER = 1e-6     # fits and decomposition
LO, HI = 2, 1000     # the count filter of the per-layer comparison


# ----------------------------------------------------------------------------- units


def test_pooling_averages_each_words_pieces():
    # two rows; words: row 0 = [1, 2] [3] (position 0 and 4 do not count), row 1 = [0, 1, 2]
    counted = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    starts = torch.tensor([[0, 1, 0, 1, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    keys = torch.tensor([[9, 7, 7, 5, 9], [4, 4, 4, 9, 9]])
    g = torch.Generator().manual_seed(0)
    hidden = [torch.randn((2, 5, 3), generator=g) for _ in range(3)]
    pooled, word_keys = pool_words(hidden, [0, 2], keys, counted, starts, torch.float64)
    assert word_keys.tolist() == [[7, 5, 4]]
    for out, layer in zip(pooled, [0, 2]):
        h = hidden[layer].double()
        want = torch.stack([h[0, 1:3].mean(0), h[0, 3], h[1, 0:3].mean(0)])[None]
        assert out.dtype == torch.float64 and torch.allclose(out, want, rtol=1e-15, atol=0)


def test_word_names_are_stored_once_with_the_first_record(redis_server):
    """A hashed key's name is written with its first record, in its shard's slot, once;
    the reader finds it; a deleted collection frees it."""
    r = redis_client(redis_server.url)
    pair = K.PairKeys("names", "m")
    conf = make_conf(r, pair)
    words = ["embeddings", "unbelievably", "Ġcovid", "naïve"]
    hashed = word_key_of_hash(string_hashes(words)[0])
    names = dict(zip(hashed.tolist(), words))
    rng = np.random.default_rng(5)
    for given in (names, {k: "not this" for k in names}):
        keys = np.r_[rng.integers(0, 30, size=40), np.repeat(hashed, 3)]
        _, tok, lay = points_window(rng, keys)
        jobs = held_jobs(r, pair, 1)
        cp = new_checkpoint_id()
        cpr = Checkpointer(r, "w")
        assert cpr.seal(pair, conf.gen, cp, jobs, pair.jobs, 3).status == "sealed"
        out = cpr.apply_and_complete(pair, conf, cp, WindowMoments(tok, lay, names=given), jobs, 3)
        assert out.status == "completed"
        reader = Reader()
        state = run_sync(r, reader.pair_state(pair))
        # the second round's names are not written: the keys' records existed already
        assert run_sync(r, reader.names(state, np.r_[hashed, 3, 4])) == names
    parts = pair.parts(conf.gen)
    stored = sum(r.hlen(parts.shard(s).name) for s in range(conf.shards))
    assert stored == len(words)  # vocabulary keys are named by the tokenizer, not stored
    for s in range(conf.shards):  # the names' hash sits in its shard's slot (Redis Cluster)
        assert key_slot(parts.shard(s).name.encode()) == key_slot(parts.shard(s).rec.encode())
    Collections(r).delete("names")
    assert not any(r.exists(parts.shard(s).name) for s in range(conf.shards))
    r.close()


# ----------------------------------------------------------------------------- reference


def reference_words(tokenizer, model, texts):
    """Every word of ``texts`` (no special tokens), one text at a time: its names under
    string and id keys and, per layer, its float64 mean of pieces:
    ``({"string": names, "id": names}, [X_layer (N, d) float64])``."""
    names, per_layer = {"string": [], "id": []}, None
    scheme = P.marker_scheme(tokenizer)
    with torch.inference_mode():
        for text in texts:
            enc = tokenizer(text, return_special_tokens_mask=True, return_offsets_mapping=True,
                            return_tensors="pt")
            word_ids = enc.word_ids(0)
            special = enc["special_tokens_mask"][0].tolist()
            groups, previous = [], None
            for p, word in enumerate(word_ids):
                if special[p]:
                    previous = None
                    continue
                if word == previous:
                    groups[-1].append(p)
                else:
                    groups.append([p])
                previous = word
            out = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                        output_hidden_states=True)
            if per_layer is None:
                per_layer = [[] for _ in out.hidden_states]
            for layer, h in enumerate(out.hidden_states):
                h = h[0].double().numpy()
                per_layer[layer].append(np.stack([h[g].mean(0) for g in groups]))
            ids = enc["input_ids"][0].tolist()
            offsets = enc["offset_mapping"][0].tolist()
            for g in groups:
                if len(g) == 1:
                    token = tokenizer.convert_ids_to_tokens(ids[g[0]])
                    names["string"].append(P.paper_key(token, scheme))
                    names["id"].append(token)
                else:  # a WordPiece word's name is the (normalised) text it covers
                    span = text[offsets[g[0]][0]:offsets[g[-1]][1]]
                    name = tokenizer.backend_tokenizer.normalizer.normalize_str(span)
                    names["string"].append(name)
                    names["id"].append(name)
    return names, [np.concatenate(x) for x in per_layer]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from transformers import AutoModel, AutoTokenizer

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    path = str(minilm_path())
    return AutoModel.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def texts(model_and_tokenizer):
    _, tok = model_and_tokenizer
    out = bbc_texts("paragraphs")[:N_TEXTS]
    assert all(len(tok(t)["input_ids"]) <= tok.model_max_length for t in out)
    return out


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with app_with_worker(tmp_path_factory) as c:
        yield c


@pytest.fixture(scope="module")
def ingested(client, model_and_tokenizer, texts):
    """Both word collections (string and id keys) ingested in two jobs each, and the
    reference (computed while the worker runs): ``(names by key, states, job statuses)``."""
    model, tok = model_and_tokenizer
    t0 = time.monotonic()
    jobs = {}
    for key in ("string", "id"):
        collection = f"words_{key}"
        r = client.put(f"/v1/collections/{collection}", json={"unit": "word", "key": key})
        assert r.status_code == 201, r.text
        for chunk in (texts[:20], texts[20:]):
            r = client.post("/v1/jobs", json={"collection": collection, "model": MODEL, "texts": chunk})
            assert r.status_code == 202, r.text
            jobs.setdefault(key, []).append(r.json()["job_id"])
    names, states = reference_words(tok, model, texts)
    statuses = {key: wait_for_jobs(client, ids, timeout=300) for key, ids in jobs.items()}
    print(f"\n[words] ingested and reference computed in {time.monotonic() - t0:.1f}s")
    return names, states, statuses


def base(collection: str) -> str:
    return f"/v1/collections/{collection}/models/{MODEL}"


def all_tokens(client, collection, layer) -> dict[str, dict]:
    """Every row of a layer's token listing, by its ``token`` string (unique per key)."""
    page = client.get(f"{base(collection)}/layers/{layer}/tokens", params={"limit": 10000}).json()
    assert page["next_cursor"] is None
    rows = {t["token"]: t for t in page["tokens"]}
    assert len(rows) == len(page["tokens"]), "two keys shown as one string"
    return rows


# ----------------------------------------------------------------------------- tests


@pytest.mark.slow
def test_word_collection_settings_round_trip(client):
    body = {"unit": "word", "key": "string"}
    r = client.put("/v1/collections/wsettings", json=body)
    assert r.status_code == 201, r.text
    assert r.json()["settings"]["unit"] == "word" and r.json()["settings"]["key"] == "string"
    got = client.get("/v1/collections/wsettings").json()["settings"]
    assert (got["unit"], got["key"], got["include_special"]) == ("word", "string", False)
    assert client.put("/v1/collections/wsettings", json=body).status_code == 200
    r = client.put("/v1/collections/wsettings", json={"unit": "token", "key": "string"})
    assert r.status_code == 409, r.text
    r = client.put("/v1/collections/wbad", json={"unit": "sentence"})
    assert r.status_code == 422


@pytest.mark.slow
@pytest.mark.parametrize("key", ["string", "id"])
def test_word_collection_against_float64_reference(client, model_and_tokenizer, ingested, key):
    _, tok = model_and_tokenizer
    all_names, states, all_statuses = ingested
    names, statuses, collection = all_names[key], all_statuses[key], f"words_{key}"
    assert [s["status"] for s in statuses] == ["done", "done"]
    # a job counts its words, not its tokens
    assert sum(s["tokens"] for s in statuses) == len(names)

    worst, where, worst_layer = 0.0, None, 0.0
    for layer, X in enumerate(states):
        ref = P.key_stats(names, X)
        got = all_tokens(client, collection, layer)
        assert {k: int(n) for k, n in zip(ref["keys"], ref["n"])} == {k: t["n"] for k, t in got.items()}
        multi = 0
        for i, name in enumerate(ref["keys"]):
            row = got[name]
            multi += row["token_id"] >= WORD_KEY_BASE
            for q in ("Q", "M", "V"):
                err = abs(row[q] - ref[q][i]) / ref["Q"][i]
                if err > worst:
                    worst, where = err, (layer, name, q, int(ref["n"][i]))
                assert err <= TOL, (layer, name, q, row[q], ref[q][i])
        assert multi > 50  # plenty of multi-piece words, each with a hashed key
        # the per-layer numbers over the words, as over tokens
        summary = P.layer_summary(ref["n"], ref["mean"], ref["Q"], ref["M"], ref["V"], LO, HI)
        (row,) = client.get(f"{base(collection)}/layers", params={"min_count": LO, "max_count": HI}
                            ).json()["layers"][layer:layer + 1]
        assert (row["n"], row["num_types"]) == (summary["n"], summary["num_types"])
        scales = {"cv_Q": abs(summary["cv_Q"]), "slope": abs(summary["slope"]),
                  "intercept": abs(summary["intercept"]), "r2": 1.0,
                  **{q: summary["Q"] for q in ("Q", "M", "V_W", "V_B")}}
        for name, scale in scales.items():
            err = abs(row[name] - summary[name]) / scale
            worst_layer = max(worst_layer, err)
            assert err <= TOL_LAYER, (layer, name, row[name], summary[name])
    print(f"[{key} keys] {len(names)} words; max error of per-word Q/M/V = {worst:.2e} of Q_t "
          f"at (layer, word, quantity, n) = {where}; of the layer fits and decomposition "
          f"{worst_layer:.2e}")

    # a multi-piece word found by its name; its detail and the export show the name
    counts = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    word = max((n for n in counts if len(tok.tokenize(n)) > 1), key=lambda n: (counts[n], n))
    page = client.get(f"{base(collection)}/layers/3/tokens", params={"token": word}).json()
    assert [(t["token"], t["n"]) for t in page["tokens"]] == [(word, counts[word])]
    word_id = page["tokens"][0]["token_id"]
    assert word_id >= WORD_KEY_BASE
    detail = client.get(f"{base(collection)}/layers/3/tokens/{word_id}").json()
    assert (detail["token"], detail["n"]) == (word, counts[word])
    assert client.get(f"{base(collection)}/layers/3/tokens", params={"token": "zzyzxq"}).json()["total"] == 0
    r = client.get(f"{base(collection)}/layers/3/export", params={"format": "csv"})
    assert r.status_code == 200, r.text
    exported = {int(row["token_id"]): row["token"] for row in csv.DictReader(io.StringIO(r.text))}
    assert exported[word_id] == word
    assert sorted(exported.values()) == sorted(counts)
