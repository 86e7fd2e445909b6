"""Global similarity of two spaces with matched rows, each measure beside a baseline.

``A`` (k, d_a) and ``B`` (k, d_b): row i of both is the same token::

    r      = pearson({cos(a_i, a_j)}_{i<j}, {cos(b_i, b_j)}_{i<j})
    CKA    = ||B_c^T A_c||_F^2 / (||A_c^T A_c||_F ||B_c^T B_c||_F)
    CKA_u  = HSIC_1(K, L) / sqrt(HSIC_1(K, K) HSIC_1(L, L))     (debiased; Song et al. 2012)
    P      = min_{R orthogonal} ||A_n R - B_n||_F^2 = 2 - 2 ||A_n^T B_n||_*
    mkNN   = mean_i |N_A(i) & N_B(i)| / k                        (Huh et al. 2024)
    CKNNA  = CKA_u restricted to mutual neighbours                (Huh et al. 2024)
    CKA_ll = ||C_ij||_F^2 / (||C_ii||_F ||C_jj||_F)   layer by layer, from a streamed
             cross-layer co-moment (exact over every occurrence)

with ``X_c`` column-centred and ``X_n = X_c / ||X_c||_F``. Nothing here builds a k x k
matrix except :func:`cosine_matrix` (refused beyond ``10,000`` rows).
"""

from __future__ import annotations

import numpy as np

from embgeom.geometry._checks import (_centred_unit, _integer, _matrix, _neighbour_count, _pair,
                                      _rows_per_chunk, _seed, _unit_rows)
from embgeom.geometry.neighbors import _knn, _neighbor_overlap
from embgeom.stats import chan_merge, chan_merge_comoment

# Rows whose full cosine matrix we are willing to form or scan: 10,000 rows are 5e7 pairs,
# 0.8 GB as one dense matrix (never formed by pearson_cosine, which scans it in blocks) and
# about 1e8 * d flops per space. Beyond it, callers sample.
MAX_COSINE_ROWS = 10_000
# Cosines carry roundoff of order d * eps (< 1e-12 for any model width); a spread of the
# cosines below that (variance 1e-24) is roundoff, not structure.
_MIN_COSINE_VARIANCE = 1e-24


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
    and merged with :func:`embgeom.stats.chan_merge`; raw sums would cancel when the cosines share a large mean
    (anisotropic spaces have mean cosines near 0.9 with a small spread).
    """
    k = U.shape[0]
    if block_rows is None:
        # per row of a block: two cosine rows, two index rows, two gathered value rows
        block_rows = _rows_per_chunk(6 * k)
    # (x, y) as 2-vectors: their mean and 2 x 2 co-moment, merged block by block.
    n, mean, C = 0, np.zeros(2), np.zeros((2, 2))
    for s in range(0, k - 1, block_rows):
        e = min(s + block_rows, k - 1)
        # entry (r, c) of these blocks is the pair (s + r, s + 1 + c): i < j iff c >= r
        rr, cc = np.triu_indices(e - s, 0, k - s - 1)
        xy = np.stack([(U[s:e] @ U[s + 1 :].T)[rr, cc], (V[s:e] @ V[s + 1 :].T)[rr, cc]])
        nb = xy.shape[1]
        mb = xy.mean(axis=1)
        dev = xy - mb[:, None]
        C = chan_merge_comoment(n, mean, C, nb, mb, dev @ dev.T)
        n, mean, _, _ = chan_merge(n, mean, 0.0, nb, mb, 0.0)
    sxx, syy, sxy = C[0, 0], C[1, 1], C[0, 1]
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


def _hsic_unbiased_linear(A: np.ndarray, B: np.ndarray) -> float:
    """Song et al.'s unbiased HSIC of the linear kernels of A and B, without n x n matrices.

    With ``s_i = ||a_i||^2``, ``t_i = ||b_i||^2`` (the diagonals that K~ and L~ drop) and
    ``S_A = sum a_i``::

        tr(K~ L~)   = ||A^T B||_F^2 - sum_i s_i t_i
        1^T K~ 1    = ||S_A||^2 - sum_i s_i
        1^T K~ L~ 1 = sum_i (a_i . S_A - s_i) (b_i . S_B - t_i)
    """
    n = A.shape[0]
    s, t = np.einsum("ij,ij->i", A, A), np.einsum("ij,ij->i", B, B)
    sa, sb = A.sum(axis=0), B.sum(axis=0)
    trace = np.linalg.norm(A.T @ B) ** 2 - s @ t
    sum_k, sum_l = sa @ sa - s.sum(), sb @ sb - t.sum()
    row_k, row_l = A @ sa - s, B @ sb - t
    return float((trace + sum_k * sum_l / ((n - 1) * (n - 2)) - 2.0 * (row_k @ row_l) / (n - 2))
                 / (n * (n - 3)))


def _unbiased_cka(A: np.ndarray, B: np.ndarray) -> float:
    An, Bn = _centred_unit(A), _centred_unit(B)
    if An is None or Bn is None:
        return float("nan")
    aa, bb = _hsic_unbiased_linear(An, An), _hsic_unbiased_linear(Bn, Bn)
    if aa <= 0 or bb <= 0:
        return float("nan")
    return float(_hsic_unbiased_linear(An, Bn) / np.sqrt(aa * bb))


def unbiased_cka(A, B) -> float:
    """Linear CKA with the debiased HSIC estimator (Song et al. 2012), as Murphy et al. use it.

    Parameters
    ----------
    A : array-like of shape (n, d_a)
    B : array-like of shape (n, d_b)
        Matched rows, finite, ``n >= 4``.

    Returns
    -------
    cka : float
        ``HSIC_1(K, L) / sqrt(HSIC_1(K, K) HSIC_1(L, L))``: 1 for B an orthogonal transform
        of A times a scalar, about 0 (either sign) for unrelated spaces whatever n and d;
        ``nan`` when either space has no spread.

    Notes
    -----
    With ``K = A A^T``, ``L = B B^T`` and ``K~``, ``L~`` their copies with the diagonal set
    to 0::

        HSIC_1(K, L) = [tr(K~ L~) + (1^T K~ 1)(1^T L~ 1) / ((n-1)(n-2))
                        - 2 / (n-2) 1^T K~ L~ 1] / (n (n-3))

    an unbiased estimator of the population HSIC. Computed from row norms and d x d
    products (``O(n d_a d_b)``, no n x n matrix) on the centred matrices scaled to unit
    Frobenius norm (neither changes the ratio; they keep it from overflowing). The usual
    (biased) linear CKA of :func:`linear_cka` tends to 1 on independent random data when
    n is small against d; this one does not.

    References
    ----------
    L. Song, A. Smola, A. Gretton, J. Bedo, K. Borgwardt. "Feature Selection via Dependence
    Maximization". JMLR 2012.
    A. Murphy, J. Zylberberg, A. Fyshe. "Correcting Biased Centered Kernel Alignment
    Measures in Biological and Artificial Neural Networks". ICLR 2024 Re-Align workshop.
    """
    A, B = _pair(A, B, 4)
    return _unbiased_cka(A, B)


def _cosine_neighbours(A: np.ndarray, B: np.ndarray, k: int):
    """Unit rows of A and B and their k nearest neighbours by cosine (Euclidean on unit
    rows orders neighbours as the cosine does)."""
    Ua, Ub = _unit_rows(A, "A"), _unit_rows(B, "B")
    return Ua, Ub, _knn(Ua, k)[0], _knn(Ub, k)[0]


def mutual_knn(A, B, k=10) -> float:
    """Mutual k-nearest-neighbour alignment (Huh et al. 2024).

    Parameters
    ----------
    A : array-like of shape (n, d_a)
    B : array-like of shape (n, d_b)
        Matched rows, finite, no zero row.
    k : int, ``1 <= k <= n - 1``.

    Returns
    -------
    score : float in [0, 1]
        ``mean_i |N_A(i) & N_B(i)| / k``, ``N_X(i)`` the k rows of X with the largest cosine
        with x_i (itself excluded). 1 when the neighbourhoods agree; about ``k / (n - 1)``
        for unrelated spaces.

    References
    ----------
    M. Huh, B. Cheung, T. Wang, P. Isola. "The Platonic Representation Hypothesis". ICML 2024.
    """
    A, B = _pair(A, B, 2)
    k = _neighbour_count(k, A.shape[0])
    _, _, na, nb = _cosine_neighbours(A, B, k)
    return _neighbor_overlap(na, nb)


def _in_sorted(codes: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Which of ``codes`` are in the sorted array ``table``."""
    if table.size == 0:
        return np.zeros(codes.shape, dtype=bool)
    return table[np.minimum(np.searchsorted(table, codes), table.size - 1)] == codes


def _masked_hsic(U: np.ndarray, V: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> float:
    """Unbiased HSIC of ``K~ = M o (U U^T)`` and ``L~ = M o (V V^T)``, M the 0/1 mask with
    ones at (rows[e], cols[e]) (never on the diagonal, not necessarily symmetric), from the
    mask's entries only::

        sum_ij K~_ij L~_ji = sum over entries whose transpose is an entry of K_e L_e
        1^T K~ L~ 1        = sum_j (column sums of K~)_j (row sums of L~)_j
    """
    n = U.shape[0]
    k_e = np.einsum("ij,ij->i", U[rows], U[cols])
    l_e = np.einsum("ij,ij->i", V[rows], V[cols])
    codes = rows * n + cols
    table = np.sort(codes)
    both = _in_sorted(cols * n + rows, table)
    trace = float(k_e[both] @ l_e[both])
    kl = float(np.bincount(cols, k_e, n) @ np.bincount(rows, l_e, n))
    return (trace + k_e.sum() * l_e.sum() / ((n - 1) * (n - 2)) - 2.0 * kl / (n - 2)) / (n * (n - 3))


def _cknna(Ua: np.ndarray, Ub: np.ndarray, na: np.ndarray, nb: np.ndarray) -> float:
    n, k = na.shape
    owner = np.repeat(np.arange(n, dtype=np.int64), k)
    # the mutual mask: j in N_A(i) and in N_B(i)
    shared = _in_sorted((owner * n + na.ravel()), np.sort(owner * n + nb.ravel()))
    kl = _masked_hsic(Ua, Ub, owner[shared], na.ravel()[shared])
    kk = _masked_hsic(Ua, Ua, owner, na.ravel())
    ll = _masked_hsic(Ub, Ub, owner, nb.ravel())
    if not (kk > 0 and ll > 0):
        return float("nan")
    return float(kl / np.sqrt(kk * ll))


def cknna(A, B, k=10) -> float:
    """Centred kernel nearest-neighbour alignment, CKNNA (Huh et al. 2024).

    Parameters
    ----------
    A : array-like of shape (n, d_a)
    B : array-like of shape (n, d_b)
        Matched rows, finite, no zero row, ``n >= 4``.
    k : int, ``1 <= k <= n - 1``.

    Returns
    -------
    score : float
        1 when A and B have the same cosine kernel; about 0 for unrelated spaces;
        ``nan`` when a self-alignment is not positive.

    Notes
    -----
    Rows are scaled to unit norm; ``K = A A^T`` and ``L = B B^T`` (cosines); ``N_X(i)`` the
    k nearest neighbours by cosine. With ``M_ij = [j in N_A(i) and j in N_B(i)]``::

        CKNNA = HSIC_1(M o K, M o L) / sqrt(HSIC_1(M_A o K, M_A o K) HSIC_1(M_B o L, M_B o L))

    ``HSIC_1`` the unbiased estimator of :func:`unbiased_cka` (with ``sum_ij K~_ij L~_ji``
    as the trace term: the masks are not symmetric), ``M_A``, ``M_B`` each space's own
    k-NN mask: CKA restricted to pairs that are neighbours in both spaces. The formula of
    the authors' code (``platonic-rep``, ``metrics.cknna`` with ``unbiased=True``), without
    its 1e-6 added to the denominator; computed from the ``<= n k`` masked entries only.

    References
    ----------
    M. Huh, B. Cheung, T. Wang, P. Isola. "The Platonic Representation Hypothesis". ICML 2024.
    """
    A, B = _pair(A, B, 4)
    k = _neighbour_count(k, A.shape[0])
    return _cknna(*_cosine_neighbours(A, B, k))


def global_similarity(A, B, sample=None, seed=0, k=10) -> dict:
    """Every global measure of two spaces, each beside a shuffled baseline.

    Parameters
    ----------
    A : array-like of shape (n, d_a)
    B : array-like of shape (n, d_b)
        Matched rows, finite, no zero row, ``n >= 3``.
    sample : int or None
        Row sample for the Pearson of cosines only (see :func:`pearson_cosine`); the others
        are ``O(n d^2)`` or ``O(n^2 d)`` in blocks and always use every row.
    seed : int
        Seeds the row sample and the baseline's permutation.
    k : int >= 1, neighbours per row for ``mutual_knn`` and ``cknna`` (``n - 1`` if larger).

    Returns
    -------
    dict with
        ``pearson_cosine``, ``cka_linear``, ``procrustes_residual``, ``unbiased_cka``,
        ``mutual_knn``, ``cknna`` : float, as :func:`pearson_cosine`, :func:`linear_cka`,
            :func:`procrustes_residual`, :func:`unbiased_cka`, :func:`mutual_knn`,
            :func:`cknna` (``unbiased_cka`` and ``cknna`` nan below 4 rows);
        ``baseline`` : dict with the same keys, computed on ``(A, B[perm])``, perm a seeded
            random permutation of the rows: what unrelated spaces with these marginal
            geometries give (Pearson, unbiased CKA and CKNNA about 0, CKA about
            ``sqrt(d_a d_b) / n`` for n >> d and near 1 for n << d, mutual k-NN about
            ``k / (n - 1)``, Procrustes well above 0);
        ``rows`` : int, n; ``pairs`` : int, the cosine pairs compared, ``m (m - 1) / 2``;
        ``k`` : int, the neighbours used.

    Notes
    -----
    The baseline's neighbours are B's own, relabelled by the permutation (the neighbours
    of row i of ``B[perm]`` are ``perm^-1`` of those of row ``perm[i]`` of B): no second
    search.
    """
    A, B = _pair(A, B, 3)
    seed = _seed(seed)
    n = A.shape[0]
    k = min(_integer(k, "k", 1), n - 1)
    rows = _sample_rows(n, sample, seed)
    m = n if rows is None else rows.size
    perm = np.random.default_rng([seed, 1]).permutation(n)
    shuffled = B[perm]
    Ua, Ub, na, nb = _cosine_neighbours(A, B, k)
    inverse = np.argsort(perm)
    nb_shuffled = inverse[nb[perm]]
    few = n < 4

    def scores(Bx, Ux, nx):
        return {
            "pearson_cosine": _pearson_rows(A, Bx, rows),
            "cka_linear": _linear_cka(A, Bx),
            "procrustes_residual": _procrustes_residual(A, Bx),
            "unbiased_cka": float("nan") if few else _unbiased_cka(A, Bx),
            "mutual_knn": _neighbor_overlap(na, nx),
            "cknna": float("nan") if few else _cknna(Ua, Ux, na, nx),
        }

    return {
        **scores(B, Ub, nb),
        "baseline": scores(shuffled, Ub[perm], nb_shuffled),
        "rows": n,
        "pairs": m * (m - 1) // 2,
        "k": k,
    }


def layer_cka(comoment, num_layers) -> np.ndarray:
    """Linear CKA of every pair of layers from the co-moment of the concatenated layers.

    Parameters
    ----------
    comoment : array-like of shape (L d, L d), float64
        ``C = sum_x (x - mean)(x - mean)^T`` over embeddings ``x = [x_1, ..., x_L]`` (an
        occurrence's states at L layers, concatenated); block (i, j) of d x d is
        ``C_ij = X_i,c^T X_j,c``, the centred cross-moment of layers i and j.
    num_layers : int, L (it divides the side of C).

    Returns
    -------
    ndarray of shape (L, L), float64, symmetric, diagonal 1::

        CKA_ij = ||C_ij||_F^2 / (||C_ii||_F ||C_jj||_F)

    Kornblith et al.'s linear CKA over every occurrence (the HSIC form divided by n^2 on
    both sides: the counts cancel), which is also Escoufier's RV coefficient of the centred
    layers. ``nan`` in the rows of a layer with no spread (``C_ii = 0``).

    Notes
    -----
    C is divided by its largest entry first (CKA is scale invariant), so the squares
    neither overflow nor underflow.
    """
    C = _matrix(comoment, "comoment")
    L = _integer(num_layers, "num_layers", 1)
    if C.shape[0] != C.shape[1] or C.shape[0] % L:
        raise ValueError(f"comoment must be square with a side divisible by {L}, got {C.shape}")
    scale = np.max(np.abs(C))
    d = C.shape[0] // L
    blocks = (C / scale if scale > 0 else C).reshape(L, d, L, d)
    F = np.einsum("idje,idje->ij", blocks, blocks)
    norms = np.sqrt(np.diag(F))
    with np.errstate(invalid="ignore", divide="ignore"):
        out = F / np.outer(norms, norms)
    return np.clip(out, 0.0, 1.0)
