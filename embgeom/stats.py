"""Streaming moments of embeddings and the Q = M + V decomposition, in float64.

For a set X of n vectors x in R^d::

    Q(X) = mean ||x||^2          mean squared norm
    M(X) = ||mean x||^2          squared norm of the mean
    V(X) = mean ||x - mean||^2   total (population) variance,   Q = M + V

A part of X is kept as ``(n, mean, m2)`` with ``m2 = sum ||x - mean||^2`` and two parts
merge exactly with Chan, Golub & LeVeque (1979)::

    n = na + nb;  delta = mb - ma;  mean = ma + delta * nb / n
    m2 = m2a + m2b + ||delta||^2 * na * nb / n

Raw sums (``sum ||x||^2 - ||sum x||^2 / n``) cancel catastrophically when M >> V, which
is common (position-0 states, massive activations in decoders); the merge above does not,
and it gives the same result whatever the order, split or batch size of the parts.

Everything here is pure array arithmetic on float64: no I/O, no Redis, no torch import.
:func:`chan_merge` uses operators only, so the worker's device accumulator (torch
tensors) and the store's merge of stored records (numpy arrays) run this one formula.

References
----------
Chan, Golub & LeVeque, "Updating formulae and a pairwise algorithm for computing sample
variances", 1979.
Yamagiwa & Shimodaira, "Norm of Mean Contextualized Embeddings Determines their
Variance", 2024.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

__all__ = [
    "chan_merge",
    "chan_merge_comoment",
    "TokenMoments",
    "LayerMoments",
    "WindowMoments",
    "BUCKET_EDGES",
    "bucket_index",
    "aligned_buckets",
    "bucket_sums",
    "moments_of_points",
    "q_m_v",
    "decomposition",
    "decomposition_from_sums",
    "decomposition_from_totals",
    "two_sum",
    "compensated_sum",
    "add_compensated",
    "layer_summary",
]

# Unit roundoff of float64 (half the machine epsilon): |fl(a op b) - a op b| <= U |a op b|.
U = float(np.finfo(np.float64).eps) / 2


def _gamma(m: int) -> float:
    """Higham's ``gamma_m = m u / (1 - m u)``: the relative error bound of m roundings."""
    return m * U / (1.0 - m * U)


def _float(x):
    """float64 view of a count or array; torch tensors pass through (callers give float64)."""
    if type(x).__module__.startswith("torch"):
        return x
    return np.asarray(x, dtype=np.float64)


def _weights(n_a, n_b):
    """``(n, na nb / n, nb / n)``: Python ints (the store's counts) stay exact until the one
    division; arrays and tensors in float64, an empty merge dividing by 1, not 0."""
    if isinstance(n_a, int) and isinstance(n_b, int):
        n = n_a + n_b
        return n, (n_a * n_b / n if n else 0.0), (n_b / n if n else 0.0)
    n_a, n_b = _float(n_a), _float(n_b)
    n = n_a + n_b
    safe_n = n + (n == 0)
    return n, n_a * n_b / safe_n, n_b / safe_n


def _last_axis(w):
    """A per-row weight broadcast over the last (dimension) axis."""
    return w if isinstance(w, float) else w[..., None]


def chan_merge(n_a, mean_a, m2_a, n_b, mean_b, m2_b, inplace: bool = False):
    """Merge two moment states ``(n, mean, m2)`` (Chan et al.), vectorised over rows.

    The project's one Chan merge: the worker's device window (torch), the store's head
    segments and the geometry's blocked Pearson all call it.

    Parameters
    ----------
    n_a, n_b : arrays of shape (...,), counts (an empty part has n = 0), or Python ints
        (then ``na nb / n`` is formed exactly before its one rounding).
    mean_a, mean_b : arrays of shape (..., d), float64 means.
    m2_a, m2_b : arrays of shape (...,), float64 ``sum ||x - mean||^2``.

    Works on numpy arrays and, unchanged, on float64 torch tensors (operators only).
    ``inplace=True`` writes the merged mean and m2 into ``mean_a`` and ``m2_a`` and
    returns them: purely a memory (and memory-traffic) optimisation, the same numbers.

    Returns
    -------
    n, mean, m2 : the merged state, same shapes, float64.
    cross : array of shape (...,), ``||mb - ma||^2 na nb / n``; the increase of the
        within-part sum of squares beyond ``m2_a + m2_b`` (callers keep running totals
        of sum m2 with it).

    Notes
    -----
    ``n = na + nb; delta = mb - ma; mean = ma + delta nb / n;
    m2 = m2a + m2b + ||delta||^2 na nb / n``. A side with n = 0 contributes nothing.
    """
    n, f, w = _weights(n_a, n_b)
    delta = mean_b - mean_a
    cross = (delta * delta).sum(-1) * f
    delta *= _last_axis(w)
    if inplace:
        mean_a += delta
        m2_a += m2_b
        m2_a += cross
        return n, mean_a, m2_a, cross
    return n, mean_a + delta, m2_a + m2_b + cross, cross


def chan_merge_comoment(n_a, mean_a, c_a, n_b, mean_b, c_b, index=None):
    """Merge two co-moment matrices ``C = sum (x - mean)(x - mean)^T``, batched over layers.

    Parameters
    ----------
    n_a, n_b : float or int, counts (the same for every layer).
    mean_a, mean_b : arrays of shape (..., d), float64.
    c_a, c_b : arrays of shape (..., d, d), float64; or, with ``index``, of shape
        (..., m): the entries ``C[rows, cols]`` only (the store's upper-triangular chunks).
    index : None, or ``(rows, cols)``, integer arrays of shape (m,).

    Returns
    -------
    array of c_a's shape: ``C = Ca + Cb + (na nb / n) delta delta^T``,
    ``delta = mb - ma`` (restricted to ``index``). The covariance (population) is
    ``C / n``; ``trace(C)`` is the m2 of :func:`chan_merge`; the merged mean is
    :func:`chan_merge`'s.
    """
    n, f, _ = _weights(n_a, n_b)
    delta = mean_b - mean_a
    if index is None:
        outer = delta[..., :, None] * delta[..., None, :]
    else:
        outer = delta[..., index[0]] * delta[..., index[1]]
    return c_a + c_b + outer * f


@dataclass
class TokenMoments:
    """Per-token moments at every kept layer, for a set of distinct token keys.

    Token-major, the layout of the stored records: one row per token, all layers.

    Attributes
    ----------
    ids : ndarray of shape (k,), int64, the token keys (unique).
    n : ndarray of shape (k,), int64, occurrences of each token (the same at every layer).
    mean : ndarray of shape (k, L, d), float64, per-layer mean embedding of each token.
    m2 : ndarray of shape (k, L), float64, per-layer ``sum ||x - mean||^2``.
    unit_sum : ndarray of shape (k, L, d), float64, per-layer ``sum x / ||x||`` (for
        self-similarity, Ethayarajh 2019), or None when the collection keeps none.
    """

    ids: np.ndarray
    n: np.ndarray
    mean: np.ndarray
    m2: np.ndarray
    unit_sum: Optional[np.ndarray] = None

    @property
    def num_layers(self) -> int:
        return self.mean.shape[1]

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def take(self, rows) -> "TokenMoments":
        """The subset ``rows`` (an index array or mask), in that order."""
        return TokenMoments(self.ids[rows], self.n[rows], self.mean[rows], self.m2[rows],
                            None if self.unit_sum is None else self.unit_sum[rows])

    def layers(self, span: slice) -> "TokenMoments":
        """The kept layers ``span`` of every token (views, no copy): mean (k, P, d)."""
        return TokenMoments(self.ids, self.n, self.mean[:, span], self.m2[:, span],
                            None if self.unit_sum is None else self.unit_sum[:, span])


@dataclass
class LayerMoments:
    """Moments of all embeddings of each kept layer, whatever their token.

    Attributes
    ----------
    n : int, number of embeddings (the same at every layer).
    mean : ndarray of shape (L, d), float64.
    comoment : ndarray of shape (L, d, d), float64, ``sum (x - mean)(x - mean)^T``;
        its trace is ``m2`` and ``comoment / n`` the population covariance.
    unit_sum : ndarray of shape (L, d), float64, ``U = sum x / ||x||``.
    unit_sq_sum : ndarray of shape (L, d), float64, ``sum (x_i / ||x||)^2`` per dimension.
    cross : ndarray of shape (L d, L d), float64, or None: the co-moment of the
        concatenation ``[x_1, ..., x_L]`` of an embedding's kept layers (its mean is
        ``mean.reshape(-1)``); block (i, j) is ``sum (x_i - mean_i)(x_j - mean_j)^T``, the
        diagonal blocks are ``comoment``. Kept only by ``cross_layer`` collections.
    """

    n: int
    mean: np.ndarray
    comoment: np.ndarray
    unit_sum: np.ndarray
    unit_sq_sum: np.ndarray
    cross: Optional[np.ndarray] = None

    @classmethod
    def empty(cls, num_layers: int, dim: int) -> "LayerMoments":
        return cls(
            n=0,
            mean=np.zeros((num_layers, dim)),
            comoment=np.zeros((num_layers, dim, dim)),
            unit_sum=np.zeros((num_layers, dim)),
            unit_sq_sum=np.zeros((num_layers, dim)),
        )

    @property
    def m2(self) -> np.ndarray:
        """``sum ||x - mean||^2`` per layer, shape (L,)."""
        return np.einsum("lii->l", self.comoment)

    def merged(self, other: "LayerMoments") -> "LayerMoments":
        """Return the exact union of two disjoint sets of embeddings (Chan merge)."""
        if self.n + other.n == 0:
            return self
        n, mean, _, _ = chan_merge(self.n, self.mean, 0.0, other.n, other.mean, 0.0)
        return LayerMoments(
            n=n,
            mean=mean,
            comoment=chan_merge_comoment(self.n, self.mean, self.comoment,
                                         other.n, other.mean, other.comoment),
            unit_sum=self.unit_sum + other.unit_sum,
            unit_sq_sum=self.unit_sq_sum + other.unit_sq_sum,
            cross=None if self.cross is None or other.cross is None else chan_merge_comoment(
                self.n, self.mean.reshape(-1), self.cross, other.n, other.mean.reshape(-1),
                other.cross),
        )


@dataclass
class WindowMoments:
    """What one checkpoint adds: the merged moments of a window of whole jobs.

    Attributes
    ----------
    tokens : the per-token moments of every token the window saw, ids sorted.
    layers : the per-layer moments of all its embeddings.
    job_tokens : job id -> embeddings it counted (per layer), for its status.
    names : hashed word key -> its name (word-unit collections), stored with the key's
        record when the key is first written to its shard.
    """

    tokens: TokenMoments
    layers: LayerMoments
    job_tokens: dict = field(default_factory=dict)
    names: dict = field(default_factory=dict)

    @property
    def counted(self) -> int:
        return int(self.layers.n)


# ------------------------------------------------------------ compensated running sums

def two_sum(a, b):
    """Error-free sum (Knuth): ``s = fl(a + b)`` and ``e`` with ``a + b = s + e`` exactly.

    Parameters
    ----------
    a, b : float64 arrays of one shape (or broadcastable).

    Returns
    -------
    s, e : float64 arrays. Six roundings, no branch; exact whatever the magnitudes.
    """
    s = a + b
    b_virtual = s - a
    a_virtual = s - b_virtual
    return s, (a - a_virtual) + (b - b_virtual)


def compensated_sum(terms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sum of the rows of ``terms`` as an unevaluated pair ``(s, e)``.

    Parameters
    ----------
    terms : ndarray of shape (m, ...), float64.

    Returns
    -------
    s, e : ndarrays of shape ``terms.shape[1:]``; ``s`` is the exact sum of the rows'
    high parts and ``s + e`` equals the exact sum up to ``4 m (m + 2) u^2 max|terms|``.

    Notes
    -----
    Rump, Ogita & Oishi's extraction (AccSum, 2008), per column: with ``sigma = 2^k >=
    2^ceil(log2(m + 2)) max|x_i|``, ``q_i = fl(fl(sigma + x_i) - sigma)`` and
    ``r_i = x_i - q_i`` are exact, the q_i are multiples of one power of two whose sum
    float64 holds, so ``sum q_i`` has no rounding at all, and only the small ``r_i``
    (``|r_i| <= u sigma``) are summed with rounding. A few passes over the rows, in
    cache-sized blocks: the cost of a few plain sums.
    """
    x = np.asarray(terms, dtype=np.float64)
    m = x.shape[0]
    s, e = np.zeros(x.shape[1:]), np.zeros(x.shape[1:])
    if m == 0:
        return s, e
    big = np.maximum(x.max(axis=0), -x.min(axis=0))
    _, exponent = np.frexp(big)  # big < 2**exponent
    sigma = np.where(big > 0, np.ldexp(1.0, exponent + int(np.ceil(np.log2(m + 2)))), 0.0)
    # Blocks of rows whose temporaries stay in cache (a speed choice only: every partial
    # sum of the q_i is exact, so the blocking changes no bit of ``s``).
    q = np.empty((min(m, _BLOCK),) + x.shape[1:])
    r = np.empty_like(q)
    for i in range(0, m, _BLOCK):
        block = x[i:i + _BLOCK]
        qb = np.add(block, sigma, out=q[:block.shape[0]])
        qb -= sigma
        s += qb.sum(axis=0)
        e += np.subtract(block, qb, out=r[:block.shape[0]]).sum(axis=0)
    return s, e


_BLOCK = 128


def add_compensated(total: np.ndarray, comp: np.ndarray, s: np.ndarray, e: np.ndarray):
    """A running sum kept as ``(total, comp)`` plus a delta ``(s, e)``, renormalised.

    Returns ``(total', comp')`` with ``total' + comp' = total + comp + s + e`` up to
    ``u^2 |total|`` and ``total' = fl(total' + comp')``: the stored ``total`` is the
    correctly rounded running sum (a reader may ignore ``comp``), and ``comp`` carries
    what float64 cannot hold, so add/subtract updates do not drift with their number
    (Neumaier 1974, in the renormalised double-double form).
    """
    t, err = two_sum(total, s)
    return two_sum(t, comp + (err + e))


# ----------------------------------------------------------------------- count buckets

# Lower edges of the token-count buckets. A token type with n_t occurrences is in bucket
# ``b`` when ``BUCKET_EDGES[b] <= n_t < BUCKET_EDGES[b + 1]``. A count filter
# ``min_count <= n_t <= max_count`` is a union of whole buckets when ``min_count`` is an
# edge and ``max_count`` is None or ``max_count + 1`` is an edge: the usual thresholds
# (2, 3, 5, 10, 20, 50, 100, ... and the paper's 10 <= n_t <= 100000) are.
BUCKET_EDGES = np.array([1, 2, 3, 5, 10, 20, 50, 100, 101, 200, 500, 1000, 1001, 2000,
                         5000, 10000, 10001, 100000, 100001], dtype=np.int64)


def bucket_index(n) -> np.ndarray:
    """Bucket of each count: ndarray of shape (k,) int64 in ``[0, len(BUCKET_EDGES))``."""
    return np.searchsorted(BUCKET_EDGES, np.asarray(n, dtype=np.int64), side="right") - 1


def aligned_buckets(min_count: int, max_count: Optional[int]) -> Optional[np.ndarray]:
    """The buckets whose union is exactly ``min_count <= n_t <= max_count``, or None
    when the filter does not fall on bucket edges."""
    edges = BUCKET_EDGES.tolist()
    if min_count not in edges:
        return None
    lo = edges.index(min_count)
    if max_count is None:
        return np.arange(lo, len(edges))
    if max_count + 1 not in edges:
        return None
    return np.arange(lo, edges.index(max_count + 1))


def bucket_sums(buckets: np.ndarray, n: np.ndarray, mean: np.ndarray, num_buckets: int):
    """Per-bucket aggregates of token types, for the filtered decomposition.

    Parameters
    ----------
    buckets : ndarray of shape (k,), int64, the bucket of each type.
    n : ndarray of shape (k,), counts.
    mean : ndarray of shape (k, L, d), float64, per-type means.

    Returns
    -------
    types : ndarray (B,) float64, number of types per bucket; ``count`` (B,) float64,
    ``sum n_t``; ``vector`` (B, L, d) float64, ``sum n_t mean_t`` (the sum of the
    embeddings of the bucket's types).
    """
    n = np.asarray(n, dtype=np.float64)
    types = np.bincount(buckets, minlength=num_buckets).astype(np.float64)
    count = np.bincount(buckets, weights=n, minlength=num_buckets)
    vector = np.zeros((num_buckets,) + mean.shape[1:])
    for b in np.flatnonzero(types):  # a loop over the (few) buckets, not the tokens
        rows = buckets == b
        vector[b] = np.einsum("k,k...->...", n[rows], mean[rows])
    return types, count, vector


def moments_of_points(x: np.ndarray) -> tuple[int, np.ndarray, float]:
    """Two-pass float64 moments of a point set, the reference the merges must equal.

    Parameters
    ----------
    x : ndarray of shape (n, d).

    Returns
    -------
    n, mean (d,), m2 = sum ||x - mean||^2.
    """
    x = np.asarray(x, dtype=np.float64)
    mean = x.mean(axis=0)
    return x.shape[0], mean, float(((x - mean) ** 2).sum())


def q_m_v(n, mean, m2):
    """Q, M, V of each part from its moments.

    Parameters
    ----------
    n : array-like of shape (...,), counts > 0.
    mean : ndarray of shape (..., d), float64.
    m2 : array-like of shape (...,), float64.

    Returns
    -------
    Q, M, V : ndarrays of shape (...,): ``M = ||mean||^2``, ``V = m2 / n``, ``Q = M + V``.
    """
    n = np.asarray(n, dtype=np.float64)
    M = np.einsum("...i,...i->...", mean, mean)
    V = np.asarray(m2, dtype=np.float64) / n
    return M + V, M, V


def _empty() -> dict:
    return {"n": 0, "num_types": 0, "Q": None, "M": None, "V": None, "V_W": None, "V_B": None,
            "V_B_error": None}


def decomposition(n_t, mean_t, m2_t) -> dict:
    """Global decomposition ``Q(X) = M(X) + V_W(X) + V_B(X)`` over token types.

    Parameters
    ----------
    n_t : ndarray of shape (k,), counts of the token types (all > 0).
    mean_t : ndarray of shape (k, d), float64, their means.
    m2_t : ndarray of shape (k,), float64, their ``sum ||x - mean_t||^2``.

    Returns
    -------
    dict with ``n``, ``num_types``, ``Q``, ``M``, ``V``, ``V_W``, ``V_B`` and
    ``V_B_error`` (floats; None when there is no embedding).

    Notes
    -----
    ``mu = sum n_t mu_t / n``; ``V_W = sum m2_t / n``; ``V_B = sum n_t ||mu_t - mu||^2 / n``
    (two-pass, no cancellation); ``M = ||mu||^2``; ``V = V_W + V_B``; ``Q = M + V``.
    ``V_B_error`` bounds the rounding of V_B: each difference ``mu_t - mu`` is rounded
    relatively, and the error of the computed ``mu`` (k products, k - 1 additions and a
    division: at most ``gamma_{k+1} sqrt(A)``, ``A = sum n_t ||mu_t||^2 / n``) raises V_B
    by its square only, so ``|error| <= gamma_{d+k+3} V_B + gamma_{k+1}^2 A``.
    """
    n_t = np.asarray(n_t, dtype=np.float64)
    n = float(n_t.sum())
    k = int(n_t.shape[0])
    if n == 0:
        return _empty()
    mu = (n_t[:, None] * mean_t).sum(axis=0) / n
    dev = mean_t - mu
    v_b = float((n_t * np.einsum("ki,ki->k", dev, dev)).sum() / n)
    v_w = float(np.sum(m2_t) / n)
    m = float(mu @ mu)
    a = float((n_t * np.einsum("ki,ki->k", mean_t, mean_t)).sum() / n)
    d = int(np.shape(mean_t)[-1])
    return {
        "n": int(n), "num_types": k,
        "Q": m + v_w + v_b, "M": m, "V": v_w + v_b, "V_W": v_w, "V_B": v_b,
        "V_B_error": _gamma(d + k + 3) * v_b + _gamma(k + 1) ** 2 * a,
    }


def decomposition_from_sums(n: float, vector_sum: np.ndarray, sum_m2: float, sum_nM: float,
                            num_types: int, parts: int = 1) -> dict:
    """The decomposition over a set of token types from its sums (no per-type means).

    Parameters
    ----------
    n : ``sum n_t`` over the types; ``vector_sum`` : ndarray (d,), ``sum n_t mu_t``;
    ``sum_m2`` : ``sum m2_t``; ``sum_nM`` : ``sum n_t ||mu_t||^2``; ``num_types`` : k;
    ``parts`` : how many stored partial sums ``vector_sum`` was added from (shards).

    Returns
    -------
    dict as :func:`decomposition`.

    Notes
    -----
    ``mu = vector_sum / n; M = ||mu||^2; V_W = sum_m2 / n; A = sum_nM / n;
    V_B = A - M``: the between-type variance as a difference of two means of squares,
    the only form the sums allow. It is not clamped: when the types' means nearly
    coincide (``V_B << M``) the difference cancels, and ``V_B_error`` says by how much.
    With every ``||mu_t||^2`` a length-d dot product, their weighted sum over k types, and
    ``vector_sum`` correctly rounded per part then summed over ``parts`` (each of its
    components off by at most ``gamma_{parts+1} sum n_t |mu_t,i|``, whose norm over i is
    at most ``n sqrt(A)``), ``|V_B - V_B_exact| <= gamma_{d+k+parts+3} (A + M)``.
    A negative V_B is within that bound of 0 (and rounding only).
    """
    if n == 0:
        return _empty()
    mu = np.asarray(vector_sum, dtype=np.float64) / n
    m = float(mu @ mu)
    v_w = float(sum_m2) / n
    a = float(sum_nM) / n
    v_b = a - m
    bound = _gamma(int(mu.shape[-1]) + int(num_types) + int(parts) + 3) * (a + m)
    return {"n": int(n), "num_types": int(num_types),
            "Q": m + v_w + v_b, "M": m, "V": v_w + v_b, "V_W": v_w, "V_B": v_b,
            "V_B_error": bound}


def decomposition_from_totals(n: float, mean: np.ndarray, m2: float, within: float,
                              num_types: int, parts: int = 1) -> dict:
    """The unfiltered decomposition in O(d) from the layer's moments and the within sum.

    Parameters
    ----------
    n : embeddings of the layer; ``mean`` : ndarray (d,), their mean; ``m2`` :
    ``sum ||x - mean||^2`` (the layer head); ``within`` : ``sum_t m2_t`` over every type,
    added from ``parts`` stored partial sums; ``num_types`` : k.

    Returns
    -------
    dict as :func:`decomposition`.

    Notes
    -----
    ``M = ||mean||^2; V = m2 / n; V_W = within / n; V_B = V - V_W``: a difference,
    cancelling when the types' means nearly coincide (``V_B << V_W``). Both operands are
    sums of at most n non-negative terms (per-embedding squares, Chan cross terms) added
    over ``parts``, each of relative error at most ``gamma_{d+n+parts+4}``; the Chan
    merges also subtract means (``delta = mb - ma``, off by ``u (|ma| + |mb|)``), which
    adds at most ``4 u sqrt(d Q m2 n log2(n + 1)) / n`` per operand, with
    ``Q = M + V`` standing for the squared norm of the means merged. ``V_B_error`` is the
    sum of both for ``V`` and ``V_W``: first order, an estimate of the worst case.
    """
    if n == 0:
        return _empty()
    mean = np.asarray(mean, dtype=np.float64)
    m = float(mean @ mean)
    v = float(m2) / n
    v_w = float(within) / n
    d = int(mean.shape[-1])
    chan = 4 * U * np.sqrt(d * (m + v) * np.log2(n + 1)) * (np.sqrt(v) + np.sqrt(v_w))
    bound = _gamma(d + int(n) + int(parts) + 4) * (v + v_w) + float(chan)
    return {"n": int(n), "num_types": int(num_types),
            "Q": m + v, "M": m, "V": v, "V_W": v_w, "V_B": v - v_w, "V_B_error": bound}


def _least_squares(x: np.ndarray, y: np.ndarray) -> tuple[float | None, float | None]:
    """Slope and R^2 of the least-squares line y ~ a + b x; None when undefined."""
    if x.shape[0] < 2:
        return None, None
    # The float mean of equal values can differ from them by an ulp, so test equality
    # directly rather than trusting sxx == 0.
    if np.all(x == x[0]):
        return None, None
    dx = x - x.mean()
    sxx = float(dx @ dx)
    dy = y - y.mean()
    slope = float(dx @ dy) / sxx
    syy = float(dy @ dy)
    r2 = None if (syy <= 0 or np.all(y == y[0])) else float(1.0 - ((dy - slope * dx) @ (dy - slope * dx)) / syy)
    return slope, r2


def layer_summary(n_t, Q_t, M_t, V_t) -> dict:
    """Per-layer summary over token types (Yamagiwa & Shimodaira 2024).

    Parameters
    ----------
    n_t, Q_t, M_t, V_t : ndarrays of shape (k,), counts and per-type Q, M, V of the
        token types already passing the caller's count filter.

    Returns
    -------
    dict with
    ``cv_Q``: population std / mean of ``Q_t``;
    ``slope``, ``intercept``, ``r2``: least squares ``V_t ~ intercept + slope * M_t``;
    ``slope_Q_log10n``, ``slope_M_log10n``, ``slope_V_log10n``: slopes of Q, M, V
    against ``log10 n_t``. Undefined values (fewer than 2 types, constant regressor)
    are None.
    """
    n_t = np.asarray(n_t, dtype=np.float64)
    Q_t, M_t, V_t = (np.asarray(a, dtype=np.float64) for a in (Q_t, M_t, V_t))
    out: dict = {"cv_Q": None, "slope": None, "intercept": None, "r2": None,
                 "slope_Q_log10n": None, "slope_M_log10n": None, "slope_V_log10n": None}
    if n_t.shape[0] == 0:
        return out
    mean_q = float(Q_t.mean())
    out["cv_Q"] = float(Q_t.std() / mean_q) if mean_q > 0 else None
    slope, r2 = _least_squares(M_t, V_t)
    out["slope"], out["r2"] = slope, r2
    if slope is not None:
        out["intercept"] = float(V_t.mean() - slope * M_t.mean())
    log_n = np.log10(n_t)
    for name, y in (("Q", Q_t), ("M", M_t), ("V", V_t)):
        out[f"slope_{name}_log10n"] = _least_squares(log_n, y)[0]
    return out
