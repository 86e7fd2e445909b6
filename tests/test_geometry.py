"""Tests for embgeom.geometry: known answers, invariances and peers.

Known answers: a space against a rotation (and a scaling, and a rotation into a wider
zero-padded space) of itself scores perfectly; unrelated spaces score what sampling theory
says; points on a known d-dimensional linear subspace have intrinsic dimension d; a known
linear map is recovered. Peers that do not share our code path: numpy.corrcoef on the dense
cosine matrices, the HSIC form of CKA on k x k Gram matrices, scipy's orthogonal
Procrustes on explicitly padded matrices, scikit-learn's NearestNeighbors, Ridge and
r2_score, a per-point KKT solve of the LLE weights, and scikit-dimension's TwoNN, MLE and
lPCA estimators.

Tolerances: float64 identities hold to about d * eps ~ 1e-14; we assert 1e-10. Statistical
bounds are stated with the standard error they come from.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import skdim  # the peer for intrinsic dimension: scikit-dimension==0.5.0, a test dependency
from sklearn.linear_model import Ridge
from sklearn.metrics import r2_score
from sklearn.neighbors import NearestNeighbors

from embgeom import geometry as geo


def _rotation(rng, d):
    q, r = np.linalg.qr(rng.normal(size=(d, d)))
    return q * np.sign(np.diag(r))


def _subspace_points(rng, n, d, ambient=30, offset=3.0, gaussian=False):
    """n points uniform in a unit d-cube (or standard normal) on a random d-dim affine subspace."""
    basis, _ = np.linalg.qr(rng.normal(size=(ambient, d)))
    coords = rng.normal(size=(n, d)) if gaussian else rng.uniform(size=(n, d))
    return coords @ basis.T + offset * rng.normal(size=ambient)


def _swiss_roll(rng, n, noise=0.05):
    t = 1.5 * np.pi * (1 + 2 * rng.uniform(size=n))
    h = 21 * rng.uniform(size=n)
    points = np.c_[t * np.cos(t), h, t * np.sin(t)]
    return points + noise * rng.normal(size=points.shape)


def _upper(C):
    return C[np.triu_indices(C.shape[0], 1)]


# ------------------------------------------------------------------------ global similarity


def _rotated(rng, A):
    return A @ _rotation(rng, A.shape[1])


def _rotated_scaled(rng, A):
    return 3.7 * A @ _rotation(rng, A.shape[1])


def _rotated_into_wider(rng, A):
    padded = np.c_[A, np.zeros((A.shape[0], 9))]
    return padded @ _rotation(rng, padded.shape[1])


@pytest.mark.parametrize("transform", [_rotated, _rotated_scaled, _rotated_into_wider])
def test_rotation_of_a_space_scores_perfectly(transform):
    rng = np.random.default_rng(0)
    A = rng.normal(size=(300, 16)) * np.linspace(0.2, 3.0, 16)  # anisotropic on purpose
    B = transform(rng, A)
    result = geo.global_similarity(A, B)
    assert result["pearson_cosine"] == pytest.approx(1.0, abs=1e-10)
    assert result["cka_linear"] == pytest.approx(1.0, abs=1e-10)
    assert result["procrustes_residual"] == pytest.approx(0.0, abs=1e-10)
    # the same numbers from the individual functions, in either order of the spaces
    assert geo.pearson_cosine(B, A) == pytest.approx(1.0, abs=1e-10)
    assert geo.linear_cka(B, A) == pytest.approx(1.0, abs=1e-10)
    assert geo.procrustes_residual(B, A) == pytest.approx(0.0, abs=1e-10)


def test_translation_changes_cosines_but_not_cka_or_procrustes():
    rng = np.random.default_rng(1)
    A = rng.normal(size=(200, 8))
    B = A @ _rotation(rng, 8) + 5.0 * rng.normal(size=8)
    assert geo.linear_cka(A, B) == pytest.approx(1.0, abs=1e-10)
    assert geo.procrustes_residual(A, B) == pytest.approx(0.0, abs=1e-10)
    # cosines are taken about the origin: a translation is a real change for them
    assert geo.pearson_cosine(A, B) < 0.9


def test_unrelated_spaces_score_what_sampling_theory_says():
    rng = np.random.default_rng(2)
    k, d_a, d_b = 400, 10, 14
    A = rng.normal(size=(k, d_a))
    B = rng.normal(size=(k, d_b))
    pairs = k * (k - 1) / 2
    # Independent isotropic spaces: distinct pairs' cosines are uncorrelated, so r has
    # standard error 1 / sqrt(pairs) = 0.0035; five of them.
    assert abs(geo.pearson_cosine(A, B)) < 5 / np.sqrt(pairs)
    # CKA is not 0 but about sqrt(d_a d_b) / k (= 0.03 here): the numerator is a sum of
    # d_a d_b squared Gaussians, relative standard deviation sqrt(2 / (d_a d_b)) = 0.12.
    expected = np.sqrt(d_a * d_b) / k
    assert 0.5 * expected < geo.linear_cka(A, B) < 1.5 * expected
    # ||A_n^T B_n||_F is about 1 / sqrt(k), so the nuclear norm is at most about
    # sqrt(min d / k) (Cauchy-Schwarz over min d singular values): residual >= 2 - 2 * that.
    bound = 2 - 3 * np.sqrt(min(d_a, d_b) / k)
    assert geo.procrustes_residual(A, B) > bound


def test_shuffled_baseline_is_near_zero_for_related_spaces():
    rng = np.random.default_rng(3)
    k, d = 400, 12
    A = rng.normal(size=(k, d))
    B = 2.0 * A @ _rotation(rng, d)
    result = geo.global_similarity(A, B, seed=7)
    baseline = result["baseline"]
    assert result["pearson_cosine"] == pytest.approx(1.0, abs=1e-10)
    assert abs(baseline["pearson_cosine"]) < 5 / np.sqrt(k * (k - 1) / 2)
    assert baseline["cka_linear"] < 2 * d / k
    assert baseline["procrustes_residual"] > 2 - 3 * np.sqrt(d / k)
    assert result["rows"] == k and result["pairs"] == k * (k - 1) // 2
    # the baseline is seeded: the same seed gives the same numbers, another seed others
    assert geo.global_similarity(A, B, seed=7) == result
    assert geo.global_similarity(A, B, seed=8)["baseline"] != baseline


@pytest.mark.parametrize("block_rows", [1, 2, 7, 64, None])
def test_blocked_pearson_equals_dense_corrcoef(block_rows):
    # A large common offset puts every cosine near 1 with a small spread: raw sums over
    # pairs would cancel there; the Chan-merged blocks must not.
    rng = np.random.default_rng(4)
    A = rng.normal(size=(57, 6)) + 8.0
    B = A @ rng.normal(size=(6, 9)) + rng.normal(size=(57, 9))
    expected = np.corrcoef(_upper(geo.cosine_matrix(A)), _upper(geo.cosine_matrix(B)))[0, 1]
    ua, ub = A / np.linalg.norm(A, axis=1)[:, None], B / np.linalg.norm(B, axis=1)[:, None]
    assert geo.similarity._pearson_offdiag(ua, ub, block_rows) == pytest.approx(expected, abs=1e-10)


def test_pearson_sample_is_seeded_and_bounded():
    rng = np.random.default_rng(5)
    A = rng.normal(size=(300, 5))
    B = A + 0.5 * rng.normal(size=(300, 5))
    full = geo.pearson_cosine(A, B)
    assert geo.pearson_cosine(A, B, sample=300) == full  # a sample of every row is all rows
    assert geo.pearson_cosine(A, B, sample=1000) == full
    s1 = geo.pearson_cosine(A, B, sample=100, seed=1)
    assert geo.pearson_cosine(A, B, sample=100, seed=1) == s1
    assert geo.pearson_cosine(A, B, sample=100, seed=2) != s1
    # the sampled value is the full computation on 100 rows
    rows = geo.similarity._sample_rows(300, 100, 1)
    assert rows.size == 100 and np.unique(rows).size == 100
    assert s1 == pytest.approx(geo.pearson_cosine(A[rows], B[rows]), abs=1e-12)
    # more rows than the cap need a sample; the dense matrix is refused outright
    big = np.ones((geo.MAX_COSINE_ROWS + 1, 2))
    with pytest.raises(ValueError, match="sample"):
        geo.pearson_cosine(big, big)
    with pytest.raises(ValueError, match="refused"):
        geo.cosine_matrix(big)
    noisy = rng.normal(size=big.shape)
    assert geo.pearson_cosine(noisy, noisy, sample=50) == pytest.approx(1.0, abs=1e-12)


def test_cka_equals_hsic_form_on_gram_matrices():
    rng = np.random.default_rng(6)
    k = 80
    A = rng.normal(size=(k, 7)) + 3.0
    B = np.tanh(A @ rng.normal(size=(7, 11))) + rng.normal(size=(k, 11))
    H = np.eye(k) - 1.0 / k
    K, L = H @ A @ A.T @ H, H @ B @ B.T @ H
    expected = np.sum(K * L) / (np.linalg.norm(K) * np.linalg.norm(L))
    assert geo.linear_cka(A, B) == pytest.approx(expected, abs=1e-12)
    assert 0.05 < expected < 0.95  # a non-trivial case


def test_procrustes_matches_scipy_on_padded_matrices():
    rng = np.random.default_rng(7)
    k = 90
    A = rng.normal(size=(k, 5)) * [3, 2, 1, 0.5, 0.1] + 1.0
    B = np.c_[A @ rng.normal(size=(5, 5)), rng.normal(size=(k, 3))] + 2.0
    An = (A - A.mean(0)) / np.linalg.norm(A - A.mean(0))
    Bn = (B - B.mean(0)) / np.linalg.norm(B - B.mean(0))
    An = np.c_[An, np.zeros((k, 3))]  # zero-pad the narrower one to width 8
    R, _ = scipy.linalg.orthogonal_procrustes(An, Bn)
    expected = np.linalg.norm(An @ R - Bn) ** 2
    assert geo.procrustes_residual(A, B) == pytest.approx(expected, abs=1e-12)
    assert geo.procrustes_residual(B, A) == pytest.approx(expected, abs=1e-12)
    assert 0.05 < expected < 2


def test_no_spread_is_nan_not_an_error():
    A = np.ones((10, 3))
    B = np.random.default_rng(8).normal(size=(10, 3))
    assert np.isnan(geo.linear_cka(A, B))
    assert np.isnan(geo.procrustes_residual(A, B))
    assert np.isnan(geo.pearson_cosine(A, B))  # every cosine of A is 1


# ----------------------------------------------------------------------------- neighbours


def test_nearest_neighbors_match_sklearn_and_exclude_self():
    rng = np.random.default_rng(9)
    X = rng.normal(size=(150, 6)) * 0.01 + 100.0  # close points far from the origin
    X[17] = X[3]  # a duplicate: neighbours at distance 0, yet never the row itself
    idx, dist = geo.nearest_neighbors(X, 5)
    ref_dist, ref_idx = NearestNeighbors(n_neighbors=5).fit(X).kneighbors()
    np.testing.assert_allclose(dist, ref_dist, rtol=1e-9, atol=1e-12)
    assert np.array_equal(np.sort(idx, axis=1), np.sort(ref_idx, axis=1))
    assert idx.dtype == np.int64 and idx.shape == (150, 5)
    assert not np.any(idx == np.arange(150)[:, None])
    assert idx[3, 0] == 17 and idx[17, 0] == 3 and dist[3, 0] == 0.0


# ----------------------------------------------------------------------------------- LLE


def test_lle_weights_sum_to_one_and_solve_the_constrained_problem():
    rng = np.random.default_rng(10)
    X = rng.normal(size=(60, 5))
    reg, k = 1e-3, 8
    idx, W = geo.lle_weights(X, k, reg)
    np.testing.assert_allclose(W.sum(axis=1), 1.0, atol=1e-12)
    # independent path: the KKT system of min ||x_i - Z^T w||^2 + R ||w||^2, sum w = 1
    for i in range(0, 60, 7):
        Z = X[idx[i]] - X[i]
        G = Z @ Z.T
        R = reg * np.trace(G)
        kkt = np.zeros((k + 1, k + 1))
        kkt[:k, :k] = 2 * (G + R * np.eye(k))
        kkt[:k, k] = kkt[k, :k] = 1.0
        w = np.linalg.solve(kkt, np.r_[np.zeros(k), 1.0])[:k]
        np.testing.assert_allclose(W[i], w, rtol=1e-8, atol=1e-10)


def test_lle_weights_match_sklearn_barycenter_weights():
    try:  # a private scikit-learn function; its absence is not our bug
        from sklearn.manifold._locally_linear import barycenter_weights
    except ImportError:
        pytest.skip("sklearn.manifold._locally_linear.barycenter_weights is gone")
    rng = np.random.default_rng(11)
    X = rng.normal(size=(80, 4))
    idx, W = geo.lle_weights(X, 6, reg=1e-2)
    np.testing.assert_allclose(W, barycenter_weights(X, X, idx, reg=1e-2), rtol=1e-8, atol=1e-10)


def test_lle_reconstructs_points_of_a_linear_subspace_exactly():
    rng = np.random.default_rng(12)
    X = _subspace_points(rng, 200, 2, ambient=10)
    # k = 6 > 2 + 1: the Gram matrices are singular and need reg; with reg = 1e-8 the
    # regularisation's bias on the error is of order reg^2 (measured 1e-16).
    idx, W = geo.lle_weights(X, 6, reg=1e-8)
    assert geo.reconstruction_error(X, idx, W) < 1e-10
    np.testing.assert_allclose(W.sum(axis=1), 1.0, atol=1e-12)


def test_lle_transfer_across_a_rotation_equals_own_error_and_beats_random():
    rng = np.random.default_rng(13)
    n = 500
    A = np.c_[_swiss_roll(rng, n), np.zeros((n, 7))] @ _rotation(rng, 10)
    B = 2.5 * np.c_[A, np.zeros((n, 2))] @ _rotation(rng, 12) + 7.0
    result = geo.lle_transfer(A, B, k=10, seed=3)
    # LLE weights are invariant to rotation, scaling and translation: A's weights are B's
    assert result["transfer_error"] == pytest.approx(result["own_error"], rel=1e-9)
    assert result["own_neighbors_error"] == pytest.approx(result["own_error"], rel=1e-9)
    assert result["transfer_over_own"] == pytest.approx(1.0, abs=1e-9)
    assert result["neighbor_overlap"] == 1.0
    # on a curved 2-D manifold, random convex weights miss the local plane (measured 0.002)
    assert result["transfer_over_random"] < 0.05
    assert result["own_error"] < 1e-3
    assert result["k"] == 10 and result["reg"] == 1e-3


def test_lle_transfer_to_an_unrelated_space_is_no_better_than_random():
    rng = np.random.default_rng(14)
    A = _swiss_roll(rng, 400)
    B = _swiss_roll(rng, 400)  # same manifold, rows not matched
    result = geo.lle_transfer(A, B, k=8, seed=0)
    assert result["transfer_over_own"] > 100
    assert 0.5 < result["transfer_over_random"] < 2.0
    assert result["neighbor_overlap"] < 0.1


# ---------------------------------------------------------------------- intrinsic dimension


@pytest.mark.parametrize("d", [2, 5])
def test_local_pca_recovers_subspace_dimension_at_every_point(d):
    rng = np.random.default_rng(20 + d)
    X = _subspace_points(rng, 600, d)
    # Beyond d the eigenvalues are roundoff (1e-30 relative), so no threshold below 1 can
    # count them. The smallest of d sample eigenvalues of 30 neighbours holds far more
    # than 0.1 % of the variance (Marchenko-Pastur lower edge (1 - sqrt(d/30))^2 / d,
    # 5 % for d = 5), so a 0.999 threshold needs all d.
    exact = geo.local_pca_dimension(X, 30, threshold=0.999)
    assert exact.dtype == np.int64 and exact.shape == (600,)
    assert np.all(exact == d)
    assert np.all(geo.local_pca_dimension(X, 30, threshold=0.9) <= d)


@pytest.mark.parametrize("threshold", [0.8, 0.95])
def test_local_pca_matches_skdim_pointwise(threshold):
    rng = np.random.default_rng(22)
    X = _swiss_roll(rng, 150, noise=0.3) @ rng.normal(size=(3, 8))
    X += 0.2 * rng.normal(size=(150, 8))
    ours = geo.local_pca_dimension(X, 15, threshold=threshold)
    peer = skdim.id.lPCA(ver="ratio", alphaRatio=threshold, verbose=False)
    theirs = peer.fit_pw(X, n_neighbors=15).dimension_pw_
    assert np.array_equal(ours, theirs)
    assert len(np.unique(ours)) > 1  # a case where the answer varies by point


@pytest.mark.parametrize("d", [2, 5])
def test_twonn_and_mle_recover_subspace_dimension(d):
    rng = np.random.default_rng(30 + d)
    n = 2000
    X = _subspace_points(rng, n, d)
    # TwoNN: standard error about d / sqrt(n) (2 %); points near the faces of the cube see
    # fewer neighbours and bias it down (measured -2 to -8 % for d = 5). Allow 10 % + 4 SE.
    tolerance = 0.1 * d + 4 * d / np.sqrt(n)
    assert abs(geo.twonn_dimension(X) - d) < tolerance
    assert abs(geo.twonn_dimension(X, "linear", 0.1) - d) < tolerance
    assert abs(np.nanmean(geo.twonn_local_dimension(X, 50)) - d) < tolerance
    # Levina-Bickel with k = 20 looks farther than TwoNN, so the faces bias it more (about
    # -10 % for d = 5); without faces (Gaussian coordinates) it is within 5 %.
    mle = geo.mle_dimension(X, 20)
    assert 0.85 * d < mle.dimension < 1.05 * d
    assert mle.per_point.shape == (n,)
    gaussian = geo.mle_dimension(_subspace_points(rng, n, d, gaussian=True), 20)
    assert gaussian.dimension == pytest.approx(d, rel=0.05)


# skdim also returns the fit's coordinates, -log(1 - F), infinite at F = 1 when nothing is
# discarded; that warning is about them, not about the dimension we compare.
_SKDIM_LOG0 = pytest.mark.filterwarnings("ignore:divide by zero encountered in log")


@_SKDIM_LOG0
@pytest.mark.parametrize(
    "ambient,method,discard",
    [(10, "mle", 0.0), (10, "mle", 0.1), (10, "linear", 0.1), (30, "linear", 0.2), (30, "mle", 0.0)],
)
def test_twonn_matches_skdim(ambient, method, discard):
    # skdim takes the neighbours from a tree below 26 features, from dense distances above
    rng = np.random.default_rng(40)
    X = _subspace_points(rng, 500, 4, ambient=ambient) + 0.01 * rng.normal(size=(500, ambient))
    peer = skdim.id.TwoNN(discard_fraction=discard, method=method).fit(X).dimension_
    assert geo.twonn_dimension(X, method, discard) == pytest.approx(peer, rel=1e-9)


@_SKDIM_LOG0
@pytest.mark.parametrize("method,discard", [("mle", 0.0), ("linear", 0.1)])
def test_twonn_local_cloud_matches_skdim_pointwise(method, discard):
    rng = np.random.default_rng(41)
    X = _subspace_points(rng, 120, 3, ambient=6) + 0.05 * rng.normal(size=(120, 6))
    ours = geo.twonn_local_dimension(X, 20, method, discard, neighborhood="cloud")
    peer = skdim.id.TwoNN(discard_fraction=discard, method=method)
    theirs = peer.fit_pw(X, n_neighbors=20).dimension_pw_
    np.testing.assert_allclose(ours, theirs, rtol=1e-9)


def test_twonn_local_pooled_is_twonn_over_the_neighbourhood_ratios():
    rng = np.random.default_rng(42)
    X = _subspace_points(rng, 200, 3, ambient=8)
    k = 12
    ours = geo.twonn_local_dimension(X, k)
    idx, dist = geo.nearest_neighbors(X, k)
    log_mu = np.log(dist[:, 1] / dist[:, 0])
    for i in range(0, 200, 13):
        pooled = np.r_[log_mu[i], log_mu[idx[i]]]
        assert ours[i] == pytest.approx((pooled.size - 1) / pooled.sum(), rel=1e-12)


def test_twonn_drops_duplicates_and_linear_skips_the_infinite_point():
    rng = np.random.default_rng(43)
    X = _subspace_points(rng, 300, 2, ambient=5)
    with_duplicate = np.r_[X, X[:1]]
    # the duplicated point and its copy have r1 = 0: dropped, the rest is unchanged
    _, dist = geo.nearest_neighbors(with_duplicate, 2)
    assert np.sum(dist[:, 0] == 0) == 2
    assert np.isfinite(geo.twonn_dimension(with_duplicate))
    # linear with nothing discarded: the largest ratio (F = 1) is left out of the fit
    idx, dist = geo.nearest_neighbors(X, 2)
    x = np.sort(np.log(dist[:, 1] / dist[:, 0]))[:-1]
    y = -np.log(1 - np.arange(1, 300) / 300)
    assert geo.twonn_dimension(X, "linear", 0.0) == pytest.approx(x @ y / (x @ x), rel=1e-12)


def test_mle_matches_skdim():
    rng = np.random.default_rng(44)
    X = _subspace_points(rng, 300, 4, ambient=12) + 0.01 * rng.normal(size=(300, 12))
    ours = geo.mle_dimension(X, 15)
    peer = skdim.id.MLE().fit(X, n_neighbors=15)
    np.testing.assert_allclose(ours.per_point, peer.dimension_pw_, rtol=1e-9)
    assert ours.dimension == pytest.approx(peer.dimension_, rel=1e-9)
    unbiased = geo.mle_dimension(X, 15, unbiased=True)
    peer_unbiased = skdim.id.MLE(unbiased=True).fit(X, n_neighbors=15)
    np.testing.assert_allclose(unbiased.per_point, peer_unbiased.dimension_pw_, rtol=1e-9)


def test_intrinsic_dimension_dispatches():
    rng = np.random.default_rng(45)
    X = _subspace_points(rng, 150, 3, ambient=7)
    pca = geo.intrinsic_dimension(X, "local_pca", k=10, threshold=0.95)
    assert np.array_equal(pca.per_point, geo.local_pca_dimension(X, 10, 0.95))
    assert pca.dimension == pytest.approx(pca.per_point.mean())
    twonn = geo.intrinsic_dimension(X, "twonn", k=10)
    np.testing.assert_array_equal(twonn.per_point, geo.twonn_local_dimension(X, 10))
    assert twonn.dimension == geo.twonn_dimension(X)
    mle = geo.intrinsic_dimension(X, "mle", k=10)
    assert mle.dimension == geo.mle_dimension(X, 10).dimension


# ------------------------------------------------------------------------------- Emb2Emb


def test_fit_linear_map_recovers_a_known_map():
    rng = np.random.default_rng(50)
    k, d_a, d_b = 400, 12, 200
    A = rng.normal(size=(k, d_a)) + 2.0
    W_true = rng.normal(size=(d_a, d_b))
    c_true = rng.normal(size=d_b)
    B = A @ W_true + c_true
    fit = geo.fit_linear_map(A, B, ridge=1e-10, held_out=0.2, seed=0)
    # noiseless and well conditioned: the ridge bias is about 1e-10 / k relative
    assert np.max(np.abs(fit.weight - W_true)) < 1e-6
    assert np.max(np.abs(fit.bias - c_true)) < 1e-6
    assert fit.r2 > 0.999 and fit.mean_cosine > 0.999
    assert fit.held_out_rows.size == 80 and fit.n_train == 320
    assert np.unique(fit.held_out_rows).size == 80

    # a steering vector (difference of group means) maps through W alone
    pos, neg = rng.choice(k, 30, replace=False), rng.choice(k, 30, replace=False)
    v_a = A[pos].mean(0) - A[neg].mean(0)
    v_b = B[pos].mean(0) - B[neg].mean(0)
    np.testing.assert_allclose(geo.transfer_vector(fit.weight, v_a), v_b, atol=1e-6)
    np.testing.assert_allclose(
        geo.transfer_vector(fit.weight, np.stack([v_a, 2 * v_a])), np.stack([v_b, 2 * v_b]),
        atol=1e-6,
    )
    # a random map of the same shape and norm: cos ~ N(0, 1 / d_b), sd 0.07; five sd
    random = geo.random_map_like(fit.weight, seed=1)
    assert random.shape == fit.weight.shape
    assert np.linalg.norm(random) == pytest.approx(np.linalg.norm(fit.weight))
    mapped = geo.transfer_vector(random, v_a)
    cos = mapped @ v_b / (np.linalg.norm(mapped) * np.linalg.norm(v_b))
    assert abs(cos) < 5 / np.sqrt(d_b)


def test_bias_drops_out_of_a_transferred_difference():
    rng = np.random.default_rng(51)
    A = rng.normal(size=(100, 6)) + 1.0
    B = np.tanh(A @ rng.normal(size=(6, 9))) + 4.0  # not linear: the map is only a fit
    fit = geo.fit_linear_map(A, B, ridge=0.5)
    p, q = A[:10].mean(0), A[10:40].mean(0)
    f = lambda a: a @ fit.weight + fit.bias  # noqa: E731
    np.testing.assert_allclose(geo.transfer_vector(fit.weight, p - q), f(p) - f(q), atol=1e-12)


def test_ridge_and_held_out_r2_match_sklearn():
    rng = np.random.default_rng(52)
    k = 150
    A = rng.normal(size=(k, 8)) * 3 + 1
    B = A @ rng.normal(size=(8, 5)) + rng.normal(size=(k, 5)) * 2
    fit = geo.fit_linear_map(A, B, ridge=3.0, held_out=0.3, seed=4)
    test = fit.held_out_rows
    train = np.setdiff1d(np.arange(k), test)
    ref = Ridge(alpha=3.0).fit(A[train], B[train])
    np.testing.assert_allclose(fit.weight, ref.coef_.T, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(fit.bias, ref.intercept_, rtol=1e-9, atol=1e-12)
    pred = ref.predict(A[test])
    r2 = r2_score(B[test], pred, multioutput="variance_weighted")
    assert fit.r2 == pytest.approx(r2, abs=1e-10)
    norms = np.linalg.norm(pred, axis=1) * np.linalg.norm(B[test], axis=1)
    cos = np.sum(pred * B[test], 1) / norms
    assert fit.mean_cosine == pytest.approx(cos.mean(), abs=1e-10)
    assert 0.5 < fit.r2 < 0.999  # a noisy, non-trivial fit
    # no held-out rows: the map is fitted on everything and the fit is not reported
    whole = geo.fit_linear_map(A, B, ridge=3.0, held_out=0.0)
    assert np.isnan(whole.r2) and np.isnan(whole.mean_cosine) and whole.n_train == k


# ----------------------------------------------------------------------------- validation

_X = np.random.default_rng(60).normal(size=(20, 4))
_Y = np.random.default_rng(61).normal(size=(20, 3))


@pytest.mark.parametrize(
    "call",
    [
        lambda: geo.pearson_cosine(_X, _Y[:19]),  # rows not matched
        lambda: geo.pearson_cosine(_X[0], _Y[0]),  # 1-D
        lambda: geo.pearson_cosine(np.where(_X > 1, np.nan, _X), _Y),  # nan
        lambda: geo.pearson_cosine(np.r_[_X[:19], np.zeros((1, 4))], _Y),  # zero row
        lambda: geo.pearson_cosine(_X, _Y, sample=2),
        lambda: geo.pearson_cosine(_X, _Y, sample=5.5),
        lambda: geo.pearson_cosine(_X, _Y, seed=-1),
        lambda: geo.pearson_cosine(_X[:2], _Y[:2]),  # too few rows
        lambda: geo.linear_cka([["a", "b"]], [["c", "d"]]),
        lambda: geo.linear_cka(np.inf * _X, _Y),
        lambda: geo.procrustes_residual(_X, np.empty((20, 0))),
        lambda: geo.global_similarity(_X, _Y, sample="all"),
        lambda: geo.nearest_neighbors(_X, 20),  # k = n
        lambda: geo.nearest_neighbors(_X, 0),
        lambda: geo.nearest_neighbors(_X, True),
        lambda: geo.lle_weights(_X, 3, reg=-1e-3),
        lambda: geo.lle_weights(_X, 3, reg=float("nan")),
        lambda: geo.lle_transfer(_X, _Y, k=20),
        lambda: geo.reconstruction_error(_X, np.full((20, 3), 20), np.ones((20, 3)) / 3),
        lambda: geo.reconstruction_error(_X, np.zeros((20, 3)), np.ones((20, 2))),
        lambda: geo.local_pca_dimension(_X, 1),
        lambda: geo.local_pca_dimension(_X, 5, threshold=1.0),
        lambda: geo.local_pca_dimension(_X, 5, threshold=0.0),
        lambda: geo.twonn_dimension(_X, method="ols"),
        lambda: geo.twonn_dimension(_X, discard_fraction=1.0),
        lambda: geo.twonn_dimension(_X[:2]),
        lambda: geo.twonn_local_dimension(_X, 2),
        lambda: geo.twonn_local_dimension(_X, 5, neighborhood="ball"),
        lambda: geo.mle_dimension(_X, 20),
        lambda: geo.mle_dimension(_X, 5, unbiased="yes"),
        lambda: geo.intrinsic_dimension(_X, method="pca"),
        lambda: geo.fit_linear_map(_X, _Y, ridge=-1.0),
        lambda: geo.fit_linear_map(_X, _Y, held_out=1.0),
        lambda: geo.fit_linear_map(_X, _Y, held_out=0.95),  # one training row
        lambda: geo.fit_linear_map(_X[:4], _Y[:4], ridge=0.0, held_out=0.0),  # k <= d_a
        lambda: geo.transfer_vector(np.ones((4, 3)), np.ones(5)),
        lambda: geo.transfer_vector(np.ones((4, 3)), np.ones((2, 2, 4))),
        lambda: geo.transfer_vector(np.ones((4, 3)), [np.nan, 0, 0, 0]),
        lambda: geo.random_map_like(np.ones(3)),
    ],
)
def test_invalid_input_raises_value_error(call):
    with pytest.raises(ValueError):
        call()
