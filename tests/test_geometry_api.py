"""Shared geometry across models through HTTP: global similarity, LLE transfer, intrinsic
dimension, neighbours and Emb2Emb steering transfer, and their figures, on real models over
one real corpus (MiniLM and MPNet; SmolLM2 and gemma-3-270m in the slow decoder test).

A real ``redis-server``, a real worker (in a thread) running the packaged MiniLM and MPNet
over the same BBC paragraphs, and the real app in this process. The math itself is pinned
by tests/test_geometry.py; here: the spaces are the right ones (a space against itself is
identical, two models are above their shuffled baselines), the numbers are the stored
means' (neighbour cosines recomputed with numpy from a scan of the store), and every bad
request has its 4xx.
"""

from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import redis
from fastapi.testclient import TestClient

from embgeom.corpora import bbc_articles, bbc_texts
from embgeom.geometry.matching import match_tokens, select_rows
from embgeom.comparisons.cache import GeometryCache
from embgeom.errors import InvalidInput
from embgeom.store.keys import PairKeys
from embgeom.store.reader import Reader, run_sync
from embgeom.store.server import RedisServer
from service.app import create_app
from tests.conftest import WorkerThread, wait_for_jobs
from tests.conftest import test_settings as settings_for
from tests.test_scale_out import post_job

# 200 short paragraphs spread over the five topics (the corpus is in topic order): about
# 5,600 tokens, a few seconds for MiniLM and under a minute for MPNet on two CPU cores.
PARAS = [p for p in bbc_texts("paragraphs") if 60 <= len(p) <= 200][::15][:200]
MINILM_LAST = {"collection": "bbc", "model": "minilm", "layer": 6}
MPNET_LAST = {"collection": "bbc", "model": "mpnet", "layer": 12}


def _topic_paragraphs(topic: str, count: int) -> list[str]:
    out = [line.strip() for _, text in bbc_articles([topic]) for line in text.split("\n")
           if 60 <= len(line.strip()) <= 200]
    return out[-count:]  # the end of the topic: not among PARAS' first picks


SPORT = _topic_paragraphs("sports", 24)
BUSINESS = _topic_paragraphs("business", 24)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """Redis + a worker + the app; collection ``bbc`` holds both models over PARAS,
    ``few`` keeps layers 0 and 6 of MiniLM over 20 paragraphs."""
    server = RedisServer(tmp_path_factory.mktemp("geometry") / "redis").start()
    settings = settings_for(server.url)
    try:
        with WorkerThread(settings), TestClient(create_app(settings)) as client:
            # The API loads a model in the background (503 model_loading meanwhile): load first.
            for name in ("minilm", "mpnet"):
                client.app.state.runtime.sync_pool.get(name)
            r = client.put("/v1/collections/few", json={"layers": [0, 6]})
            assert r.status_code == 201, r.text
            ids = [post_job(client, PARAS, "bbc", model="minilm"),
                   post_job(client, PARAS[:20], "few", model="minilm"),
                   post_job(client, PARAS, "bbc", model="mpnet")]
            final = wait_for_jobs(client, ids, timeout=600)
            assert all(s["status"] == "done" for s in final), final
            yield client, server
    finally:
        server.kill()


def _ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def _error(r, status: int, type_: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == type_, body
    return body


def _stored_means(server, collection: str, model: str, layer: int, min_count: int):
    """ids, n and means (k, d) of a layer, by a scan of the store (Reader.means)."""
    reader = Reader()
    client = redis.Redis.from_url(server.url)
    try:
        state = run_sync(client, reader.pair_state(PairKeys(collection, model)))
        pos = state.conf.layer_position(layer)
        ids, n, _, mean = run_sync(client, reader.means(state, [pos], keep=lambda c: c >= min_count))
    finally:
        client.close()
    return ids, n, mean[:, 0]


# ------------------------------------------------------------------ global similarity


def test_a_space_against_itself_is_identical(service):
    client, server = service
    body = _ok(client.post("/v1/compare/global", json={"a": MINILM_LAST, "b": MINILM_LAST}))
    ids, _, _ = _stored_means(server, "bbc", "minilm", 6, 5)
    assert body["matched_by"] == "id"
    assert body["shared_tokens"] == body["tokens_used"] == len(ids) >= 100
    assert body["pairs"] == len(ids) * (len(ids) - 1) // 2
    assert body["pearson_cosine"] >= 0.9999
    assert body["cka_linear"] >= 0.9999
    assert body["procrustes_residual"] <= 1e-6
    assert abs(body["baseline"]["pearson_cosine"]) < 0.2
    assert body["baseline"]["procrustes_residual"] > 0.1
    assert body["as_of"]["a"]["version"] >= 1 and body["as_of"]["a"] == body["as_of"]["b"]

    mpnet_input = {"collection": "bbc", "model": "mpnet", "layer": "input"}
    body = _ok(client.post("/v1/compare/global", json={"a": mpnet_input, "b": mpnet_input, "min_count": 2}))
    assert body["matched_by"] == "id"
    assert body["pearson_cosine"] >= 0.9999 and body["procrustes_residual"] <= 1e-6


@pytest.mark.parametrize("layer_a, layer_b", [(6, 12), ("input", "input")])
def test_minilm_vs_mpnet_is_above_its_shuffled_baseline(service, layer_a, layer_b):
    client, _ = service
    a = {**MINILM_LAST, "layer": layer_a}
    b = {**MPNET_LAST, "layer": layer_b}
    body = _ok(client.post("/v1/compare/global", json={"a": a, "b": b, "seed": 3}))
    # Different vocabularies (MPNet adds <s>, </s>, ...): matched by string.
    assert body["matched_by"] == "string"
    assert body["shared_tokens"] >= 100
    base = body["baseline"]
    assert body["pearson_cosine"] > base["pearson_cosine"] + 0.3
    assert body["cka_linear"] > base["cka_linear"] + 0.1
    assert body["procrustes_residual"] < base["procrustes_residual"] - 0.1


def test_sample_is_seeded_and_results_cached_until_a_checkpoint(service):
    client, _ = service
    grow = {"collection": "grow", "model": "minilm", "layer": 6}
    final = wait_for_jobs(client, [post_job(client, PARAS[:100], "grow")])
    assert final[0]["status"] == "done"
    request = {"a": grow, "b": MINILM_LAST, "min_count": 2, "sample": 40, "seed": 7}
    first = _ok(client.post("/v1/compare/global", json=request))
    assert first["sampled"] and first["tokens_used"] == 40 < first["shared_tokens"]
    cache = client.app.state.geometry.cache
    hits = cache.hits
    assert _ok(client.post("/v1/compare/global", json=request)) == first
    assert cache.hits == hits + 1
    other_seed = _ok(client.post("/v1/compare/global", json={**request, "seed": 8}))
    assert other_seed["pearson_cosine"] != first["pearson_cosine"]

    final = wait_for_jobs(client, [post_job(client, PARAS[100:160], "grow")])
    assert final[0]["status"] == "done"
    after = _ok(client.post("/v1/compare/global", json=request))
    assert after["as_of"]["a"]["version"] > first["as_of"]["a"]["version"]
    assert after["shared_tokens"] > first["shared_tokens"]
    assert after["as_of"]["b"] == first["as_of"]["b"]


# -------------------------------------------------------------------------------- LLE


def test_lle_transfer(service):
    client, _ = service
    same = _ok(client.post("/v1/compare/lle", json={"a": MINILM_LAST, "b": MINILM_LAST, "k": 8}))
    assert same["neighbor_overlap"] == 1.0
    assert same["transfer_over_own"] == pytest.approx(1.0, abs=1e-9)
    assert same["transfer_error"] < same["random_error"]

    body = _ok(client.post("/v1/compare/lle", json={"a": MINILM_LAST, "b": MPNET_LAST, "k": 8}))
    assert body["matched_by"] == "string" and body["k"] == 8
    assert body["chance_overlap"] == pytest.approx(8 / (body["tokens_used"] - 1))
    assert body["neighbor_overlap"] > 3 * body["chance_overlap"]
    assert body["transfer_error"] < body["random_error"]
    assert body["transfer_over_random"] < 1.0
    assert body["transfer_over_own"] >= 1.0 - 1e-6


# ------------------------------------------------------- intrinsic dimension, neighbours


@pytest.mark.parametrize("method", ["local_pca", "twonn", "mle"])
def test_intrinsic_dimension_lists_lowest_and_highest(service, method):
    client, server = service
    ids, n, _ = _stored_means(server, "bbc", "minilm", 6, 5)
    body = _ok(client.get("/v1/collections/bbc/models/minilm/layers/6/intrinsic-dimension",
                          params={"method": method, "k": 15, "limit": 5, "neighbors": 3}))
    assert body["tokens"] == len(ids) and body["method"] == method
    assert body["dimension"] > 0 and body["undefined"] == 0
    low = [t["estimate"] for t in body["lowest"]]
    high = [t["estimate"] for t in body["highest"]]
    assert len(low) == len(high) == 5
    assert low == sorted(low) and high == sorted(high, reverse=True)
    assert low[0] <= body["median"] <= high[0]
    counts = dict(zip(ids.tolist(), n.tolist()))
    for t in body["lowest"] + body["highest"]:
        assert counts[t["token_id"]] == t["n"] >= 5
        assert len(t["neighbors"]) == 3
        assert t["token_id"] not in {x["token_id"] for x in t["neighbors"]}
    if method == "local_pca":
        assert body["threshold"] == 0.9
        assert all(float(x).is_integer() and 1 <= x <= 15 for x in low + high)
        assert body["dimension"] == pytest.approx(body["mean"])


def test_neighbors_are_the_nearest_means_by_cosine(service):
    client, server = service
    ids, n, means = _stored_means(server, "bbc", "minilm", 3, 5)
    query = int(ids[np.argmax(n)])  # the most frequent token
    body = _ok(client.get(f"/v1/collections/bbc/models/minilm/layers/3/tokens/{query}/neighbors",
                          params={"k": 12}))
    unit = means / np.linalg.norm(means, axis=1, keepdims=True)
    cos = unit @ unit[np.argmax(n)]
    others = np.flatnonzero(ids != query)
    order = others[np.lexsort((ids[others], -cos[others]))][:12]
    assert body["token_id"] == query and body["n"] == int(n.max())
    assert body["candidates"] == len(ids) - 1
    got = body["neighbors"]
    assert [t["token_id"] for t in got] == ids[order].tolist()
    np.testing.assert_allclose([t["cosine"] for t in got], cos[order], rtol=0, atol=1e-12)
    assert [t["cosine"] for t in got] == sorted((t["cosine"] for t in got), reverse=True)
    assert all(t["token"] for t in got)

    # A token below min_count is still a query; it is not among the candidates.
    rare = int(ids[np.argmin(n)])
    body = _ok(client.get(f"/v1/collections/bbc/models/minilm/layers/3/tokens/{rare}/neighbors",
                          params={"k": 3, "min_count": int(n.min()) + 1}))
    assert body["n"] == int(n.min()) and len(body["neighbors"]) == 3
    assert rare not in {t["token_id"] for t in body["neighbors"]}


# ---------------------------------------------------------------------------- Emb2Emb


def test_steering_transfer_sport_vs_business(service):
    client, _ = service
    request = {"a": MINILM_LAST, "b": MPNET_LAST, "positive_texts": SPORT,
               "negative_texts": BUSINESS, "min_count": 2}
    body = _ok(client.post("/v1/steering/transfer", json=request))
    assert body["source"] == "texts"
    assert len(body["vector"]) == 768
    assert body["vector_norm"] == pytest.approx(np.linalg.norm(body["vector"]))
    base = body["baseline"]
    assert body["cosine"] > 0.3
    assert body["cosine"] > base["random_map"]["max_abs"]
    assert body["cosine"] > base["shuffled_map"]["cosine"]
    fit = body["map"]
    assert fit["held_out_tokens"] == round(0.2 * body["tokens_used"])
    assert fit["r2"] > 0 and fit["mean_cosine"] > fit["mean_baseline_cosine"]

    # A vector given directly: mapped with the same W (same spaces, seed and ridge).
    v = np.random.default_rng(0).standard_normal(384)
    direct = _ok(client.post("/v1/steering/transfer", json={
        "a": MINILM_LAST, "b": MPNET_LAST, "vector": v.tolist(), "min_count": 2}))
    assert direct["source"] == "vector" and len(direct["vector"]) == 768
    assert direct["cosine"] is None and direct["baseline"] is None
    assert direct["map"] == fit
    # Linear: twice the vector, twice the image.
    double = _ok(client.post("/v1/steering/transfer", json={
        "a": MINILM_LAST, "b": MPNET_LAST, "vector": (2 * v).tolist(), "min_count": 2}))
    np.testing.assert_allclose(double["vector"], 2 * np.array(direct["vector"]), rtol=1e-9)


# ----------------------------------------------------------------------------- errors


def test_every_bad_request_has_its_4xx(service):
    client, server = service
    ID = "/v1/collections/{c}/models/{m}/layers/{l}/intrinsic-dimension"

    def compare(a, b=MINILM_LAST, path="/v1/compare/global", **extra):
        return client.post(path, json={"a": a, "b": b, **extra})

    # Bad spaces.
    _error(compare({**MINILM_LAST, "model": "nope"}), 404, "unknown_model")
    _error(compare({**MINILM_LAST, "collection": "nothing"}), 404, "collection_not_found")
    _error(compare({**MINILM_LAST, "collection": "few", "model": "mpnet"}), 404,
           "model_not_in_collection")
    _error(compare({**MINILM_LAST, "layer": 7}), 404, "layer_not_found")
    _error(compare({**MINILM_LAST, "collection": "few", "layer": 3}), 404, "layer_not_kept")
    _error(compare({**MINILM_LAST, "layer": "output"}), 422, "validation_error")
    _error(compare({**MINILM_LAST, "layer": -1}), 422, "validation_error")
    _error(compare({**MINILM_LAST, "extra": 1}), 422, "validation_error")
    _error(compare({**MINILM_LAST, "collection": "a b"}), 422, "validation_error")
    _error(client.get(ID.format(c="few", m="minilm", l=3)), 404, "layer_not_kept")
    _error(client.get(ID.format(c="bbc", m="minilm", l=9)), 404, "layer_not_found")
    _error(client.get(ID.format(c="bbc", m="nope", l=1)), 404, "unknown_model")
    _error(client.get(ID.format(c="nothing", m="minilm", l=1)), 404, "collection_not_found")

    # Sizes.
    _error(compare(MPNET_LAST, min_count=10**6), 422, "too_few_shared_tokens")
    _error(compare(MPNET_LAST, sample=20_000), 422, "sample_too_large")
    _error(compare(MPNET_LAST, path="/v1/compare/lle", k=101), 422, "k_too_large")
    _error(compare({**MINILM_LAST, "collection": "few"}, path="/v1/compare/lle", k=50, min_count=3),
           422, "k_too_large")
    _error(client.get(ID.format(c="bbc", m="minilm", l=6), params={"k": 101}), 422, "k_too_large")
    _error(client.get(ID.format(c="few", m="minilm", l=6), params={"k": 50, "min_count": 3}),
           422, "k_too_large")
    _error(client.get(ID.format(c="bbc", m="minilm", l=6), params={"method": "pca"}), 422,
           "validation_error")
    _error(client.get(ID.format(c="bbc", m="minilm", l=6), params={"threshold": 1.5}), 422,
           "validation_error")
    neighbors = "/v1/collections/bbc/models/minilm/layers/6/tokens/{}/neighbors"
    _error(client.get(neighbors.format(29000)), 404, "token_not_found")  # never seen
    _error(client.get(neighbors.format(2006), params={"k": 500}), 422, "k_too_large")

    # Steering: one source, of the right width.
    steer = {"a": MINILM_LAST, "b": MPNET_LAST, "min_count": 2}
    _error(client.post("/v1/steering/transfer", json=steer), 422, "invalid_steering")
    _error(client.post("/v1/steering/transfer", json={**steer, "vector": [1.0] * 384,
                                                       "positive_texts": SPORT}), 422, "invalid_steering")
    _error(client.post("/v1/steering/transfer", json={**steer, "positive_texts": SPORT}), 422,
           "invalid_steering")
    _error(client.post("/v1/steering/transfer", json={**steer, "vector": [1.0] * 768}), 422,
           "invalid_vector")
    _error(client.post("/v1/steering/transfer", json={**steer, "vector": [1.0] * 384,
                                                       "held_out": 1.0}), 422, "validation_error")
    _error(client.post("/v1/steering/transfer", json={**steer, "positive_texts": ["a b"] * 2001,
                                                       "negative_texts": ["c"]}), 413, "payload_too_large")

    # A cap too small for the layer's tokens: 422 with the min_count that fits, which works.
    with TestClient(create_app(settings_for(server.url, geometry_max_tokens=50))) as small:
        body = _error(small.get(ID.format(c="bbc", m="minilm", l=6), params={"min_count": 1}),
                      422, "too_many_tokens")
        fit = body["detail"]["min_count_to_fit"]
        assert fit > 1 and body["detail"]["limit"] == 50
        ok = _ok(small.get(ID.format(c="bbc", m="minilm", l=6), params={"min_count": fit, "k": 5}))
        assert ok["tokens"] <= 50
        _error(small.get(ID.format(c="bbc", m="minilm", l=6), params={"min_count": fit - 1, "k": 5}),
               422, "too_many_tokens")
        # A comparison samples down to the cap instead.
        body = _ok(small.post("/v1/compare/global", json={"a": MINILM_LAST, "b": MPNET_LAST}))
        assert body["sampled"] and body["tokens_used"] <= 50 < body["shared_tokens"]


# ------------------------------------------------------------------ matching, caps, cache


def test_string_matching_prefers_the_most_frequent_form_then_the_smallest_key():
    # Space a has "s" (key 5, n 3) and "##s" (key 9, n 7): both canonical "s".
    m = match_tokens([5, 9, 12], [3, 7, 4], ["s", "s", "cat"],
                     [100, 101, 102, 103], [1, 1, 1, 1], ["dog", "cat", "s", "s"], "string")
    assert m.by == "string"
    pairs = sorted(zip(np.array([5, 9, 12])[m.rows_a].tolist(),
                       np.array([100, 101, 102, 103])[m.rows_b].tolist()))
    assert pairs == [(9, 102), (12, 101)]  # "s": a's most frequent; b's tie: smaller key
    m = match_tokens([1, 2, 3], [1, 1, 1], None, [2, 3, 4], [1, 1, 1], None, "id")
    assert m.rows_a.tolist() == [1, 2] and m.rows_b.tolist() == [0, 1]


def test_select_rows_caps_and_samples_with_the_seed():
    rows, sampled = select_rows(100, 50, None, 0)
    assert sampled and len(rows) == 50 and np.all(np.diff(rows) > 0)
    assert np.array_equal(rows, select_rows(100, 50, None, 0)[0])
    assert not np.array_equal(rows, select_rows(100, 50, None, 1)[0])
    assert select_rows(30, 50, None, 0)[1] is False
    assert len(select_rows(100, 50, 20, 0)[0]) == 20
    with pytest.raises(InvalidInput) as exc:
        select_rows(100, 50, 60, 0)
    assert exc.value.type == "sample_too_large"


def test_cache_is_bounded_by_entries_and_bytes():
    cache = GeometryCache(max_entries=2, max_bytes=100)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.get("a")
    cache.put("c", 3)  # evicts b, the least recently used
    assert cache.get("b") is None and cache.get("a") == 1 and cache.get("c") == 3
    cache.put("big", 4, nbytes=101)  # larger than the whole cache: not kept
    assert cache.get("big") is None
    cache.put("x", 5, nbytes=60)
    cache.put("y", 6, nbytes=60)  # 120 bytes > 100: x goes
    assert cache.get("x") is None and cache.get("y") == 6


# ---------------------------------------------------------------------------- figures

FIGURE_ID = "/v1/collections/{c}/models/{m}/layers/{l}/figures/{name}"


def _png(r) -> np.ndarray:
    """The decoded image of a PNG response (checked: status, type, magic bytes, size)."""
    import matplotlib.image

    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "image/png"
    assert r.content[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(io.BytesIO(r.content), format="png")
    assert image.shape[0] >= 400 and image.shape[1] >= 1000, image.shape
    assert image[..., :3].std() > 0.05  # not a blank canvas
    return image


def _svg(r) -> ET.Element:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "image/svg+xml"
    root = ET.fromstring(r.content)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert len(r.content) > 10_000
    return root


def _space_param(space: dict) -> str:
    return f"{space['collection']}:{space['model']}:{space['layer']}"


def test_global_figure_shows_the_comparisons_numbers(service):
    client, _ = service
    request = {"a": MINILM_LAST, "b": MPNET_LAST, "seed": 3}
    body = _ok(client.post("/v1/compare/global", json=request))
    params = {"a": _space_param(MINILM_LAST), "b": _space_param(MPNET_LAST), "seed": 3, "pairs": 5000}
    r = client.get("/v1/compare/figures/global", params=params)
    _png(r)
    # The r shown is the JSON answer's, to the last bit.
    assert json.loads(r.headers["X-Embgeom-Pearson"]) == body["pearson_cosine"]
    assert json.loads(r.headers["X-Embgeom-Baseline-Pearson"]) == body["baseline"]["pearson_cosine"]
    assert int(r.headers["X-Embgeom-Pairs-Plotted"]) == min(5000, body["pairs"])
    assert r.headers["X-Embgeom-Version-A"] == str(body["as_of"]["a"]["version"])
    assert r.headers["X-Embgeom-Version-B"] == str(body["as_of"]["b"]["version"])
    assert r.headers["X-Embgeom-Cache"] == "miss"
    again = client.get("/v1/compare/figures/global", params=params)
    assert again.headers["X-Embgeom-Cache"] == "hit" and again.content == r.content
    # A parameter the figure does not use shares the entry.
    assert client.get("/v1/compare/figures/global", params={**params, "k": 7}).headers["X-Embgeom-Cache"] == "hit"
    svg = client.get("/v1/compare/figures/global", params={**params, "format": "svg"})
    _svg(svg)
    assert b"Pearson r = " in svg.content

    # Input spaces, matched by string, a sample of tokens: the r of the same request.
    a_in, b_in = {**MINILM_LAST, "layer": "input"}, {**MPNET_LAST, "layer": "input"}
    body = _ok(client.post("/v1/compare/global", json={"a": a_in, "b": b_in, "sample": 100, "seed": 1}))
    assert body["sampled"] and body["tokens_used"] == 100
    r = client.get("/v1/compare/figures/global", params={"a": _space_param(a_in), "b": _space_param(b_in),
                                                         "sample": 100, "seed": 1})
    _png(r)
    assert json.loads(r.headers["X-Embgeom-Pearson"]) == body["pearson_cosine"]
    assert int(r.headers["X-Embgeom-Pairs-Plotted"]) == body["pairs"] == 100 * 99 // 2  # fewer than asked: all


def test_lle_figure_shows_the_comparisons_numbers(service):
    client, _ = service
    body = _ok(client.post("/v1/compare/lle", json={"a": MINILM_LAST, "b": MPNET_LAST, "k": 8}))
    params = {"a": _space_param(MINILM_LAST), "b": _space_param(MPNET_LAST), "k": 8}
    r = client.get("/v1/compare/figures/lle", params=params)
    _png(r)
    for name in ("transfer_error", "own_error", "random_error"):
        header = "X-Embgeom-" + "-".join(p.capitalize() for p in name.split("_"))
        assert json.loads(r.headers[header]) == body[name]
    _svg(client.get("/v1/compare/figures/lle", params={**params, "format": "svg"}))


def test_intrinsic_dimension_figure(service):
    client, _ = service
    for method in ("local_pca", "mle"):
        params = {"method": method, "k": 15, "limit": 5}
        body = _ok(client.get("/v1/collections/bbc/models/minilm/layers/6/intrinsic-dimension", params=params))
        r = client.get(FIGURE_ID.format(c="bbc", m="minilm", l=6, name="intrinsic_dimension"), params=params)
        _png(r)
        assert json.loads(r.headers["X-Embgeom-Dimension"]) == body["dimension"]
        assert r.headers["X-Embgeom-Version"] == str(body["as_of"]["version"])
    svg = client.get(FIGURE_ID.format(c="bbc", m="mpnet", l=12, name="intrinsic_dimension"),
                     params={"format": "svg"})
    _svg(svg)


def test_figures_are_cached_until_the_collection_changes(service):
    client, _ = service
    final = wait_for_jobs(client, [post_job(client, PARAS[:40], "figgrow")])
    assert final[0]["status"] == "done"
    url = FIGURE_ID.format(c="figgrow", m="minilm", l=6, name="intrinsic_dimension")
    params = {"min_count": 2, "k": 10}
    first = client.get(url, params=params)
    _png(first)
    assert first.headers["X-Embgeom-Cache"] == "miss"
    assert client.get(url, params=params).headers["X-Embgeom-Cache"] == "hit"
    final = wait_for_jobs(client, [post_job(client, PARAS[40:60], "figgrow")])
    assert final[0]["status"] == "done"
    after = client.get(url, params=params)
    _png(after)
    assert after.headers["X-Embgeom-Cache"] == "miss"
    assert int(after.headers["X-Embgeom-Version"]) > int(first.headers["X-Embgeom-Version"])


def test_every_bad_figure_request_has_its_4xx(service):
    client, _ = service
    GLOBAL = "/v1/compare/figures/{}"
    ok = {"a": _space_param(MINILM_LAST), "b": _space_param(MPNET_LAST)}

    _error(client.get(GLOBAL.format("steering"), params=ok), 404, "unknown_figure")
    _error(client.get(GLOBAL.format("global"), params={**ok, "format": "jpg"}), 422, "invalid_format")
    _error(client.get(GLOBAL.format("global"), params={"a": ok["a"]}), 422, "validation_error")
    for bad in ("bbc:minilm", "bbc:minilm:six", "bbc:minilm:-1", "b c:minilm:6", "bbc:minilm:6:1"):
        _error(client.get(GLOBAL.format("global"), params={**ok, "a": bad}), 422, "validation_error")
    _error(client.get(GLOBAL.format("global"), params={**ok, "a": "bbc:nope:6"}), 404, "unknown_model")
    _error(client.get(GLOBAL.format("global"), params={**ok, "a": "nothing:minilm:6"}), 404,
           "collection_not_found")
    _error(client.get(GLOBAL.format("global"), params={**ok, "a": "bbc:minilm:7"}), 404, "layer_not_found")
    _error(client.get(GLOBAL.format("global"), params={**ok, "a": "few:minilm:3"}), 404, "layer_not_kept")
    _error(client.get(GLOBAL.format("global"), params={**ok, "pairs": 10}), 422, "validation_error")
    _error(client.get(GLOBAL.format("global"), params={**ok, "pairs": 10**9}), 422, "validation_error")
    _error(client.get(GLOBAL.format("global"), params={**ok, "seed": -1}), 422, "validation_error")
    _error(client.get(GLOBAL.format("global"), params={**ok, "min_count": 10**6}), 422,
           "too_few_shared_tokens")
    _error(client.get(GLOBAL.format("global"), params={**ok, "sample": 20_000}), 422, "sample_too_large")
    _error(client.get(GLOBAL.format("lle"), params={**ok, "k": 101}), 422, "k_too_large")
    for bad in ("nan", "inf", "-1"):
        _error(client.get(GLOBAL.format("lle"), params={**ok, "reg": bad}), 422, "validation_error")

    ID = FIGURE_ID.format(c="bbc", m="minilm", l=6, name="intrinsic_dimension")
    _error(client.get(FIGURE_ID.format(c="bbc", m="minilm", l=6, name="vm_scatter")), 404, "unknown_figure")
    _error(client.get(ID, params={"format": "pdf"}), 422, "invalid_format")
    for bad in ("nan", "inf", "1.5", "0"):
        _error(client.get(ID, params={"threshold": bad}), 422, "validation_error")
    _error(client.get(ID, params={"method": "pca"}), 422, "validation_error")
    _error(client.get(ID, params={"limit": 21}), 422, "validation_error")
    _error(client.get(ID, params={"k": 101}), 422, "k_too_large")
    _error(client.get(FIGURE_ID.format(c="few", m="minilm", l=3, name="intrinsic_dimension")), 404,
           "layer_not_kept")
    _error(client.get(FIGURE_ID.format(c="bbc", m="minilm", l=9, name="intrinsic_dimension")), 404,
           "layer_not_found")
    _error(client.get(FIGURE_ID.format(c="bbc", m="nope", l=1, name="intrinsic_dimension")), 404,
           "unknown_model")


# ------------------------------------------------------------------- two decoders


@pytest.mark.slow
def test_smollm2_vs_gemma3_is_above_its_shuffled_baseline(service):
    """Two decoders of different families, tokenizers (byte-level BPE, 49k; SentencePiece,
    262k) and widths (576, 640) over the same paragraphs: their last layers and their input
    embeddings arrange the shared tokens alike, far beyond the shuffled correspondence."""
    client, _ = service
    ids = [post_job(client, PARAS, "dec", model="smollm2"), post_job(client, PARAS, "dec", model="gemma3")]
    final = wait_for_jobs(client, ids, timeout=900)
    assert all(s["status"] == "done" for s in final), final
    rt = client.app.state.runtime
    for name in ("smollm2", "gemma3"):  # input spaces run the models in the API: load them first
        rt.sync_pool.get(name)
    for la, lb in ((30, 18), ("input", "input")):
        a = {"collection": "dec", "model": "smollm2", "layer": la}
        b = {"collection": "dec", "model": "gemma3", "layer": lb}
        body = _ok(client.post("/v1/compare/global", json={"a": a, "b": b, "min_count": 3}))
        assert body["matched_by"] == "string"
        assert body["shared_tokens"] >= 100
        base = body["baseline"]
        assert abs(base["pearson_cosine"]) < 0.1
        assert body["pearson_cosine"] > base["pearson_cosine"] + 0.2
        assert body["cka_linear"] > base["cka_linear"]
        assert body["procrustes_residual"] < base["procrustes_residual"]
    lle = _ok(client.post("/v1/compare/lle", json={"a": {"collection": "dec", "model": "smollm2", "layer": 30},
                                                    "b": {"collection": "dec", "model": "gemma3", "layer": 18},
                                                    "k": 8, "min_count": 3}))
    assert lle["neighbor_overlap"] > 3 * lle["chance_overlap"]
    assert lle["transfer_error"] < lle["random_error"]
