"""Reads of the accumulators, written once as *plans* run by a sync or an async driver.

A plan is a generator: it yields a list of Redis commands (``(method, *args)``), receives
their replies, and finally returns its result. :func:`run_sync` runs a plan on a
``redis.Redis`` (workers, CLI, benchmarks); :func:`run_async` on a ``redis.asyncio``
client (the API, which must never block its event loop). Every command of one step goes
out in one pipeline (non-transactional: on a cluster the parts live on several nodes), and
no command reads an unbounded amount (scans go by shard, large hashes by HSCAN pages), so
no single command holds Redis for long.

A read reports ``as_of``: the number of completed checkpoints (``version``), the time of
the last one, and ``applying``, the checkpoints sealed and still being applied when it
read. Parts are applied one after another, so while ``applying`` > 0 a read that spans
several parts may see a checkpoint in some of them and not yet in others (a token's layer
groups too: each layer's moments are whole, at that layer's count); every count of one
token at one layer is always whole.

A token's records are cut into layer groups (``PairConf.groups``, parts of their own): a
read of some layers touches only their groups; a read of all layers gathers every group.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generator, Optional, Sequence

import numpy as np
import redis

from embgeom.errors import NotFound
from embgeom.store import codec
from embgeom.store import keys as K
from embgeom.store.conf import PairConf, shard_of
from embgeom.store.keys import PairKeys
from embgeom.store.layers import (chunk_span, comoment_from_chunks, merge_chunks, merge_head,
                                  ordered_segments)
from embgeom.store.scripts import SCAN_SLICES, SLICES

__all__ = ["Plan", "run_sync", "run_async", "PairState", "Scalars", "BoundedCache", "Reader"]

Plan = Generator[list, list, object]


def run_sync(client, plan: Plan):
    """Run a plan on a synchronous client."""
    try:
        commands = next(plan)
        while True:
            with client.pipeline(transaction=False) as p:
                for name, *args in commands:
                    getattr(p, name)(*args)
                replies = p.execute() if commands else []
            commands = plan.send(replies)
    except StopIteration as stop:
        return stop.value


async def run_async(client, plan: Plan, timeout: Optional[float] = 10.0):
    """Run a plan on a ``redis.asyncio`` client, within ``timeout`` seconds as a whole
    (one timer per read, not one per command: ``redis.TimeoutError`` beyond it)."""
    try:
        async with asyncio.timeout(timeout):
            return await _drive(client, plan)
    except TimeoutError:
        raise redis.TimeoutError(f"the store did not answer within {timeout} s") from None


async def _drive(client, plan: Plan):
    try:
        commands = next(plan)
        while True:
            if commands:
                async with client.pipeline(transaction=False) as p:
                    for name, *args in commands:
                        getattr(p, name)(*args)
                    replies = await p.execute()
            else:
                replies = []
            commands = plan.send(replies)
    except StopIteration as stop:
        return stop.value


@dataclass(frozen=True)
class PairState:
    """What a read of one pair starts from: its generation, configuration and freshness."""

    pair: PairKeys
    gen: int
    conf: Optional[PairConf]
    version: int
    updated_at: Optional[float]
    applying: int

    def as_of(self) -> dict:
        return {"version": self.version, "updated_at": self.updated_at, "applying": self.applying}

    @property
    def empty(self) -> bool:
        return self.conf is None


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


class BoundedCache:
    """A map of at most ``entries`` items, the least recently used dropped first.

    One lock around every operation (and nothing else: no read or decoding holds it), so
    the event loop and the thread pool can share it; a miss is a default, never a
    ``KeyError``."""

    _MISSING = object()

    def __init__(self, entries: int):
        if entries < 1:
            raise ValueError("a cache holds at least one entry")
        self.entries = entries
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def get(self, key, default=None):
        with self._lock:
            value = self._items.get(key, self._MISSING)
            if value is self._MISSING:
                return default
            self._items.move_to_end(key)
            return value

    def put(self, key, value) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.entries:
                self._items.popitem(last=False)

    def discard(self, key) -> None:
        with self._lock:
            self._items.pop(key, None)


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


def _join_scalars(by_group: list) -> Scalars:
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


def _decode_hash(raw: dict, width: int) -> tuple[np.ndarray, np.ndarray]:
    if not raw:
        return np.zeros(0, dtype=np.int64), np.zeros((0, width))
    ids = np.fromiter((int(k) for k in raw.keys()), dtype=np.int64, count=len(raw))
    rows = np.frombuffer(b"".join(raw.values()), dtype=codec.F64).reshape(len(raw), width)
    return ids, rows


class Reader:
    """Plans over a pair's parts, with small caches keyed by what cannot change (a
    generation's configuration) or by the version read (scalars of a settled pair)."""

    def __init__(self, scalar_cache_entries: int = 8, conf_cache_entries: int = 1024):
        # pair -> (generation, its configuration): the last generation read, so a DELETE
        # replaces its pair's entry instead of adding one; LRU over pairs.
        self._confs = BoundedCache(conf_cache_entries)
        # pair -> ((generation, version), Scalars): one settled version per pair.
        self._scalars = BoundedCache(scalar_cache_entries)

    # ---------------------------------------------------------------- the pair
    _HEAD = 4  # commands of the state read

    def _head(self, pair: PairKeys) -> list:
        return [("get", pair.gen), ("hgetall", pair.meta), ("zcard", pair.inflight),
                ("sismember", K.PAIRS, pair.pair)]

    def pair_state(self, pair: PairKeys) -> Plan:
        """The pair's generation, configuration and freshness; ``collection_not_found`` or
        ``model_not_in_collection`` when nothing was ever sent to it."""
        replies = yield self._head(pair)
        return (yield from self._state(pair, replies))

    def pair_state_with(self, pair: PairKeys, then) -> Plan:
        """:meth:`pair_state` and, in the same round trip, the commands ``then(gen, conf)``
        for the generation last seen: ``(state, their replies)``, or ``(state, None)``
        when that guess was wrong (a first read, a deletion since)."""
        guess = self._confs.get(pair.pair)
        extra = then(*guess) if guess else []
        replies = yield self._head(pair) + extra
        state = yield from self._state(pair, replies[:self._HEAD])
        if guess and not state.empty and state.gen == guess[0]:
            return state, replies[self._HEAD:]
        return state, None

    def _state(self, pair: PairKeys, replies: list) -> Plan:
        gen_raw, meta, applying, listed = replies
        if not listed:
            yield from self._not_found(pair)
        gen = int(gen_raw or 0)
        cached = self._confs.get(pair.pair)
        conf = cached[1] if cached is not None and cached[0] == gen else None
        if conf is None:
            if cached is not None and cached[0] < gen:
                self._scalars.discard(pair.pair)  # of a deleted generation
            (raw,) = yield [("get", pair.conf(gen))]
            if raw is not None:
                conf = PairConf.from_json(raw)
        if conf is not None:
            self._confs.put(pair.pair, (gen, conf))
        updated = meta.get(b"updated_at")
        return PairState(pair, gen, conf, int(meta.get(b"version", 0)),
                         float(updated) if updated else None, int(applying))

    def _not_found(self, pair: PairKeys) -> Plan:
        members, settings = yield [("smembers", K.PAIRS),
                                   ("exists", K.collection_settings(pair.collection))]
        collections = {K.split_pair(m.decode())[0] for m in members}
        if pair.collection not in collections and not settings:
            raise NotFound("collection_not_found", f"no collection {pair.collection!r}",
                           collection=pair.collection)
        raise NotFound("model_not_in_collection",
                       f"no text was ever sent to collection {pair.collection!r} for model "
                       f"{pair.model!r}", collection=pair.collection, model=pair.model)

    def live_workers(self, silence_seconds: float) -> Plan:
        """Heartbeat details of the workers heard from within ``silence_seconds``."""
        # Heartbeats are scored by each worker's clock: compared with ours, as they are.
        (ids,) = yield [("zrangebyscore", K.WORKERS, time.time() - silence_seconds, "+inf")]
        if not ids:
            return []
        raws = yield [("get", K.worker(i.decode())) for i in ids]
        return [json.loads(raw) for raw in raws if raw]

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
            ids, rows = zip(*(_decode_hash(raw, view.scal_width)
                              for (_, h, _), raw in zip(token_parts, raws) if h == g))
            ids, rows = np.concatenate(ids), np.concatenate(rows)
            order = np.argsort(ids, kind="stable")
            by_group.append((ids[order], codec.from_scal(rows[order], view.L)))
        out = _join_scalars(by_group)
        if state.applying == 0:
            self._scalars.put(state.pair.pair, (at, out))
        return out

    @staticmethod
    def _token_commands(parts, conf: PairConf, key: int) -> list:
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

    @staticmethod
    def _token_record(conf: PairConf, replies: list):
        """``(n, M (L,), m2 (L,), ||U||^2 (L,) or None)`` from :meth:`_token_commands`'
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

    def token(self, pair: PairKeys, key: int) -> Plan:
        """``(state, record)``: the pair's state and one token's ``(n, M (L,), m2 (L,),
        ||U||^2 (L,) or None)`` (None if never seen), in one round trip when the pair's
        generation is the one last read."""
        state, replies = yield from self.pair_state_with(
            pair, lambda gen, conf: self._token_commands(pair.parts(gen), conf, key))
        if state.empty:
            return state, None
        if replies is None:
            replies = yield self._token_commands(pair.parts(state.gen), state.conf, key)
        return state, self._token_record(state.conf, replies)

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
                    k_ids, rows = _decode_hash(dict(zip(flat[0::2], flat[1::2])), width)
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
