"""The per-token records a read gets back, decoded into arrays: every token's scalars
(its layer groups joined), one token's record, a hash of records.

A token's records are cut into layer groups (``PairConf.groups``, parts of their own): a
read of some layers touches only their groups; a read of all layers gathers every group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from embgeom.store import codec
from embgeom.store.conf import PairConf, shard_of

__all__ = ["Scalars", "join_scalars", "decode_hash", "token_commands", "token_record"]


@dataclass
class Scalars:
    """Per-token scalars of every token type: ids (k,), n (k,), M (k, L), m2 (k, L), and
    ``unit_norms`` ``||U||^2`` (k, L) of the unit sums, None for a pair without them
    (self-similarity off, or a generation stored before scal records carried them).

    ``layer_n`` (k, L): the count each layer's M and m2 are at; it differs from ``n`` (the
    first layer group's) only for a token whose layer groups a checkpoint being applied
    has reached in part. None: ``n`` at every layer."""

    ids: np.ndarray
    n: np.ndarray
    M: np.ndarray
    m2: np.ndarray
    unit_norms: Optional[np.ndarray] = None
    layer_n: Optional[np.ndarray] = None

    def unit_norms_at(self, position: int) -> Optional[np.ndarray]:
        """``||U||^2`` (k,) of every token at one kept layer, or None (see the class)."""
        return None if self.unit_norms is None else self.unit_norms[:, position]

    def at(self, position: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(M, V, Q) of every token at one kept layer (its position in ``conf.layers``)."""
        M = self.M[:, position]
        V = self.m2[:, position] / (self.n if self.layer_n is None else self.layer_n[:, position])
        return M, V, M + V


def join_scalars(by_group: list) -> Scalars:
    """One :class:`Scalars` from each layer group's ``(ids sorted, from_scal(rows))``:
    the tokens of the first group, each other group's columns aligned to them (zeros for
    a token a checkpoint being applied has not reached there yet, at the first group's n)."""
    ids, (n, M, m2, norms) = by_group[0]
    if len(by_group) == 1:
        return Scalars(ids, n, M, m2, norms)
    Ms, m2s, norms_all, ns = [M], [m2], [norms], [np.broadcast_to(n[:, None], M.shape)]
    for g_ids, (g_n, g_M, g_m2, g_norms) in by_group[1:]:
        at = np.minimum(np.searchsorted(g_ids, ids), max(len(g_ids) - 1, 0))
        hit = (g_ids[at] == ids) if len(g_ids) else np.zeros(len(ids), dtype=bool)

        def aligned(a):
            out = np.zeros((len(ids),) + a.shape[1:])
            out[hit] = a[at[hit]]
            return out
        Ms.append(aligned(g_M))
        m2s.append(aligned(g_m2))
        norms_all.append(None if g_norms is None else aligned(g_norms))
        g_count = np.where(hit, aligned(g_n), n)  # not there yet: zeros at the first group's n
        ns.append(np.broadcast_to(g_count[:, None], (len(ids), g_M.shape[1])))
    norms = None if any(x is None for x in norms_all) else np.concatenate(norms_all, axis=1)
    return Scalars(ids, n, np.concatenate(Ms, axis=1), np.concatenate(m2s, axis=1), norms,
                   layer_n=np.concatenate(ns, axis=1))


def decode_hash(raw: dict, width: int) -> tuple[np.ndarray, np.ndarray]:
    if not raw:
        return np.zeros(0, dtype=np.int64), np.zeros((0, width))
    ids = np.fromiter((int(k) for k in raw.keys()), dtype=np.int64, count=len(raw))
    rows = np.frombuffer(b"".join(raw.values()), dtype=codec.F64).reshape(len(raw), width)
    return ids, rows


def token_commands(parts, conf: PairConf, key: int) -> list:
    """The scal record of ``key`` in each layer group (and, for a generation stored
    before scal records held ``||U||^2``, its unit record)."""
    s = int(shard_of([key], conf.shards)[0])
    commands = []
    for g in range(len(conf.groups)):
        shard = parts.shard(s, g)
        commands.append(("hget", shard.scal, str(key)))
        if conf.self_similarity and not conf.stores_unit_norms:  # a generation stored before
            commands.append(("hget", shard.unit, str(key)))
    return commands


def token_record(conf: PairConf, replies: list):
    """``(n, M (L,), m2 (L,), ||U||^2 (L,) or None)`` from :func:`token_commands`'
    replies, groups concatenated (n: the first group's); None if never seen."""
    step = len(replies) // len(conf.groups)
    if any(r is None for r in replies[0::step]):
        return None
    Ms, m2s, norms_all = [], [], []
    for g in range(len(conf.groups)):
        view, raw = conf.group_view(g), replies[g * step:(g + 1) * step]
        n, M, m2, norms = codec.from_scal(np.frombuffer(raw[0], dtype=codec.F64)[None, :], view.L)
        if g == 0:
            count = int(round(n[0]))
        if norms is not None:
            norms = norms[0]
        elif view.self_similarity and raw[1] is not None:
            unit = np.frombuffer(raw[1], dtype=codec.F64).reshape(view.L, view.d)
            norms = np.einsum("ld,ld->l", unit, unit)
        Ms.append(M[0])
        m2s.append(m2[0])
        norms_all.append(norms)
    norms = None if any(x is None for x in norms_all) else np.concatenate(norms_all)
    return count, np.concatenate(Ms), np.concatenate(m2s), norms
