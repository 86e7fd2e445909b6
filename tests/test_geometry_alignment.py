"""The cross-model alignment measures of embgeom.geometry.similarity (debiased CKA, mutual
k-NN, CKNNA) against independent computations: the unbiased HSIC formula evaluated
directly on n x n Gram matrices, scikit-learn's NearestNeighbors, and a dense transcription
of the authors' CKNNA; plus the bias that motivates the debiased estimator."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.neighbors import NearestNeighbors

from embgeom import geometry as geo


def _hsic1_direct(K: np.ndarray, L: np.ndarray) -> float:
    """Song et al. (2012), eq. 5, on dense Gram matrices (O(n^2) memory): the reference."""
    n = K.shape[0]
    Kt, Lt = K.copy(), L.copy()
    np.fill_diagonal(Kt, 0.0)
    np.fill_diagonal(Lt, 0.0)
    one = np.ones(n)
    return (np.trace(Kt @ Lt) + (one @ Kt @ one) * (one @ Lt @ one) / ((n - 1) * (n - 2))
            - 2.0 / (n - 2) * (one @ Kt @ Lt @ one)) / (n * (n - 3))


def _related(n=120, d_a=12, d_b=9, noise=0.5, seed=0):
    rng = np.random.default_rng(seed)
    Z = rng.standard_normal((n, 6))
    A = Z @ rng.standard_normal((6, d_a)) + noise * rng.standard_normal((n, d_a)) + 3.0
    B = Z @ rng.standard_normal((6, d_b)) + noise * rng.standard_normal((n, d_b)) - 1.0
    return A, B


@pytest.mark.parametrize("n", [5, 17, 60])
def test_unbiased_cka_equals_the_direct_unbiased_hsic_formula(n):
    A, B = _related(n)
    K, L = A @ A.T, B @ B.T
    expected = _hsic1_direct(K, L) / np.sqrt(_hsic1_direct(K, K) * _hsic1_direct(L, L))
    # Both are float64 sums of O(n^2) terms of order ||A||^4 / n^2: agreement to 1e-9
    # relative leaves room for the different summation orders only.
    assert geo.unbiased_cka(A, B) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_biased_cka_near_one_and_unbiased_near_zero_for_random_n_much_smaller_than_d():
    rng = np.random.default_rng(3)
    n, d = 24, 2000
    biased, unbiased = [], []
    for _ in range(20):
        A, B = rng.standard_normal((n, d)), rng.standard_normal((n, d))
        biased.append(geo.linear_cka(A, B))
        unbiased.append(geo.unbiased_cka(A, B))
    # Independent Gaussians: both Gram matrices are ~ d I after centring, so the biased
    # CKA tends to 1 (Murphy et al. 2024); the debiased one has mean 0 and a standard
    # deviation of about sqrt(2) / n = 0.06 per draw: the mean of 20 draws within 4
    # standard errors (0.055), every draw within 4 standard deviations.
    assert min(biased) > 0.9
    assert abs(np.mean(unbiased)) < 0.055
    assert max(abs(u) for u in unbiased) < 0.25


def test_unbiased_cka_of_a_space_with_itself_and_a_similarity_transform_is_one():
    A, _ = _related(80)
    rng = np.random.default_rng(1)
    R = np.linalg.qr(rng.standard_normal((12, 12)))[0]
    assert geo.unbiased_cka(A, A) == pytest.approx(1.0, abs=1e-12)
    assert geo.unbiased_cka(A, 7.0 * A @ R - 2.0) == pytest.approx(1.0, abs=1e-10)
    assert np.isnan(geo.unbiased_cka(np.ones((10, 3)), A[:10]))
    with pytest.raises(ValueError):
        geo.unbiased_cka(A[:3], A[:3])


@pytest.mark.parametrize("k", [1, 5, 20])
def test_mutual_knn_equals_scikit_learn_neighbours(k):
    A, B = _related(150)
    Ua = A / np.linalg.norm(A, axis=1, keepdims=True)
    Ub = B / np.linalg.norm(B, axis=1, keepdims=True)
    # scikit-learn: k + 1 neighbours of each unit row (cosine order), the row itself first.
    ia = NearestNeighbors(n_neighbors=k + 1).fit(Ua).kneighbors(Ua, return_distance=False)[:, 1:]
    ib = NearestNeighbors(n_neighbors=k + 1).fit(Ub).kneighbors(Ub, return_distance=False)[:, 1:]
    expected = np.mean([len(set(ia[i]) & set(ib[i])) / k for i in range(A.shape[0])])
    assert geo.mutual_knn(A, B, k) == pytest.approx(expected, abs=1e-15)
    assert geo.mutual_knn(A, A, k) == 1.0


def _cknna_dense(A, B, k):
    """The authors' formula (platonic-rep metrics.cknna, unbiased=True) on dense n x n masks."""
    Ua = A / np.linalg.norm(A, axis=1, keepdims=True)
    Ub = B / np.linalg.norm(B, axis=1, keepdims=True)
    K, L = Ua @ Ua.T, Ub @ Ub.T
    n = K.shape[0]

    def mask(G):
        H = G.copy()
        np.fill_diagonal(H, -np.inf)
        top = np.argsort(-H, axis=1, kind="stable")[:, :k]
        M = np.zeros((n, n))
        M[np.arange(n)[:, None], top] = 1.0
        return M

    def hsic(Kt, Lt):  # torch.sum(K * L.T) etc., diagonals already 0
        return (np.sum(Kt * Lt.T) + Kt.sum() * Lt.sum() / ((n - 1) * (n - 2))
                - 2.0 * np.sum(Kt @ Lt) / (n - 2)) / (n * (n - 3))

    Ma, Mb = mask(K), mask(L)
    M = Ma * Mb
    return hsic(M * K, M * L) / np.sqrt(hsic(Ma * K, Ma * K) * hsic(Mb * L, Mb * L))


@pytest.mark.parametrize("k", [3, 10])
def test_cknna_equals_a_dense_transcription_of_the_authors_formula(k):
    A, B = _related(90, noise=0.8)
    assert geo.cknna(A, B, k) == pytest.approx(_cknna_dense(A, B, k), rel=1e-9)
    assert geo.cknna(A, A, k) == pytest.approx(1.0, abs=1e-12)


def test_global_similarity_reports_each_new_measure_beside_its_shuffled_baseline():
    A, B = _related(400, noise=0.3)
    g = geo.global_similarity(A, B, seed=2, k=10)
    assert g["k"] == 10
    # the answers equal the standalone functions
    assert g["unbiased_cka"] == pytest.approx(geo.unbiased_cka(A, B), abs=1e-12)
    assert g["mutual_knn"] == geo.mutual_knn(A, B, 10)
    assert g["cknna"] == pytest.approx(geo.cknna(A, B, 10), abs=1e-12)
    # the baseline is the same measure on b's rows permuted (its neighbours relabelled,
    # not searched again: the same numbers as a fresh search)
    perm = np.random.default_rng([2, 1]).permutation(400)
    base = g["baseline"]
    assert base["unbiased_cka"] == pytest.approx(geo.unbiased_cka(A, B[perm]), abs=1e-12)
    assert base["mutual_knn"] == geo.mutual_knn(A, B[perm], 10)
    assert base["cknna"] == pytest.approx(geo.cknna(A, B[perm], 10), abs=1e-12)
    # related spaces score well above chance; the shuffled pairing near chance: mutual
    # k-NN about k / (n - 1) = 0.025, the others about 0 (standard error ~ 1 / n)
    for name in ("unbiased_cka", "mutual_knn", "cknna"):
        assert g[name] > base[name] + 0.2, name
    assert base["mutual_knn"] < 0.06
    assert abs(base["unbiased_cka"]) < 0.05 and abs(base["cknna"]) < 0.1
