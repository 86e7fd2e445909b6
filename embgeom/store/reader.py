"""Reads of the accumulators, written once as plans (:mod:`embgeom.store.plans`) run by a
sync or an async driver.

Each read starts from its pair's state (:mod:`embgeom.store.pair_state`: generation,
configuration, and ``as_of``, what it reports of the checkpoints it saw), and what it gets
back is decoded by :mod:`embgeom.store.records`. No command reads an unbounded amount
(scans go by shard, large hashes by HSCAN pages), so no single command holds Redis for long.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from embgeom.keyspace import is_key
from embgeom.store import codec
from embgeom.store.conf import PairConf, shard_of
from embgeom.store.keys import PairKeys
from embgeom.store.layers import (chunk_span, comoment_from_chunks, merge_chunks, merge_head,
                                  ordered_segments)
from embgeom.store.pair_state import BoundedCache, PairState, PairStates
from embgeom.store.plans import Plan, run_async, run_sync
from embgeom.store.records import Scalars, decode_hash, join_scalars, token_commands, token_record
from embgeom.store.scripts import SCAN_SLICES, SLICES

# Plan, its drivers and PairState are re-exported: most callers import them from here.
__all__ = ["Plan", "run_sync", "run_async", "PairState", "Scalars", "BoundedCache", "Reader"]


# Sliced reads (see scripts.SLICES): what one script call may copy inside Redis (whole
# records) and at most how many fields it names, so no call holds Redis for long.
CALL_BYTES = 4 << 20
CALL_FIELDS = 512


def _fields_per_call(record_bytes: int) -> int:
    return max(1, min(CALL_FIELDS, CALL_BYTES // max(1, record_bytes)))


def _script_command(script, key: str, args: list) -> tuple:
    """A plan command running ``script`` on one key (EVAL, routed by that key's slot)."""
    return ("execute_command", "EVAL", script.source, 1, key, *args)


def _range_args(ranges: Sequence[tuple[int, int]]) -> list:
    return [len(ranges)] + [x for r in ranges for x in r]


def _by_shard(keys: np.ndarray, shards: int, per_call: int) -> list[tuple[int, np.ndarray]]:
    """Row indices of ``keys`` grouped by shard, in key order within a shard, cut into
    groups of at most ``per_call``: ``[(shard, rows)]``."""
    shard = shard_of(keys, shards)
    order = np.lexsort((keys, shard))
    out = []
    for g in np.split(order, np.flatnonzero(np.diff(shard[order])) + 1):
        if len(g):
            out.extend((int(shard[g[0]]), g[i:i + per_call]) for i in range(0, len(g), per_call))
    return out


def _by_group(conf: PairConf, positions: Sequence[int]) -> dict:
    """Kept-layer ``positions`` by layer group, groups in order of first appearance:
    ``{group: (indices into positions, positions within the group)}``."""
    out: dict = {}
    for i, p in enumerate(positions):
        g, at = conf.group_of(int(p))
        rows, ats = out.setdefault(g, ([], []))
        rows.append(i)
        ats.append(at)
    return out


class Reader:
    """Plans over a pair's parts, with small caches keyed by what cannot change (a
    generation's configuration, in :attr:`states`) or by the version read (scalars of a
    settled pair)."""

    def __init__(self, scalar_cache_entries: int = 8, conf_cache_entries: int = 1024):
        # pair -> ((generation, version), Scalars): one settled version per pair.
        self._scalars = BoundedCache(scalar_cache_entries)
        self.states = PairStates(conf_cache_entries, on_new_generation=self._scalars.discard)

    def pair_state(self, pair: PairKeys) -> Plan:
        """:meth:`PairStates.pair_state <embgeom.store.pair_state.PairStates.pair_state>`."""
        return self.states.pair_state(pair)

    # ------------------------------------------------------------------- heads
    def heads(self, state: PairState) -> Plan:
        """Merged head of every kept layer: n, mean (L, d), m2 (L,), unit sums."""
        conf = state.conf
        (fields,) = yield [("hgetall", state.pair.parts(state.gen).head.seg)]
        return merge_head([codec.from_head(v, conf.L, conf.d) for v in ordered_segments(fields)],
                          conf.L, conf.d)

    def aggs(self, state: PairState) -> Plan:
        """Summed shard aggregates: types, count (of the first layer group), within (L,)
        (each group's layers from its parts)."""
        conf = state.conf
        token_parts = state.pair.parts(state.gen).shard_parts(conf)
        raws = yield [("get", keys.agg) for *_, keys in token_parts]
        totals = [np.zeros(2 + len(members)) for members in conf.groups]
        for (_, g, _), raw in zip(token_parts, raws):
            if raw:
                totals[g] += np.frombuffer(raw, dtype=codec.F64)
        return {"types": int(round(totals[0][0])), "count": int(round(totals[0][1])),
                "within": np.concatenate([t[2:] for t in totals])}

    # ----------------------------------------------------------------- scalars
    def scalars(self, state: PairState) -> Plan:
        """Every token type's scalars (one HGETALL per shard; cached per version once
        no checkpoint is applying)."""
        conf = state.conf
        at = (state.gen, state.version)
        cached = self._scalars.get(state.pair.pair)
        if state.applying == 0 and cached is not None and cached[0] == at:
            return cached[1]
        token_parts = state.pair.parts(state.gen).shard_parts(conf)
        raws = yield [("hgetall", keys.scal) for *_, keys in token_parts]
        by_group = []
        for g in range(len(conf.groups)):
            view = conf.group_view(g)
            ids, rows = zip(*(decode_hash(raw, view.scal_width)
                              for (_, h, _), raw in zip(token_parts, raws) if h == g))
            ids, rows = np.concatenate(ids), np.concatenate(rows)
            order = np.argsort(ids, kind="stable")
            by_group.append((ids[order], codec.from_scal(rows[order], view.L)))
        out = join_scalars(by_group)
        if state.applying == 0:
            self._scalars.put(state.pair.pair, (at, out))
        return out

    def token(self, pair: PairKeys, key: int) -> Plan:
        """``(state, record)``: the pair's state and one token's ``(n, M (L,), m2 (L,),
        ||U||^2 (L,) or None)`` (None if never seen), in one round trip when the pair's
        generation is the one last read; a key outside the key space was never seen."""
        if not is_key(key):
            state = yield from self.states.pair_state(pair)
            return state, None
        state, replies = yield from self.states.pair_state_with(
            pair, lambda gen, conf: token_commands(pair.parts(gen), conf, key))
        if state.empty:
            return state, None
        if replies is None:
            replies = yield token_commands(pair.parts(state.gen), state.conf, key)
        return state, token_record(state.conf, replies)

    def units(self, state: PairState, keys: Sequence[int], position: int) -> Plan:
        """Unit-vector sums (d,) at one kept layer of each of ``keys`` (None if absent).
        Only that layer's bytes leave Redis (see :meth:`_sliced`)."""
        conf = state.conf
        if not conf.self_similarity or len(keys) == 0:
            return [None] * len(keys)
        g, at = conf.group_of(position)
        present, rows = yield from self._sliced(state, "unit", keys, codec.unit_ranges(conf.d, [at]),
                                                8 * len(conf.groups[g]) * conf.d, group=g)
        return [row if p else None for p, row in zip(present.tolist(), rows)]

    @staticmethod
    def _sliced(state: PairState, part: str, keys: Sequence[int], ranges: list[tuple[int, int]],
                record_bytes: int, step_bytes: int = 32 << 20, group: int = 0) -> Plan:
        """The records of ``keys`` in layer group ``group``'s ``part`` hash ("rec", "unit"), each cut
        inside Redis to the byte ``ranges`` (:data:`embgeom.store.scripts.SLICES`):
        ``(present (k,) bool, rows (k, width) float64)``, row i for ``keys[i]``, zeros
        when absent. One script call per shard and group of keys (at most
        :data:`CALL_BYTES` of whole records copied in Redis per call), calls pipelined in
        steps of at most ``step_bytes`` of cut bytes."""
        keys = np.asarray(keys, dtype=np.int64)
        width = sum(length for _, length in ranges) // 8
        present = np.zeros(keys.shape[0], dtype=bool)
        rows = np.zeros((keys.shape[0], width))
        if keys.shape[0] == 0:
            return present, rows
        parts = state.pair.parts(state.gen)
        args = _range_args(ranges)
        per_call = _fields_per_call(record_bytes)
        calls = _by_shard(keys, state.conf.shards, per_call)
        per_step = max(1, step_bytes // (8 * width * per_call))
        for i in range(0, len(calls), per_step):
            step = calls[i:i + per_step]
            replies = yield [_script_command(SLICES, getattr(parts.shard(s, group), part),
                                             args + [str(int(x)) for x in keys[g]]) for s, g in step]
            for (_, g), raws in zip(step, replies):
                present[g], rows[g] = codec.unpack_rows(raws, width)
        return present, rows

    def names(self, state: PairState, keys: Sequence[int]) -> Plan:
        """Stored names of hashed word keys (see :mod:`embgeom.store.keys`): dict key ->
        str, one HMGET per shard (and group of keys); a key without a stored name is left out."""
        keys = np.asarray(keys, dtype=np.int64)
        if keys.shape[0] == 0:
            return {}
        parts = state.pair.parts(state.gen)
        calls = _by_shard(keys, state.conf.shards, CALL_FIELDS)
        replies = yield [("hmget", parts.shard(s).name, [str(int(k)) for k in keys[g]]) for s, g in calls]
        return {int(k): raw.decode("utf-8", "surrogatepass")
                for (_, g), reply in zip(calls, replies) for k, raw in zip(keys[g], reply)
                if raw is not None}

    # ----------------------------------------------------------------- buckets
    def buckets(self, state: PairState, buckets: Sequence[int],
                positions: Optional[Sequence[int]] = None) -> Plan:
        """Summed bucket aggregates over all shards: types, count (of the first group read),
        vector (P, d) at the kept-layer ``positions`` (all kept layers when None); only
        those layers' groups are read, and only those layers' bytes leave Redis."""
        conf = state.conf
        parts = state.pair.parts(state.gen)
        pos = list(range(conf.L)) if positions is None else list(positions)
        asked = _by_group(conf, pos) or {0: ([], [])}  # no layer asked: the counts only
        commands = []
        for g, (_, at) in asked.items():
            args = _range_args(codec.bkt_ranges(conf.d, at)) + [str(int(b)) for b in buckets]
            commands += [_script_command(SLICES, parts.shard(s, g).bkt, args) for s in range(conf.shards)]
        replies = iter((yield commands))
        counts, vector = None, np.zeros((len(pos), conf.d))
        for g, (rows, at) in asked.items():
            total = np.zeros(2 + len(at) * conf.d)
            for _ in range(conf.shards):
                for raw in next(replies):
                    if raw is not None:
                        total += np.frombuffer(raw, dtype=codec.F64)
            counts = total[:2] if counts is None else counts
            vector[rows] = total[2:].reshape(len(at), conf.d)
        return {"types": int(round(counts[0])), "count": int(round(counts[1])), "vector": vector}

    # ------------------------------------------------------------- covariance
    def covariance(self, state: PairState, position: int) -> Plan:
        """One kept layer's exact moments: n, mean (d,), comoment (d, d), unit_sum,
        unit_sq_sum, from the head and the layer's co-moment chunks."""
        conf = state.conf
        parts = state.pair.parts(state.gen)
        layer = conf.layers[position]
        j_count = len(conf.chunks) - 1
        replies = yield [("hgetall", parts.head.seg)] + \
            [("hgetall", parts.chunk(layer, j).seg) for j in range(j_count)]
        head = merge_head([codec.from_head(v, conf.L, conf.d) for v in ordered_segments(replies[0])],
                          conf.L, conf.d)
        chunks = []
        for j, fields in enumerate(replies[1:]):
            r0, r1 = conf.chunks[j], conf.chunks[j + 1]
            chunks.append((r0, r1, merge_chunks(ordered_segments(fields), conf.d, r0, r1)[2]))
        return {"n": head["n"], "mean": head["mean"][position], "m2": head["m2"][position],
                "comoment": comoment_from_chunks(chunks, conf.d),
                "unit_sum": head["unit_sum"][position], "unit_sq_sum": head["unit_sq_sum"][position]}

    def cross_layer(self, state: PairState) -> Plan:
        """The co-moment of all kept layers concatenated (``cross_layer`` pairs): n, mean
        (L d,), comoment (L d, L d), merged from its chunks as :meth:`covariance` merges
        a layer's."""
        conf = state.conf
        parts = state.pair.parts(state.gen)
        j_count = len(conf.cross_chunks) - 1
        replies = yield [("hgetall", parts.cross(j).seg) for j in range(j_count)]
        n, mean, chunks = 0, np.zeros(conf.cross_dim), []
        for j, fields in enumerate(replies):
            width, r0, r1 = chunk_span(conf, "cross", j)
            n, mean, entries = merge_chunks(ordered_segments(fields), width, r0, r1)
            chunks.append((r0, r1, entries))
        return {"n": n, "mean": mean, "comoment": comoment_from_chunks(chunks, conf.cross_dim)}

    # ------------------------------------------------------------------- means
    def means(self, state: PairState, positions: Sequence[int], keep=None, page: int = 64) -> Plan:
        """A scan of every token's record: ids (k,), n (k,), m2 (k, P), mean (k, P, d) at
        the kept-layer ``positions``, for tokens with ``keep(n)`` True (all when None).

        The first asked layer's group is scanned: HSCAN pages of ``page`` records per
        shard, all shards in one pipeline per step, each record cut inside Redis to n and
        the asked layers (:data:`embgeom.store.scripts.SCAN_SLICES`); the asked layers of
        other groups are then read for the tokens kept (:meth:`_sliced`)."""
        conf = state.conf
        pos = list(positions)
        (g, (rows, at)), *rest = _by_group(conf, pos).items()
        ids, n, m2_g, mean_g = yield from self._scan(state, g, at, keep, page)
        m2, mean = np.zeros((len(ids), len(pos))), np.zeros((len(ids), len(pos), conf.d))
        m2[:, rows], mean[:, rows] = m2_g, mean_g
        for g, (rows, at) in rest:
            _, m2[:, rows], mean[:, rows] = yield from self._group_means(state, g, ids, at)
        return ids, n, m2, mean

    def _scan(self, state: PairState, g: int, at: Sequence[int], keep, page: int) -> Plan:
        """:meth:`means` of layers ``at`` (positions within layer group g) of that group."""
        conf = state.conf
        parts = state.pair.parts(state.gen)
        d = conf.d
        ranges = codec.rec_ranges(len(conf.groups[g]), d, at)
        width = sum(length for _, length in ranges) // 8
        args = _range_args(ranges)
        cursors = {s: 0 for s in range(conf.shards)}
        ids, ns, m2s, means = [], [], [], []
        while cursors:
            order = list(cursors)
            replies = yield [_script_command(SCAN_SLICES, parts.shard(s, g).rec, [cursors[s], page] + args)
                             for s in order]
            for s, (cursor, flat) in zip(order, replies):
                if flat:
                    k_ids, rows = decode_hash(dict(zip(flat[0::2], flat[1::2])), width)
                    n, m2, mean = codec.from_rec(rows, len(at), d)
                    sel = np.ones(len(n), dtype=bool) if keep is None else keep(n)
                    ids.append(k_ids[sel])
                    ns.append(n[sel])
                    m2s.append(m2[sel])
                    means.append(mean[sel])
                if int(cursor) == 0:
                    cursors.pop(s)
                else:
                    cursors[s] = int(cursor)
        if not ids:
            return (np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros((0, len(at))),
                    np.zeros((0, len(at), d)))
        ids, ns, m2s, means = (np.concatenate(x) for x in (ids, ns, m2s, means))
        order = np.argsort(ids, kind="stable")
        ids = ids[order]
        # HSCAN may return an entry twice (a rehash between pages): keep one of each.
        last = np.r_[ids[1:] != ids[:-1], True] if len(ids) else np.zeros(0, dtype=bool)
        order = order[last]
        return ids[last], ns[order], m2s[order], means[order]

    def _group_means(self, state: PairState, g: int, keys: Sequence[int], at: Sequence[int],
                     step_bytes: int = 32 << 20) -> Plan:
        """n (k,), m2 (k, P), mean (k, P, d) of ``keys`` at positions ``at`` within layer
        group g (zeros for a key the group does not hold)."""
        conf = state.conf
        size = len(conf.groups[g])
        _, rows = yield from self._sliced(state, "rec", keys, codec.rec_ranges(size, conf.d, at),
                                          8 * (1 + size + size * conf.d), step_bytes, group=g)
        return codec.from_rec(rows, len(at), conf.d)

    def means_of(self, state: PairState, keys: Sequence[int], positions: Sequence[int],
                 step_bytes: int = 32 << 20) -> Plan:
        """The records of the given token keys only: n (k,), m2 (k, P), mean (k, P, d) at
        the kept-layer ``positions``, row i for ``keys[i]``; a key never seen has n = 0 and
        zeros. Unlike :meth:`means`, what it reads grows with ``len(keys)``, not with every
        token ever seen: a caller that selects (count filter, sample) from the scalars
        first reads only what it uses; and only the asked layers' bytes leave Redis
        (:meth:`_sliced`, in steps of at most ``step_bytes``)."""
        conf = state.conf
        pos = list(positions)
        n, m2, mean = None, np.zeros((len(keys), len(pos))), np.zeros((len(keys), len(pos), conf.d))
        for g, (rows, at) in _by_group(conf, pos).items():
            g_n, m2[:, rows], mean[:, rows] = yield from self._group_means(state, g, keys, at, step_bytes)
            n = g_n if n is None else n  # the first asked group's count
        return (np.zeros(len(keys)) if n is None else n), m2, mean
