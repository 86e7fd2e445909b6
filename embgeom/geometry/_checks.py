"""Validation and small helpers shared by the geometry measures (numpy only, no I/O).

Invalid input raises ``ValueError`` (the service maps it to 422). Blocks of rows are
bounded by ``_CHUNK_BYTES``: purely a memory optimisation, the results do not change.
"""

from __future__ import annotations

import operator

import numpy as np

# Working memory of one block of rows (pairwise distances, cosines, neighbourhoods).
_CHUNK_BYTES = 64 * 2**20
# A centred matrix whose norm is below this fraction of the raw matrix's norm is constant up
# to the roundoff of centring (about eps * ||mean||): its spread is undefined, not tiny.
_ZERO_SPREAD_RTOL = 1e-12


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
