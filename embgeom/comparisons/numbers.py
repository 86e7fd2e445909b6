"""Numbers as the comparisons answer them: JSON floats, cosines of single vectors."""

from __future__ import annotations

from typing import Optional

import numpy as np

__all__ = ["json_float", "cosine", "unit_rows"]


def json_float(x) -> Optional[float]:
    """A float for JSON: nan and infinities are null."""
    if x is None:
        return None
    x = float(x)
    return x if np.isfinite(x) else None


def cosine(u: np.ndarray, v: np.ndarray) -> Optional[float]:
    """The cosine of two vectors; None when either is zero (no direction)."""
    nu, nv = np.linalg.norm(u), np.linalg.norm(v)
    if nu == 0 or nv == 0:
        return None
    return float(np.clip(u @ v / (nu * nv), -1.0, 1.0))


def unit_rows(X: np.ndarray) -> np.ndarray:
    """The rows of X scaled to unit length; a zero row stays zero."""
    norms = np.linalg.norm(X, axis=1)
    return X / np.where(norms > 0, norms, 1.0)[:, None]
