"""Binary layouts of the stored records: little-endian float64, one contiguous buffer per
batch of records and zero-copy views per field (no per-value Python work).

Per token (``L`` kept layers, hidden size ``d``)::

    rec   [n, m2_0 .. m2_{L-1}, mean_0 (d) .. mean_{L-1} (d)]        1 + L + L d
    unit  [u_0 (d) .. u_{L-1} (d)]                                  L d
    scal  [n, M_0 .. M_{L-1}, m2_0 .. m2_{L-1}, N_0 .. N_{L-1}]     1 + 3 L
          N_l = ||U_l||^2 of the unit sum; without it (self-similarity off, or a
          generation stored before, see ``PairConf.scal_unit_norms``)   1 + 2 L

Per shard: ``bkt`` field b ``[types, count, sum n_t mean_t per layer (L d)]`` and ``agg``
``[types, count, within_0 .. within_{L-1}]`` (their vectors and within sums compensated:
:mod:`embgeom.store.shards`). Per layer part: the head segment (all
layers) ``[n, mean (d), m2, unit_sum (d), unit_sq_sum (d)]`` per layer, and a co-moment
chunk segment ``[n, mean (d), upper-triangular rows r0..r1 of C]``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Sequence

import numpy as np

from embgeom.stats import LayerMoments, TokenMoments

F64 = np.dtype("<f8")

__all__ = [
    "F64", "pack_rows", "unpack_rows", "rec_rows", "from_rec", "scal_rows", "from_scal", "head_segment",
    "from_head", "chunk_segment", "from_chunk", "upper_index", "rec_ranges", "unit_ranges",
    "bkt_ranges",
]


def pack_rows(a: np.ndarray) -> list[memoryview]:
    """Rows of a 2-D array as zero-copy little-endian float64 byte views."""
    a = np.ascontiguousarray(a, dtype=F64)
    if a.shape[0] == 0:
        return []
    width = a.shape[1] * 8
    view = memoryview(a).cast("B")
    return [view[i * width:(i + 1) * width] for i in range(a.shape[0])]


def unpack_rows(raws: Sequence[Optional[bytes]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Replies of HMGET (bytes or None) as ``(present (k,) bool, rows (k, width) float64)``;
    absent rows are zeros."""
    present = np.fromiter((r is not None for r in raws), dtype=bool, count=len(raws))
    rows = np.zeros((len(raws), width))
    if present.any():
        got = np.frombuffer(b"".join(r for r in raws if r is not None), dtype=F64)
        rows[present] = got.reshape(-1, width)
    return present, rows


def rec_rows(n: np.ndarray, m2: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """(k, 1 + L + L d) rows from n (k,), m2 (k, L), mean (k, L, d)."""
    k = n.shape[0]
    return np.concatenate([np.asarray(n, dtype=F64)[:, None], m2, mean.reshape(k, -1)], axis=1)


def from_rec(rows: np.ndarray, L: int, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n (k,), m2 (k, L), mean (k, L, d) from rec rows."""
    k = rows.shape[0]
    return rows[:, 0], rows[:, 1:1 + L], rows[:, 1 + L:].reshape(k, L, d)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges (start, length) with each one that starts where the previous one ends
    joined to it (fewer cuts, same bytes in the same order)."""
    out: list[tuple[int, int]] = []
    for start, length in ranges:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return out


def rec_ranges(L: int, d: int, positions: Sequence[int]) -> list[tuple[int, int]]:
    """Byte ranges of a rec row holding n, then m2 and the mean at the kept-layer
    ``positions``: cut and concatenated they are a rec row of ``len(positions)`` layers
    (decoded by :func:`from_rec` with ``L = len(positions)``)."""
    return _merged([(0, 8)] + [(8 * (1 + p), 8) for p in positions]
                   + [(8 * (1 + L + p * d), 8 * d) for p in positions])


def unit_ranges(d: int, positions: Sequence[int]) -> list[tuple[int, int]]:
    """Byte ranges of a unit row holding the unit sums (d,) at the kept-layer ``positions``."""
    return _merged([(8 * p * d, 8 * d) for p in positions])


def bkt_ranges(d: int, positions: Sequence[int]) -> list[tuple[int, int]]:
    """Byte ranges of a bucket value holding types, count and the vector sums (d,) at the
    kept-layer ``positions``: a bucket value of ``len(positions)`` layers."""
    return _merged([(0, 16)] + [(16 + 8 * p * d, 8 * d) for p in positions])


def scal_rows(n: np.ndarray, mean: np.ndarray, m2: np.ndarray,
              unit: Optional[np.ndarray] = None) -> np.ndarray:
    """(k, 1 + 2L) rows (n, M per layer, m2 per layer); M = ||mean||^2 in float64. With
    ``unit`` (k, L, d), the merged unit sums, (k, 1 + 3L): ``||U||^2`` per layer appended,
    computed from the whole sum at every write (never accumulated), so self-similarity
    ``(||U||^2 - n) / (n (n - 1))`` needs no unit record."""
    M = np.einsum("kld,kld->kl", mean, mean)
    cols = [np.asarray(n, dtype=F64)[:, None], M, m2]
    if unit is not None:
        cols.append(np.einsum("kld,kld->kl", unit, unit))
    return np.concatenate(cols, axis=1)


def from_scal(rows: np.ndarray, L: int) -> tuple:
    """n (k,), M (k, L), m2 (k, L), and ``||U||^2`` (k, L) or None (rows of ``1 + 2L``)."""
    norms = rows[:, 1 + 2 * L:1 + 3 * L] if rows.shape[1] == 1 + 3 * L else None
    return rows[:, 0], rows[:, 1:1 + L], rows[:, 1 + L:1 + 2 * L], norms


def head_segment(layers: LayerMoments) -> bytes:
    """The head segment of a window's (or base's) layer moments, all layers."""
    L, d = layers.mean.shape
    n = np.full((L, 1), float(layers.n))
    m2 = np.einsum("lii->l", layers.comoment)[:, None] if layers.comoment is not None \
        else np.zeros((L, 1))
    return np.concatenate([n, layers.mean, m2, layers.unit_sum, layers.unit_sq_sum],
                          axis=1).astype(F64).tobytes()


def from_head(raw: bytes, L: int, d: int) -> dict:
    """n (int), mean (L, d), m2 (L,), unit_sum (L, d), unit_sq_sum (L, d) of a head segment."""
    a = np.frombuffer(raw, dtype=F64).reshape(L, 2 + 3 * d)
    return {"n": int(round(a[0, 0])), "mean": a[:, 1:1 + d], "m2": a[:, 1 + d],
            "unit_sum": a[:, 2 + d:2 + 2 * d], "unit_sq_sum": a[:, 2 + 2 * d:]}


@lru_cache(maxsize=256)
def upper_index(d: int, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) of the upper-triangular entries of rows r0..r1-1 of a d x d matrix."""
    rows, cols = np.triu_indices(d)
    keep = (rows >= r0) & (rows < r1)
    return rows[keep], cols[keep]


def chunk_segment(n: int, mean: np.ndarray, comoment: np.ndarray, r0: int, r1: int) -> bytes:
    """A co-moment chunk: ``[n, mean (d), C[i, j] for r0 <= i < r1, j >= i]``."""
    rows, cols = upper_index(comoment.shape[0], r0, r1)
    return np.concatenate([[float(n)], mean, comoment[rows, cols]]).astype(F64).tobytes()


def from_chunk(raw: bytes, d: int, r0: int, r1: int) -> tuple[int, np.ndarray, np.ndarray]:
    """n, mean (d,), and the chunk's upper-triangular entries (flat)."""
    a = np.frombuffer(raw, dtype=F64)
    return int(round(a[0])), a[1:1 + d], a[1 + d:]
