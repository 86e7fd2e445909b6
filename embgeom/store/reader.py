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
several parts may see a checkpoint in some of them and not yet in others; every count of
one token is always whole.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Generator, Optional, Sequence

import numpy as np
import redis

from embgeom.errors import NotFound
from embgeom.store import codec
from embgeom.store import keys as K
from embgeom.store.conf import PairConf, shard_of
from embgeom.store.keys import PairKeys
from embgeom.store.layers import comoment_from_chunks, merge_chunks, merge_head

__all__ = ["Plan", "run_sync", "run_async", "PairState", "Scalars", "Reader"]

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
    """Per-token scalars of every token type: ids (k,), n (k,), M (k, L), m2 (k, L)."""

    ids: np.ndarray
    n: np.ndarray
    M: np.ndarray
    m2: np.ndarray

    def at(self, position: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(M, V, Q) of every token at one kept layer (its position in ``conf.layers``)."""
        M = self.M[:, position]
        V = self.m2[:, position] / self.n
        return M, V, M + V


def _decode_hash(raw: dict, width: int) -> tuple[np.ndarray, np.ndarray]:
    if not raw:
        return np.zeros(0, dtype=np.int64), np.zeros((0, width))
    ids = np.fromiter((int(k) for k in raw.keys()), dtype=np.int64, count=len(raw))
    rows = np.frombuffer(b"".join(raw.values()), dtype=codec.F64).reshape(len(raw), width)
    return ids, rows


class Reader:
    """Plans over a pair's parts, with small caches keyed by what cannot change (a
    generation's configuration) or by the version read (scalars of a settled pair)."""

    def __init__(self, scalar_cache_entries: int = 8):
        self._confs: dict[tuple[str, int], PairConf] = {}
        self._latest: dict[str, tuple[int, PairConf]] = {}  # pair -> last generation read
        self._scalars: dict[tuple[str, int, int], Scalars] = {}
        self._scalar_cache_entries = scalar_cache_entries

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
        guess = self._latest.get(pair.pair)
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
        conf = self._confs.get((pair.pair, gen))
        if conf is None:
            (raw,) = yield [("get", pair.conf(gen))]
            if raw is not None:
                conf = self._confs.setdefault((pair.pair, gen), PairConf.from_json(raw))
        if conf is not None:
            self._latest[pair.pair] = (gen, conf)
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
        return merge_head([codec.from_head(v, conf.L, conf.d) for v in fields.values()],
                          conf.L, conf.d)

    def aggs(self, state: PairState) -> Plan:
        """Summed shard aggregates: types, count, within (L,)."""
        conf = state.conf
        parts = state.pair.parts(state.gen)
        raws = yield [("get", parts.shard(s).agg) for s in range(conf.shards)]
        total = np.zeros(2 + conf.L)
        for raw in raws:
            if raw:
                total += np.frombuffer(raw, dtype=codec.F64)
        return {"types": int(round(total[0])), "count": int(round(total[1])), "within": total[2:]}

    # ----------------------------------------------------------------- scalars
    def scalars(self, state: PairState) -> Plan:
        """Every token type's scalars (one HGETALL per shard; cached per version once
        no checkpoint is applying)."""
        conf = state.conf
        cache_key = (state.pair.pair, state.gen, state.version)
        if state.applying == 0 and cache_key in self._scalars:
            return self._scalars[cache_key]
        parts = state.pair.parts(state.gen)
        raws = yield [("hgetall", parts.shard(s).scal) for s in range(conf.shards)]
        width = 1 + 2 * conf.L
        ids, rows = zip(*(_decode_hash(raw, width) for raw in raws))
        ids, rows = np.concatenate(ids), np.concatenate(rows)
        order = np.argsort(ids, kind="stable")
        ids, rows = ids[order], rows[order]
        out = Scalars(ids, rows[:, 0], rows[:, 1:1 + conf.L], rows[:, 1 + conf.L:])
        if state.applying == 0:
            if len(self._scalars) >= self._scalar_cache_entries:
                self._scalars.pop(next(iter(self._scalars)))
            self._scalars[cache_key] = out
        return out

    @staticmethod
    def _token_commands(parts, conf: PairConf, key: int) -> list:
        shard = parts.shard(int(shard_of([key], conf.shards)[0]))
        commands = [("hget", shard.scal, str(key))]
        if conf.self_similarity:
            commands.append(("hget", shard.unit, str(key)))
        return commands

    @staticmethod
    def _token_record(conf: PairConf, replies: list):
        if replies[0] is None:
            return None
        row = np.frombuffer(replies[0], dtype=codec.F64)
        unit = (np.frombuffer(replies[1], dtype=codec.F64).reshape(conf.L, conf.d)
                if conf.self_similarity and replies[1] is not None else None)
        return int(round(row[0])), row[1:1 + conf.L], row[1 + conf.L:], unit

    def token(self, pair: PairKeys, key: int) -> Plan:
        """``(state, record)``: the pair's state and one token's ``(n, M (L,), m2 (L,),
        unit_sum (L, d) or None)`` (None if never seen), in one round trip when the
        pair's generation is the one last read."""
        state, replies = yield from self.pair_state_with(
            pair, lambda gen, conf: self._token_commands(pair.parts(gen), conf, key))
        if state.empty:
            return state, None
        if replies is None:
            replies = yield self._token_commands(pair.parts(state.gen), state.conf, key)
        return state, self._token_record(state.conf, replies)

    def units(self, state: PairState, keys: Sequence[int], position: int) -> Plan:
        """Unit-vector sums (d,) at one kept layer of each of ``keys`` (None if absent)."""
        conf = state.conf
        if not conf.self_similarity or len(keys) == 0:
            return [None] * len(keys)
        parts = state.pair.parts(state.gen)
        shards = shard_of(keys, conf.shards)
        replies = yield [("hget", parts.shard(int(s)).unit, str(int(k))) for k, s in zip(keys, shards)]
        d = conf.d
        return [None if r is None else np.frombuffer(r, dtype=codec.F64)[position * d:(position + 1) * d]
                for r in replies]

    def names(self, state: PairState, keys: Sequence[int]) -> Plan:
        """Stored names of hashed word keys (see :mod:`embgeom.store.keys`): dict key ->
        str, one HMGET per shard; a key without a stored name is left out."""
        keys = np.asarray(keys, dtype=np.int64)
        if keys.shape[0] == 0:
            return {}
        parts = state.pair.parts(state.gen)
        shards = shard_of(keys, state.conf.shards)
        order = np.argsort(shards, kind="stable")
        groups = np.split(order, np.flatnonzero(np.diff(shards[order])) + 1)
        replies = yield [("hmget", parts.shard(int(shards[g[0]])).name,
                          [str(int(k)) for k in keys[g]]) for g in groups]
        return {int(k): raw.decode("utf-8", "surrogatepass")
                for g, reply in zip(groups, replies) for k, raw in zip(keys[g], reply)
                if raw is not None}

    # ----------------------------------------------------------------- buckets
    def buckets(self, state: PairState, buckets: Sequence[int]) -> Plan:
        """Summed bucket aggregates over all shards: types, count, vector (L, d)."""
        conf = state.conf
        parts = state.pair.parts(state.gen)
        fields = [str(int(b)) for b in buckets]
        replies = yield [("hmget", parts.shard(s).bkt, fields) for s in range(conf.shards)]
        total = np.zeros(2 + conf.L * conf.d)
        for reply in replies:
            for raw in reply:
                if raw is not None:
                    total += np.frombuffer(raw, dtype=codec.F64)
        return {"types": int(round(total[0])), "count": int(round(total[1])),
                "vector": total[2:].reshape(conf.L, conf.d)}

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
        head = merge_head([codec.from_head(v, conf.L, conf.d) for v in replies[0].values()],
                          conf.L, conf.d)
        chunks = []
        for j, fields in enumerate(replies[1:]):
            r0, r1 = conf.chunks[j], conf.chunks[j + 1]
            chunks.append((r0, r1, merge_chunks(list(fields.values()), conf.d, r0, r1)[2]))
        return {"n": head["n"], "mean": head["mean"][position], "m2": head["m2"][position],
                "comoment": comoment_from_chunks(chunks, conf.d),
                "unit_sum": head["unit_sum"][position], "unit_sq_sum": head["unit_sq_sum"][position]}

    # ------------------------------------------------------------------- means
    def means(self, state: PairState, positions: Sequence[int], keep=None, page: int = 64) -> Plan:
        """A scan of every token's record: ids (k,), n (k,), m2 (k, P), mean (k, P, d) at
        the kept-layer ``positions``, for tokens with ``keep(n)`` True (all when None).

        HSCAN pages of ``page`` records per shard, all shards in one pipeline per step."""
        conf = state.conf
        parts = state.pair.parts(state.gen)
        L, d = conf.L, conf.d
        pos = list(positions)
        cursors = {s: 0 for s in range(conf.shards)}
        ids, ns, m2s, means = [], [], [], []
        while cursors:
            order = list(cursors)
            replies = yield [("hscan", parts.shard(s).rec, cursors[s], None, page) for s in order]
            for s, (cursor, fields) in zip(order, replies):
                if fields:
                    k_ids, rows = _decode_hash(fields, 1 + L + L * d)
                    n, m2, mean = codec.from_rec(rows, L, d)
                    sel = np.ones(len(n), dtype=bool) if keep is None else keep(n)
                    ids.append(k_ids[sel])
                    ns.append(n[sel])
                    m2s.append(m2[sel][:, pos])
                    means.append(mean[sel][:, pos])
                if int(cursor) == 0:
                    cursors.pop(s)
                else:
                    cursors[s] = int(cursor)
        if not ids:
            return (np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros((0, len(pos))),
                    np.zeros((0, len(pos), d)))
        ids, ns, m2s, means = (np.concatenate(x) for x in (ids, ns, m2s, means))
        order = np.argsort(ids, kind="stable")
        ids = ids[order]
        # HSCAN may return an entry twice (a rehash between pages): keep one of each.
        last = np.r_[ids[1:] != ids[:-1], True] if len(ids) else np.zeros(0, dtype=bool)
        order = order[last]
        return ids[last], ns[order], m2s[order], means[order]

    def means_of(self, state: PairState, keys: Sequence[int], positions: Sequence[int],
                 step_bytes: int = 32 << 20) -> Plan:
        """The records of the given token keys only: n (k,), m2 (k, P), mean (k, P, d) at
        the kept-layer ``positions``, row i for ``keys[i]``; a key never seen has n = 0 and
        zeros. Unlike :meth:`means`, what it reads grows with ``len(keys)``, not with every
        token ever seen: a caller that selects (count filter, sample) from the scalars
        first reads only what it uses.

        HMGET per shard, in steps of at most ``step_bytes`` of records."""
        conf = state.conf
        parts = state.pair.parts(state.gen)
        L, d = conf.L, conf.d
        pos = list(positions)
        keys = np.asarray(keys, dtype=np.int64)
        k = keys.shape[0]
        n = np.zeros(k)
        m2 = np.zeros((k, len(pos)))
        mean = np.zeros((k, len(pos), d))
        width = 1 + L + L * d
        per_step = max(1, step_bytes // (8 * width))
        shards = shard_of(keys, conf.shards) if k else np.zeros(0, dtype=np.int64)
        # Rows grouped by shard (one HMGET per shard and step), in key order within a shard.
        order = np.lexsort((keys, shards))
        for s0 in range(0, k, per_step):
            rows = order[s0:s0 + per_step]
            groups = np.split(rows, np.flatnonzero(np.diff(shards[rows])) + 1)
            replies = yield [("hmget", parts.shard(int(shards[g[0]])).rec,
                              [str(int(x)) for x in keys[g]]) for g in groups]
            for g, raws in zip(groups, replies):
                present, got = codec.unpack_rows(raws, width)
                g_n, g_m2, g_mean = codec.from_rec(got, L, d)
                n[g] = np.where(present, g_n, 0.0)
                m2[g] = g_m2[:, pos]
                mean[g] = g_mean[:, pos]
        return n, m2, mean
