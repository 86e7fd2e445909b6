"""Peer tests for embgeom.diagnostics.

Every value is checked against a computation that does not share our code path: the
``isoscore`` package (torch), brute-force loops over pairs or candidate thresholds,
numpy.cov on explicitly transformed points, scikit-learn's PCA and StandardScaler, and
scipy's entropy and logsumexp.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch  # the isoscore package computes with torch; C0 goes in as a tensor
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from IsoScore import IsoScore  # the peer: isoscore==2.0.1, a test dependency
from sklearn.decomposition import PCA
from sklearn.preprocessing import StandardScaler

from embgeom import diagnostics as dg


def _anisotropic_cloud(rng, n, d, offset=0.0, decay=0.7):
    """Points with a geometric variance spectrum, randomly rotated, plus a common offset."""
    scales = decay ** np.arange(d)
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    return (rng.normal(size=(n, d)) * scales) @ q.T + offset * rng.normal(size=d)


def _package(value) -> float:
    return float(value.item() if hasattr(value, "item") else value)


# ------------------------------------------------------------------------------- IsoScore


@pytest.mark.parametrize(
    "seed,n,d,offset,decay",
    [
        (0, 200, 5, 0.0, 0.5),
        (1, 50, 16, 10.0, 0.8),
        (2, 30, 64, 100.0, 0.9),  # fewer points than dimensions: rank-deficient covariance
        (3, 1000, 3, 1e3, 0.1),
        (4, 500, 32, 0.0, 1.0),  # nearly isotropic
    ],
)
def test_isoscore_from_covariance_matches_package(seed, n, d, offset, decay):
    rng = np.random.default_rng(seed)
    X = _anisotropic_cloud(rng, n, d, offset, decay)
    expected = _package(IsoScore.IsoScore(X))
    ours = dg.isoscore_from_covariance(np.cov(X.T, bias=True))
    assert ours == pytest.approx(expected, abs=1e-6)
    # The package divides by n - 1 (torch.cov) while we passed the ddof=0 covariance: it
    # does not matter because IsoScore only sees lam / ||lam||, which is scale invariant.
    assert dg.isoscore_from_covariance(np.cov(X.T, ddof=1)) == pytest.approx(ours, abs=1e-12)
    # and the package's own covariance entry point agrees
    assert ours == pytest.approx(_package(IsoScore.IsoScore_cov(np.cov(X.T))), abs=1e-6)


def test_isoscore_extremes_and_scale_invariance():
    assert dg.isoscore_from_eigenvalues(np.ones(7)) == pytest.approx(1.0, abs=1e-12)
    assert dg.isoscore_from_eigenvalues([3.0, 0.0, 0.0, 0.0]) == pytest.approx(0.0, abs=1e-12)
    lam = np.array([5.0, 2.0, 1.0, 0.5, 0.0])
    # order of eigenvalues and their units do not matter
    assert dg.isoscore_from_eigenvalues(lam * 1e150) == pytest.approx(dg.isoscore_from_eigenvalues(lam[::-1]), abs=1e-12)
    assert dg.isoscore_from_eigenvalues(lam * 1e-150) == pytest.approx(dg.isoscore_from_eigenvalues(lam), abs=1e-12)
    # k equal eigenvalues out of d: the package on a diagonal covariance is the peer
    for k in range(1, 6):
        lam = np.r_[np.ones(k), np.zeros(6 - k)]
        expected = _package(IsoScore.IsoScore_cov(np.diag(lam)))
        assert dg.isoscore_from_eigenvalues(lam) == pytest.approx(expected, abs=1e-6)


def test_isoscore_degenerate_inputs():
    assert math.isnan(dg.isoscore_from_eigenvalues(np.zeros(4)))
    assert math.isnan(dg.isoscore_from_covariance(np.zeros((4, 4))))
    # roundoff negatives are clipped, not rejected
    assert dg.isoscore_from_eigenvalues([1.0, 1.0, -1e-17]) == pytest.approx(
        dg.isoscore_from_eigenvalues([1.0, 1.0, 0.0]), abs=1e-15
    )
    with pytest.raises(ValueError, match="non-negative"):
        dg.isoscore_from_eigenvalues([1.0, -0.5])
    with pytest.raises(ValueError, match="at least 2"):
        dg.isoscore_from_eigenvalues([1.0])
    with pytest.raises(ValueError, match="nan"):
        dg.isoscore_from_eigenvalues([1.0, np.nan])
    with pytest.raises(ValueError, match="symmetric"):
        dg.isoscore_from_covariance([[1.0, 0.5], [0.0, 1.0]])
    with pytest.raises(ValueError, match="square"):
        dg.covariance_eigenvalues(np.ones((2, 3)))


def test_covariance_eigenvalues_descending_against_svd():
    rng = np.random.default_rng(5)
    X = _anisotropic_cloud(rng, 10, 20, offset=3.0)  # rank 9 of 20: many ~0 eigenvalues
    C = np.cov(X.T, bias=True)
    lam = dg.covariance_eigenvalues(C)
    assert lam.dtype == np.float64 and lam.shape == (20,)
    assert np.all(np.diff(lam) <= 0)
    assert np.all(lam >= 0)
    # singular values of the centred data give the same spectrum without forming C
    sv = np.linalg.svd(X - X.mean(axis=0), compute_uv=False)
    expected = np.r_[sv**2 / X.shape[0], np.zeros(20 - sv.size)]
    np.testing.assert_allclose(lam, expected, atol=1e-12 * lam[0])


# ------------------------------------------------------------------------------ IsoScore*


@pytest.mark.parametrize("zeta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("reference", ["identity", "large_sample"])
def test_isoscore_star_matches_package(zeta, reference):
    rng = np.random.default_rng(11)
    d = 24
    big = _anisotropic_cloud(rng, 2000, d, offset=5.0, decay=0.8)
    points = big[rng.choice(2000, size=12, replace=False)]  # n < d: the case IsoScore* is for
    C0 = np.eye(d) if reference == "identity" else np.cov(big.T)
    expected = _package(IsoScore.IsoScore_star(points, torch.tensor(C0), zeta))
    ours = dg.isoscore_star(np.cov(points.T, ddof=1), C0, zeta)
    assert ours == pytest.approx(expected, abs=1e-6)


def test_isoscore_star_convention_is_ddof1():
    # Pins the convention: C0 is not rescaled, so the sample covariance's normalisation
    # changes the shrinkage; only ddof=1 reproduces the package.
    rng = np.random.default_rng(12)
    d = 10
    points = _anisotropic_cloud(rng, 4, d, decay=0.6)
    C0 = np.eye(d) * np.trace(np.cov(points.T)) / d
    expected = _package(IsoScore.IsoScore_star(points, torch.tensor(C0), 0.3))
    ddof1 = dg.isoscore_star(np.cov(points.T, ddof=1), C0, 0.3)
    ddof0 = dg.isoscore_star(np.cov(points.T, ddof=0), C0, 0.3)
    assert ddof1 == pytest.approx(expected, abs=1e-6)
    assert abs(ddof0 - expected) > 1e-4
    # endpoints: zeta=0 is plain IsoScore of the sample, zeta=1 of the reference
    assert dg.isoscore_star(np.cov(points.T), C0, 0.0) == pytest.approx(_package(IsoScore.IsoScore(points)), abs=1e-6)
    assert dg.isoscore_star(np.cov(points.T), C0, 1.0) == pytest.approx(1.0, abs=1e-12)


def test_isoscore_star_rejects_bad_input():
    with pytest.raises(ValueError, match="zeta"):
        dg.isoscore_star(np.eye(3), np.eye(3), 1.5)
    with pytest.raises(ValueError, match="same shape"):
        dg.isoscore_star(np.eye(3), np.eye(4), 0.5)


# ---------------------------------------------------------------------- spectrum summaries


def test_spectrum_summaries_against_independent_formulas():
    rng = np.random.default_rng(21)
    for d in (2, 7, 50):
        X = _anisotropic_cloud(rng, 300, d, offset=2.0, decay=0.85)
        C = np.cov(X.T, bias=True)
        lam = dg.covariance_eigenvalues(C)
        # Shannon entropy by scipy (normalises, 0 log 0 = 0)
        assert dg.effective_rank(lam) == pytest.approx(np.exp(scipy.stats.entropy(lam)), rel=1e-12)
        # tr(C)^2 / ||C||_F^2, no eigenvalues involved
        assert dg.participation_ratio(lam) == pytest.approx(np.trace(C) ** 2 / np.sum(C * C), rel=1e-10)
        # spectral norm over trace
        assert dg.top_eigenvalue_ratio(lam) == pytest.approx(np.linalg.norm(C, 2) / np.trace(C), rel=1e-10)


def test_spectrum_summaries_extremes():
    one_hot = [0.0, 4.0, 0.0, 0.0]
    flat = np.full(6, 2.5)
    assert dg.effective_rank(one_hot) == pytest.approx(1.0)
    assert dg.effective_rank(flat) == pytest.approx(6.0)
    assert dg.participation_ratio(one_hot) == pytest.approx(1.0)
    assert dg.participation_ratio(flat) == pytest.approx(6.0)
    assert dg.top_eigenvalue_ratio(one_hot) == pytest.approx(1.0)
    assert dg.top_eigenvalue_ratio(flat) == pytest.approx(1 / 6)
    # zeros among the eigenvalues do not change the effective rank (0 log 0 = 0)
    assert dg.effective_rank([1.0, 2.0, 0.0, 0.0]) == pytest.approx(dg.effective_rank([1.0, 2.0]))
    for f in (dg.effective_rank, dg.participation_ratio, dg.top_eigenvalue_ratio):
        assert math.isnan(f(np.zeros(3)))
    assert dg.participation_ratio([1e200, 1e200]) == pytest.approx(2.0)


# ------------------------------------------------------------------------ cosine geometry


def _unit_stats(X):
    u = X / np.linalg.norm(X, axis=1, keepdims=True)
    return u.sum(axis=0), (u * u).sum(axis=0)


def _brute_pairs(X):
    n, d = X.shape
    cos_sum, contrib = 0.0, np.zeros(d)
    for i, j in itertools.permutations(range(n), 2):
        a, b = X[i], X[j]
        na, nb = math.sqrt(sum(v * v for v in a)), math.sqrt(sum(v * v for v in b))
        cos_sum += sum(p * q for p, q in zip(a, b)) / (na * nb)
        contrib += (a / na) * (b / nb)
    pairs = n * (n - 1)
    return cos_sum / pairs, contrib / pairs


@st.composite
def _point_sets(draw):
    n = draw(st.integers(2, 7))
    d = draw(st.integers(1, 5))
    X = draw(hnp.arrays(np.float64, (n, d), elements=st.floats(-10, 10, allow_subnormal=False)))
    offset = draw(st.sampled_from([0.0, 1e3, -1e4]))
    X = X + offset * np.linspace(1.0, 2.0, d)
    repeat = draw(st.booleans())
    if repeat:  # repeated vectors: cosine exactly 1 between copies
        X[-1] = X[0]
    return X


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_point_sets())
def test_mean_cosine_and_rogue_match_brute_force(X):
    norms = np.linalg.norm(X, axis=1)
    assume(np.all(norms > 1e-3))  # a zero vector has no direction; the statistics exclude it
    U, S = _unit_stats(X)
    n = X.shape[0]
    brute_mean, brute_contrib = _brute_pairs(X)
    mc = dg.mean_cosine(U, n)
    cc = dg.rogue_contributions(U, S, n)
    assert mc == pytest.approx(brute_mean, abs=1e-9)
    np.testing.assert_allclose(cc, brute_contrib, atol=1e-9)
    assert cc.sum() == pytest.approx(mc, abs=1e-12)


def test_mean_cosine_and_rogue_undefined_below_two_points():
    u = np.array([0.6, 0.8])
    assert math.isnan(dg.mean_cosine(u, 1))
    assert math.isnan(dg.mean_cosine(np.zeros(2), 0))
    assert np.all(np.isnan(dg.rogue_contributions(u, u * u, 1)))
    with pytest.raises(ValueError):
        dg.mean_cosine(u, 2.5)
    with pytest.raises(ValueError):
        dg.rogue_contributions(u, np.ones(3), 4)


def test_rogue_dimension_dominates_with_common_offset():
    # One dimension with a large shared mean makes every cosine ~1 and owns the sum.
    rng = np.random.default_rng(31)
    X = rng.normal(size=(400, 8))
    X[:, 3] += 20.0
    U, S = _unit_stats(X)
    cc = dg.rogue_contributions(U, S, 400)
    assert int(np.argmax(cc)) == 3
    assert cc[3] / cc.sum() > 0.9


def test_self_similarity_vectorised_matches_per_token_loop():
    rng = np.random.default_rng(41)
    d = 6
    groups = [rng.normal(size=(k, d)) + rng.normal(size=d) * s for k, s in [(1, 0), (2, 1), (5, 3), (9, 0.1), (3, 50)]]
    U = np.stack([_unit_stats(g)[0] for g in groups])
    n = np.array([len(g) for g in groups])
    got = dg.self_similarity(U, n)
    assert got.shape == (5,)
    assert math.isnan(got[0])
    for t, g in enumerate(groups[1:], start=1):
        assert got[t] == pytest.approx(_brute_pairs(g)[0], abs=1e-12)
    # an empty row (n = 0) is nan too, and bad counts are refused
    assert np.isnan(dg.self_similarity(np.zeros((1, d)), [0])).all()
    with pytest.raises(ValueError):
        dg.self_similarity(U, n[:3])
    with pytest.raises(ValueError):
        dg.self_similarity(U, n - 3)


# ------------------------------------------------------------------------------- outliers


def test_outlier_dimensions_against_brute_force():
    rng = np.random.default_rng(51)
    var = rng.uniform(0.5, 1.5, size=64)
    var[[7, 40, 12]] = [30.0, 80.0, 30.0]
    means = rng.normal(size=64)
    got = dg.outlier_dimensions(var, means)
    mean_var = sum(var) / len(var)
    expected = [
        {"dim": i, "variance": var[i], "ratio": var[i] / mean_var, "mean": means[i]}
        for i in range(64)
        if var[i] >= 5.0 * mean_var
    ]
    expected.sort(key=lambda r: (-r["ratio"], r["dim"]))
    assert [r["dim"] for r in got] == [40, 7, 12] == [r["dim"] for r in expected]
    for g, e in zip(got, expected):
        assert set(g) == {"dim", "variance", "ratio", "mean"}
        assert type(g["dim"]) is int and all(type(g[k]) is float for k in ("variance", "ratio", "mean"))
        for k in ("variance", "ratio", "mean"):
            assert g[k] == pytest.approx(e[k], rel=1e-12)


def test_outlier_threshold_is_inclusive_and_configurable():
    var = np.array([1.0, 1.0, 1.0, 9.0])  # mean 3: dim 3 has ratio exactly 3
    assert [r["dim"] for r in dg.outlier_dimensions(var, np.zeros(4), threshold=3.0)] == [3]
    assert dg.outlier_dimensions(var, np.zeros(4), threshold=3.0001) == []
    assert dg.outlier_dimensions(np.zeros(4), np.zeros(4)) == []
    with pytest.raises(ValueError):
        dg.outlier_dimensions(var, np.zeros(3))
    with pytest.raises(ValueError):
        dg.outlier_dimensions(-var, np.zeros(4))


# ------------------------------------------------------------------ partition isotropy


def _brute_partition_isotropy(W):
    _, vecs = np.linalg.eigh(W.T @ W)
    log_z = []
    for c in np.hstack([vecs, -vecs]).T:
        dots = [float(np.dot(c, w)) for w in W]
        top = max(dots)
        log_z.append(top + math.log(math.fsum(math.exp(v - top) for v in dots)))
    return math.exp(min(log_z) - max(log_z))


def test_partition_isotropy_against_direct_sums():
    rng = np.random.default_rng(61)
    W = rng.normal(size=(300, 5)) * [1.0, 0.5, 0.3, 0.2, 0.1] + 0.4
    _, vecs = np.linalg.eigh(W.T @ W)
    z = [np.sum(np.exp(W @ c)) for c in np.hstack([vecs, -vecs]).T]  # no overflow at this scale
    assert dg.partition_isotropy(W) == pytest.approx(min(z) / max(z), rel=1e-10)


def test_partition_isotropy_large_norms_do_not_overflow():
    rng = np.random.default_rng(62)
    W = rng.normal(size=(200, 4)) * 3.0 + [30.0, 0.0, 0.0, 0.0]  # exp(c.w) up to e^45
    expected = _brute_partition_isotropy(W)
    assert dg.partition_isotropy(W) == pytest.approx(expected, rel=1e-9)
    # norms ~300: the naive exp(c.w) overflows float64, the ratio (~1e-187) does not
    V = rng.normal(size=(100, 3)) * 300.0
    _, vecs = np.linalg.eigh(V.T @ V)
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(V @ np.hstack([vecs, -vecs]))).any()
    got = dg.partition_isotropy(V)
    assert got > 0.0 and got == pytest.approx(_brute_partition_isotropy(V), rel=1e-6)
    # norms ~3e3: every log Z is still finite and right; the ratio underflows to 0.0, not nan
    big = W * 100.0
    _, vecs = np.linalg.eigh(big.T @ big)
    dirs = np.hstack([vecs, -vecs])
    log_z = dg._partition_log_z(big, dirs, block_rows=64)
    np.testing.assert_allclose(log_z, scipy.special.logsumexp(big @ dirs, axis=0), rtol=1e-12)
    assert dg.partition_isotropy(big) == 0.0


def test_partition_isotropy_properties():
    d = 4
    # the set {+-e_i} is isotropic: every Z(c) is e + 1/e + 2(d-1)
    W = np.vstack([np.eye(d), -np.eye(d)])
    assert dg.partition_isotropy(W) == pytest.approx(1.0, abs=1e-12)
    rng = np.random.default_rng(63)
    V = rng.normal(size=(500, d))
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    base = dg.partition_isotropy(V)
    # a rotation of the words rotates the eigenvectors with them
    assert dg.partition_isotropy(V @ q) == pytest.approx(base, rel=1e-9)
    # a common offset is the anisotropy the measure was made to detect
    assert dg.partition_isotropy(V + 2.0) < 0.5 * base


def test_partition_isotropy_blocking_is_only_a_memory_optimisation():
    rng = np.random.default_rng(64)
    W = rng.normal(size=(1000, 6)) * 4.0 + 1.0
    _, vecs = np.linalg.eigh(W.T @ W)
    dirs = np.hstack([vecs, -vecs])
    whole = dg._partition_log_z(W, dirs, block_rows=W.shape[0])
    pieces = dg._partition_log_z(W, dirs, block_rows=7)
    np.testing.assert_allclose(pieces, whole, rtol=1e-12)
    np.testing.assert_allclose(whole, scipy.special.logsumexp(W @ dirs, axis=0), rtol=1e-12)


# ----------------------------------------------------------------------------- transforms


def _points_with_constant_dim(rng, n=400, d=10):
    X = _anisotropic_cloud(rng, n, d, offset=4.0, decay=0.75)
    # distinct variance scales so standardisation has work to do
    X = X * np.geomspace(0.01, 100.0, d)
    X[:, 2] = 3.0  # a constant dimension, exactly representable mean
    return X


def test_standardize_equals_covariance_of_z_scored_points():
    X = _points_with_constant_dim(np.random.default_rng(71))
    Z = StandardScaler().fit_transform(X)  # ddof=0 z-scores; constant dim -> 0
    expected = np.cov(Z.T, bias=True)
    got = dg.transform_covariance(np.cov(X.T, bias=True), "standardize")
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9 * np.abs(expected).max())
    assert np.all(got[2] == 0) and np.all(got[:, 2] == 0)
    # correlation is scale free, so the ddof of the input does not matter
    np.testing.assert_allclose(dg.transform_covariance(np.cov(X.T), "standardize"), got, atol=1e-12)
    # isoscore on the transformed points, computed by the package from the points
    assert dg.isoscore_from_covariance(got) == pytest.approx(_package(IsoScore.IsoScore(Z)), abs=1e-6)


@pytest.mark.parametrize("D", [1, 2, 5])
def test_abtt_equals_covariance_of_postprocessed_points(D):
    rng = np.random.default_rng(72 + D)
    X = _anisotropic_cloud(rng, 500, 12, offset=20.0, decay=0.6)  # well-separated spectrum
    pca = PCA(n_components=D).fit(X)
    Xc = X - X.mean(axis=0)
    Xp = Xc - (Xc @ pca.components_.T) @ pca.components_
    expected = np.cov(Xp.T, bias=True)
    got = dg.transform_covariance(np.cov(X.T, bias=True), f"abtt:{D}")
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9 * np.abs(expected).max())
    # D eigenvalues removed, the rest untouched
    lam = dg.covariance_eigenvalues(np.cov(X.T, bias=True))
    np.testing.assert_allclose(np.sort(dg.covariance_eigenvalues(got))[D:], np.sort(lam[D:]), rtol=1e-9)
    assert dg.isoscore_from_covariance(got) == pytest.approx(_package(IsoScore.IsoScore(Xp)), abs=1e-6)


def test_transform_none_and_specs():
    C = np.cov(np.random.default_rng(73).normal(size=(50, 4)).T)
    for spec in (None, "none", " NONE ", "abtt:0"):
        np.testing.assert_array_equal(dg.transform_covariance(C, spec), (C + C.T) / 2)
    assert dg.parse_transform("Standardize") == dg.Transform("standardize", 0)
    assert dg.parse_transform("abtt:3") == dg.Transform("abtt", 3)
    assert dg.parse_transform(dg.Transform("abtt", 3)) == dg.Transform("abtt", 3)
    for bad in ("", "abtt", "abtt:", "abtt:-1", "abtt:1.5", "abtt:x", "pca:2", "zscore", 3):
        with pytest.raises(ValueError, match="transform"):
            dg.parse_transform(bad)
    with pytest.raises(ValueError, match="fewer components"):
        dg.transform_covariance(C, "abtt:4")


# --------------------------------------------------------------------------------- probing


def _brute_threshold(train_x, train_y, test_x, test_y):
    """O(n^2): every candidate, both directions, scored by applying the rule."""
    values = sorted(set(train_x.tolist()))
    candidates = [float(np.nextafter(values[0], -np.inf))]
    candidates += [values[k - 1] / 2 + values[k] / 2 for k in range(1, len(values))]
    candidates += [float(np.nextafter(values[-1], np.inf))]
    best = None
    for direction in (1, -1):  # same tie order as documented: +1 first, then smaller threshold
        for t in candidates:
            acc = sum((direction * (x - t) > 0) == (y == 1) for x, y in zip(train_x, train_y)) / len(train_x)
            if best is None or acc > best[2]:
                best = (t, direction, acc)
    t, direction, acc = best
    test_acc = (
        sum((direction * (x - t) > 0) == (y == 1) for x, y in zip(test_x, test_y)) / len(test_x)
        if len(test_x)
        else float("nan")
    )
    return t, direction, acc, test_acc


@st.composite
def _probe_data(draw):
    n = draw(st.integers(1, 40))
    # few distinct values so ties and repeated x with mixed labels are common
    xs = st.integers(-5, 5).map(float) | st.floats(-1e6, 1e6, allow_subnormal=False)
    train_x = np.array(draw(st.lists(xs, min_size=n, max_size=n)))
    train_y = np.array(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)))
    m = draw(st.integers(0, 20))
    test_x = np.array(draw(st.lists(xs, min_size=m, max_size=m)), dtype=np.float64)
    test_y = np.array(draw(st.lists(st.integers(0, 1), min_size=m, max_size=m)), dtype=np.int64)
    return train_x, train_y, test_x, test_y


@settings(max_examples=200, deadline=None)
@given(_probe_data())
def test_best_threshold_matches_brute_force(data):
    got = dg.best_threshold_accuracy(*data)
    expected = _brute_threshold(*data)
    # Both find the maximal training accuracy.
    assert got[2] == pytest.approx(expected[2], abs=1e-12)
    values = np.unique(data[0])
    midpoints = values[:-1] / 2 + values[1:] / 2
    if np.any((midpoints == values[:-1]) | (midpoints == values[1:])):
        # Adjacent floats whose midpoint rounds onto one of them (documented): that
        # candidate does not separate them, so the two scans may settle an equal-accuracy
        # tie differently; the rule returned must still score what it claims.
        direction, threshold = got[1], got[0]
        pred = direction * (data[0] - threshold) > 0
        assert np.mean(pred == (data[1] == 1)) == pytest.approx(got[2], abs=1e-12)
        return
    assert got[0] == expected[0]
    assert got[1] == expected[1]
    if math.isnan(expected[3]):
        assert math.isnan(got[3])
    else:
        assert got[3] == pytest.approx(expected[3], abs=1e-12)


def test_best_threshold_separable_and_reversed():
    x = np.array([0.1, 0.2, 0.3, 0.7, 0.8, 0.9])
    t, direction, train_acc, test_acc = dg.best_threshold_accuracy(x, [0, 0, 0, 1, 1, 1], [0.0, 1.0], [0, 1])
    assert (t, direction, train_acc, test_acc) == (pytest.approx(0.5), 1, 1.0, 1.0)
    t, direction, train_acc, test_acc = dg.best_threshold_accuracy(x, [1, 1, 1, 0, 0, 0], [0.0, 1.0], [1, 1])
    assert (t, direction, train_acc, test_acc) == (pytest.approx(0.5), -1, 1.0, 0.5)
    # a single label: the constant classifier, threshold just outside the data
    t, direction, train_acc, _ = dg.best_threshold_accuracy(x, np.ones(6), [], [])
    assert train_acc == 1.0 and t < 0.1 and direction == 1


def test_best_threshold_scales_to_many_points():
    # n = 200k would take hours with the O(n^2) scan; the cumulative-count scan is a sort.
    rng = np.random.default_rng(81)
    y = rng.integers(0, 2, size=200_000)
    x = rng.normal(size=y.size) + 1.5 * y
    t, direction, train_acc, test_acc = dg.best_threshold_accuracy(x[:150_000], y[:150_000], x[150_000:], y[150_000:])
    # Bayes rule for two unit Gaussians 1.5 apart: threshold 0.75, accuracy Phi(0.75)
    assert direction == 1 and t == pytest.approx(0.75, abs=0.05)
    assert train_acc == pytest.approx(scipy.stats.norm.cdf(0.75), abs=0.01)
    assert test_acc == pytest.approx(scipy.stats.norm.cdf(0.75), abs=0.01)


def test_best_threshold_rejects_bad_labels():
    with pytest.raises(ValueError, match="binary"):
        dg.best_threshold_accuracy([1.0, 2.0], [0, 2], [], [])
    with pytest.raises(ValueError, match="shape"):
        dg.best_threshold_accuracy([1.0, 2.0], [0], [], [])


def test_standardize_keeps_tiny_but_varying_dimensions_given_the_mean():
    # A LayerNorm weight of ~1e-32 leaves a dimension whose values are ~1e-32 yet vary
    # (std/|mean| ~ 10): it must be standardised, not zeroed as "constant"; a truly
    # constant dimension (variance 0) is still zeroed.
    rng = np.random.default_rng(7)
    X = rng.normal(size=(500, 4))
    X[:, 1] *= 1e-32
    X[:, 2] = 3.0
    cov = np.cov(X.T, bias=True)
    mean = X.mean(axis=0)
    from embgeom.diagnostics import transform_covariance

    r = transform_covariance(cov, "standardize", mean=mean)
    assert np.allclose(np.diag(r), [1.0, 1.0, 0.0, 1.0])
    expected = np.corrcoef(X[:, [0, 1, 3]].T)
    assert np.allclose(r[np.ix_([0, 1, 3], [0, 1, 3])], expected, atol=1e-12)


def test_log_partition_isotropy_is_finite_where_the_ratio_underflows():
    from embgeom.diagnostics import log_partition_isotropy, partition_isotropy

    rng = np.random.default_rng(3)
    W = rng.normal(size=(50, 6))
    assert np.isclose(np.exp(log_partition_isotropy(W)), partition_isotropy(W), rtol=1e-12)
    W_far = W + np.array([2000.0, 0, 0, 0, 0, 0])  # a huge common direction
    assert partition_isotropy(W_far) == 0.0
    log_iw = log_partition_isotropy(W_far)
    # Z(+e1) ~ 50 exp(2000), Z(-e1) ~ 50 exp(-2000): log ratio ~ -4000
    assert np.isfinite(log_iw) and -4100 < log_iw < -3900
