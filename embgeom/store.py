"""Accumulators in Redis: the exactly-once commit of a job, and consistent reads.

A worker reduces a whole job locally (float64) and commits it in one optimistic
transaction on the pair's slot::

    WATCH meta gen job            # any other commit bumps meta; DELETE bumps gen
    job done / already committed?  -> nothing to do (a redelivery)
    job epoch != ours?             -> JobFenced (a newer delivery owns the job)
    read the touched tokens and the layer moments, Chan-merge in numpy
    MULTI  write tokens, layers; SADD committed; job -> done; version += 1;  EXEC

If EXEC aborts because another commit landed first, it reads again and retries. The
job's stream entry is acknowledged only after EXEC; a crash in between redelivers the
job, which then finds itself in ``committed`` and is acknowledged without counting.
Readers run their reads in one MULTI, so a read never sees half a commit, and report
``version``/``updated_at`` as ``as_of``.

Every transaction here touches the pair's keys only (one hash slot), so the same code
runs on a standalone Redis and on Redis Cluster, where redis-py's cluster pipeline with
``transaction=True`` sends WATCH, the reads under it and MULTI/EXEC over one connection to
the node owning that slot.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import redis

from embgeom import keys as K
from embgeom.errors import JobFenced
from embgeom.pipeline import JobMoments
from embgeom.stats import LayerMoments, chan_merge, chan_merge_comoment

__all__ = ["AsOf", "LayerScalars", "AccumulatorStore"]

F64 = np.dtype("<f8")


def _pack(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype=F64).tobytes()


def _unpack(b: bytes) -> np.ndarray:
    return np.frombuffer(b, dtype=F64)


@dataclass(frozen=True)
class AsOf:
    version: int
    updated_at: Optional[float]

    def to_dict(self) -> dict:
        return {"version": self.version, "updated_at": self.updated_at}


@dataclass
class LayerScalars:
    """Per-token scalars of one layer: ids (k,), n (k,), M (k,), m2 (k,)."""

    ids: np.ndarray
    n: np.ndarray
    M: np.ndarray
    m2: np.ndarray

    @property
    def V(self) -> np.ndarray:
        return self.m2 / self.n

    @property
    def Q(self) -> np.ndarray:
        return self.M + self.V


@dataclass
class LayerGlobal:
    """O(d) per-layer aggregates: n, m2 = sum ||x - mean||^2, within = sum_t m2_t, mean."""

    n: int
    m2: float
    within: float
    mean: np.ndarray


class AccumulatorStore:
    def __init__(self, client: redis.Redis):
        self.r = client

    # ------------------------------------------------------------------ commit
    def commit_job(
        self,
        pair: K.PairKeys,
        job_id: str,
        epoch: int,
        moments: JobMoments,
        num_layers: int,
        hidden_size: int,
        done_fields: dict,
    ) -> str:
        """Merge a job's moments into the pair's accumulators and mark it done, once.

        Returns ``"committed"``, or ``"duplicate"`` when the job was already counted.
        Raises :class:`JobFenced` when another delivery of the job owns it now.
        """
        job_key = pair.job(job_id)
        snapshot = moments.tokens.snapshot()
        fields = [str(i).encode() for i in snapshot.ids.tolist()]
        attempt = 0
        while True:
            with self.r.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(pair.meta, pair.gen, job_key)
                    job = pipe.hgetall(job_key)
                    if pipe.sismember(pair.committed, job_id) or job.get(b"status") == b"done":
                        pipe.unwatch()
                        return "duplicate"
                    if int(job.get(b"epoch", b"0")) != epoch:
                        pipe.unwatch()
                        raise JobFenced(f"job {job_id} is owned by a newer delivery")
                    gen = int(pipe.get(pair.gen) or b"0")
                    if int(job.get(b"gen", b"0")) != gen:
                        pipe.unwatch()
                        return "void"
                    writes = self._merged_writes(pair, snapshot, fields, moments.layers, num_layers)
                    pipe.multi()
                    for key, mapping in writes["hashes"]:
                        pipe.hset(key, mapping=mapping)
                    for key, value in writes["strings"]:
                        pipe.set(key, value)
                    pipe.sadd(pair.committed, job_id)
                    pipe.hset(job_key, mapping=done_fields)
                    pipe.delete(pair.payload(job_id))
                    pipe.hincrby(pair.meta, "version", 1)
                    pipe.hset(pair.meta, mapping={
                        "updated_at": repr(time.time()),
                        "num_layers": num_layers,
                        "hidden_size": hidden_size,
                    })
                    pipe.execute()
                    return "committed"
                except redis.WatchError:
                    attempt += 1
                    time.sleep(min(0.5, 0.01 * 2 ** min(attempt, 6)) * random.random())

    def _merged_writes(self, pair, snapshot, fields, job_layers: LayerMoments, num_layers: int) -> dict:
        """Read what the job touches (outside MULTI, under the caller's WATCH) and merge."""
        d = snapshot.mean.shape[2]
        reader = self.r.pipeline(transaction=False)
        for layer in range(num_layers):
            if fields:
                reader.hmget(pair.tok(layer), fields)
                reader.hmget(pair.unit(layer), fields)
            reader.get(pair.glob(layer))
            reader.get(pair.cov(layer))
        results = iter(reader.execute())
        hashes, strings = [], []
        k = len(fields)
        for layer in range(num_layers):
            old_n = np.zeros(k)
            old_m2 = np.zeros(k)
            old_mean = np.zeros((k, d))
            old_unit = np.zeros((k, d))
            if fields:
                for i, raw in enumerate(next(results)):
                    if raw is not None:
                        rec = _unpack(raw)
                        old_n[i], old_m2[i], old_mean[i] = rec[0], rec[1], rec[2:]
                for i, raw in enumerate(next(results)):
                    if raw is not None:
                        old_unit[i] = _unpack(raw)
            n, mean, m2, cross = chan_merge(
                old_n, old_mean, old_m2, snapshot.n, snapshot.mean[layer], snapshot.m2[layer]
            )
            unit = old_unit + snapshot.unit_sum[layer]
            M = np.einsum("ki,ki->k", mean, mean)
            if fields:
                tok = np.concatenate([n[:, None], m2[:, None], mean], axis=1)
                scal = np.stack([n, M, m2], axis=1)
                hashes.append((pair.tok(layer), dict(zip(fields, map(_pack, tok)))))
                hashes.append((pair.unit(layer), dict(zip(fields, map(_pack, unit)))))
                hashes.append((pair.scal(layer), dict(zip(fields, map(_pack, scal)))))
            glob_raw, cov_raw = next(results), next(results)
            g = self._decode_glob(glob_raw, d)
            c_old = np.zeros((d, d)) if cov_raw is None else _unpack(cov_raw)[: d * d].reshape(d, d)
            extra_old = np.zeros(2 * d) if cov_raw is None else _unpack(cov_raw)[d * d:]
            job_m2 = float(np.trace(job_layers.comoment[layer]))
            gn, gmean, gm2, _ = chan_merge(
                g.n, g.mean, g.m2, job_layers.n, job_layers.mean[layer], job_m2
            )
            # sum_t m2_t grows by the job's own within-sum plus the cross terms of
            # merging each of its tokens into the stored ones.
            within = g.within + float(job_layers.within[layer]) + float(cross.sum())
            strings.append((pair.glob(layer), _pack(np.concatenate([[gn, gm2, within], gmean]))))
            comoment = chan_merge_comoment(
                g.n, g.mean, c_old, job_layers.n, job_layers.mean[layer], job_layers.comoment[layer]
            )
            extra = extra_old + np.concatenate(
                [job_layers.unit_sum[layer], job_layers.unit_sq_sum[layer]]
            )
            strings.append((pair.cov(layer), _pack(np.concatenate([comoment.ravel(), extra]))))
        return {"hashes": hashes, "strings": strings}

    @staticmethod
    def _decode_glob(raw: Optional[bytes], d: int) -> LayerGlobal:
        if raw is None:
            return LayerGlobal(0, 0.0, 0.0, np.zeros(d))
        a = _unpack(raw)
        return LayerGlobal(int(a[0]), float(a[1]), float(a[2]), a[3:].copy())

    # ------------------------------------------------------------------ reads
    def meta(self, pair: K.PairKeys) -> Optional[dict]:
        raw = self.r.hgetall(pair.meta)
        return _decode_meta(raw) if raw else None

    def _read(self, pair: K.PairKeys, commands) -> tuple[Optional[dict], list]:
        """Run ``commands(pipe)`` after reading meta, all in one MULTI (a consistent view)."""
        with self.r.pipeline(transaction=True) as pipe:
            pipe.hgetall(pair.meta)
            commands(pipe)
            out = pipe.execute()
        meta = _decode_meta(out[0]) if out[0] else None
        return meta, out[1:]

    def _read_layers(self, pair: K.PairKeys, layers: Sequence[int], *commands) -> tuple[Optional[dict], dict[int, list]]:
        """For every layer, queue each ``command(pipe, layer)``; all in one MULTI.

        Returns meta and, per layer, the commands' replies in order."""
        def queue(p):
            for l in layers:
                for command in commands:
                    command(p, l)
        meta, out = self._read(pair, queue)
        width = len(commands)
        return meta, {l: out[width * i: width * (i + 1)] for i, l in enumerate(layers)}

    def scalars(self, pair: K.PairKeys, layers: Sequence[int]) -> tuple[Optional[dict], dict[int, LayerScalars]]:
        meta, out = self._read_layers(pair, layers, lambda p, l: p.hgetall(pair.scal(l)))
        return meta, {l: _decode_scalars(out[l][0]) for l in layers}

    def globals(self, pair: K.PairKeys, layers: Sequence[int], with_scalars: bool = False):
        """O(d) aggregates of each layer and its number of token types, and (optionally,
        from the same snapshot) the per-token scalars.

        Returns ``(meta, {layer: LayerGlobal}, {layer: num_types}, {layer: LayerScalars})``.
        """
        commands = [lambda p, l: p.get(pair.glob(l)), lambda p, l: p.hlen(pair.tok(l))]
        if with_scalars:
            commands.append(lambda p, l: p.hgetall(pair.scal(l)))
        meta, out = self._read_layers(pair, layers, *commands)
        d = meta["hidden_size"] if meta else 0
        globs = {l: self._decode_glob(out[l][0], d) for l in layers}
        types = {l: int(out[l][1]) for l in layers}
        scalars = {l: _decode_scalars(out[l][2]) for l in layers} if with_scalars else {}
        return meta, globs, types, scalars

    def covariance_state(self, pair: K.PairKeys, layers: Sequence[int], with_means: bool = False):
        """Per layer: (LayerGlobal, co-moment (d, d), unit_sum (d,), unit_sq_sum (d,)), and
        with ``with_means`` a fifth item from the same snapshot: (ids, n, m2, means (k, d))
        of every token type (a scan)."""
        commands = [lambda p, l: p.get(pair.glob(l)), lambda p, l: p.get(pair.cov(l))]
        if with_means:
            commands.append(lambda p, l: p.hgetall(pair.tok(l)))
        meta, out = self._read_layers(pair, layers, *commands)
        result = {}
        if meta is None:
            return None, result
        d = meta["hidden_size"]
        for l in layers:
            g = self._decode_glob(out[l][0], d)
            raw = out[l][1]
            c = np.zeros(d * d + 2 * d) if raw is None else _unpack(raw)
            result[l] = (g, c[: d * d].reshape(d, d), c[d * d: d * d + d], c[d * d + d:])
            if with_means:
                result[l] += (_decode_means(out[l][2], d),)
        return meta, result

    def token_means(self, pair: K.PairKeys, layers: Sequence[int]) -> tuple[Optional[dict], dict]:
        """Per layer: (ids, n, m2, mean (k, d)) of every token type (a scan)."""
        meta, out = self._read_layers(pair, layers, lambda p, l: p.hgetall(pair.tok(l)))
        d = meta["hidden_size"] if meta else 0
        return meta, {l: _decode_means(out[l][0], d) for l in layers}

    def token_records(self, pair: K.PairKeys, layer: int, ids: Sequence[int]):
        """(n, m2, mean, unit_sum) of the given tokens at one layer; rows of None for unseen."""
        fields = [str(int(i)) for i in ids]
        meta, out = self._read(pair, lambda p: (p.hmget(pair.tok(layer), fields), p.hmget(pair.unit(layer), fields)) if fields else None)
        if not fields:
            return meta, []
        rows = []
        for tok_raw, unit_raw in zip(out[0], out[1]):
            if tok_raw is None:
                rows.append(None)
                continue
            rec = _unpack(tok_raw)
            rows.append((int(rec[0]), float(rec[1]), rec[2:], _unpack(unit_raw) if unit_raw else None))
        return meta, rows

    def delete_pair(self, pair: K.PairKeys) -> None:
        """Remove a pair's accumulators and void its in-flight jobs (generation bump)."""
        meta = self.meta(pair)
        num_layers = meta["num_layers"] if meta else 0
        with self.r.pipeline(transaction=True) as pipe:  # the pair's slot only
            pipe.incr(pair.gen)
            for key in pair.data_keys(max(num_layers, 1)):
                pipe.delete(key)  # one key per DEL: a cluster pipeline refuses several
            pipe.execute()
        # The directory lives in another slot: a second command. If a job of the new
        # generation committed meanwhile (its worker re-adds the pair after its EXEC),
        # put the pair back so its data stay listed.
        self.r.srem(K.PAIRS, pair.pair)
        if self.r.exists(pair.meta):
            self.r.sadd(K.PAIRS, pair.pair)


def _decode_meta(raw: dict) -> dict:
    get = lambda k, default=None: raw.get(k.encode(), default)  # noqa: E731
    updated = get("updated_at")
    return {
        "version": int(get("version", b"0")),
        "updated_at": float(updated) if updated else None,
        "num_layers": int(get("num_layers", b"0")),
        "hidden_size": int(get("hidden_size", b"0")),
    }


def _decode_hash(raw: dict, width: int) -> tuple[np.ndarray, np.ndarray]:
    if not raw:
        return np.zeros(0, dtype=np.int64), np.zeros((0, width))
    ids = np.fromiter((int(k) for k in raw.keys()), dtype=np.int64, count=len(raw))
    recs = np.frombuffer(b"".join(raw.values()), dtype=F64).reshape(len(raw), -1)
    order = np.argsort(ids, kind="stable")
    return ids[order], recs[order]


def _decode_means(raw: dict, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A layer's ``tok`` hash as (ids, n, m2, means (k, d)), sorted by id."""
    ids, recs = _decode_hash(raw, d + 2)
    return ids, recs[:, 0], recs[:, 1], recs[:, 2:]


def _decode_scalars(raw: dict) -> LayerScalars:
    ids, recs = _decode_hash(raw, 3)
    return LayerScalars(ids=ids, n=recs[:, 0], M=recs[:, 1], m2=recs[:, 2])
