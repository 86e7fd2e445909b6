"""Steering maps (Emb2Emb): ``B ~ A W + c`` by ridge regression; a steering vector maps
as ``v_b = v_a W``; a random map of W's norm is the baseline."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from embgeom.geometry._checks import _matrix, _pair, _real, _row_cosines, _seed

class LinearMap(NamedTuple):
    """A fitted affine map ``b ~ a @ weight + bias`` and its held-out fit.

    Attributes
    ----------
    weight : ndarray of shape (d_a, d_b), float64
    bias : ndarray of shape (d_b,), float64
    r2 : float, held-out ``1 - SSE / SST`` over all output dimensions (nan without a
        held-out set of at least 2 rows with spread).
    mean_cosine : float, held-out mean of ``cos(prediction_i, b_i)`` (nan without one).
    held_out_rows : ndarray of shape (h,), int64, the held-out row indices (sorted).
    n_train : int
    """

    weight: np.ndarray
    bias: np.ndarray
    r2: float
    mean_cosine: float
    held_out_rows: np.ndarray
    n_train: int


def _ridge(A: np.ndarray, B: np.ndarray, ridge: float) -> tuple[np.ndarray, np.ndarray]:
    ma, mb = A.mean(axis=0), B.mean(axis=0)
    Ac, Bc = A - ma, B - mb
    G = Ac.T @ Ac
    G[np.diag_indices_from(G)] += ridge
    try:
        W = np.linalg.solve(G, Ac.T @ Bc)
    except np.linalg.LinAlgError:
        raise ValueError("A^T A is singular on the training rows; use ridge > 0") from None
    return W, mb - ma @ W


def fit_linear_map(A, B, ridge=1e-2, held_out=0.2, seed=0) -> LinearMap:
    """Ridge regression from space A to space B (Emb2Emb), with a held-out fit.

    Parameters
    ----------
    A : array-like of shape (k, d_a)
    B : array-like of shape (k, d_b)
        Matched rows, finite.
    ridge : float, ``>= 0``
        Penalty on ``||W||_F^2`` (absolute, in the units of ``||A||^2``, as scikit-learn's
        ``Ridge(alpha=ridge)``); the intercept is not penalised. 0 is least squares and
        needs at least ``d_a + 1`` training rows of full rank.
    held_out : float in [0, 1)
        Fraction of rows, ``round(held_out * k)`` of them, set aside by a seeded
        permutation to measure the fit; 0 fits on every row and reports nan.
    seed : int

    Returns
    -------
    LinearMap

    Notes
    -----
    On the training rows, with means ``m_a, m_b`` and centred ``A_c, B_c``::

        W = solve(A_c^T A_c + ridge I, A_c^T B_c),   c = m_b - m_a W

    the minimiser of ``||A W + 1 c - B||_F^2 + ridge ||W||_F^2`` (normal equations of size
    d_a x d_a: ``O(k d_a (d_a + d_b))``). On the held-out rows, with predictions
    ``P = A W + c``, ``R^2 = 1 - sum ||b_i - p_i||^2 / sum ||b_i - mean_held_out(B)||^2``
    (scikit-learn's ``r2_score(multioutput="variance_weighted")``) and the mean cosine of
    ``p_i`` with ``b_i`` (rows where either is zero are skipped). Raw cosines of
    anisotropic embeddings are high whatever the map; compare with a map from
    :func:`random_map_like`.

    References
    ----------
    Lee, Weber, Viegas & Wattenberg 2025, section 6 (Emb2Emb).
    """
    A, B = _pair(A, B, 2)
    ridge = _real(ridge, "ridge", 0.0, np.inf, closed_high=False)
    held_out = _real(held_out, "held_out", 0.0, 1.0, closed_high=False)
    seed = _seed(seed)
    k, d_a = A.shape
    n_test = int(round(held_out * k))
    if held_out > 0 and n_test == 0:
        n_test = 1
    n_train = k - n_test
    if n_train < 2:
        raise ValueError(f"held_out={held_out} leaves {n_train} training rows; need 2")
    if ridge == 0 and n_train <= d_a:
        raise ValueError(
            f"least squares (ridge=0) needs more than d_a={d_a} training rows, got {n_train}"
        )
    perm = np.random.default_rng(seed).permutation(k)
    test = np.sort(perm[:n_test])
    train = np.sort(perm[n_test:])
    W, c = _ridge(A[train], B[train], ridge)
    r2 = mean_cos = float("nan")
    if n_test > 0:
        pred = A[test] @ W + c
        truth = B[test]
        resid = truth - pred
        centred = truth - truth.mean(axis=0)
        sst = float(np.einsum("ij,ij->", centred, centred))
        if n_test >= 2 and sst > 0:
            r2 = 1.0 - float(np.einsum("ij,ij->", resid, resid)) / sst
        cos = _row_cosines(pred, truth)
        if np.any(np.isfinite(cos)):
            mean_cos = float(np.nanmean(cos))
    return LinearMap(W, c, r2, mean_cos, test.astype(np.int64), n_train)


def transfer_vector(W, v) -> np.ndarray:
    """Map a steering vector (or several) from space A to space B: ``v_b = v_a @ W``.

    Parameters
    ----------
    W : array-like of shape (d_a, d_b), e.g. ``fit_linear_map(A, B).weight``.
    v : array-like of shape (d_a,) or (m, d_a).

    Returns
    -------
    ndarray of shape (d_b,) or (m, d_b), float64.

    Notes
    -----
    A steering vector is a difference of means, ``v_a = mean(A_P) - mean(A_N)``. Under the
    affine map ``f(a) = a W + c`` a mean maps to the mean of the images, so
    ``f(mean A_P) - f(mean A_N) = (mean A_P - mean A_N) W``: the bias c cancels, and only
    the linear part applies to differences of points.
    """
    W = _matrix(W, "W")
    try:
        v = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError("v must be a numeric array") from None
    if v.ndim not in (1, 2):
        raise ValueError(f"v must be a vector (d_a,) or a matrix (m, d_a), got shape {v.shape}")
    if v.shape[-1] != W.shape[0]:
        raise ValueError(f"v has {v.shape[-1]} dimensions, W maps from {W.shape[0]}")
    if not np.all(np.isfinite(v)):
        raise ValueError("v contains nan or inf")
    return v @ W


def random_map_like(W, seed=0) -> np.ndarray:
    """A random Gaussian map of W's shape and Frobenius norm: the baseline for Emb2Emb.

    Parameters
    ----------
    W : array-like of shape (d_a, d_b)
    seed : int

    Returns
    -------
    ndarray of shape (d_a, d_b), float64
        i.i.d. standard normal entries rescaled to ``||W||_F`` (unit variance if W is 0).
        The cosine of ``v @ random`` with any fixed vector of B is about 0, with a
        standard deviation about ``1 / sqrt(d_b)``.
    """
    W = _matrix(W, "W")
    G = np.random.default_rng(_seed(seed)).standard_normal(W.shape)
    norm_w = np.linalg.norm(W)
    return G * (norm_w / np.linalg.norm(G)) if norm_w > 0 else G
