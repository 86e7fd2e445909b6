"""The geometry figures' data (embgeom.figures.geometry, embgeom.geometry.matching.sample_pairs,
embgeom.geometry.lle_transfer_rows) on synthetic spaces: what each panel plots is the
input, every token or pair once, and the numbers shown are the answer's. The figures
through HTTP, on real models, are in tests/test_geometry_api.py."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import numpy as np
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.patches import Rectangle

from embgeom import geometry
from embgeom.figures import geometry as gf
from embgeom.geometry.matching import sample_pairs

A_SPACE = {"collection": "c", "model": "m$1", "layer": 3}
B_SPACE = {"collection": "c", "model": "other", "layer": "input"}


def _spaces(m=300, seed=0):
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((m, 12))
    B = A @ rng.standard_normal((12, 20)) + rng.standard_normal((m, 20)) + 2.0
    return A, B


def _unit(X):
    return X / np.linalg.norm(X, axis=1, keepdims=True)


# ------------------------------------------------------------------------ pairs, rows


def test_sample_pairs_all_when_few_else_distinct_seeded_and_uniform():
    i, j = sample_pairs(6, 100, 0)
    assert list(zip(i.tolist(), j.tolist())) == [(a, b) for a in range(6) for b in range(a + 1, 6)]
    i, j = sample_pairs(400, 20_000, 3)
    assert i.size == 20_000 and np.all(i < j) and np.all(j < 400)
    assert len(set(zip(i.tolist(), j.tolist()))) == 20_000
    same = sample_pairs(400, 20_000, 3)
    assert np.array_equal(i, same[0]) and np.array_equal(j, same[1])
    assert not np.array_equal(i, sample_pairs(400, 20_000, 4)[0])
    # Uniform over pairs: each row takes part in (m - 1) of the m (m - 1) / 2 pairs.
    counts = np.bincount(np.r_[i, j], minlength=400)
    expected = 20_000 * 2 / 400
    assert abs(counts.mean() - expected) < 1e-9 and counts.std() < 4 * np.sqrt(expected)


def test_lle_transfer_rows_average_to_lle_transfer():
    A, B = _spaces()
    agg = geometry.lle_transfer(A, B, 8, 1e-3, 5)
    rows = geometry.lle_transfer_rows(A, B, 8, 1e-3, 5)
    for name, key in (("transfer", "transfer_error"), ("own", "own_error"),
                      ("own_neighbors", "own_neighbors_error"), ("random", "random_error"),
                      ("overlap", "neighbor_overlap")):
        assert rows[name].shape == (300,)
        assert rows[name].mean() == pytest.approx(agg[key], rel=1e-12), name
    idx, _ = geometry.nearest_neighbors(A, 8)
    assert np.array_equal(rows["neighbors"], idx)
    assert np.all(rows["transfer"] >= 0) and np.all((rows["overlap"] >= 0) & (rows["overlap"] <= 1))


# ------------------------------------------------------------------------ figures


def _global_inputs(m=200):
    A, B = _spaces(m)
    g = geometry.global_similarity(A, B, None, 0)
    result = {"a": A_SPACE, "b": B_SPACE, "matched_by": "string", "shared_tokens": m + 5,
              "tokens_used": m, "pairs": g["pairs"], "pearson_cosine": g["pearson_cosine"],
              "cka_linear": g["cka_linear"], "procrustes_residual": g["procrustes_residual"],
              "baseline": g["baseline"]}
    Ua, Ub = _unit(A), _unit(B)
    i, j = sample_pairs(m, 5000, 0)
    perm = np.random.default_rng([0, 1]).permutation(m)
    return result, (Ua[i] * Ua[j]).sum(1), (Ub[i] * Ub[j]).sum(1), (Ub[perm[i]] * Ub[perm[j]]).sum(1)


def test_global_figure_plots_every_pair_once_and_the_answers_r():
    result, ca, cb, cs = _global_inputs()
    # The shuffled pairs are those of the baseline: their r is the answer's baseline r.
    assert np.corrcoef(ca, cs)[0, 1] == pytest.approx(result["baseline"]["pearson_cosine"], abs=0.05)
    cb[3] = np.nan  # a missing value is skipped, in both panels (same pairs)
    fig = gf.global_similarity(result, ca, cb, cs)
    left, right = fig.axes[:2]  # then their colour bars
    for ax in (left, right):
        (hexbin,) = [c for c in ax.collections if isinstance(c, PolyCollection)]
        assert hexbin.get_array().sum() == ca.size - 1
    assert f"Pearson r = {result['pearson_cosine']:.3g}" in left.get_title()
    assert f"r = {result['baseline']['pearson_cosine']:.3g}" in right.get_title()
    png = gf.render(fig, "png")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert gf.render(gf.global_similarity(result, ca, cb, cs), "png") == png  # deterministic
    svg = gf.render(fig, "svg")
    assert ET.fromstring(svg).tag == "{http://www.w3.org/2000/svg}svg"


def test_lle_figure_plots_each_token_and_the_answers_errors():
    A, B = _spaces()
    agg = geometry.lle_transfer(A, B, 8, 1e-3, 0)
    rows = geometry.lle_transfer_rows(A, B, 8, 1e-3, 0)
    result = {"a": A_SPACE, "b": B_SPACE, "k": 8, "tokens_used": 300, **agg, "chance_overlap": 8 / 299}
    fig = gf.lle(result, rows, [f"t{i}" for i in range(300)])
    scatter_ax, bars_ax = fig.axes[0], fig.axes[1]
    (points,) = scatter_ax.collections
    np.testing.assert_array_equal(points.get_offsets(), np.c_[rows["own"], rows["transfer"]])
    heights = [p.get_height() for p in bars_ax.patches if isinstance(p, Rectangle)]
    assert heights == [agg["own_error"], agg["own_neighbors_error"], agg["transfer_error"],
                       agg["random_error"]]
    assert len(scatter_ax.texts) == 8  # the 4 best and 4 worst transferred tokens named


def test_intrinsic_dimension_figure_counts_every_defined_estimate():
    A, _ = _spaces(250)
    est = geometry.intrinsic_dimension(A, "local_pca", 15, 0.9)
    per = est.per_point.astype(float)
    per[:2] = np.nan  # undefined: left out
    n = np.arange(1, 251)
    order = np.argsort(per[2:], kind="stable")[:3] + 2
    lowest = [{"token": f"w{i}", "n": int(n[i]), "estimate": float(per[i])} for i in order]
    result = {"collection": "c", "model": "m", "layer": 2, "method": "local_pca", "k": 15,
              "threshold": 0.9, "min_count": 1, "tokens": 250, "dimension": est.dimension,
              "mean": float(np.nanmean(per)), "median": float(np.nanmedian(per)), "undefined": 2,
              "lowest": lowest, "highest": []}
    fig = gf.intrinsic_dimension(result, per, n)
    hist_ax, scatter_ax = fig.axes
    bars = [p for p in hist_ax.patches if isinstance(p, Rectangle)]
    assert sum(b.get_height() for b in bars) == 248
    # Integer estimates: one bin per integer, centred on it.
    assert all(float(b.get_x() + b.get_width() / 2).is_integer() for b in bars)
    assert scatter_ax.collections[0].get_offsets().shape[0] == 248
    assert "248 tokens, 2 undefined" == hist_ax.get_title()
    assert "w" + str(order[0]) in " ".join(t.get_text() for t in fig.texts)

    empty = gf.intrinsic_dimension({**result, "lowest": []}, [np.nan], [1])
    assert any(t.get_text() == "no data" for t in empty.axes[0].texts)
    with pytest.raises(ValueError):
        gf.intrinsic_dimension(result, [1.0, 2.0], [1])
    with pytest.raises(ValueError):
        gf.render(fig, "jpg")
