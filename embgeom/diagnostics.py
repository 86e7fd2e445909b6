"""Isotropy, outlier and spectrum diagnostics of an embedding space.

Almost every quantity here is a function of a few streamed sufficient statistics of the
embeddings of one layer, never of the raw points:

- the covariance ``C`` (a Chan-merged co-moment matrix divided by a count) and its
  eigenvalues ``lam``: IsoScore, IsoScore*, effective rank, participation ratio, the top
  eigenvalue's share, and the post-processing transforms (per-dimension standardisation,
  all-but-the-top);
- the sum of unit vectors ``U = sum_x x / ||x||`` and of their squares: the exact mean
  cosine similarity over all distinct pairs, ``(||U||^2 - n) / (n (n - 1))``, its
  per-dimension split (rogue dimensions) and per-token self-similarity;
- the per-dimension variances: outlier dimensions.

Two functions take raw arrays because their quantity is defined on them:
``partition_isotropy`` (a word matrix) and ``best_threshold_accuracy`` (a probe on one
dimension).

Everything is float64 numpy, pure and without I/O. Invalid input raises ``ValueError``
(the service maps it to 422); a quantity that is undefined on valid input (no spread, fewer
than two points) is ``nan`` (the service reports null).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

__all__ = [
    "Transform",
    "best_threshold_accuracy",
    "covariance_eigenvalues",
    "effective_rank",
    "isoscore_from_covariance",
    "isoscore_from_eigenvalues",
    "isoscore_star",
    "mean_cosine",
    "outlier_dimensions",
    "parse_transform",
    "participation_ratio",
    "partition_isotropy",
    "log_partition_isotropy",
    "rogue_contributions",
    "self_similarity",
    "self_similarity_from_norm",
    "top_eigenvalue_ratio",
    "transform_covariance",
    "transform_points",
]

# Eigenvalues of a positive semi-definite matrix come out slightly negative from roundoff:
# a few eps * ||C|| * d in float64, and ~1e-7 * ||C|| for the streamed co-moment, whose
# per-batch GEMM runs in float32 on batch-centred data (embgeom.compute.reduce); anything
# below -_PSD_RTOL * max|lam| is not roundoff but a matrix that is not a covariance, which
# we refuse rather than silently clip.
_PSD_RTOL = 1e-6
# A covariance accumulated in float64 is symmetric to roundoff; beyond this it is a bug.
_SYMMETRY_RTOL = 1e-8
# A dimension whose variance is below this fraction of the largest variance is constant
# up to roundoff (a constant coordinate streamed through Chan merges leaves ~eps^2 * x^2,
# not an exact 0); dividing by its standard deviation would amplify noise into +-1 entries.
_ZERO_VARIANCE_RTOL = 1e-12
# Rows of W handled at once by partition_isotropy: bounds memory at
# _PARTITION_BLOCK_ROWS * d float64 instead of num_words * d (262k x 640 for gemma-3).
_PARTITION_BLOCK_ROWS = 8192


# ----------------------------------------------------------------------------- validation


def _finite_array(x, name: str, ndim: int) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-dimensional, got shape {a.shape}")
    if a.size == 0:
        raise ValueError(f"{name} must not be empty, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains nan or inf")
    return a


def _count(n, name: str = "n") -> int:
    try:
        value = float(n)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a non-negative integer, got {n!r}") from None
    if not value.is_integer() or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {n!r}")
    return int(value)


def _clip_roundoff(lam: np.ndarray) -> np.ndarray:
    scale = np.max(np.abs(lam))
    if np.any(lam < -_PSD_RTOL * scale):
        raise ValueError(
            "eigenvalues must be non-negative (a covariance is positive semi-definite); "
            f"smallest is {lam.min():.6g} against a largest magnitude of {scale:.6g}"
        )
    return np.clip(lam, 0.0, None)


def _check_eigenvalues(eigenvalues) -> np.ndarray:
    lam = _finite_array(eigenvalues, "eigenvalues", 1)
    return _clip_roundoff(lam)


def _check_covariance(cov, name: str = "cov") -> np.ndarray:
    c = _finite_array(cov, name, 2)
    if c.shape[0] != c.shape[1]:
        raise ValueError(f"{name} must be square, got shape {c.shape}")
    scale = np.max(np.abs(c))
    if np.max(np.abs(c - c.T)) > _SYMMETRY_RTOL * scale:
        raise ValueError(f"{name} must be symmetric")
    # eigvalsh/eigh read one triangle only; averaging lets both contribute.
    return (c + c.T) / 2.0


# ------------------------------------------------------------------------------- spectrum


def covariance_eigenvalues(cov) -> np.ndarray:
    """Eigenvalues of a covariance matrix, in descending order, clipped at 0.

    Parameters
    ----------
    cov : array-like of shape (d, d)
        Symmetric positive semi-definite matrix (float64 after conversion).

    Returns
    -------
    eigenvalues : ndarray of shape (d,), float64
        ``numpy.linalg.eigvalsh(cov)`` sorted descending. Negative values from roundoff
        (at most ``1e-8 * max|lam|`` in magnitude) are set to 0.

    Raises
    ------
    ValueError
        If ``cov`` is not square, not finite, not symmetric, or has an eigenvalue below
        ``-1e-8 * max|lam|`` (not positive semi-definite).
    """
    c = _check_covariance(cov)
    lam = np.linalg.eigvalsh(c)[::-1]
    return _clip_roundoff(lam)


def isoscore_from_eigenvalues(eigenvalues) -> float:
    """IsoScore of a covariance spectrum (Rudman et al., 2022).

    Parameters
    ----------
    eigenvalues : array-like of shape (d,)
        Eigenvalues ``lam`` of a covariance matrix (the variances along its principal
        axes), any order, ``d >= 2``. Negative values from roundoff are clipped to 0.

    Returns
    -------
    isoscore : float
        In ``[0, 1]``: 1 when every eigenvalue is equal (isotropic), 0 when one
        dimension holds all the variance. ``nan`` when every eigenvalue is 0 (no spread).

    Notes
    -----
    ::

        s     = sqrt(d) * lam / ||lam||
        delta = ||s - 1|| / sqrt(2 (d - sqrt d))
        phi   = (d - delta^2 (d - sqrt d))^2 / d^2
        IsoScore = (d phi - 1) / (d - 1)

    IsoScore is invariant to scaling ``lam``, hence to the covariance normalisation
    (dividing the co-moment matrix by ``n`` or ``n - 1``). It equals
    ``IsoScore.IsoScore.IsoScore(points)`` of the ``isoscore`` package applied to the
    points whose covariance has these eigenvalues (the package takes the singular values
    of ``torch.cov(points.T)``, which are these eigenvalues).

    References
    ----------
    W. Rudman, N. Gillman, T. Rayne, C. Eickhoff. "IsoScore: Measuring the Uniformity of
    Embedding Space Utilization". Findings of ACL 2022.
    """
    lam = _check_eigenvalues(eigenvalues)
    d = lam.shape[0]
    if d < 2:
        raise ValueError(f"IsoScore needs at least 2 dimensions, got {d}")
    top = lam.max()
    if top == 0.0:
        return float("nan")
    # Scale invariance lets us divide by the largest eigenvalue first, so ||lam|| cannot
    # overflow or underflow whatever the units of the embeddings.
    lam = lam / top
    sqrt_d = np.sqrt(d)
    s = sqrt_d * lam / np.linalg.norm(lam)
    delta_sq = np.sum((s - 1.0) ** 2) / (2.0 * (d - sqrt_d))
    phi = (d - delta_sq * (d - sqrt_d)) ** 2 / d**2
    score = (d * phi - 1.0) / (d - 1.0)
    # The bounds are exact; roundoff can push an isotropic spectrum to 1 + 1e-16.
    return float(np.clip(score, 0.0, 1.0))


def isoscore_from_covariance(cov) -> float:
    """IsoScore of a covariance matrix: ``isoscore_from_eigenvalues(eigvalsh(cov))``.

    Parameters
    ----------
    cov : array-like of shape (d, d)
        Symmetric positive semi-definite matrix, ``d >= 2``. Its normalisation (``ddof``)
        does not matter: IsoScore is scale invariant.

    Returns
    -------
    isoscore : float
        See :func:`isoscore_from_eigenvalues`; ``nan`` for the zero matrix.
    """
    return isoscore_from_eigenvalues(covariance_eigenvalues(cov))


def isoscore_star(sample_cov, reference_cov, zeta) -> float:
    """IsoScore* (Rudman & Eickhoff, 2024): IsoScore of a shrunk sample covariance.

    Parameters
    ----------
    sample_cov : array-like of shape (d, d)
        Covariance ``Sigma_S`` of the (small) sample of points. To agree with the
        ``isoscore`` package this must be the *unbiased* covariance, co-moment matrix
        divided by ``n - 1`` (``numpy.cov(points.T)``, ``ddof=1``); see Notes.
    reference_cov : array-like of shape (d, d)
        Shrinkage target ``C0``: the covariance of a larger sample from the same space,
        or the identity when none is available. Used as given, not rescaled.
    zeta : float in [0, 1]
        Shrinkage weight: 0 is plain IsoScore of ``sample_cov``, 1 is IsoScore of
        ``reference_cov``.

    Returns
    -------
    isoscore_star : float
        ``isoscore_from_covariance((1 - zeta) * sample_cov + zeta * reference_cov)``.

    Notes
    -----
    Convention, read from ``IsoScore/IsoScore.py`` of ``isoscore==2.0.1``, function
    ``IsoScore_star(points, C0, zeta)`` (the method ``istar.IsoScore_star`` has the same
    body):

    - ``C = torch.cov(points.T)``: centred on the sample mean, divided by ``n - 1``;
    - ``cov = (1 - zeta) * C + zeta * C0``: ``C0`` enters unnormalised (no trace
      matching), so the scale of ``sample_cov`` relative to ``C0`` matters and, unlike
      plain IsoScore, so does ``ddof``: passing the ``ddof=0`` covariance is the same as
      shrinking the ``ddof=1`` one with a different weight;
    - the spectrum is ``torch.linalg.svdvals(cov)``, the eigenvalues of the symmetric
      positive semi-definite ``cov``; there is no PCA rotation (it would not change the
      spectrum anyway);
    - then the IsoScore formula of :func:`isoscore_from_eigenvalues`. The package
      evaluates ``sqrt(d)`` in float32, so it differs from this float64 value by about
      1e-7.

    The shrinkage is Friedman's regularised discriminant analysis applied to the
    covariance; it keeps IsoScore stable on point clouds with fewer points than
    dimensions, whose sample covariance is rank deficient.

    References
    ----------
    W. Rudman, C. Eickhoff. "Stable Anisotropic Regularization". ICLR 2024.
    """
    s = _check_covariance(sample_cov, "sample_cov")
    c0 = _check_covariance(reference_cov, "reference_cov")
    if s.shape != c0.shape:
        raise ValueError(
            f"sample_cov and reference_cov must have the same shape, got {s.shape} and {c0.shape}"
        )
    try:
        z = float(zeta)
    except (TypeError, ValueError):
        raise ValueError(f"zeta must be a number in [0, 1], got {zeta!r}") from None
    if not 0.0 <= z <= 1.0:
        raise ValueError(f"zeta must be in [0, 1], got {zeta!r}")
    return isoscore_from_covariance((1.0 - z) * s + z * c0)


def effective_rank(eigenvalues) -> float:
    """Effective rank of a spectrum (Roy & Vetterli, 2007).

    Parameters
    ----------
    eigenvalues : array-like of shape (d,)
        Non-negative eigenvalues (or singular values) ``lam``; roundoff negatives are
        clipped to 0.

    Returns
    -------
    effective_rank : float
        ``exp(H(p))`` with ``p = lam / sum(lam)`` and ``H(p) = -sum_i p_i log p_i``,
        ``0 log 0 = 0``. In ``[1, d]``: 1 for a single nonzero eigenvalue, ``d`` for equal
        ones. ``nan`` when every eigenvalue is 0.

    References
    ----------
    O. Roy, M. Vetterli. "The effective rank: A measure of effective dimensionality".
    EUSIPCO 2007.
    """
    lam = _check_eigenvalues(eigenvalues)
    total = lam.sum()
    if total == 0.0:
        return float("nan")
    p = lam / total
    p = p[p > 0.0]  # the limit 0 log 0 = 0
    return float(np.exp(-np.sum(p * np.log(p))))


def participation_ratio(eigenvalues) -> float:
    """Participation ratio of a spectrum: ``(sum lam)^2 / sum lam^2``.

    Parameters
    ----------
    eigenvalues : array-like of shape (d,)
        Non-negative eigenvalues ``lam`` of a covariance; roundoff negatives clipped to 0.

    Returns
    -------
    participation_ratio : float
        In ``[1, d]``; equals ``trace(C)^2 / ||C||_F^2``. ``nan`` when every eigenvalue
        is 0.

    References
    ----------
    P. Gao, E. Trautmann, B. Yu et al. "A theory of multineuronal dimensionality,
    dynamics and measurement". bioRxiv 2017 (the neuroscience use of the measure).
    """
    lam = _check_eigenvalues(eigenvalues)
    top = lam.max()
    if top == 0.0:
        return float("nan")
    lam = lam / top  # scale invariant; keeps lam^2 from overflowing
    return float(lam.sum() ** 2 / np.sum(lam**2))


def top_eigenvalue_ratio(eigenvalues) -> float:
    """Share of the total variance on the first principal axis: ``max(lam) / sum(lam)``.

    Parameters
    ----------
    eigenvalues : array-like of shape (d,)
        Non-negative eigenvalues ``lam``; roundoff negatives clipped to 0.

    Returns
    -------
    ratio : float
        In ``[1/d, 1]``; ``nan`` when every eigenvalue is 0.
    """
    lam = _check_eigenvalues(eigenvalues)
    total = lam.sum()
    if total == 0.0:
        return float("nan")
    return float(lam.max() / total)


# ------------------------------------------------------------------------ cosine geometry


def mean_cosine(unit_sum, n) -> float:
    """Exact mean cosine similarity over all distinct pairs, from the sum of unit vectors.

    Parameters
    ----------
    unit_sum : array-like of shape (d,)
        ``U = sum_x x / ||x||`` over the ``n`` embeddings (nonzero vectors only: a zero
        vector has no direction).
    n : int
        Number of embeddings summed into ``U``.

    Returns
    -------
    mean_cosine : float
        ``(||U||^2 - n) / (n (n - 1))``, the mean of ``cos(x, y)`` over the
        ``n (n - 1)`` ordered pairs of distinct occurrences (equal to the mean over
        unordered pairs). ``nan`` when ``n < 2``: there is no pair.

    Notes
    -----
    ``||U||^2 = sum_x sum_y cos(x, y)`` and the ``n`` diagonal terms are each 1. The
    subtraction loses about ``eps * ||U||^2`` absolute, i.e. ``O(eps)`` on the mean.

    References
    ----------
    K. Ethayarajh. "How Contextual are Contextualized Word Representations?" EMNLP 2019
    (average cosine similarity between random words as the anisotropy baseline).
    """
    u = _finite_array(unit_sum, "unit_sum", 1)
    count = _count(n)
    if count < 2:
        return float("nan")
    return float((u @ u - count) / (count * (count - 1.0)))


def rogue_contributions(unit_sum, unit_sq_sum, n) -> np.ndarray:
    """Per-dimension contribution to the mean cosine similarity (rogue dimensions).

    Parameters
    ----------
    unit_sum : array-like of shape (d,)
        ``U = sum_x u(x)`` with ``u(x) = x / ||x||``.
    unit_sq_sum : array-like of shape (d,)
        ``S = sum_x u(x)**2`` (elementwise square).
    n : int
        Number of embeddings.

    Returns
    -------
    contributions : ndarray of shape (d,), float64
        ``CC_i = (U_i^2 - S_i) / (n (n - 1))``, the mean of ``u_i v_i`` over the ordered
        pairs of distinct embeddings ``(u, v)``. They sum to :func:`mean_cosine`. All
        ``nan`` when ``n < 2``.

    Notes
    -----
    ``U_i^2 = sum_x sum_y u_i(x) u_i(y)``; removing the diagonal ``x = y`` leaves the
    distinct pairs. Timkey & van Schijndel estimate ``CC_i`` on sampled pairs; this is the
    exact mean over all pairs.

    References
    ----------
    W. Timkey, M. van Schijndel. "All Bark and No Bite: Rogue Dimensions in Transformer
    Language Models Obscure Representational Quality". EMNLP 2021.
    """
    u = _finite_array(unit_sum, "unit_sum", 1)
    sq = _finite_array(unit_sq_sum, "unit_sq_sum", 1)
    if u.shape != sq.shape:
        raise ValueError(
            f"unit_sum and unit_sq_sum must have the same shape, got {u.shape} and {sq.shape}"
        )
    count = _count(n)
    if count < 2:
        return np.full(u.shape, np.nan)
    return (u * u - sq) / (count * (count - 1.0))


def self_similarity(unit_sum, n) -> np.ndarray:
    """Self-similarity of each token type (Ethayarajh, 2019), vectorised over types.

    Parameters
    ----------
    unit_sum : array-like of shape (k, d)
        Row ``t`` is ``U_t = sum_{x in X_t} x / ||x||`` over the occurrences of type ``t``.
    n : array-like of shape (k,)
        Occurrence counts ``n_t`` (non-negative integers).

    Returns
    -------
    self_similarity : ndarray of shape (k,), float64
        ``(||U_t||^2 - n_t) / (n_t (n_t - 1))``: the mean cosine similarity between
        distinct occurrences of the same type in the same layer. ``nan`` where ``n_t < 2``.

    References
    ----------
    K. Ethayarajh. "How Contextual are Contextualized Word Representations? Comparing the
    Geometry of BERT, ELMo, and GPT-2 Embeddings". EMNLP 2019, definition 1.
    """
    u = _finite_array(unit_sum, "unit_sum", 2)
    counts = np.asarray(n)
    if counts.shape != (u.shape[0],):
        raise ValueError(f"n must have shape ({u.shape[0]},), got {counts.shape}")
    counts = counts.astype(np.float64)
    if not np.all(np.isfinite(counts)) or np.any(counts < 0) or np.any(counts != np.round(counts)):
        raise ValueError("n must hold non-negative integers")
    return self_similarity_from_norm(np.einsum("ij,ij->i", u, u), counts)


def self_similarity_from_norm(sq_norm, n):
    """:func:`self_similarity` from ``||U_t||^2`` and ``n_t`` (arrays or scalars, not
    validated): ``(||U_t||^2 - n_t) / (n_t (n_t - 1))``, ``nan`` where ``n_t < 2``."""
    sq_norm = np.asarray(sq_norm, dtype=np.float64)
    c = np.asarray(n, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(c >= 2, (sq_norm - c) / (c * (c - 1.0)), np.nan)


# ------------------------------------------------------------------------------- outliers


def outlier_dimensions(variances, means, threshold: float = 5.0) -> list[dict]:
    """Dimensions whose variance is at least ``threshold`` times the mean variance.

    Parameters
    ----------
    variances : array-like of shape (d,)
        Per-dimension variance ``C_ii`` (non-negative).
    means : array-like of shape (d,)
        Per-dimension mean, reported alongside (massive activations show as a large mean).
    threshold : float, default 5.0
        Outlier if ``variance_i >= threshold * mean(variances)``; 5 as in the outlier
        dimension literature.

    Returns
    -------
    outliers : list of dict
        ``{"dim": int, "variance": float, "ratio": variance / mean(variances),
        "mean": float}`` per outlier, sorted by ``ratio`` descending, ties by ``dim``
        ascending. Empty when every variance is 0.

    References
    ----------
    O. Kovaleva, S. Kulshreshtha, A. Rogers, A. Rumshisky. "BERT Busters: Outlier
    Dimensions that Disrupt Transformers". Findings of ACL 2021. W. Rudman, C. Chen,
    C. Eickhoff. "Outlier Dimensions Encode Task-Specific Knowledge". EMNLP 2023.
    """
    var = _finite_array(variances, "variances", 1)
    mu = _finite_array(means, "means", 1)
    if var.shape != mu.shape:
        raise ValueError(f"variances and means must have the same shape, got {var.shape} and {mu.shape}")
    if np.any(var < 0):
        raise ValueError("variances must be non-negative")
    try:
        t = float(threshold)
    except (TypeError, ValueError):
        raise ValueError(f"threshold must be a positive number, got {threshold!r}") from None
    if not np.isfinite(t) or t <= 0:
        raise ValueError(f"threshold must be a positive number, got {threshold!r}")
    mean_var = var.mean()
    if mean_var == 0.0:
        return []
    idx = np.flatnonzero(var >= t * mean_var)
    ratio = var[idx] / mean_var
    order = np.lexsort((idx, -ratio))
    return [
        {"dim": int(idx[j]), "variance": float(var[idx[j]]), "ratio": float(ratio[j]), "mean": float(mu[idx[j]])}
        for j in order
    ]


# ----------------------------------------------------------------- partition-function isotropy


def _partition_log_z(W: np.ndarray, directions: np.ndarray, block_rows: int) -> np.ndarray:
    """log Z(c) = log sum_w exp(c^T w) for each column c of directions, streamed over rows.

    Each block's log-sum-exp is merged into the running one by the same max-shift rule, so
    no exponent ever exceeds 0.
    """
    log_z = np.full(directions.shape[1], -np.inf)
    for start in range(0, W.shape[0], block_rows):
        a = W[start : start + block_rows] @ directions  # (rows, 2d)
        top = np.maximum(a.max(axis=0), log_z)
        block = np.exp(a - top).sum(axis=0)
        log_z = top + np.log(block + np.exp(log_z - top))
    return log_z


def partition_isotropy(W) -> float:
    """Partition-function isotropy ``I(W)`` of a word matrix (Mu & Viswanath, 2018).

    Parameters
    ----------
    W : array-like of shape (num_words, d)
        One embedding per row, uncentred (the measure is meant to see a common mean).

    Returns
    -------
    isotropy : float
        ``I(W) = min_c Z(c) / max_c Z(c)`` with ``Z(c) = sum_w exp(c^T w)``, in ``(0, 1]``;
        1 for an isotropic set. It underflows to 0.0 when the ratio is below ~1e-308.

    Notes
    -----
    ``c`` ranges over the unit eigenvectors of ``W^T W`` taken with both signs, ``2d``
    directions: an eigenvector's sign is arbitrary, and ``Z(c) != Z(-c)`` in general (a
    common mean vector makes ``Z`` large on one side and small on the other), so using one
    sign would make the result depend on the eigensolver. With repeated eigenvalues of
    ``W^T W`` the eigenvectors, hence ``I(W)``, are not unique.

    ``log Z`` is a log-sum-exp shifted by its maximum, so norms in the thousands do not
    overflow; rows are processed in blocks of 8192, purely a memory optimisation (the
    result changes only by roundoff).

    References
    ----------
    J. Mu, P. Viswanath. "All-but-the-Top: Simple and Effective Postprocessing for Word
    Representations". ICLR 2018.
    """
    return float(np.exp(log_partition_isotropy(W)))


def log_partition_isotropy(W) -> float:
    """``log I(W) = min_c log Z(c) - max_c log Z(c)`` (natural log), see
    :func:`partition_isotropy`; finite where ``I(W)`` itself underflows to 0."""
    w = _finite_array(W, "W", 2)
    _, vecs = np.linalg.eigh(w.T @ w)
    directions = np.hstack([vecs, -vecs])
    log_z = _partition_log_z(w, directions, _PARTITION_BLOCK_ROWS)
    return float(log_z.min() - log_z.max())


# ----------------------------------------------------------------------------- transforms


class Transform(NamedTuple):
    """A parsed post-processing transform: ``kind`` in {"none", "standardize", "abtt"};
    ``components`` is D for "abtt" and 0 otherwise."""

    kind: str
    components: int = 0


_ABTT = re.compile(r"abtt:(\d+)")


def parse_transform(spec) -> Transform:
    """Parse a transform specification.

    Parameters
    ----------
    spec : str or None or Transform
        ``None`` or ``"none"`` (identity), ``"standardize"`` (per-dimension z-score) or
        ``"abtt:D"`` with ``D`` a non-negative integer (all-but-the-top, remove the top
        ``D`` principal components). Case and surrounding spaces are ignored.

    Returns
    -------
    transform : Transform

    Raises
    ------
    ValueError
        For any other value, with the accepted forms in the message.
    """
    if isinstance(spec, Transform):
        return parse_transform(spec.kind if spec.kind != "abtt" else f"abtt:{spec.components}")
    if spec is None:
        return Transform("none")
    if not isinstance(spec, str):
        raise ValueError(f"transform must be a string, got {type(spec).__name__}")
    s = spec.strip().lower()
    if s in ("none", "standardize"):
        return Transform(s)
    m = _ABTT.fullmatch(s)
    if m:
        return Transform("abtt", int(m.group(1)))
    raise ValueError(
        f"unknown transform {spec!r}: expected 'none', 'standardize' or 'abtt:D' "
        "with D a non-negative integer (e.g. 'abtt:3')"
    )


def _varying_dimensions(var: np.ndarray, mean) -> np.ndarray:
    """Which dimensions vary, judged against each dimension's own scale.

    With the mean known, a dimension is constant when its spread is below roundoff of its
    own values, ``var_i <= (1e-12 |mean_i|)^2`` (a constant coordinate merges to exactly 0
    or an ulp-sized trace); tiny but genuine variation (a LayerNorm weight of 1e-32 still
    gives std/|mean| ~ 10) is kept. Without the mean, fall back to 1e-12 of the largest
    variance.
    """
    if mean is None:
        return var > _ZERO_VARIANCE_RTOL * var.max()
    mean = np.asarray(mean, dtype=np.float64)
    return (var > 0) & (var > (_ZERO_VARIANCE_RTOL * np.abs(mean)) ** 2)


def transform_covariance(cov, transform, mean=None) -> np.ndarray:
    """Covariance of the embeddings after a post-processing transform.

    Parameters
    ----------
    cov : array-like of shape (d, d)
        Covariance ``C`` of the original embeddings (any ``ddof``; the transforms are
        linear in ``C`` except standardisation, which is scale invariant).
    transform : str or None or Transform
        See :func:`parse_transform`.
    mean : array-like of shape (d,), optional
        The embeddings' mean; with it, "standardize" judges each dimension's constancy
        against its own scale (see ``_varying_dimensions``).

    Returns
    -------
    cov_t : ndarray of shape (d, d), float64
        - ``"none"``: ``C``.
        - ``"standardize"``: the correlation matrix ``D^-1/2 C D^-1/2`` with
          ``D = diag(C)``, the covariance of per-dimension z-scores. A dimension that is
          constant up to roundoff (``C_ii <= (1e-12 mean_i)^2`` given the mean, else
          ``C_ii <= 1e-12 max_j C_jj``) gets a zero row and column, as a z-score defined
          as 0 for a constant dimension would.
        - ``"abtt:D"``: ``P C P`` with ``P = I - sum_{i<D} u_i u_i^T``, ``u_i`` the
          eigenvectors of ``C`` for its ``D`` largest eigenvalues. This is the covariance
          of ``(x - mean) P``, all-but-the-top: the mean subtraction does not change a
          covariance, the projection removes the top ``D`` principal components. If
          ``lam_D == lam_{D+1}`` the removed subspace is not unique.

    Raises
    ------
    ValueError
        For a bad specification, a bad ``cov``, or ``D >= d`` in ``"abtt:D"``.

    References
    ----------
    J. Mu, P. Viswanath. "All-but-the-Top: Simple and Effective Postprocessing for Word
    Representations". ICLR 2018, algorithm 1.
    """
    t = parse_transform(transform)
    c = _check_covariance(cov)
    d = c.shape[0]
    if t.kind == "none":
        return c
    if t.kind == "standardize":
        var = np.diag(c).copy()
        if np.any(var < 0):
            raise ValueError("cov has a negative variance on its diagonal")
        keep = _varying_dimensions(var, mean)
        inv_sd = np.zeros(d)
        inv_sd[keep] = 1.0 / np.sqrt(var[keep])
        r = c * inv_sd[:, None] * inv_sd[None, :]
        # exact 1, not 1 +- eps, so a kept dimension's z-score has unit variance
        r[keep, keep] = 1.0
        return r
    # abtt
    if t.components >= d:
        raise ValueError(f"abtt:{t.components} must remove fewer components than d = {d}")
    if t.components == 0:
        return c
    p = _projection_off_top(c, t.components)
    out = p @ c @ p
    return (out + out.T) / 2.0


def _projection_off_top(c: np.ndarray, components: int) -> np.ndarray:
    """``P = I - sum_{i<D} u_i u_i^T`` for the top ``D`` eigenvectors of ``c``."""
    d = c.shape[0]
    if components == 0:
        return np.eye(d)
    _, vecs = np.linalg.eigh(c)
    top = vecs[:, ::-1][:, :components]
    return np.eye(d) - top @ top.T


def transform_points(points, mean, cov, transform) -> np.ndarray:
    """Apply a post-processing transform to points, given the moments it is defined by.

    Parameters
    ----------
    points : array-like of shape (k, d), e.g. the matrix of per-token means.
    mean : array-like of shape (d,), the mean of all embeddings.
    cov : array-like of shape (d, d), their covariance.
    transform : see :func:`parse_transform`.

    Returns
    -------
    ndarray of shape (k, d): ``points`` unchanged for "none"; ``(x - mean) / sd`` for
    "standardize" (0 on zero-variance dimensions, as in :func:`transform_covariance`);
    ``(x - mean) P`` for "abtt:D". The covariance of transformed embeddings is
    :func:`transform_covariance` of ``cov``.
    """
    t = parse_transform(transform)
    x = _finite_array(points, "points", 2)
    if t.kind == "none":
        return x
    c = _check_covariance(cov)
    centred = x - np.asarray(mean, dtype=np.float64)
    if t.kind == "standardize":
        var = np.diag(c)
        keep = _varying_dimensions(var, mean)
        inv_sd = np.zeros_like(var)
        inv_sd[keep] = 1.0 / np.sqrt(var[keep])
        return centred * inv_sd
    if t.components >= c.shape[0]:
        raise ValueError(f"abtt:{t.components} must remove fewer components than d = {c.shape[0]}")
    return centred @ _projection_off_top(c, t.components)


# --------------------------------------------------------------------------------- probing


def best_threshold_accuracy(train_x, train_y, test_x, test_y) -> tuple[float, int, float, float]:
    """Best single-threshold classifier on one dimension, and its held-out accuracy.

    Parameters
    ----------
    train_x : array-like of shape (n_train,)
        Values of one dimension on the training points, ``n_train >= 1``.
    train_y : array-like of shape (n_train,)
        Binary labels in {0, 1}.
    test_x : array-like of shape (n_test,)
    test_y : array-like of shape (n_test,)
        Held-out points and labels; may be empty.

    Returns
    -------
    threshold : float
    direction : int, +1 or -1
        The rule predicts 1 iff ``direction * (x - threshold) > 0``.
    train_accuracy : float
        Accuracy of the rule on the training points (the maximum over candidates).
    test_accuracy : float
        Accuracy of the same rule on the test points; ``nan`` if there are none.

    Notes
    -----
    With the distinct training values sorted, ``v_0 < ... < v_{m-1}``, the candidate
    thresholds are the midpoints ``(v_{k-1} + v_k) / 2`` plus one just below ``v_0`` and
    one just above ``v_{m-1}`` (the adjacent floats, ``numpy.nextafter``), which give the
    constant classifiers; each with both directions. For the split after ``k`` distinct
    values, direction +1 is right on ``zeros_left(k) + ones_right(k)`` points, and -1 on
    the rest, so cumulative label counts score every candidate at once: ``O(n log n)``
    for the sort. Ties go to direction +1 first, then to the smaller threshold.

    The accuracies are recomputed by applying the returned rule, so they are exact even
    in the degenerate case where two distinct values are adjacent floats and their
    midpoint rounds onto one of them.
    """
    x = _finite_array(train_x, "train_x", 1)
    y = _labels(train_y, "train_y", x.shape[0])
    tx = np.asarray(test_x, dtype=np.float64)
    if tx.ndim != 1 or not np.all(np.isfinite(tx)):
        raise ValueError("test_x must be a 1-dimensional finite array")
    ty = _labels(test_y, "test_y", tx.shape[0])

    values, inverse = np.unique(x, return_inverse=True)
    m = values.shape[0]
    ones_per_value = np.bincount(inverse, weights=y, minlength=m)
    count_per_value = np.bincount(inverse, minlength=m).astype(np.float64)
    # k = 0..m distinct values on the left of the threshold
    ones_left = np.concatenate([[0.0], np.cumsum(ones_per_value)])
    zeros_left = np.concatenate([[0.0], np.cumsum(count_per_value - ones_per_value)])
    total_ones = ones_left[-1]
    n = float(x.shape[0])
    correct_plus = zeros_left + (total_ones - ones_left)
    correct_minus = n - correct_plus
    # argmax takes the first maximum: direction +1 before -1, then smaller k
    best = int(np.argmax(np.concatenate([correct_plus, correct_minus])))
    direction = 1 if best <= m else -1
    k = best % (m + 1)

    if k == 0:
        threshold = float(np.nextafter(values[0], -np.inf))
    elif k == m:
        threshold = float(np.nextafter(values[-1], np.inf))
    else:
        # halves first: (a + b) / 2 overflows for |a|, |b| near the float64 maximum
        threshold = float(values[k - 1] / 2.0 + values[k] / 2.0)

    def accuracy(xs: np.ndarray, ys: np.ndarray) -> float:
        if xs.shape[0] == 0:
            return float("nan")
        pred = direction * (xs - threshold) > 0
        return float(np.mean(pred == (ys == 1)))

    return threshold, direction, accuracy(x, y), accuracy(tx, ty)


def _labels(y, name: str, length: int) -> np.ndarray:
    a = np.asarray(y)
    if a.shape != (length,):
        raise ValueError(f"{name} must have shape ({length},), got {a.shape}")
    a = a.astype(np.float64)
    if not np.all((a == 0) | (a == 1)):
        raise ValueError(f"{name} must hold binary labels 0 and 1")
    return a
