"""Local geometry: locally linear reconstruction weights (LLE) and their transfer from
one space to another::

    w_i = argmin ||x_i - sum_j w_ij x_j||^2  s.t. sum_j w_ij = 1

over the k nearest neighbours of x_i; weights from A reused in B.
"""

from __future__ import annotations

import numpy as np

from embgeom.geometry._checks import (_matrix, _neighbour_count, _pair, _real,
                                      _rows_per_chunk, _seed)
from embgeom.geometry.neighbors import _knn, _neighbor_overlap

def _barycenter_weights(X: np.ndarray, neighbors: np.ndarray, reg: float) -> np.ndarray:
    n, k = neighbors.shape
    d = X.shape[1]
    Xc = X - X.mean(axis=0)
    weights = np.empty((n, k), dtype=np.float64)
    diag = np.arange(k)
    chunk = _rows_per_chunk(k * d + 2 * k * k)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        Z = Xc[neighbors[s:e]] - Xc[s:e, None, :]  # (c, k, d)
        G = Z @ Z.transpose(0, 2, 1)  # local Gram matrices (c, k, k)
        trace = np.trace(G, axis1=1, axis2=2)
        G[:, diag, diag] += np.where(trace > 0, reg * trace, reg)[:, None]
        try:
            w = np.linalg.solve(G, np.ones((e - s, k, 1)))[..., 0]
        except np.linalg.LinAlgError:
            raise ValueError(
                "a local Gram matrix is singular (more neighbours than the local dimension, "
                "or duplicate points); use reg > 0"
            ) from None
        weights[s:e] = w / w.sum(axis=1, keepdims=True)
    return weights


def lle_weights(X, k, reg=1e-3) -> tuple[np.ndarray, np.ndarray]:
    """Locally linear reconstruction weights of every row from its k nearest neighbours.

    Parameters
    ----------
    X : array-like of shape (n, d)
    k : int, ``1 <= k <= n - 1``.
    reg : float, ``>= 0``
        Tikhonov regularisation relative to the local scale (see Notes). Needed whenever
        ``k`` exceeds the local dimension, where the Gram matrix is singular.

    Returns
    -------
    indices : ndarray of shape (n, k), int64
        Neighbours of each row, as :func:`nearest_neighbors` (excluding the row itself).
    weights : ndarray of shape (n, k), float64
        ``w_ij`` with ``sum_j w_ij = 1`` for every row.

    Notes
    -----
    For row i with neighbours ``x_j`` (j in N_i), ``Z = [x_j - x_i]_j`` (k x d) and the
    local Gram matrix ``G = Z Z^T``::

        (G + R I) w = 1,   w <- w / sum(w),   R = reg * trace(G)  (reg if trace(G) = 0)

    the minimiser of ``||x_i - sum_j w_ij x_j||^2 + R ||w||^2`` subject to ``sum w = 1``
    (Roweis & Saul 2000), with scikit-learn's ``barycenter_weights`` regularisation.
    Weights summing to 1 make the reconstruction invariant to translation, rotation and
    scaling of the space.

    References
    ----------
    S. Roweis, L. Saul. "Nonlinear Dimensionality Reduction by Locally Linear Embedding".
    Science, 2000.
    """
    X = _matrix(X, "X", 2)
    k = _neighbour_count(k, X.shape[0])
    reg = _real(reg, "reg", 0.0, np.inf, closed_high=False)
    indices, _ = _knn(X, k)
    return indices, _barycenter_weights(X, indices, reg)


def _reconstruction_error(Y: np.ndarray, neighbors: np.ndarray, weights: np.ndarray) -> float:
    n, k = neighbors.shape
    Yc = Y - Y.mean(axis=0)
    sst = float(np.einsum("ij,ij->", Yc, Yc))
    sse = 0.0
    chunk = _rows_per_chunk(k * Y.shape[1])
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        r = Yc[s:e] - np.einsum("rk,rkd->rd", weights[s:e], Yc[neighbors[s:e]])
        sse += float(np.einsum("ij,ij->", r, r))
    if sst <= 0.0:
        return float("nan")
    return sse / sst


def reconstruction_error(Y, neighbors, weights) -> float:
    """Relative error of reconstructing each row of Y from other rows with given weights.

    Parameters
    ----------
    Y : array-like of shape (n, d)
    neighbors : array-like of shape (n, k), integer row indices into Y
    weights : array-like of shape (n, k)

    Returns
    -------
    error : float
        ``sum_i ||y_i - sum_j w_ij y_{n_ij}||^2 / sum_i ||y_i - mean(Y)||^2``: the
        fraction of Y's total variance left unexplained by the reconstructions; 0 when
        exact, about 1 or more for weights unrelated to Y; ``nan`` when Y has no spread.
    """
    Y = _matrix(Y, "Y", 2)
    idx = np.asarray(neighbors)
    if idx.ndim != 2 or idx.shape[0] != Y.shape[0]:
        raise ValueError(f"neighbors must have shape ({Y.shape[0]}, k), got {idx.shape}")
    if not np.issubdtype(idx.dtype, np.integer):
        raise ValueError("neighbors must hold integer row indices")
    if idx.size and (idx.min() < 0 or idx.max() >= Y.shape[0]):
        raise ValueError(f"neighbors must index rows 0..{Y.shape[0] - 1}")
    W = _matrix(weights, "weights")
    if W.shape != idx.shape:
        raise ValueError(f"weights must have the shape of neighbors {idx.shape}, got {W.shape}")
    return _reconstruction_error(Y, idx.astype(np.int64), W)


def lle_transfer(A, B, k, reg=1e-3, seed=0) -> dict:
    """How well the local linear structure of A reconstructs B (LLE weight transfer).

    Parameters
    ----------
    A : array-like of shape (n, d_a)
    B : array-like of shape (n, d_b)
        Matched rows, finite, ``n >= k + 1``.
    k : int, neighbours per row, ``1 <= k <= n - 1``.
    reg : float, LLE regularisation (see :func:`lle_weights`).
    seed : int, seeds the random weights.

    Returns
    -------
    dict with, every error as :func:`reconstruction_error` in B (the fraction of B's total
    variance that the reconstructions leave unexplained):
        ``transfer_error``: A's neighbours and A's weights, applied to B;
        ``own_error``: A's neighbours, B's own optimal weights on them (LLE solved in B):
            the best any weights can do with A's neighbourhoods, the reference for
            ``transfer_error``;
        ``own_neighbors_error``: B's own neighbours and weights (plain LLE in B);
        ``random_error``: A's neighbours, random weights ``w_i ~ Dirichlet(1, ..., 1)``
            (non-negative, summing to 1, uniform on the simplex), seeded;
        ``transfer_over_own`` = transfer / own (>= 1 up to the regularisation; 1 when B's
            local geometry is A's, e.g. B a rotation and scaling of A);
        ``transfer_over_random`` = transfer / random (near 1 when A's weights carry no
            information about B; small when they do);
        ``neighbor_overlap``: mean over rows of ``|N_A(i) & N_B(i)| / k``;
        ``k``, ``reg``.
    A ratio is ``nan`` when its denominator is 0.

    Notes
    -----
    When k exceeds B's local dimension + 1, the affine hull of almost any k points
    contains b_i, so ``own_error`` is small even for neighbourhoods unrelated to B (the
    regularisation only limits how large the weights get): read ``transfer_over_own``
    together with ``transfer_over_random`` and ``neighbor_overlap``.

    References
    ----------
    Roweis & Saul, Science 2000; Lee, Weber, Viegas & Wattenberg 2025, section 4 (local
    similarity with LLE).
    """
    A, B, k, reg, seed = _lle_inputs(A, B, k, reg, seed)
    idx_a, w_a, w_b_same, idx_b, w_b, w_rand = _lle_parts(A, B, k, reg, seed)
    transfer = _reconstruction_error(B, idx_a, w_a)
    own = _reconstruction_error(B, idx_a, w_b_same)
    random = _reconstruction_error(B, idx_a, w_rand)

    def ratio(num, den):
        return float(num / den) if den > 0 else float("nan")

    return {
        "transfer_error": transfer,
        "own_error": own,
        "own_neighbors_error": _reconstruction_error(B, idx_b, w_b),
        "random_error": random,
        "transfer_over_own": ratio(transfer, own),
        "transfer_over_random": ratio(transfer, random),
        "neighbor_overlap": _neighbor_overlap(idx_a, idx_b),
        "k": k,
        "reg": reg,
    }


def _lle_inputs(A, B, k, reg, seed):
    A, B = _pair(A, B, 2)
    k = _neighbour_count(k, A.shape[0])
    reg = _real(reg, "reg", 0.0, np.inf, closed_high=False)
    return A, B, k, reg, _seed(seed)


def _lle_parts(A: np.ndarray, B: np.ndarray, k: int, reg: float, seed: int):
    """a's neighbours and weights, b's weights on them, b's own neighbours and weights,
    and the seeded random weights: everything :func:`lle_transfer` compares."""
    idx_a, _ = _knn(A, k)
    w_a = _barycenter_weights(A, idx_a, reg)
    w_b_same = _barycenter_weights(B, idx_a, reg)
    idx_b, _ = _knn(B, k)
    w_b = _barycenter_weights(B, idx_b, reg)
    w_rand = np.random.default_rng(seed).dirichlet(np.ones(k), size=A.shape[0])
    return idx_a, w_a, w_b_same, idx_b, w_b, w_rand


def _row_errors(Y: np.ndarray, neighbors: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Per row, ``||y_i - sum_j w_ij y_j||^2`` over the mean squared deviation of Y: their
    mean is :func:`_reconstruction_error`."""
    n, k = neighbors.shape
    Yc = Y - Y.mean(axis=0)
    msd = float(np.einsum("ij,ij->", Yc, Yc)) / n
    out = np.empty(n, dtype=np.float64)
    chunk = _rows_per_chunk(k * Y.shape[1])
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        r = Yc[s:e] - np.einsum("rk,rkd->rd", weights[s:e], Yc[neighbors[s:e]])
        out[s:e] = np.einsum("ij,ij->i", r, r)
    if msd <= 0.0:
        return np.full(n, np.nan)
    return out / msd


def lle_transfer_rows(A, B, k, reg=1e-3, seed=0) -> dict:
    """:func:`lle_transfer` token by token (for plots).

    Parameters are those of :func:`lle_transfer`, with the same neighbours and weights
    (the same ``seed`` draws the same random weights).

    Returns
    -------
    dict of arrays of shape (n,), one entry per row, each error relative to B's mean
    squared deviation from its mean (``||b_i - sum_j w_ij b_j||^2 / (sum_i ||b_i -
    mean(B)||^2 / n)``), so that the mean of each array is the matching aggregate of
    :func:`lle_transfer`:
        ``transfer``, ``own``, ``own_neighbors``, ``random``: as ``transfer_error``,
        ``own_error``, ``own_neighbors_error``, ``random_error``;
        ``overlap``: ``|N_A(i) & N_B(i)| / k`` (mean: ``neighbor_overlap``);
    and ``neighbors`` (n, k) int64, row i's neighbours in A.
    """
    A, B, k, reg, seed = _lle_inputs(A, B, k, reg, seed)
    idx_a, w_a, w_b_same, idx_b, w_b, w_rand = _lle_parts(A, B, k, reg, seed)
    return {
        "transfer": _row_errors(B, idx_a, w_a),
        "own": _row_errors(B, idx_a, w_b_same),
        "own_neighbors": _row_errors(B, idx_b, w_b),
        "random": _row_errors(B, idx_a, w_rand),
        "overlap": np.sum(idx_a[:, :, None] == idx_b[:, None, :], axis=(1, 2)) / k,
        "neighbors": idx_a,
    }
