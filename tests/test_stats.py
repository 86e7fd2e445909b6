"""Property tests for the streaming moment math in :mod:`embgeom.stats`.

Every check compares what the streaming code returns against an independent two-pass
float64 computation over the raw points, written here with plain numpy (the reference
never calls a helper of ``embgeom.stats``).

Tolerances
----------
float64 has eps = 2.2e-16. In these tests a merged value is the result of at most a few
thousand additions / multiplications, each adding a rounding error of eps times the size
of the quantities involved. The largest quantities are squared norms ``||x||^2``, so the
natural scale of an absolute error on ``V`` (or ``m2 / n``) is ``Q = mean ||x||^2``:

* general data: ``|m2 - m2_ref| <= 1e-9 * m2_ref + 1e-15 * n * Q`` and
  ``|mean - mean_ref| <= 1e-9 * sqrt(Q)``. Chan's update only subtracts means, so its error
  on m2 is relative to m2 itself (~1e-11 here), not to Q; the floor 1e-15 * n * Q (a few
  eps of the squared norms) only matters where m2_ref is ~0 (a single point). A tolerance
  relative to n * Q alone would pass an m2 of 0 on data whose M dwarfs V (offset 100,
  scale 1e-3: V / Q ~ 1e-10), so none is used. The same goes for V_W, V_B and
  co-moments. Any algebraic mistake (a wrong weight, a missing cross term, an off-by-one
  count) shows up as an O(1) relative error.
* adversarial data (M/V ~ 1e8): ``|V - V_ref| <= 1e-9 * V_ref``, relative to V itself.
  Chan's update only ever subtracts means (``delta = mb - ma``), never squared norms: the
  rounding of a mean is ~eps * 1e4 = 2e-12 in absolute terms, against deltas of O(0.1..1)
  (noise scale 1), so the relative error on V stays ~1e-11. A raw-sum formula would carry
  an absolute error ~eps * Q = eps * 1e8 * V, i.e. ~1e-8 relative in float64 and O(1) in
  float32 (pinned below).
* counts are integers and must be exact.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from embgeom.stats import (
    BUCKET_EDGES,
    LayerMoments,
    aligned_buckets,
    bucket_index,
    bucket_sums,
    add_compensated,
    chan_merge,
    compensated_sum,
    decomposition,
    decomposition_from_sums,
    decomposition_from_totals,
    layer_summary,
    moments_of_points,
    q_m_v,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
REL = 1e-9  # see module docstring
U = 2.0**-53  # float64 unit roundoff

# --------------------------------------------------------------------------- references


def ref_moments(x: np.ndarray):
    """Two-pass float64 (n, mean, m2) of the rows of x, numpy only."""
    x = np.asarray(x, dtype=np.float64)
    mu = x.sum(axis=0) / x.shape[0]
    dev = x - mu
    return x.shape[0], mu, float(np.sum(dev * dev))


def ref_q(x: np.ndarray) -> float:
    """mean ||x||^2, directly."""
    return float(np.mean(np.sum(x * x, axis=1)))


def ref_v(x: np.ndarray) -> float:
    """mean ||x - mu||^2, two-pass."""
    mu = x.mean(axis=0)
    return float(np.mean(np.sum((x - mu) ** 2, axis=1)))


# --------------------------------------------------------------------------- data helpers


def make_points(rng, n, d, offset, scale):
    return offset + scale * rng.standard_normal((n, d))


def random_split(rng, n, parts, allow_singletons=False):
    """Random partition of range(n) (shuffled) into `parts` non-empty index arrays."""
    perm = rng.permutation(n)
    if allow_singletons:
        return [np.array([i]) for i in perm]
    cuts = np.sort(rng.choice(np.arange(1, n), size=parts - 1, replace=False)) if parts > 1 else []
    return np.split(perm, cuts)


def merge_all(states, order, rng, merge):
    """Merge a list of states with `merge(a, b)` in the given order / tree shape."""
    states = list(states)
    if order == "left":
        acc = states[0]
        for s in states[1:]:
            acc = merge(acc, s)
        return acc
    if order == "reversed":
        acc = states[-1]
        for s in reversed(states[:-1]):
            acc = merge(s, acc)  # right fold: new part on the left side
        return acc
    if order == "pairwise":
        while len(states) > 1:
            nxt = [merge(states[i], states[i + 1]) for i in range(0, len(states) - 1, 2)]
            if len(states) % 2:
                nxt.append(states[-1])
            states = nxt
        return states[0]
    if order == "random":
        while len(states) > 1:
            i, j = rng.choice(len(states), size=2, replace=False)
            a, b = states[i], states[j]
            states = [s for k, s in enumerate(states) if k not in (i, j)] + [merge(a, b)]
        return states[0]
    raise ValueError(order)


def chan(a, b):
    n, mean, m2, _ = chan_merge(a[0], a[1], a[2], b[0], b[1], b[2])
    return n, mean, m2


ORDERS = st.sampled_from(["left", "reversed", "pairwise", "random"])
OFFSETS = st.sampled_from([0.0, 1.0, -3.0, 100.0])
SCALES = st.sampled_from([1e-3, 1.0, 1e3])

# --------------------------------------------------------------------------- chan_merge


@FAST
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 200), d=st.integers(1, 16),
       parts=st.integers(1, 8), order=ORDERS, offset=OFFSETS, scale=SCALES)
def test_chan_merge_equals_two_pass(seed, n, d, parts, order, offset, scale):
    rng = np.random.default_rng(seed)
    parts = min(parts, n)
    x = make_points(rng, n, d, offset, scale)
    states = [ref_moments(x[idx]) for idx in random_split(rng, n, parts)]
    n_m, mean_m, m2_m = merge_all(states, order, rng, chan)

    n_r, mean_r, m2_r = ref_moments(x)
    q = ref_q(x)
    assert n_m == n_r  # float64 count, exact for these sizes
    assert np.all(np.abs(mean_m - mean_r) <= REL * np.sqrt(q))
    assert abs(m2_m - m2_r) <= REL * m2_r + 1e-15 * n * q
    assert m2_m >= 0.0


@FAST
@given(seed=st.integers(0, 2**32 - 1), na=st.integers(0, 50), nb=st.integers(0, 50),
       d=st.integers(1, 8))
def test_chan_merge_cross_term_and_empty_sides(seed, na, nb, d):
    assume(na + nb > 0)
    rng = np.random.default_rng(seed)
    xa, xb = make_points(rng, na, d, 2.0, 1.0), make_points(rng, nb, d, -1.0, 3.0)
    a = ref_moments(xa) if na else (0, np.zeros(d), 0.0)
    b = ref_moments(xb) if nb else (0, np.zeros(d), 0.0)
    n, mean, m2, cross = chan_merge(a[0], a[1], a[2], b[0], b[1], b[2])
    if na == 0:  # an empty side contributes nothing, exactly
        assert np.array_equal(mean, b[1]) and m2 == b[2] and cross == 0.0
    if nb == 0:
        assert np.array_equal(mean, a[1]) and m2 == a[2] and cross == 0.0
    dlt = b[1] - a[1]
    expected_cross = float(np.sum(dlt * dlt)) * na * nb / (na + nb)
    assert cross == pytest.approx(expected_cross, rel=1e-12, abs=0.0)
    assert m2 == a[2] + b[2] + cross
    x = np.concatenate([xa, xb])
    m2_r = ref_moments(x)[2]
    assert abs(m2 - m2_r) <= REL * m2_r + 1e-15 * (na + nb) * ref_q(x)


@FAST
@given(seed=st.integers(0, 2**32 - 1), L=st.integers(1, 3), k=st.integers(1, 6),
       d=st.integers(1, 5))
def test_chan_merge_vectorised_rows_match_scalar(seed, L, k, d):
    rng = np.random.default_rng(seed)
    na, nb = rng.integers(0, 20, size=k), rng.integers(1, 20, size=k)
    ma, mb = rng.standard_normal((L, k, d)), rng.standard_normal((L, k, d))
    m2a, m2b = rng.random((L, k)), rng.random((L, k))
    n, mean, m2, cross = chan_merge(na, ma, m2a, nb, mb, m2b)
    assert mean.shape == (L, k, d) and m2.shape == (L, k) and cross.shape == (L, k)
    for layer in range(L):
        for j in range(k):
            s = chan_merge(na[j], ma[layer, j], m2a[layer, j], nb[j], mb[layer, j], m2b[layer, j])
            assert n[j] == na[j] + nb[j]
            np.testing.assert_allclose(mean[layer, j], s[1], rtol=1e-14, atol=1e-14)
            np.testing.assert_allclose(m2[layer, j], s[2], rtol=1e-14)


def test_moments_of_points_is_two_pass():
    rng = np.random.default_rng(0)
    x = make_points(rng, 37, 5, 10.0, 2.0)
    n, mean, m2 = moments_of_points(x)
    n_r, mean_r, m2_r = ref_moments(x)
    assert n == n_r
    np.testing.assert_allclose(mean, mean_r, rtol=1e-14)
    assert m2 == pytest.approx(m2_r, rel=1e-12)


# --------------------------------------------------------------------------- q_m_v


@FAST
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 100), d=st.integers(1, 16),
       offset=OFFSETS, scale=SCALES)
def test_q_m_v_matches_points(seed, n, d, offset, scale):
    rng = np.random.default_rng(seed)
    x = make_points(rng, n, d, offset, scale)
    n_r, mean_r, m2_r = ref_moments(x)
    Q, M, V = q_m_v(n_r, mean_r, m2_r)
    q = ref_q(x)
    assert abs(Q - q) <= REL * q  # the mean squared norm of the points, computed directly
    mu = x.mean(axis=0)
    assert abs(M - float(np.sum(mu * mu))) <= REL * M + 1e-15 * q
    v_r = ref_v(x)
    assert abs(V - v_r) <= REL * v_r + 1e-15 * q
    assert V >= 0.0


@FAST
@given(seed=st.integers(0, 2**32 - 1), shape=st.lists(st.integers(1, 4), min_size=0, max_size=2),
       d=st.integers(1, 6))
def test_q_m_v_vectorised(seed, shape, d):
    rng = np.random.default_rng(seed)
    n = rng.integers(1, 1000, size=shape)
    mean = rng.standard_normal(tuple(shape) + (d,))
    m2 = rng.random(shape) * 10
    Q, M, V = q_m_v(n, mean, m2)
    assert np.shape(Q) == tuple(shape)
    np.testing.assert_allclose(M, np.sum(mean**2, axis=-1), rtol=1e-14)
    np.testing.assert_allclose(V, m2 / n, rtol=1e-15)
    np.testing.assert_array_equal(Q, M + V)


# --------------------------------------------------------------------------- decomposition


def labelled_points(rng, n, d, k, offset, scale):
    """n points with token labels 0..k'-1 (every label used), per-type offsets."""
    labels = rng.integers(0, k, size=n)
    _, labels = np.unique(labels, return_inverse=True)  # relabel to the used types
    centers = offset + scale * 3 * rng.standard_normal((labels.max() + 1, d))
    x = centers[labels] + scale * rng.standard_normal((n, d))
    return x, labels


@FAST
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 300), d=st.integers(1, 12),
       k=st.integers(1, 20), offset=OFFSETS, scale=SCALES)
def test_decomposition_equals_two_pass(seed, n, d, k, offset, scale):
    rng = np.random.default_rng(seed)
    x, labels = labelled_points(rng, n, d, k, offset, scale)
    types = np.unique(labels)
    per_type = [ref_moments(x[labels == t]) for t in types]
    n_t = np.array([p[0] for p in per_type])
    mean_t = np.stack([p[1] for p in per_type])
    m2_t = np.array([p[2] for p in per_type])
    out = decomposition(n_t, mean_t, m2_t)

    # reference, per point, over the raw points
    mu = x.mean(axis=0)
    mu_of_point = np.stack([x[labels == t].mean(axis=0) for t in types])[labels]
    Q = float(np.mean(np.sum(x * x, axis=1)))
    M = float(mu @ mu)
    V = float(np.mean(np.sum((x - mu) ** 2, axis=1)))
    V_W = float(np.mean(np.sum((x - mu_of_point) ** 2, axis=1)))
    V_B = float(np.mean(np.sum((mu_of_point - mu) ** 2, axis=1)))

    assert out["n"] == n and out["num_types"] == len(types)
    for key, ref in (("Q", Q), ("M", M), ("V", V), ("V_W", V_W), ("V_B", V_B)):
        # each against its own point-by-point reference, relative to itself (see the
        # module docstring): V_B is never taken as V - V_W on either side
        assert abs(out[key] - ref) <= REL * ref + 1e-15 * Q, key
        assert out[key] >= 0.0


def test_decomposition_empty():
    out = decomposition(np.zeros(0, dtype=np.int64), np.zeros((0, 3)), np.zeros(0))
    assert out["n"] == 0 and out["num_types"] == 0
    assert all(out[k] is None for k in ("Q", "M", "V", "V_W", "V_B"))


# --------------------------------------------------------------------------- LayerMoments


def layer_part(x: np.ndarray) -> LayerMoments:
    """LayerMoments of raw points x (L, m, d), two-pass, numpy only."""
    L, m, d = x.shape
    mean = x.sum(axis=1) / m
    dev = x - mean[:, None, :]
    u = x / np.linalg.norm(x, axis=2, keepdims=True)
    return LayerMoments(
        n=m, mean=mean, comoment=np.einsum("lmi,lmj->lij", dev, dev),
        unit_sum=u.sum(axis=1), unit_sq_sum=(u * u).sum(axis=1),
    )


@FAST
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 200), L=st.integers(1, 3),
       d=st.integers(1, 10), parts=st.integers(1, 8), order=ORDERS, offset=OFFSETS,
       scale=SCALES, start_empty=st.booleans())
def test_layer_moments_merged_equals_cov(seed, n, L, d, parts, order, offset, scale,
                                         start_empty):
    rng = np.random.default_rng(seed)
    parts = min(parts, n)
    x = offset + scale * rng.standard_normal((L, n, d))
    splits = random_split(rng, n, parts)
    states = [layer_part(x[:, idx]) for idx in splits]
    if start_empty:
        states = [LayerMoments.empty(L, d)] + states + [LayerMoments.empty(L, d)]
    out = merge_all(states, order, rng, lambda a, b: a.merged(b))

    assert out.n == n
    u = x / np.linalg.norm(x, axis=2, keepdims=True)
    for layer in range(L):
        xl = x[layer]
        q = ref_q(xl)
        cov = np.atleast_2d(np.cov(xl.T, bias=True)) * n
        assert np.all(np.abs(out.comoment[layer] - cov) <= REL * np.abs(cov).max() + 1e-15 * n * q)
        m2_r = ref_moments(xl)[2]
        assert abs(out.m2[layer] - m2_r) <= REL * m2_r + 1e-15 * n * q
        assert np.all(np.abs(out.mean[layer] - xl.mean(axis=0)) <= REL * np.sqrt(q))
        np.testing.assert_allclose(out.unit_sum[layer], u[layer].sum(axis=0), rtol=0, atol=1e-9 * n)
        np.testing.assert_allclose(out.unit_sq_sum[layer], (u[layer] ** 2).sum(axis=0),
                                   rtol=0, atol=1e-9 * n)
    # symmetric positive semi-definite up to rounding
    np.testing.assert_allclose(out.comoment, np.swapaxes(out.comoment, 1, 2), rtol=0,
                               atol=REL * n * float(np.max(np.sum(x * x, axis=2).mean(axis=1))))


def test_layer_moments_empty_merge():
    e = LayerMoments.empty(2, 3)
    out = e.merged(LayerMoments.empty(2, 3))
    assert out.n == 0 and np.all(out.comoment == 0) and np.all(out.m2 == 0)


# --------------------------------------------------------------------------- adversarial

OFFSET = 1e4  # every dimension: M = d * 1e8, V ~ d (noise scale 1): M / V ~ 1e8


@FAST
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 300), d=st.integers(2, 16),
       parts=st.integers(1, 8), order=ORDERS, singletons=st.booleans())
def test_adversarial_large_offset_chan_is_exact(seed, n, d, parts, order, singletons):
    rng = np.random.default_rng(seed)
    parts = min(parts, n)
    x = make_points(rng, n, d, OFFSET, 1.0)
    splits = random_split(rng, n, parts, allow_singletons=singletons)
    states = [ref_moments(x[idx]) for idx in splits]
    n_m, mean_m, m2_m = merge_all(states, order, rng, chan)
    v_ref = ref_v(x)
    assert ref_q(x) / v_ref > 1e6  # the regime we mean to test (M/V ~ 1e8)
    assert abs(m2_m / n_m - v_ref) <= REL * v_ref

    # the same through LayerMoments (co-moment trace) and decomposition
    lm = merge_all([layer_part(x[idx][None]) for idx in splits], order, rng,
                   lambda a, b: a.merged(b))
    assert abs(lm.m2[0] / n - v_ref) <= REL * v_ref
    n_t = np.array([len(idx) for idx in splits])
    dec = decomposition(n_t, np.stack([s[1] for s in states]), np.array([s[2] for s in states]))
    assert abs(dec["V"] - v_ref) <= REL * v_ref


@FAST
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 300), d=st.integers(1, 16),
       parts=st.integers(1, 8), order=ORDERS, singletons=st.booleans())
def test_adversarial_identical_vectors_variance_stays_zero(seed, n, d, parts, order, singletons):
    rng = np.random.default_rng(seed)
    parts = min(parts, n)
    v = OFFSET + rng.standard_normal(d)
    x = np.tile(v, (n, 1))  # V = 0 exactly
    splits = random_split(rng, n, parts, allow_singletons=singletons)
    states = [ref_moments(x[idx]) for idx in splits]
    n_m, mean_m, m2_m = merge_all(states, order, rng, chan)
    q = ref_q(x)
    V = m2_m / n_m
    # Only the rounding of a mean (~eps * 1e4 per coordinate) can show up, squared:
    # ~1e-22 per coordinate against Q ~ d * 1e8, so 1e-20 * Q is a loose bound.
    assert 0.0 <= V <= 1e-20 * q
    lm = merge_all([layer_part(x[idx][None]) for idx in splits], order, rng,
                   lambda a, b: a.merged(b))
    assert 0.0 <= lm.m2[0] / n <= 1e-20 * q
    ev = np.linalg.eigvalsh(lm.comoment[0] / n)
    assert np.all(np.abs(ev) <= 1e-20 * q)


def naive_float32_variance(x: np.ndarray) -> float:
    """The raw-sum formula sum||x||^2/n - ||sum x/n||^2, accumulated in float32."""
    x32 = x.astype(np.float32)
    n = np.float32(x.shape[0])
    q = np.sum(np.sum(x32 * x32, axis=1, dtype=np.float32), dtype=np.float32) / n
    mu = np.sum(x32, axis=0, dtype=np.float32) / n
    return float(q - np.sum(mu * mu, dtype=np.float32))


def naive_float32_running_variance(x: np.ndarray) -> float:
    """Same formula, as a float32 running update over one point at a time."""
    s = np.zeros(x.shape[1], dtype=np.float32)
    sq = np.float32(0.0)
    for row in x.astype(np.float32):
        s += row
        sq += np.float32(row @ row)
    n = np.float32(x.shape[0])
    mu = s / n
    return float(sq / n - mu @ mu)


@pytest.mark.parametrize("seed", range(5))
def test_naive_float32_raw_sums_are_badly_wrong_but_chan_is_not(seed):
    """Pins why Chan is needed: with M / V ~ 1e8 the raw-sum formula in float32 is useless.

    Q ~ 8e8 here; float32 numbers of that size are spaced by 64, and the subtraction of
    two of them can only return a multiple of 32 or 64, against a true V ~ 8.
    """
    rng = np.random.default_rng(seed)
    x = make_points(rng, 1000, 8, OFFSET, 1.0)
    v_ref = ref_v(x)
    assert ref_q(x) / v_ref > 1e7
    for naive in (naive_float32_variance, naive_float32_running_variance):
        v = naive(x)
        assert abs(v - v_ref) / v_ref > 1e-3, (naive.__name__, v, v_ref)
    # Chan over 10 parts on the same data stays exact
    states = [ref_moments(p) for p in np.array_split(x, 10)]
    n_m, _, m2_m = merge_all(states, "left", rng, chan)
    assert abs(m2_m / n_m - v_ref) <= REL * v_ref


# --------------------------------------------------------------------------- layer_summary


@FAST
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(2, 50), true_slope=st.floats(-2, 2),
       noise=st.sampled_from([0.0, 0.01, 1.0]))
def test_layer_summary_matches_polyfit(seed, k, true_slope, noise):
    rng = np.random.default_rng(seed)
    M = rng.uniform(0.0, 10.0, size=k)
    V = 25.0 + true_slope * M + noise * rng.standard_normal(k)
    V = np.abs(V)
    Q = M + V
    n = rng.integers(1, 100_000, size=k)
    assume(np.ptp(M) > 1e-3 and np.ptp(np.log10(n)) > 1e-3)
    out = layer_summary(n, Q, M, V)

    slope_r, intercept_r = np.polyfit(M, V, 1)
    # Rounding of V (~eps * max|V|) moves a least-squares slope by ~eps * max|V| / std(M):
    # that is the natural scale of the slope's error (std(V) alone is 0 on an exact line).
    scale = np.max(np.abs(V)) / np.std(M) + abs(slope_r)
    assert abs(out["slope"] - slope_r) <= 1e-9 * scale
    assert abs(out["intercept"] - intercept_r) <= 1e-9 * (abs(intercept_r) + np.max(np.abs(V)))
    # r2 is only well conditioned when V varies well above its rounding (~eps * max|V|);
    # for a V that is flat to within a few ulps any two correct formulas disagree.
    if np.ptp(V) > 1e-6 * np.max(np.abs(V)):
        r2_r = np.corrcoef(M, V)[0, 1] ** 2  # independent of the residual formula
        assert out["r2"] == pytest.approx(r2_r, abs=1e-9)
        resid = V - np.polyval([slope_r, intercept_r], M)
        r2_r2 = 1.0 - np.sum(resid**2) / np.sum((V - V.mean()) ** 2)
        assert out["r2"] == pytest.approx(r2_r2, abs=1e-9)
    assert out["cv_Q"] == pytest.approx(np.std(Q) / np.mean(Q), rel=1e-12)

    logn = np.log10(n.astype(np.float64))
    for name, y in (("Q", Q), ("M", M), ("V", V)):
        ref = np.polyfit(logn, y, 1)[0]
        sc = np.max(np.abs(y)) / np.std(logn) + abs(ref)
        assert abs(out[f"slope_{name}_log10n"] - ref) <= 1e-9 * sc, name


def test_layer_summary_perfect_line():
    M = np.array([1.0, 2.0, 3.0, 5.0])
    V = 10.0 - M
    out = layer_summary([10, 100, 1000, 10000], M + V, M, V)
    assert out["slope"] == pytest.approx(-1.0, rel=1e-14)
    assert out["intercept"] == pytest.approx(10.0, rel=1e-14)
    assert out["r2"] == pytest.approx(1.0, abs=1e-14)
    assert out["cv_Q"] == pytest.approx(0.0, abs=1e-15)  # Q = 10 for every type
    assert out["slope_M_log10n"] == pytest.approx(np.polyfit([1, 2, 3, 4], M, 1)[0], rel=1e-12)


def test_layer_summary_none_cases():
    keys = ("cv_Q", "slope", "intercept", "r2", "slope_Q_log10n", "slope_M_log10n",
            "slope_V_log10n")
    # no type at all
    out = layer_summary([], [], [], [])
    assert all(out[k] is None for k in keys)
    # one type: nothing to regress; cv of a single value is 0
    out = layer_summary([12], [3.0], [1.0], [2.0])
    assert out["cv_Q"] == 0.0
    assert all(out[k] is None for k in keys[1:])
    # constant M (exactly representable mean): slope/intercept/r2 undefined, log slopes defined
    M = np.full(4, 2.0)
    V = np.array([1.0, 2.0, 4.0, 8.0])
    out = layer_summary([10, 20, 40, 80], M + V, M, V)
    assert out["slope"] is None and out["intercept"] is None and out["r2"] is None
    assert out["slope_V_log10n"] is not None and out["slope_M_log10n"] == 0.0
    # constant counts: slopes against log10 n undefined
    out = layer_summary([10, 10, 10], [1.0, 2.0, 4.0], [0.5, 1.0, 3.0], [0.5, 1.0, 1.0])
    assert out["slope_Q_log10n"] is None and out["slope_M_log10n"] is None
    assert out["slope_V_log10n"] is None and out["slope"] is not None
    # constant V, varying M: slope 0, r2 undefined (no variance to explain)
    V = np.full(3, 0.5)
    M = np.array([1.0, 2.0, 4.0])
    out = layer_summary([10, 20, 40], M + V, M, V)
    assert out["slope"] == 0.0 and out["r2"] is None
    # Q all zero: cv undefined
    out = layer_summary([10, 20], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0])
    assert out["cv_Q"] is None


# The float mean of identical values need not equal them (mean([0.1]*3) = 0.1 + 1.4e-17),
# so "constant" must not be tested as sxx <= 0 after centring: these pin that.
@pytest.mark.parametrize("case", ["constant_M", "constant_n", "constant_V"])
def test_layer_summary_none_cases_inexact_mean(case):
    if case == "constant_M":
        M = np.full(3, 0.1)  # a naive sxx test gave slope 10.67, intercept 1.27, r2 0.0
        V = np.array([1.0, 2.0, 4.0])
        out = layer_summary([10, 20, 40], M + V, M, V)
        assert out["slope"] is None and out["intercept"] is None and out["r2"] is None
    elif case == "constant_n":
        M = np.array([0.5, 1.0, 3.0])  # a naive sxx test gave slope_Q_log10n = -1.33
        Q = np.array([1.0, 2.0, 4.0])
        out = layer_summary([6, 6, 6], Q, M, Q - M)
        assert out["slope_Q_log10n"] is None
    else:
        V = np.full(3, 0.7)  # a naive test gave r2 = -2.2e-16
        M = np.array([1.0, 2.0, 4.0])
        out = layer_summary([10, 20, 40], M + V, M, V)
        assert out["r2"] is None


# --------------------------------------------------------------------------- count buckets


def test_bucket_edges_cover_every_count_once():
    n = np.arange(1, 2_000_000, 997)
    b = bucket_index(n)
    assert b.min() == 0 and b.max() == len(BUCKET_EDGES) - 1
    lo = BUCKET_EDGES[b]
    hi = np.r_[BUCKET_EDGES[1:], np.iinfo(np.int64).max][b]
    assert np.all((lo <= n) & (n < hi))


@pytest.mark.parametrize("lo, hi, aligned", [
    (1, None, True), (2, None, True), (10, 100000, True), (10, None, True), (5, 100, True),
    (3, 3, False), (7, None, False), (10, 98, False), (10, 99, True), (1, 1, True),
])
def test_aligned_buckets_are_exactly_the_filter(lo, hi, aligned):
    got = aligned_buckets(lo, hi)
    assert (got is not None) == aligned
    if got is None:
        return
    n = np.arange(1, 300_000)
    keep = (n >= lo) & ((n <= hi) if hi is not None else True)
    assert np.array_equal(np.isin(bucket_index(n), got), keep)


@FAST
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 60), L=st.integers(1, 3),
       d=st.integers(1, 6), offset=OFFSETS, scale=SCALES)
def test_filtered_decomposition_from_bucket_sums_equals_two_pass(seed, k, L, d, offset, scale):
    """The bucket path (no per-type means read) agrees with the two-pass decomposition
    over the same kept types. Each value within its own scale: V_W relative to itself,
    M and V_B within the bound V_B_error states (``gamma (A + M)``, the cancellation of
    ``A - M``), Q and V within both. Not ``1e-9 Q``: on offset 100, scale 1e-3 data,
    V_B / Q ~ 1e-10 and such a tolerance passes any V_B."""
    rng = np.random.default_rng(seed)
    n = rng.integers(1, 3000, size=k)
    mean = offset + scale * rng.standard_normal((k, L, d))
    m2 = n[:, None] * scale**2 * rng.random((k, L)) * d
    buckets = bucket_index(n)
    types, count, vector = bucket_sums(buckets, n, mean, len(BUCKET_EDGES))
    assert types.sum() == k and count.sum() == n.sum()
    sel = aligned_buckets(10, None)
    keep = n >= 10
    assume(keep.any())
    for layer in range(L):
        ref = decomposition(n[keep], mean[keep, layer], m2[keep, layer])
        got = decomposition_from_sums(float(count[sel].sum()), vector[sel, layer].sum(axis=0),
                                      float(m2[keep, layer].sum()),
                                      float(n[keep] @ np.sum(mean[keep, layer] ** 2, axis=1)),
                                      int(types[sel].sum()), parts=len(sel))
        assert got["n"] == ref["n"] and got["num_types"] == ref["num_types"]
        err = got["V_B_error"] + ref["V_B_error"]
        assert abs(got["V_W"] - ref["V_W"]) <= 1e-14 * ref["V_W"]
        assert abs(got["V_B"] - ref["V_B"]) <= err
        assert abs(got["M"] - ref["M"]) <= err
        for key in ("Q", "V"):
            assert abs(got[key] - ref[key]) <= err + 1e-14 * ref[key], key


# ------------------------------------------------------- exact sums and V_B's error bound

def exact(x) -> Fraction:
    return Fraction(float(x))


def exact_between(n_t, mean_t) -> Fraction:
    """V_B over types, in exact rationals from the float64 inputs."""
    n = sum(int(c) for c in n_t)
    d = mean_t.shape[1]
    mu = [sum(int(c) * exact(m[i]) for c, m in zip(n_t, mean_t)) / n for i in range(d)]
    return sum(int(c) * sum((exact(m[i]) - mu[i]) ** 2 for i in range(d))
               for c, m in zip(n_t, mean_t)) / n


@FAST
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(1, 200), D=st.integers(1, 4),
       spread=st.integers(0, 40), cancel=st.booleans())
def test_compensated_sum_is_exact_to_u_squared(seed, m, D, spread, cancel):
    """``s + e`` is the exact sum (rationals) up to ``4 m (m + 2) u^2 max|x|``, over
    magnitudes spread across 1e40 and sums that cancel to 0; a plain sum is off by
    ~u max|x| there."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, D)) * 10.0 ** rng.integers(-spread // 2 - 1, spread // 2 + 1, (m, D))
    if cancel:
        x = np.concatenate([x, -x[rng.permutation(m)]])
    s, e = compensated_sum(x)
    rows = x.shape[0]
    for j in range(D):
        truth = sum(exact(v) for v in x[:, j])
        bound = 4 * rows * (rows + 2) * U**2 * float(np.abs(x[:, j]).max())
        assert abs(exact(s[j]) + exact(e[j]) - truth) <= Fraction(bound)


@FAST
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 400), offset=st.sampled_from([0.0, 1e3, 1e8]))
def test_running_sum_add_and_remove_has_no_drift(seed, steps, offset):
    """Add and later remove the same float64 terms through :func:`add_compensated`: the
    total always rounds the exact running sum (|total - exact| <= u |exact| + u^2 of the
    largest total seen), and returns to exactly the rounding of what is left."""
    rng = np.random.default_rng(seed)
    live: list[np.ndarray] = []
    total, comp = np.zeros(3), np.zeros(3)
    biggest = 0.0
    for _ in range(steps):
        if live and rng.random() < 0.45:
            out = live.pop(int(rng.integers(len(live))))
            total, comp = add_compensated(total, comp, *compensated_sum(-out[None]))
        else:
            term = offset + rng.standard_normal(3) * 10.0 ** rng.integers(-3, 4)
            live.append(term)
            total, comp = add_compensated(total, comp, *compensated_sum(term[None]))
        biggest = max(biggest, float(np.abs(total).max()))
    for j in range(3):
        truth = sum((exact(t[j]) for t in live), Fraction(0))
        assert abs(exact(total[j]) - truth) <= Fraction(U) * abs(truth) + Fraction(16 * steps * U * U * biggest)


@FAST
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 12), d=st.integers(1, 4),
       offset=st.sampled_from([0.0, 1.0, 1e3, 1e6]), spread=st.sampled_from([0.0, 1e-9, 1e-4, 1.0]))
def test_v_b_from_sums_is_unclamped_and_within_its_error_bound(seed, k, d, offset, spread):
    """V_B = A - M from sums, against the exact V_B (rationals): the error is within
    V_B_error whatever V_B / M (down to exactly 0, means all equal), and it is not
    clamped: its value is A - M as computed, negative when rounding makes it so, with a
    bound that says it is 0 within rounding."""
    rng = np.random.default_rng(seed)
    n = rng.integers(1, 1000, size=k)
    mean = offset + spread * rng.standard_normal((k, d))
    vector = np.einsum("k,kd->d", n.astype(float), mean)
    sum_nM = float(n @ np.einsum("kd,kd->k", mean, mean))
    got = decomposition_from_sums(float(n.sum()), vector, 0.0, sum_nM, k)
    truth = exact_between(n, mean)
    assert abs(exact(got["V_B"]) - truth) <= exact(got["V_B_error"])
    mu = vector / n.sum()
    assert got["V_B"] == sum_nM / n.sum() - float(mu @ mu)  # as computed, not clamped
    if spread == 0.0:
        assert truth == 0 and got["V_B_error"] >= abs(got["V_B"])


@FAST
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 12), d=st.integers(1, 4),
       offset=st.sampled_from([0.0, 1.0, 1e3, 1e6]), spread=st.sampled_from([0.0, 1e-9, 1e-4, 1.0]))
def test_two_pass_v_b_is_within_its_error_bound(seed, k, d, offset, spread):
    rng = np.random.default_rng(seed)
    n = rng.integers(1, 1000, size=k)
    mean = offset + spread * rng.standard_normal((k, d))
    got = decomposition(n, mean, np.zeros(k))
    assert abs(exact(got["V_B"]) - exact_between(n, mean)) <= exact(got["V_B_error"])


@FAST
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 120), d=st.integers(1, 4),
       k=st.integers(1, 8), offset=st.sampled_from([0.0, 1e2, 1e4]),
       spread=st.sampled_from([0.0, 1e-6, 1e-2, 1.0]))
def test_v_b_from_totals_is_within_its_error_bound(seed, n, d, k, offset, spread):
    """The unfiltered V_B = V - V_W, its two m2's built as the service builds them (Chan
    merges of parts of random sizes), against the exact V_B of the points (rationals)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, k, size=n)
    _, labels = np.unique(labels, return_inverse=True)
    types = labels.max() + 1
    x = offset + spread * rng.standard_normal((types, d))[labels] + rng.standard_normal((n, d))
    # layer moments and per-type moments, each merged from single points in a random order
    layer = (0.0, np.zeros(d), 0.0)
    per_type = [(0.0, np.zeros(d), 0.0) for _ in range(types)]
    for i in rng.permutation(n):
        one = (1.0, x[i], 0.0)
        layer = chan_merge(*layer, *one)[:3]
        per_type[labels[i]] = chan_merge(*per_type[labels[i]], *one)[:3]
    within = float(np.sum([p[2] for p in per_type]))
    got = decomposition_from_totals(float(n), layer[1], float(layer[2]), within, types)
    counts = np.bincount(labels)
    mean_t = [[sum(exact(v) for v in x[labels == t, i]) / int(counts[t]) for i in range(d)]
              for t in range(types)]
    mu = [sum(exact(v) for v in x[:, i]) / n for i in range(d)]
    truth = sum(int(counts[t]) * sum((mean_t[t][i] - mu[i]) ** 2 for i in range(d))
                for t in range(types)) / n
    assert abs(exact(got["V_B"]) - truth) <= exact(got["V_B_error"])
