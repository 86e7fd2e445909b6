"""Which rows of two token spaces are the same token: by key, or by canonical string.

Pure numpy on keys, counts and strings (:mod:`embgeom.comparisons` reads them): the rule
that picks one representative per string, the seeded row sample of a request, and the
seeded sample of token pairs a figure plots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from embgeom.errors import InvalidInput

__all__ = ["Match", "match_tokens", "sample_pairs", "select_rows"]


@dataclass(frozen=True)
class Match:
    """Rows of two token sets that are the same token: ``rows_a[i]`` of a and ``rows_b[i]``
    of b; ``by`` is ``"id"`` or ``"string"``."""

    rows_a: np.ndarray
    rows_b: np.ndarray
    by: str

    def __len__(self) -> int:
        return int(self.rows_a.shape[0])


def _representatives(strings: Sequence[str], n: np.ndarray, keys: np.ndarray):
    """One row per distinct string: the largest n, then the smallest key.
    Returns (unique strings sorted, their rows)."""
    uniq, inverse = np.unique(np.asarray(strings, dtype=object).astype(str), return_inverse=True)
    order = np.lexsort((keys, -n, inverse))
    first = np.r_[True, inverse[order][1:] != inverse[order][:-1]]
    return uniq, order[first]


def match_tokens(keys_a, n_a, strings_a, keys_b, n_b, strings_b, by: str) -> Match:
    """Match two token sets by key (``by="id"``) or by canonical string (``by="string"``).

    Parameters
    ----------
    keys_a, keys_b : arrays (k_a,), (k_b,) of token keys.
    n_a, n_b : their counts (pick the representative of a repeated string).
    strings_a, strings_b : canonical strings of the keys (used with ``by="string"``).

    Returns
    -------
    Match, ordered by key (id) or by string.
    """
    keys_a, keys_b = np.asarray(keys_a, dtype=np.int64), np.asarray(keys_b, dtype=np.int64)
    if by == "id":
        _, ra, rb = np.intersect1d(keys_a, keys_b, assume_unique=True, return_indices=True)
        return Match(ra.astype(np.int64), rb.astype(np.int64), "id")
    if by != "string":
        raise ValueError(f"by must be 'id' or 'string', got {by!r}")
    if len(keys_a) == 0 or len(keys_b) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Match(empty, empty, "string")
    ua, rep_a = _representatives(strings_a, np.asarray(n_a, dtype=np.float64), keys_a)
    ub, rep_b = _representatives(strings_b, np.asarray(n_b, dtype=np.float64), keys_b)
    _, ia, ib = np.intersect1d(ua, ub, assume_unique=True, return_indices=True)
    return Match(rep_a[ia].astype(np.int64), rep_b[ib].astype(np.int64), "string")


def select_rows(m: int, cap: int, sample: Optional[int], seed: int) -> tuple[np.ndarray, bool]:
    """Which of ``m`` matched rows a request uses: all of them, or a sorted seeded sample of
    ``sample`` (when asked) or of ``cap`` (when ``m > cap``). Returns (rows, sampled)."""
    if sample is not None and sample > cap:
        raise InvalidInput(f"sample {sample} exceeds the limit of {cap} tokens per request",
                           type="sample_too_large", sample=sample, limit=cap)
    size = cap if sample is None else sample
    if m <= size:
        return np.arange(m, dtype=np.int64), False
    rng = np.random.default_rng([seed, 2])
    return np.sort(rng.choice(m, size=size, replace=False)).astype(np.int64), True


def sample_pairs(m: int, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Pairs ``i < j`` of ``m`` rows: all ``m (m - 1) / 2`` when they are at most ``count``,
    else ``count`` distinct pairs drawn uniformly with ``seed``; sorted (i, then j)."""
    total = m * (m - 1) // 2
    if total <= count:
        i, j = np.triu_indices(m, 1)
        return i.astype(np.int64), j.astype(np.int64)
    rng = np.random.default_rng([seed, 5])
    # Linear indices of the upper triangle, drawn without replacement, then unranked:
    # row i holds the pairs (i, i+1..m-1), starting at offset i m - i (i + 1) / 2.
    flat = np.sort(rng.choice(total, size=count, replace=False))
    starts = np.arange(m, dtype=np.int64) * m - np.arange(m, dtype=np.int64) * (np.arange(m) + 1) // 2
    i = np.searchsorted(starts, flat, side="right") - 1
    j = flat - starts[i] + i + 1
    return i.astype(np.int64), j.astype(np.int64)
