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

Everything here is pure numpy on float64: no torch, no I/O.

References
----------
Chan, Golub & LeVeque, "Updating formulae and a pairwise algorithm for computing sample
variances", 1979.
Yamagiwa & Shimodaira, "Norm of Mean Contextualized Embeddings Determines their
Variance", 2024.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "chan_merge",
    "chan_merge_comoment",
    "TokenMoments",
    "LayerMoments",
    "TokenAccumulator",
    "moments_of_points",
    "q_m_v",
    "decomposition",
    "layer_summary",
]


def chan_merge(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    """Merge two moment states ``(n, mean, m2)`` (Chan et al.), vectorised over rows.

    Parameters
    ----------
    n_a, n_b : array-like of shape (...,), counts (an empty part has n = 0).
    mean_a, mean_b : ndarray of shape (..., d), float64 means.
    m2_a, m2_b : ndarray of shape (...,), float64 ``sum ||x - mean||^2``.

    Returns
    -------
    n, mean, m2 : the merged state, same shapes, float64.
    cross : ndarray of shape (...,), ``||mb - ma||^2 na nb / n``; the increase of the
        within-part sum of squares beyond ``m2_a + m2_b`` (callers keep running totals
        of sum m2 with it).

    Notes
    -----
    ``n = na + nb; delta = mb - ma; mean = ma + delta nb / n;
    m2 = m2a + m2b + ||delta||^2 na nb / n``. A side with n = 0 contributes nothing.
    """
    n_a = np.asarray(n_a, dtype=np.float64)
    n_b = np.asarray(n_b, dtype=np.float64)
    n = n_a + n_b
    safe_n = np.where(n > 0, n, 1.0)
    delta = mean_b - mean_a
    w_b = (n_b / safe_n)[..., None]
    mean = mean_a + delta * w_b
    cross = np.einsum("...i,...i->...", delta, delta) * (n_a * n_b / safe_n)
    m2 = m2_a + m2_b + cross
    return n, mean, m2, cross


def chan_merge_comoment(n_a, mean_a, c_a, n_b, mean_b, c_b):
    """Merge two co-moment matrices ``C = sum (x - mean)(x - mean)^T``.

    Parameters
    ----------
    n_a, n_b : float, counts.
    mean_a, mean_b : ndarray of shape (d,), float64.
    c_a, c_b : ndarray of shape (d, d), float64.

    Returns
    -------
    ndarray of shape (d, d): ``C = Ca + Cb + (na nb / n) delta delta^T``, delta = mb - ma.
    The covariance (population) is ``C / n``; ``trace(C)`` is the m2 of :func:`chan_merge`.
    """
    n = n_a + n_b
    if n == 0:
        return c_a + c_b
    delta = mean_b - mean_a
    return c_a + c_b + np.outer(delta, delta) * (n_a * n_b / n)


@dataclass
class TokenMoments:
    """Per-token moments at every layer, for a set of token keys.

    Attributes
    ----------
    ids : ndarray of shape (k,), int64, the token keys (unique).
    n : ndarray of shape (k,), int64, occurrences of each token (the same at every layer).
    mean : ndarray of shape (L, k, d), float64, per-layer mean embedding of each token.
    m2 : ndarray of shape (L, k), float64, per-layer ``sum ||x - mean||^2``.
    unit_sum : ndarray of shape (L, k, d), float64, per-layer ``sum x / ||x||`` (for
        self-similarity, Ethayarajh 2019).
    """

    ids: np.ndarray
    n: np.ndarray
    mean: np.ndarray
    m2: np.ndarray
    unit_sum: np.ndarray

    @property
    def num_layers(self) -> int:
        return self.mean.shape[0]

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@dataclass
class LayerMoments:
    """Moments of all embeddings of each layer, whatever their token.

    Attributes
    ----------
    n : int, number of embeddings (the same at every layer).
    mean : ndarray of shape (L, d), float64.
    comoment : ndarray of shape (L, d, d), float64, ``sum (x - mean)(x - mean)^T``;
        its trace is ``m2`` and ``comoment / n`` the population covariance.
    unit_sum : ndarray of shape (L, d), float64, ``U = sum x / ||x||``.
    unit_sq_sum : ndarray of shape (L, d), float64, ``sum (x_i / ||x||)^2`` per dimension.
    within : ndarray of shape (L,), float64, ``sum_t m2_t`` over token types, so that
        ``V_W = within / n`` is O(d) to read.
    """

    n: int
    mean: np.ndarray
    comoment: np.ndarray
    unit_sum: np.ndarray
    unit_sq_sum: np.ndarray
    within: np.ndarray

    @classmethod
    def empty(cls, num_layers: int, dim: int) -> "LayerMoments":
        return cls(
            n=0,
            mean=np.zeros((num_layers, dim)),
            comoment=np.zeros((num_layers, dim, dim)),
            unit_sum=np.zeros((num_layers, dim)),
            unit_sq_sum=np.zeros((num_layers, dim)),
            within=np.zeros(num_layers),
        )

    @property
    def m2(self) -> np.ndarray:
        """``sum ||x - mean||^2`` per layer, shape (L,)."""
        return np.einsum("lii->l", self.comoment)

    def merged(self, other: "LayerMoments") -> "LayerMoments":
        """Return the exact union of two disjoint sets of embeddings (Chan merge)."""
        n = self.n + other.n
        if n == 0:
            return self
        delta = other.mean - self.mean
        factor = self.n * other.n / n
        return LayerMoments(
            n=n,
            mean=self.mean + delta * (other.n / n),
            comoment=self.comoment
            + other.comoment
            + factor * np.einsum("li,lj->lij", delta, delta),
            unit_sum=self.unit_sum + other.unit_sum,
            unit_sq_sum=self.unit_sq_sum + other.unit_sq_sum,
            within=self.within + other.within,
        )


class TokenAccumulator:
    """Worker-local per-token state that grows with the distinct tokens it has seen.

    Rows are appended on first sight of a token and merged in place afterwards, so
    memory is O(distinct tokens x L x d), never O(vocabulary). ``within_increase`` keeps
    ``sum_t m2_t`` per layer exact under merges (see :func:`chan_merge`).
    """

    def __init__(self, num_layers: int, dim: int, capacity: int = 1024):
        self.num_layers = num_layers
        self.dim = dim
        self._rows: dict[int, int] = {}
        self._ids = np.zeros(capacity, dtype=np.int64)
        self._n = np.zeros(capacity, dtype=np.int64)
        self._mean = np.zeros((num_layers, capacity, dim))
        self._m2 = np.zeros((num_layers, capacity))
        self._unit_sum = np.zeros((num_layers, capacity, dim))

    def __len__(self) -> int:
        return len(self._rows)

    def _grow(self, needed: int) -> None:
        capacity = self._ids.shape[0]
        if needed <= capacity:
            return
        new_capacity = max(needed, 2 * capacity)

        def grow(a, axis):
            pad = [(0, 0)] * a.ndim
            pad[axis] = (0, new_capacity - capacity)
            return np.pad(a, pad)

        self._ids = grow(self._ids, 0)
        self._n = grow(self._n, 0)
        self._mean = grow(self._mean, 1)
        self._m2 = grow(self._m2, 1)
        self._unit_sum = grow(self._unit_sum, 1)

    def add(self, batch: TokenMoments) -> np.ndarray:
        """Merge a batch's per-token moments in place.

        Returns the increase of ``sum_t m2_t`` per layer, shape (L,).
        """
        if np.unique(batch.ids).shape[0] != len(batch):
            raise ValueError("a batch's token ids must be unique")
        rows = np.empty(len(batch), dtype=np.int64)
        for i, token in enumerate(batch.ids.tolist()):
            row = self._rows.get(token)
            if row is None:
                row = len(self._rows)
                self._rows[token] = row
            rows[i] = row
        self._grow(len(self._rows))
        self._ids[rows] = batch.ids
        n, mean, m2, cross = chan_merge(
            self._n[rows], self._mean[:, rows], self._m2[:, rows],
            batch.n, batch.mean, batch.m2,
        )
        self._n[rows] = n.astype(np.int64)
        self._mean[:, rows] = mean
        self._m2[:, rows] = m2
        self._unit_sum[:, rows] += batch.unit_sum
        return (batch.m2 + cross).sum(axis=1)

    def snapshot(self) -> TokenMoments:
        """The accumulated state as :class:`TokenMoments`, rows in order of first sight."""
        k = len(self._rows)
        return TokenMoments(
            ids=self._ids[:k].copy(),
            n=self._n[:k].copy(),
            mean=self._mean[:, :k].copy(),
            m2=self._m2[:, :k].copy(),
            unit_sum=self._unit_sum[:, :k].copy(),
        )


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


def decomposition(n_t, mean_t, m2_t) -> dict:
    """Global decomposition ``Q(X) = M(X) + V_W(X) + V_B(X)`` over token types.

    Parameters
    ----------
    n_t : ndarray of shape (k,), counts of the token types (all > 0).
    mean_t : ndarray of shape (k, d), float64, their means.
    m2_t : ndarray of shape (k,), float64, their ``sum ||x - mean_t||^2``.

    Returns
    -------
    dict with ``n``, ``num_types``, ``Q``, ``M``, ``V``, ``V_W``, ``V_B`` (floats; None
    when there is no embedding).

    Notes
    -----
    ``mu = sum n_t mu_t / n``; ``V_W = sum m2_t / n``; ``V_B = sum n_t ||mu_t - mu||^2 / n``
    (two-pass, no cancellation); ``M = ||mu||^2``; ``V = V_W + V_B``; ``Q = M + V``.
    """
    n_t = np.asarray(n_t, dtype=np.float64)
    n = float(n_t.sum())
    k = int(n_t.shape[0])
    if n == 0:
        return {"n": 0, "num_types": 0, "Q": None, "M": None, "V": None, "V_W": None, "V_B": None}
    mu = (n_t[:, None] * mean_t).sum(axis=0) / n
    dev = mean_t - mu
    v_b = float((n_t * np.einsum("ki,ki->k", dev, dev)).sum() / n)
    v_w = float(np.sum(m2_t) / n)
    m = float(mu @ mu)
    return {
        "n": int(n), "num_types": k,
        "Q": m + v_w + v_b, "M": m, "V": v_w + v_b, "V_W": v_w, "V_B": v_b,
    }


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
