"""What only the tests compare with the float64 reference
(:mod:`embgeom.testing.reference`): the per-type summary, with numpy's own fit."""

from __future__ import annotations

import numpy as np


def summary(tk: dict) -> dict:
    """cv_Q and the V-on-M least squares fit over the given token types (numpy.polyfit)."""
    Q, M, V = tk["Q"], tk["M"], tk["V"]
    slope, intercept = np.polyfit(M, V, 1)
    r2 = float(np.corrcoef(M, V)[0, 1] ** 2)
    return {"cv_Q": float(Q.std() / Q.mean()), "slope": float(slope), "r2": r2}
