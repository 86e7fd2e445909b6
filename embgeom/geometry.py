"""Cross-model geometry: how alike two embedding spaces are, globally and locally.

The inputs are two matrices of per-token mean embeddings with matched rows, ``A`` of shape
(k, d_a) and ``B`` of shape (k, d_b): row i of both is the same token, seen by two models
or two layers. Following Lee, Weber, Viegas & Wattenberg (2025) we measure::

    global     r   = pearson({cos(a_i, a_j)}_{i<j}, {cos(b_i, b_j)}_{i<j})
               CKA = ||B_c^T A_c||_F^2 / (||A_c^T A_c||_F ||B_c^T B_c||_F)
               P   = min_{R orthogonal} ||A_n R - B_n||_F^2 = 2 - 2 ||A_n^T B_n||_*
    local      w_i = argmin ||x_i - sum_j w_ij x_j||^2  s.t. sum_j w_ij = 1   (LLE)
               over the k nearest neighbours of x_i; weights from A reused in B
    dimension  per token: local PCA, TwoNN, Levina-Bickel MLE on k-neighbourhoods
    Emb2Emb    B ~ A W + c (ridge); a steering vector maps as v_b = v_a W

with ``X_c`` column-centred and ``X_n = X_c / ||X_c||_F``. Every number of the first two
groups comes with a baseline (rows of B shuffled, or random weights), without which it
does not mean much: the linear CKA of two unrelated spaces is about sqrt(d_a d_b) / k,
not 0.

Memory is bounded: nothing builds a k x k matrix except :func:`cosine_matrix` (refused
beyond ``10,000`` rows); neighbour searches and Pearson over pairs run in blocks of rows of
at most ``64 MiB``, which is purely a memory optimisation and does not change the result.

Everything is float64 numpy, pure and without I/O. Invalid input raises ``ValueError``
(the service maps it to 422); a quantity that is undefined on valid input (no spread) is
``nan`` (the service reports null).

References
----------
A. Lee, M. Weber, F. Viegas, M. Wattenberg. "Shared Global and Local Geometry of Language
Model Embeddings". COLM 2025 (arXiv:2503.21073).
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import numpy as np

__all__ = [
    "IntrinsicDimension",
    "LinearMap",
    "MAX_COSINE_ROWS",
    "MLEDimension",
    "cosine_matrix",
    "fit_linear_map",
    "global_similarity",
    "intrinsic_dimension",
    "linear_cka",
    "lle_transfer",
    "lle_transfer_rows",
    "lle_weights",
    "local_pca_dimension",
    "mle_dimension",
    "nearest_neighbors",
    "pearson_cosine",
    "procrustes_residual",
    "random_map_like",
    "reconstruction_error",
    "transfer_vector",
    "twonn_dimension",
    "twonn_local_dimension",
]

# Working memory of one block of rows (pairwise distances, cosines, neighbourhoods).
_CHUNK_BYTES = 64 * 2**20
# Rows whose full cosine matrix we are willing to form or scan: 10,000 rows are 5e7 pairs,
# 0.8 GB as one dense matrix (never formed by pearson_cosine, which scans it in blocks) and
# about 1e8 * d flops per space. Beyond it, callers sample.
MAX_COSINE_ROWS = 10_000
# Cosines carry roundoff of order d * eps (< 1e-12 for any model width); a spread of the
# cosines below that (variance 1e-24) is roundoff, not structure.
_MIN_COSINE_VARIANCE = 1e-24
# A centred matrix whose norm is below this fraction of the raw matrix's norm is constant up
# to the roundoff of centring (about eps * ||mean||): its spread is undefined, not tiny.
_ZERO_SPREAD_RTOL = 1e-12
_TWONN_METHODS = ("mle", "linear")
_DIMENSION_METHODS = ("local_pca", "twonn", "mle")


# ----------------------------------------------------------------------------- validation


def _matrix(X, name: str, min_rows: int = 1) -> np.ndarray:
    try:
        a = np.asarray(X, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a numeric array") from None
    if a.ndim != 2:
        raise ValueError(f"{name} must be 2-dimensional (rows x dims), got shape {a.shape}")
    if a.shape[0] < min_rows:
        raise ValueError(f"{name} needs at least {min_rows} rows, got {a.shape[0]}")
    if a.shape[1] < 1:
        raise ValueError(f"{name} must have at least one column, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains nan or inf")
    return a


def _pair(A, B, min_rows: int) -> tuple[np.ndarray, np.ndarray]:
    a = _matrix(A, "A", min_rows)
    b = _matrix(B, "B", min_rows)
    if a.shape[0] != b.shape[0]:
        raise ValueError(
            f"A and B must have the same number of rows (matched tokens), "
            f"got {a.shape[0]} and {b.shape[0]}"
        )
    return a, b


def _integer(value, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if v < low or (high is not None and v > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bounds}, got {v}")
    return v


def _neighbour_count(k, n: int, low: int = 1) -> int:
    if n - 1 < low:
        raise ValueError(f"{low} neighbours need at least {low + 1} rows, got {n}")
    return _integer(k, "k", low, n - 1)


def _real(value, name: str, low: float, high: float, *, closed_low=True, closed_high=True):
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    ok_low = v >= low if closed_low else v > low
    ok_high = v <= high if closed_high else v < high
    if not (np.isfinite(v) and ok_low and ok_high):
        lb = "[" if closed_low else "("
        hb = "]" if closed_high else ")"
        raise ValueError(f"{name} must be in {lb}{low}, {high}{hb}, got {value!r}")
    return v


def _seed(seed) -> int:
    return _integer(seed, "seed", 0)


def _rows_per_chunk(floats_per_row: int) -> int:
    return max(1, _CHUNK_BYTES // (8 * max(1, floats_per_row)))


# ------------------------------------------------------------------------------- helpers


def _unit_rows(X: np.ndarray, name: str) -> np.ndarray:
    # Dividing by the largest entry first keeps ||x|| from overflowing whatever the units.
    scale = np.max(np.abs(X), axis=1)
    if np.any(scale == 0):
        i = int(np.flatnonzero(scale == 0)[0])
        raise ValueError(f"row {i} of {name} is zero: its cosine similarity is undefined")
    Y = X / scale[:, None]
    return Y / np.linalg.norm(Y, axis=1)[:, None]


def _centred_unit(X: np.ndarray) -> np.ndarray | None:
    """``(X - mean) / ||X - mean||_F``, or None when the rows do not spread."""
    scale = np.max(np.abs(X))
    if scale == 0:
        return None
    Y = X / scale
    Yc = Y - Y.mean(axis=0)
    norm = np.linalg.norm(Yc)
    if norm <= _ZERO_SPREAD_RTOL * np.linalg.norm(Y):
        return None
    return Yc / norm


def _row_cosines(P: np.ndarray, Q: np.ndarray) -> np.ndarray:
    """Cosine of each row of P with the same row of Q; nan where either row is zero."""
    num = np.einsum("ij,ij->i", P, Q)
    den = np.linalg.norm(P, axis=1) * np.linalg.norm(Q, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / den, np.nan)


def _sample_rows(k: int, sample, seed: int) -> np.ndarray | None:
    """Row indices to use (sorted), or None for all rows."""
    if sample is None:
        if k > MAX_COSINE_ROWS:
            raise ValueError(
                f"{k} rows exceed the {MAX_COSINE_ROWS} rows compared without sampling; "
                f"pass sample <= {MAX_COSINE_ROWS}"
            )
        return None
    m = _integer(sample, "sample", 3)
    if m >= k:
        return None
    if m > MAX_COSINE_ROWS:
        raise ValueError(f"sample must be at most {MAX_COSINE_ROWS}, got {m}")
    rng = np.random.default_rng([seed, 0])
    return np.sort(rng.choice(k, size=m, replace=False))


# ------------------------------------------------------------------------ global similarity


def cosine_matrix(X) -> np.ndarray:
    """Cosine similarity of every pair of rows.

    Parameters
    ----------
    X : array-like of shape (k, d)
        Finite, no zero row, ``k <= 10,000`` (the result is dense k x k float64).

    Returns
    -------
    C : ndarray of shape (k, k), float64
        ``C_ij = <x_i, x_j> / (||x_i|| ||x_j||)``, clipped to [-1, 1].
    """
    X = _matrix(X, "X")
    if X.shape[0] > MAX_COSINE_ROWS:
        raise ValueError(
            f"a cosine matrix of {X.shape[0]} rows is refused (more than {MAX_COSINE_ROWS}); "
            "sample rows first"
        )
    U = _unit_rows(X, "X")
    return np.clip(U @ U.T, -1.0, 1.0)


def _pearson_offdiag(U: np.ndarray, V: np.ndarray, block_rows: int | None = None) -> float:
    """Pearson r of ``(U U^T)_ij`` against ``(V V^T)_ij`` over i < j, scanned by row blocks.

    Each block's pairs are reduced to (count, means, centred sums of squares and products)
    and merged with Chan et al.; raw sums would cancel when the cosines share a large mean
    (anisotropic spaces have mean cosines near 0.9 with a small spread).
    """
    k = U.shape[0]
    if block_rows is None:
        # per row of a block: two cosine rows, two index rows, two gathered value rows
        block_rows = _rows_per_chunk(6 * k)
    n = 0
    mx = my = sxx = syy = sxy = 0.0
    for s in range(0, k - 1, block_rows):
        e = min(s + block_rows, k - 1)
        # entry (r, c) of these blocks is the pair (s + r, s + 1 + c): i < j iff c >= r
        rr, cc = np.triu_indices(e - s, 0, k - s - 1)
        x = (U[s:e] @ U[s + 1 :].T)[rr, cc]
        y = (V[s:e] @ V[s + 1 :].T)[rr, cc]
        nb = x.size
        bx, by = x.mean(), y.mean()
        dx, dy = x - bx, y - by
        bxx, byy, bxy = dx @ dx, dy @ dy, dx @ dy
        total = n + nb
        ddx, ddy = bx - mx, by - my
        f = n * nb / total
        mx += ddx * nb / total
        my += ddy * nb / total
        sxx += bxx + ddx * ddx * f
        syy += byy + ddy * ddy * f
        sxy += bxy + ddx * ddy * f
        n = total
    if n == 0 or sxx / n < _MIN_COSINE_VARIANCE or syy / n < _MIN_COSINE_VARIANCE:
        return float("nan")
    return float(np.clip(sxy / np.sqrt(sxx * syy), -1.0, 1.0))


def _pearson_rows(A: np.ndarray, B: np.ndarray, rows: np.ndarray | None) -> float:
    if rows is not None:
        A, B = A[rows], B[rows]
    return _pearson_offdiag(_unit_rows(A, "A"), _unit_rows(B, "B"))


def pearson_cosine(A, B, sample=None, seed=0) -> float:
    """Pearson correlation of the pairwise cosine similarities of two spaces.

    Parameters
    ----------
    A : array-like of shape (k, d_a)
    B : array-like of shape (k, d_b)
        Matched rows (row i of A and of B is the same token), finite, no zero row,
        ``k >= 3``.
    sample : int or None
        None: all k rows, allowed up to ``MAX_COSINE_ROWS = 10,000``. An int m >= 3: the
        same m rows of A and B drawn without replacement with ``seed`` (all rows if
        ``m >= k``); m itself must be at most 10,000.
    seed : int
        Seed of the row sample.

    Returns
    -------
    r : float
        In [-1, 1]; ``nan`` when the cosines of either space do not vary.

    Notes
    -----
    ``r = pearson({cos(a_i, a_j)}_{i<j}, {cos(b_i, b_j)}_{i<j})`` over the
    ``m (m - 1) / 2`` distinct pairs. The two m x m matrices are never formed: the pairs
    are scanned in blocks of rows (``O(block x m)`` memory) and the block moments merged
    exactly; the result equals ``numpy.corrcoef`` of the two upper triangles. r is
    invariant to a rotation and to a global rescaling of each space, but not to a translation
    (cosines are taken about the origin). For independent isotropic spaces its standard
    error is about ``1 / sqrt(m (m - 1) / 2)``.

    References
    ----------
    Lee, Weber, Viegas & Wattenberg, "Shared Global and Local Geometry of Language Model
    Embeddings", 2025, section 3 (global similarity).
    """
    A, B = _pair(A, B, 3)
    rows = _sample_rows(A.shape[0], sample, _seed(seed))
    return _pearson_rows(A, B, rows)


def _linear_cka(A: np.ndarray, B: np.ndarray) -> float:
    An, Bn = _centred_unit(A), _centred_unit(B)
    if An is None or Bn is None:
        return float("nan")
    cross = np.linalg.norm(An.T @ Bn) ** 2
    den = np.linalg.norm(An.T @ An) * np.linalg.norm(Bn.T @ Bn)
    return float(np.clip(cross / den, 0.0, 1.0))


def linear_cka(A, B) -> float:
    """Linear centred kernel alignment (CKA) of two spaces with matched rows.

    Parameters
    ----------
    A : array-like of shape (k, d_a)
    B : array-like of shape (k, d_b)
        Matched rows, finite, ``k >= 2``.

    Returns
    -------
    cka : float
        In [0, 1]: 1 when B is an orthogonal transform of A times a scalar (plus a
        translation); ``nan`` when either space has no spread.

    Notes
    -----
    With ``A_c``, ``B_c`` the column-centred matrices::

        CKA = ||B_c^T A_c||_F^2 / (||A_c^T A_c||_F ||B_c^T B_c||_F)

    which equals the HSIC form ``<K_c, L_c>_F / (||K_c||_F ||L_c||_F)`` on the k x k
    linear Gram matrices, computed here through the (d_a x d_b), (d_a x d_a) and
    (d_b x d_b) cross-covariances: ``O(k (d_a + d_b)^2)`` time, no k x k matrix. Each
    space is first divided by its Frobenius norm (CKA is scale invariant) so nothing
    overflows. For two independent isotropic spaces CKA is about ``sqrt(d_a d_b) / k``
    when ``k >> d``, not 0: compare with the shuffled baseline of
    :func:`global_similarity`.

    References
    ----------
    S. Kornblith, M. Norouzi, H. Lee, G. Hinton. "Similarity of Neural Network
    Representations Revisited". ICML 2019.
    """
    A, B = _pair(A, B, 2)
    return _linear_cka(A, B)


def _procrustes_residual(A: np.ndarray, B: np.ndarray) -> float:
    An, Bn = _centred_unit(A), _centred_unit(B)
    if An is None or Bn is None:
        return float("nan")
    nuclear = np.linalg.svd(An.T @ Bn, compute_uv=False).sum()
    return float(np.clip(2.0 - 2.0 * nuclear, 0.0, 2.0))


def procrustes_residual(A, B) -> float:
    """Residual of the orthogonal Procrustes fit of B by A, after normalisation.

    Parameters
    ----------
    A : array-like of shape (k, d_a)
    B : array-like of shape (k, d_b)
        Matched rows, finite, ``k >= 2``.

    Returns
    -------
    residual : float
        In [0, 2]: 0 when B is a rotation (or reflection) of A up to translation and
        scale; ``nan`` when either space has no spread.

    Notes
    -----
    Normalisation: each space is column-centred and divided by its Frobenius norm,
    ``A_n = (A - mean A) / ||A - mean A||_F`` (likewise B), so ``||A_n||_F = ||B_n||_F = 1``.
    The narrower one is zero-padded with columns to the width ``d = max(d_a, d_b)``. Then::

        P = min_{R in O(d)} ||A_n R - B_n||_F^2 = 2 - 2 ||A_n^T B_n||_*

    where ``||.||_*`` is the nuclear norm (sum of singular values) and the minimiser is
    ``R = U V^T`` from the SVD ``A_n^T B_n = U S V^T`` (Schoenemann 1966). Zero columns add
    only zero singular values, so the padding is never materialised: the singular values
    of the (d_a x d_b) matrix ``A_n^T B_n`` are those of the padded (d x d) one. This is the
    "Procrustes distance" of Williams et al. (2021) squared, ``||A_n||^2 + ||B_n||^2 -
    2 tr(S)``, and symmetric in A and B.

    References
    ----------
    P. Schoenemann. "A generalized solution of the orthogonal Procrustes problem".
    Psychometrika, 1966.
    A. Williams, E. Kunz, S. Kornblith, S. Linderman. "Generalized Shape Metrics on Neural
    Representations". NeurIPS 2021.
    """
    A, B = _pair(A, B, 2)
    return _procrustes_residual(A, B)


def global_similarity(A, B, sample=None, seed=0) -> dict:
    """Pearson of cosines, linear CKA and Procrustes residual, with a shuffled baseline.

    Parameters
    ----------
    A : array-like of shape (k, d_a)
    B : array-like of shape (k, d_b)
        Matched rows, finite, no zero row, ``k >= 3``.
    sample : int or None
        Row sample for the Pearson of cosines only (see :func:`pearson_cosine`); CKA and
        Procrustes are ``O(k d^2)`` and always use every row.
    seed : int
        Seeds the row sample and the baseline's permutation.

    Returns
    -------
    dict with
        ``pearson_cosine``, ``cka_linear``, ``procrustes_residual`` : float
            as :func:`pearson_cosine`, :func:`linear_cka`, :func:`procrustes_residual`;
        ``baseline`` : dict with the same three keys, computed on ``(A, B[perm])``, perm
            a seeded random permutation of the rows: what unrelated spaces with these
            marginal geometries give (Pearson about 0, CKA about ``sqrt(d_a d_b) / k``,
            Procrustes well above 0);
        ``rows`` : int, k; ``pairs`` : int, the cosine pairs compared, ``m (m - 1) / 2``.
    """
    A, B = _pair(A, B, 3)
    seed = _seed(seed)
    k = A.shape[0]
    rows = _sample_rows(k, sample, seed)
    m = k if rows is None else rows.size
    perm = np.random.default_rng([seed, 1]).permutation(k)
    shuffled = B[perm]
    return {
        "pearson_cosine": _pearson_rows(A, B, rows),
        "cka_linear": _linear_cka(A, B),
        "procrustes_residual": _procrustes_residual(A, B),
        "baseline": {
            "pearson_cosine": _pearson_rows(A, shuffled, rows),
            "cka_linear": _linear_cka(A, shuffled),
            "procrustes_residual": _procrustes_residual(A, shuffled),
        },
        "rows": k,
        "pairs": m * (m - 1) // 2,
    }


# ---------------------------------------------------------------------------- neighbours


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


# ----------------------------------------------------------------------------------- LLE


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


def _neighbor_overlap(P: np.ndarray, Q: np.ndarray) -> float:
    n, k = P.shape
    total = 0
    chunk = _rows_per_chunk(k * k)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        total += int(np.sum(P[s:e, :, None] == Q[s:e, None, :]))
    return total / (n * k)


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


# ---------------------------------------------------------------------- intrinsic dimension


def _neighbourhoods(Xc: np.ndarray, indices: np.ndarray, s: int, e: int) -> np.ndarray:
    """The k-neighbour clouds of rows s..e, each centred on its own mean: (c, k, d)."""
    Z = Xc[indices[s:e]]
    return Z - Z.mean(axis=1, keepdims=True)


def local_pca_dimension(X, k, threshold=0.9) -> np.ndarray:
    """Per point, the number of principal components of its k-neighbourhood for a variance share.

    Parameters
    ----------
    X : array-like of shape (n, d)
    k : int, ``2 <= k <= n - 1``, neighbours per point.
    threshold : float in (0, 1), share of the variance to reach.

    Returns
    -------
    dimension : ndarray of shape (n,), int64
        For point i, with ``lam_1 >= lam_2 >= ...`` the PCA eigenvalues of the cloud of its
        k nearest neighbours (the point itself excluded, centred on the cloud's mean)::

            dim_i = min { m : (lam_1 + ... + lam_m) / sum(lam) >= threshold }

        at most ``min(k, d)``; 0 when all k neighbours coincide (no variance).

    Notes
    -----
    This is the per-token intrinsic dimension of Lee et al. (2025). Excluding the point
    matches scikit-dimension's pointwise estimates
    (``skdim.id.lPCA(ver="ratio", alphaRatio=threshold).fit_pw(X, n_neighbors=k)``), which
    fit the estimator on ``X[neighbours of i]``. Points on a d-dimensional affine subspace
    give at most d whatever the threshold below ``1 - 1e-12`` (the other eigenvalues are
    roundoff); with a threshold near 1 they give exactly d.

    References
    ----------
    K. Fukunaga, D. Olsen. "An algorithm for finding intrinsic dimensionality of data".
    IEEE Trans. Computers, 1971.
    Lee, Weber, Viegas & Wattenberg 2025, section 4 (intrinsic dimension).
    """
    X = _matrix(X, "X", 3)
    n, d = X.shape
    k = _neighbour_count(k, n, low=2)
    threshold = _real(threshold, "threshold", 0.0, 1.0, closed_low=False, closed_high=False)
    indices, _ = _knn(X, k)
    Xc = X - X.mean(axis=0)
    out = np.empty(n, dtype=np.int64)
    chunk = _rows_per_chunk(2 * k * d)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        sv = np.linalg.svd(_neighbourhoods(Xc, indices, s, e), compute_uv=False)
        cum = np.cumsum(sv**2, axis=1)
        total = cum[:, -1:]
        with np.errstate(invalid="ignore", divide="ignore"):
            share = cum / total
        dim = np.sum(share < threshold, axis=1) + 1
        out[s:e] = np.where(total[:, 0] > 0, dim, 0)
    return out


def _twonn_from_log_mu(log_mu: np.ndarray, method: str, discard_fraction: float) -> np.ndarray:
    """TwoNN estimate for each row of ``log(r2 / r1)`` values; non-finite entries dropped."""
    rows, width = log_mu.shape
    finite = np.isfinite(log_mu)
    x = np.sort(np.where(finite, log_mu, np.inf), axis=1)  # dropped ones last
    N = finite.sum(axis=1)
    n_keep = (N * (1 - discard_fraction)).astype(np.int64)
    pos = np.arange(width)[None, :]
    out = np.full(rows, np.nan)
    if method == "mle":
        keep = pos < n_keep[:, None]
        last = np.take_along_axis(x, np.clip(n_keep - 1, 0, width - 1)[:, None], axis=1)[:, 0]
        denominator = np.where(keep, x, 0.0).sum(axis=1) + np.where(
            n_keep < N, (N - n_keep) * last, 0.0
        )
        ok = (n_keep >= 2) & (denominator > 0)
        out[ok] = (n_keep[ok] - 1) / denominator[ok]
    else:
        # The empirical CDF reaches 1 at the largest ratio, where -log(1 - F) is infinite.
        n_fit = np.minimum(n_keep, N - 1)
        keep = pos < n_fit[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            F = (pos + 1) / N[:, None]
            y = np.where(keep, -np.log1p(-np.where(keep, F, 0.0)), 0.0)
        xk = np.where(keep, x, 0.0)
        sxx = (xk * xk).sum(axis=1)
        ok = (n_fit >= 2) & (sxx > 0)
        out[ok] = (xk * y).sum(axis=1)[ok] / sxx[ok]
    return out


def _twonn_method(method, discard_fraction):
    if method not in _TWONN_METHODS:
        raise ValueError(f"method must be one of {_TWONN_METHODS}, got {method!r}")
    return _real(discard_fraction, "discard_fraction", 0.0, 1.0, closed_high=False)


def twonn_dimension(X, method="mle", discard_fraction=0.0) -> float:
    """Global intrinsic dimension by TwoNN (Facco et al. 2017).

    Parameters
    ----------
    X : array-like of shape (n, d), ``n >= 3``.
    method : "mle" or "linear"
    discard_fraction : float in [0, 1)
        Fraction of the largest ratios mu set aside (Facco et al. use 0.1 with "linear").

    Returns
    -------
    dimension : float
        ``nan`` if fewer than 2 ratios remain or they carry no spread.

    Notes
    -----
    With ``r1, r2`` each point's distances to its first and second nearest neighbours,
    ``mu = r2 / r1`` follows a Pareto law ``P(mu > t) = t^-d`` on a locally uniform
    d-dimensional manifold. Points with ``r1 = 0`` (duplicates) are dropped. Of the N
    ratios, the ``n = int(N (1 - discard_fraction))`` smallest are kept.

    - ``"mle"``: ``log mu ~ Exponential(d)``; with the largest ones censored::

          d = (n - 1) / (sum_{i<=n} log mu_(i) + (N - n) log mu_(n))

      which for ``discard_fraction = 0`` is ``(N - 1) / sum log mu``, the unbiased
      form of the maximum likelihood ``N / sum log mu`` (Denti et al. 2022).
    - ``"linear"``: Facco's fit through the origin of ``-log(1 - i/N)`` against
      ``log mu_(i)``, i = 1..n (the point with ``i = N``, where the left side is
      infinite, is left out): ``d = sum x y / sum x^2``.

    Both equal ``skdim.id.TwoNN(discard_fraction=..., method=...)`` (scikit-dimension
    0.5.0) on the same data, except ``"linear"`` with ``discard_fraction = 0``, where
    scikit-dimension keeps the infinite point.

    References
    ----------
    E. Facco, M. d'Errico, A. Rodriguez, A. Laio. "Estimating the intrinsic dimension of
    datasets by a minimal neighborhood information". Scientific Reports, 2017.
    F. Denti, D. Doimo, A. Laio, A. Mira. "The generalized ratios intrinsic dimension
    estimator". Scientific Reports, 2022.
    """
    X = _matrix(X, "X", 3)
    discard_fraction = _twonn_method(method, discard_fraction)
    _, dist = _knn(X, 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_mu = np.log(dist[:, 1] / dist[:, 0])
    return float(_twonn_from_log_mu(log_mu[None, :], method, discard_fraction)[0])


def twonn_local_dimension(
    X, k, method="mle", discard_fraction=0.0, neighborhood="pooled"
) -> np.ndarray:
    """Per point, TwoNN on the k-neighbourhood of the point.

    Parameters
    ----------
    X : array-like of shape (n, d)
    k : int, ``3 <= k <= n - 1``.
    method, discard_fraction : as :func:`twonn_dimension`.
    neighborhood : "pooled" or "cloud"
        What "per token" means:

        - ``"pooled"`` (default): the TwoNN estimator applied to the k + 1 ratios
          ``mu_j = r2(j) / r1(j)`` of x_i and of its k nearest neighbours, each ratio
          measured in the whole data set (as the global estimate). The ratios are the
          same as the global estimator's, only pooled over a neighbourhood, so the mean
          over points has the global estimator's small bias.
        - ``"cloud"``: :func:`twonn_dimension` applied to the k points nearest to x_i
          (x_i excluded) as a data set of its own, r1 and r2 measured within that cloud:
          the convention of scikit-dimension's pointwise estimates
          (``skdim.id.TwoNN(...).fit_pw(X, n_neighbors=k)``), which it matches. Most
          points of a small cloud lie on its rim, which biases the estimate down (about
          -10 % for d = 5, k = 50).

    Returns
    -------
    dimension : ndarray of shape (n,), float64
        ``nan`` where undefined (fewer than 2 usable ratios, or no spread).

    Notes
    -----
    k + 1 (or k) ratios give a relative standard error of about ``1 / sqrt(k)`` per point:
    average over tokens, or use a large k.
    """
    X = _matrix(X, "X", 4)
    n, d = X.shape
    k = _neighbour_count(k, n, low=3)
    discard_fraction = _twonn_method(method, discard_fraction)
    if neighborhood not in ("pooled", "cloud"):
        raise ValueError(f"neighborhood must be 'pooled' or 'cloud', got {neighborhood!r}")
    indices, dist = _knn(X, k)
    if neighborhood == "pooled":
        with np.errstate(divide="ignore", invalid="ignore"):
            log_mu = np.log(dist[:, 1] / dist[:, 0])
        pooled = np.concatenate([log_mu[:, None], log_mu[indices]], axis=1)
        return _twonn_from_log_mu(pooled, method, discard_fraction)
    Xc = X - X.mean(axis=0)
    out = np.empty(n, dtype=np.float64)
    diag = np.arange(k)
    chunk = _rows_per_chunk(k * d + 3 * k * k)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        Z = _neighbourhoods(Xc, indices, s, e)
        G = Z @ Z.transpose(0, 2, 1)
        sq = G[:, diag, diag]
        d2 = np.clip(sq[:, :, None] + sq[:, None, :] - 2.0 * G, 0.0, None)
        d2[:, diag, diag] = np.inf
        two = np.sqrt(np.partition(d2, 1, axis=2)[..., :2])
        with np.errstate(divide="ignore", invalid="ignore"):
            log_mu = np.log(two[..., 1] / two[..., 0])
        out[s:e] = _twonn_from_log_mu(log_mu, method, discard_fraction)
    return out


class MLEDimension(NamedTuple):
    """Levina-Bickel estimates: ``per_point`` (n,) float64 and their ``dimension`` (float)."""

    per_point: np.ndarray
    dimension: float


def mle_dimension(X, k, unbiased=False) -> MLEDimension:
    """Maximum likelihood intrinsic dimension per point (Levina & Bickel 2004).

    Parameters
    ----------
    X : array-like of shape (n, d)
    k : int, ``2 <= k <= n - 1``, neighbours per point.
    unbiased : bool
        Use ``k - 2`` instead of ``k - 1`` in the numerator (unbiased for a Poisson
        process; Levina & Bickel's text uses ``k - 2``, their experiments ``k - 1``).

    Returns
    -------
    MLEDimension
        ``per_point[i]``, with ``T_j`` the distance from x_i to its j-th nearest
        neighbour (x_i excluded)::

            m_i = (k - 1) / sum_{j=1}^{k-1} log(T_k / T_j)

        and ``dimension`` MacKay & Ghahramani's average of the inverses,
        ``1 / mean_i(1 / m_i) = (k - 1) / mean_i(sum_j log(T_k / T_j))``, over the
        points where it is finite.

    Notes
    -----
    A point with a duplicate among its first k - 1 neighbours gets ``m_i = 0``, one whose
    neighbours all coincide with it ``nan``, one whose k neighbours are equidistant
    ``inf``; the global value leaves out the first two. Equal to
    ``skdim.id.MLE().fit(X, n_neighbors=k)`` (``dimension_pw_`` and, with comb="mle",
    ``dimension_``).

    References
    ----------
    E. Levina, P. Bickel. "Maximum Likelihood Estimation of Intrinsic Dimension". NIPS 2004.
    D. MacKay, Z. Ghahramani. "Comments on 'Maximum Likelihood Estimation of Intrinsic
    Dimension' by E. Levina and P. Bickel", 2005.
    """
    X = _matrix(X, "X", 3)
    k = _neighbour_count(k, X.shape[0], low=2)
    if not isinstance(unbiased, (bool, np.bool_)):
        raise ValueError(f"unbiased must be a bool, got {unbiased!r}")
    _, dist = _knn(X, k)
    factor = k - 2 if unbiased else k - 1
    with np.errstate(divide="ignore", invalid="ignore"):
        S = np.log(dist[:, -1:] / dist[:, :-1]).sum(axis=1)
        per_point = factor / S
    finite = np.isfinite(S)
    if not finite.any() or S[finite].mean() == 0:
        dimension = float("nan")
    else:
        dimension = float(factor / S[finite].mean())
    return MLEDimension(per_point, dimension)


class IntrinsicDimension(NamedTuple):
    """Per-point estimates ``per_point`` (n,) and one ``dimension`` for the whole set."""

    per_point: np.ndarray
    dimension: float


def intrinsic_dimension(X, method="local_pca", k=20, threshold=0.9) -> IntrinsicDimension:
    """Per-point and overall intrinsic dimension by one of three estimators.

    Parameters
    ----------
    X : array-like of shape (n, d)
    method : "local_pca", "twonn" or "mle"
    k : int, neighbours per point (``n > k``; at least 2, 3 for "twonn").
    threshold : float in (0, 1), variance share, used by "local_pca" only.

    Returns
    -------
    IntrinsicDimension
        - "local_pca": :func:`local_pca_dimension` per point, ``dimension`` their mean;
        - "twonn": :func:`twonn_local_dimension` per point (MLE, nothing discarded,
          pooled neighbourhood), ``dimension`` the global :func:`twonn_dimension`;
        - "mle": :func:`mle_dimension`, ``dimension`` the MacKay-Ghahramani average.
    """
    if method not in _DIMENSION_METHODS:
        raise ValueError(f"method must be one of {_DIMENSION_METHODS}, got {method!r}")
    if method == "local_pca":
        per_point = local_pca_dimension(X, k, threshold)
        return IntrinsicDimension(per_point, float(per_point.mean()))
    if method == "twonn":
        per_point = twonn_local_dimension(X, k)
        return IntrinsicDimension(per_point, twonn_dimension(X))
    per_point, dimension = mle_dimension(X, k)
    return IntrinsicDimension(per_point, dimension)


# ------------------------------------------------------------------------------- Emb2Emb


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
