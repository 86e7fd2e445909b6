"""One exact neighbour search (Euclidean, brute force in bounded blocks), used by every
local measure."""

from __future__ import annotations

import numpy as np

from embgeom.geometry._checks import _matrix, _neighbour_count, _rows_per_chunk

def _knn(X: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    n, d = X.shape
    # Distances are translation invariant; centring keeps the expansion below accurate.
    Xc = X - X.mean(axis=0)
    sq = np.einsum("ij,ij->i", Xc, Xc)
    indices = np.empty((n, k), dtype=np.int64)
    distances = np.empty((n, k), dtype=np.float64)
    chunk = _rows_per_chunk(2 * n + 2 * k * d)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        d2 = sq[s:e, None] + sq[None, :] - 2.0 * (Xc[s:e] @ Xc.T)
        d2[np.arange(e - s), np.arange(s, e)] = np.inf  # a point is not its own neighbour
        cand = np.argpartition(d2, k - 1, axis=1)[:, :k]
        # The expansion selects; exact distances come from differences, which do not
        # cancel when two points are much closer than their norms.
        diff = Xc[cand] - Xc[s:e, None, :]
        exact = np.sqrt(np.einsum("rkd,rkd->rk", diff, diff))
        order = np.lexsort((cand, exact), axis=-1)
        indices[s:e] = np.take_along_axis(cand, order, axis=1)
        distances[s:e] = np.take_along_axis(exact, order, axis=1)
    return indices, distances


def nearest_neighbors(X, k) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest neighbours of every row (Euclidean, exact, excluding the row itself).

    Parameters
    ----------
    X : array-like of shape (n, d)
    k : int, ``1 <= k <= n - 1``.

    Returns
    -------
    indices : ndarray of shape (n, k), int64
        Row indices of the neighbours of each row, nearest first (ties by index).
    distances : ndarray of shape (n, k), float64
        ``||x_i - x_j||``, ascending.

    Notes
    -----
    Brute force over blocks of rows: ``O(n^2 d)`` time, ``O(block x n)`` memory with
    blocks of at most 64 MiB. Candidates are selected with ``||x||^2 + ||y||^2 - 2 <x, y>``
    on centred data and their distances recomputed from differences; duplicates of a row
    are its neighbours at distance 0, the row itself never is.
    """
    X = _matrix(X, "X", 2)
    k = _neighbour_count(k, X.shape[0])
    return _knn(X, k)


def _neighbor_overlap(P: np.ndarray, Q: np.ndarray) -> float:
    """Mean over rows of ``|P_i & Q_i| / k`` for two (n, k) neighbour lists (rows without
    repeats): the mutual k-NN score."""
    n, k = P.shape
    total = 0
    chunk = _rows_per_chunk(k * k)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        total += int(np.sum(P[s:e, :, None] == Q[s:e, None, :]))
    return total / (n * k)
