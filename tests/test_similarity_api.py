"""Layer-by-layer CKA, cross-model alignment and intrinsic dimension over HTTP, on the
embedded default (``embgeom serve``: its own Redis and worker) with MiniLM over BBC
paragraphs, against independent computations:

- the CKA matrix of a ``cross_layer`` collection against a float64 two-pass over the raw
  hidden states (tests/reference.py: one text at a time, every occurrence stacked), n equal
  to the occurrences counted; a collection without it answers 409 ``cross_layer_not_kept``;
- ``unbiased_cka``, ``mutual_knn`` and ``cknna`` of a space against itself are 1, and
  layer 3 against layer 5 scores above its shuffled baseline on each;
- the intrinsic dimension of the layer's token means against scikit-dimension (lPCA,
  TwoNN, MLE) on the same points (the means the service exports), which are the reference's
  float64 means up to the float32 reduction.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import skdim  # scikit-dimension==0.5.0, a test dependency
import torch

from embgeom.corpora import bbc_texts
from embgeom.sources import minilm_path
from tests.conftest import wait_for_jobs
from embgeom.testing.reference import raw_hidden_states

# 300 short paragraphs (about 9,000 counted tokens), one window each.
TEXTS = [p for p in bbc_texts("paragraphs") if 60 <= len(p) <= 240][::7][:300]
LAYER = 3


def _reference_cka(states: list[np.ndarray]) -> np.ndarray:
    """Linear CKA of every pair of layers, float64, two-pass (centre, then products)."""
    X = [s.astype(np.float64) - s.astype(np.float64).mean(axis=0) for s in states]
    L = len(X)
    F = np.empty((L, L))
    for i in range(L):
        for j in range(L):
            F[i, j] = np.linalg.norm(X[i].T @ X[j]) ** 2
    return F / np.sqrt(np.outer(np.diag(F), np.diag(F)))


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModel, AutoTokenizer

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    path = str(minilm_path())
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return raw_hidden_states(model, AutoTokenizer.from_pretrained(path), TEXTS)


def test_cross_layer_cka_alignment_and_intrinsic_dimension_over_http(embedded_service, reference):
    url, _ = embedded_service
    with httpx.Client(base_url=url, timeout=300) as c:
        r = c.put("/v1/collections/xl", json={"cross_layer": True})
        assert r.status_code == 201, r.text
        assert r.json()["settings"]["cross_layer"] is True
        assert c.put("/v1/collections/plain", json={}).status_code == 201
        ids = [c.post("/v1/jobs", json={"collection": name, "model": "minilm", "texts": TEXTS})
               .json()["job_id"] for name in ("xl", "plain")]
        final = wait_for_jobs(c, ids, timeout=900)
        assert all(s["status"] == "done" for s in final), final

        # --- the exact layer-by-layer CKA
        sim = _ok(c.get("/v1/collections/xl/models/minilm/similarity",
                        params={"metric": "linear_cka"}))
        expected = _reference_cka(reference.states)
        assert sim["layers"] == list(range(len(reference.states)))
        assert sim["n"] == reference.ids.shape[0]
        got = np.array(sim["matrix"], dtype=np.float64)
        # The worker's GEMMs run in float32 on data centred on the window's shift and are
        # summed in float64; the bound for the exact matrix is 1e-6.
        assert np.max(np.abs(got - expected)) < 1e-6, np.max(np.abs(got - expected))
        assert np.allclose(np.diag(got), 1.0) and np.allclose(got, got.T)
        assert got.min() < 0.9  # layers do differ: a test that could fail
        assert sim["as_of"] is not None
        rv = _ok(c.get("/v1/collections/xl/models/minilm/similarity", params={"metric": "rv"}))
        assert rv["matrix"] == sim["matrix"] and rv["metric"] == "rv"
        # the per-layer statistics count the same occurrences
        layers = _ok(c.get("/v1/collections/xl/models/minilm/layers"))["layers"]
        assert all(row["n"] == sim["n"] for row in layers)

        r = c.get("/v1/collections/plain/models/minilm/similarity")
        assert r.status_code == 409, r.text
        assert r.json()["type"] == "cross_layer_not_kept"
        assert c.get("/v1/collections/xl/models/minilm/similarity",
                     params={"metric": "cosine"}).status_code == 422

        # --- cross-model (here cross-layer) alignment on shared tokens, with baselines
        def space(layer):
            return {"collection": "xl", "model": "minilm", "layer": layer}

        same = _ok(c.post("/v1/compare/global", json={"a": space(LAYER), "b": space(LAYER),
                                                      "k": 10, "min_count": 3}))
        for name in ("unbiased_cka", "mutual_knn", "cknna", "cka_linear"):
            assert same[name] == pytest.approx(1.0, abs=1e-9), name
        pair = _ok(c.post("/v1/compare/global", json={"a": space(3), "b": space(5), "k": 10,
                                                      "min_count": 3}))
        assert pair["k"] == 10 and pair["tokens_used"] >= 100
        for name in ("unbiased_cka", "mutual_knn", "cknna"):
            assert pair[name] > pair["baseline"][name] + 0.1, (name, pair)
        # chance level of the shuffled pairing: k / (m - 1) for mutual k-NN
        assert pair["baseline"]["mutual_knn"] < 3 * pair["chance_mutual_knn"]
        # The acceptance's figures (docs/similarity.md quotes a run with -s).
        print(f"\nacceptance: {len(TEXTS)} texts, n = {sim['n']} occurrences, CKA max |error| vs float64 "
              f"two-pass = {np.max(np.abs(got - expected)):.3e} (min CKA {got.min():.4f}); self "
              + ", ".join(f"{name} {same[name]!r}" for name in ("unbiased_cka", "mutual_knn", "cknna"))
              + f"; layer 3 vs 5 on {pair['tokens_used']} tokens (k = 10): "
              + ", ".join(f"{name} {pair[name]:.4f} (baseline {pair['baseline'][name]:.4f})"
                          for name in ("cka_linear", "unbiased_cka", "mutual_knn", "cknna"))
              + f", chance_mutual_knn {pair['chance_mutual_knn']:.4f}")

        # --- intrinsic dimension of real token means against scikit-dimension
        min_count, k = 3, 15
        csv = c.get(f"/v1/collections/xl/models/minilm/layers/{LAYER}/export",
                    params={"format": "csv", "min_count": min_count, "means": "true"})
        assert csv.status_code == 200, csv.text
        import io

        import pandas as pd

        table = pd.read_csv(io.StringIO(csv.text))
        X = np.array([json.loads(m) for m in table["mean"]], dtype=np.float64)
        # the exported points are the float64 means of the raw states, up to the float32
        # reduction's rounding
        ref_ids = reference.ids
        states = reference.states[LAYER].astype(np.float64)
        for row, token in zip(X[:50], table["token_id"][:50]):
            np.testing.assert_allclose(row, states[ref_ids == token].mean(axis=0),
                                       rtol=0, atol=1e-5)

        def answer(method):
            return _ok(c.get(f"/v1/collections/xl/models/minilm/layers/{LAYER}/intrinsic-dimension",
                             params={"method": method, "k": k, "min_count": min_count}))

        lpca = answer("local_pca")
        assert lpca["tokens"] == X.shape[0]
        peer = skdim.id.lPCA(ver="ratio", alphaRatio=0.9, verbose=False).fit_pw(X, n_neighbors=k)
        assert lpca["dimension"] == pytest.approx(np.mean(peer.dimension_pw_), rel=1e-12)
        twonn = answer("twonn")
        assert twonn["dimension"] == pytest.approx(
            skdim.id.TwoNN(discard_fraction=0.0, method="mle").fit(X).dimension_, rel=1e-9)
        mle = answer("mle")
        assert mle["dimension"] == pytest.approx(
            skdim.id.MLE().fit(X, n_neighbors=k).dimension_, rel=1e-9)
