"""Layer-level state: the head (n, mean, m2, unit sums of every kept layer) and the
co-moment matrices, as append-only segments folded into a base from time to time.

Every checkpoint adds one *segment* per layer part (the head, each co-moment chunk of
each kept layer: ``conf.chunks`` row blocks of the upper triangle, each within
``chunk_bytes``, and with ``cross_layer`` the chunks of the concatenated layers'
co-moment, ``conf.cross_chunks``), keyed by its checkpoint id, so writing it is idempotent and never
rewrites the accumulated state: its cost is the window's own moments. When a part holds
more than ``max_segments`` segments, the worker that noticed folds them into the part's
``base`` (a Chan merge in numpy, under the part's lock) and records the folded ids, so a
late rewrite of a folded segment is refused.

Readers merge the base and the segments present (:func:`merge_head`,
:func:`merge_chunks`): both are :func:`embgeom.stats.chan_merge` (and its co-moment form),
exact in any order.
"""

from __future__ import annotations

import uuid
from typing import Optional

import numpy as np
import redis

from embgeom.errors import CheckTooOld, GenerationDeleted
from embgeom.stats import LayerMoments, chan_merge, chan_merge_comoment
from embgeom.store import codec
from embgeom.store.conf import PairConf
from embgeom.store.keys import PartKeys, PartTag
from embgeom.store.scripts import FOLD, PUT_SEGMENT

__all__ = ["LayerWriter", "layer_parts", "chunk_span", "merge_head", "merge_chunks",
           "comoment_from_chunks"]


def layer_parts(parts: PartKeys, conf: PairConf) -> list[tuple[str, Optional[int], Optional[int], PartTag]]:
    """Every layer part of a pair's generation: ``(kind, layer position, chunk, keys)``;
    kind "head", "chunk" (a layer's co-moment) or "cross" (the cross-layer co-moment)."""
    out = [("head", None, None, parts.head)]
    for li, layer in enumerate(conf.layers):
        for j in range(len(conf.chunks) - 1):
            out.append(("chunk", li, j, parts.chunk(layer, j)))
    for j in range(len(conf.cross_chunks) - 1):
        out.append(("cross", None, j, parts.cross(j)))
    return out


def chunk_span(conf: PairConf, kind: str, j: int) -> tuple[int, int, int]:
    """``(width, r0, r1)`` of co-moment chunk j: of a layer (width d) or of the
    concatenated layers (width L d)."""
    bounds, width = (conf.cross_chunks, conf.cross_dim) if kind == "cross" else (conf.chunks, conf.d)
    return width, bounds[j], bounds[j + 1]


def ordered_segments(fields: dict) -> list[bytes]:
    """A part's segment values (an HGETALL of ``:seg``) in a fixed order, "base" first,
    then by checkpoint id: Redis's hash order changes when it reloads its data, and the
    merges' rounding follows their order, so every read of the same data gives the same
    bits only in an order that is part of the data."""
    return [fields[k] for k in sorted(fields, key=lambda k: (k != b"base", k))]


def merge_head(segments: list[dict], L: int, d: int) -> dict:
    """Chan-merge head segments: n, mean (L, d), m2 (L,), unit_sum, unit_sq_sum."""
    out = {"n": 0, "mean": np.zeros((L, d)), "m2": np.zeros(L), "unit_sum": np.zeros((L, d)),
           "unit_sq_sum": np.zeros((L, d))}
    for seg in segments:
        if seg["n"] == 0:
            continue
        out["n"], out["mean"], out["m2"], _ = chan_merge(out["n"], out["mean"], out["m2"],
                                                         seg["n"], seg["mean"], seg["m2"])
        out["unit_sum"] = out["unit_sum"] + seg["unit_sum"]
        out["unit_sq_sum"] = out["unit_sq_sum"] + seg["unit_sq_sum"]
    return out


def merge_chunks(raws: list[bytes], d: int, r0: int, r1: int) -> tuple[int, np.ndarray, np.ndarray]:
    """Chan-merge co-moment chunk segments: n, mean (d,), the chunk's upper entries."""
    rows, cols = codec.upper_index(d, r0, r1)
    n, mean, c = 0, np.zeros(d), np.zeros(rows.shape[0])
    for raw in raws:
        nb, mb, cb = codec.from_chunk(raw, d, r0, r1)
        if nb == 0:
            continue
        c = chan_merge_comoment(n, mean, c, nb, mb, cb, index=(rows, cols))
        n, mean, _, _ = chan_merge(n, mean, 0.0, nb, mb, 0.0)
    return n, mean, c


def comoment_from_chunks(chunks: list[tuple[int, int, np.ndarray]], d: int) -> np.ndarray:
    """The full symmetric (d, d) co-moment from its chunks' upper entries."""
    C = np.zeros((d, d))
    for r0, r1, entries in chunks:
        rows, cols = codec.upper_index(d, r0, r1)
        C[rows, cols] = entries
    return C + np.triu(C, 1).T


class LayerWriter:
    """Writes a checkpoint's layer segments and folds parts that hold too many."""

    def __init__(self, client: redis.Redis, worker_id: str, max_age_ms: int = 600_000,
                 max_segments: int = 8, lock_ms: int = 60_000):
        self.r = client
        self.worker_id = worker_id
        self.max_age_ms = max_age_ms
        self.max_segments = max_segments
        self.lock_ms = lock_ms

    def segments(self, conf: PairConf, layers: LayerMoments) -> list[bytes]:
        """The window's segment of every layer part, in :func:`layer_parts` order."""
        out = [codec.head_segment(layers)]
        for li in range(conf.L):
            for j in range(len(conf.chunks) - 1):
                out.append(codec.chunk_segment(layers.n, layers.mean[li], layers.comoment[li],
                                               conf.chunks[j], conf.chunks[j + 1]))
        if conf.cross_layer:
            if layers.cross is None:
                raise ValueError("a cross_layer pair's window carries no cross-layer co-moment")
            flat = layers.mean.reshape(-1)
            for j in range(len(conf.cross_chunks) - 1):
                _, r0, r1 = chunk_span(conf, "cross", j)
                out.append(codec.chunk_segment(layers.n, flat, layers.cross, r0, r1))
        return out

    def put(self, parts: PartKeys, conf: PairConf, cp: str, layers: LayerMoments,
            checked: int) -> tuple[list, int]:
        """Write the segments; returns the parts due for folding and the bytes written."""
        targets = layer_parts(parts, conf)
        blobs = self.segments(conf, layers)
        with self.r.pipeline(transaction=False) as p:
            for (_, _, _, keys), blob in zip(targets, blobs):
                PUT_SEGMENT.queue(p, [keys.seg, keys.folded, keys.dead],
                                  [cp, blob, checked, self.max_age_ms])
            results = p.execute()
        due = []
        for target, res in zip(targets, results):
            if res == -1:
                raise GenerationDeleted(parts.pair.pair)
            if res == -2:
                raise CheckTooOld(f"checkpoint {cp}: its in-flight check is too old")
            if res > self.max_segments:  # -3 (already folded) is fine: it counts once
                due.append(target)
        return due, sum(len(b) for b in blobs)

    def fold(self, conf: PairConf, targets: list) -> int:
        """Fold each due part's segments into its base; returns how many were folded."""
        folded = 0
        for kind, li, j, keys in targets:
            fence = f"{self.worker_id}:{uuid.uuid4().hex[:12]}"
            if not self.r.set(keys.lock, fence, nx=True, px=self.lock_ms):
                continue  # someone else is folding it
            try:
                fields = self.r.hgetall(keys.seg)
                cps = [k for k in fields if k != b"base"]
                if len(cps) < 2:
                    continue
                raws = ordered_segments(fields)
                if kind == "head":
                    merged = merge_head([codec.from_head(r, conf.L, conf.d) for r in raws], conf.L, conf.d)
                    base = np.concatenate(
                        [np.full((conf.L, 1), float(merged["n"])), merged["mean"], merged["m2"][:, None],
                         merged["unit_sum"], merged["unit_sq_sum"]], axis=1).astype(codec.F64).tobytes()
                else:
                    width, r0, r1 = chunk_span(conf, kind, j)
                    n, mean, c = merge_chunks(raws, width, r0, r1)
                    base = np.concatenate([[float(n)], mean, c]).astype(codec.F64).tobytes()
                folded += FOLD(self.r, [keys.lock, keys.seg, keys.folded], [fence, base, *cps]) == 1
            finally:
                self.r.eval("if redis.call('GET', KEYS[1]) == ARGV[1] then "
                            "redis.call('DEL', KEYS[1]) end return 1", 1, keys.lock, fence)
        return folded
