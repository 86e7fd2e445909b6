"""The integer key space of per-token statistics, shared by compute (which makes keys)
and store (which keeps names for some of them).

A key is an int64: a vocabulary id (key "id"), the smallest vocabulary id of a canonical
token string (key "string"), or, for a multi-piece word of a word-unit collection whose
name is not a vocabulary string, a 62-bit hash of that name in ``[2**62, 2**63)``: positive,
and above every vocabulary id, so the two can never collide
(:func:`embgeom.compute.positions.word_key_of_hash`).
"""

from __future__ import annotations

import numpy as np

__all__ = ["WORD_KEY_BASE", "is_key", "is_word_key"]

WORD_KEY_BASE = 1 << 62


def is_key(value: int) -> bool:
    """Whether the integer ``value`` can be a key at all (an int64): one outside was never
    seen, whatever a request names."""
    return -(1 << 63) <= value < (1 << 63)


def is_word_key(keys) -> np.ndarray:
    """Which keys are hashed word names (not vocabulary ids): bool array of ``keys``' shape."""
    return np.asarray(keys, dtype=np.int64) >= WORD_KEY_BASE
