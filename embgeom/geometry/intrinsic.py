"""Intrinsic dimension, per point and overall: local PCA, TwoNN, Levina-Bickel MLE on
k-neighbourhoods (the estimators of scikit-dimension, which they match)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from embgeom.geometry._checks import _matrix, _neighbour_count, _real, _rows_per_chunk
from embgeom.geometry.neighbors import _knn

_TWONN_METHODS = ("mle", "linear")
_DIMENSION_METHODS = ("local_pca", "twonn", "mle")


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
