"""Token shards: applying a checkpoint's per-token moments, once, shard by shard.

A pair's per-token state is split into ``conf.shards`` shards by a hash of the token key,
and each shard's records into the pair's layer groups (``PairConf.groups``): each (shard,
group) is a *part*, its own hash slot (:mod:`embgeom.store.keys`), whose records are laid
out as those of a pair keeping only the group's layers (``PairConf.group_view``). A
checkpoint touches every part of every shard that holds one of its tokens; within a shard
its tokens are cut into *pieces* of at most ``piece_tokens`` tokens (sorted by key, so a
redelivered checkpoint cuts the same pieces), the same pieces in every group, which bounds
the bytes a single Redis command carries: one piece of one group.

One round, for a set of parts::

    SET lock NX PX       try-lock each part (a fencing token); a busy part waits for a
                         later round, the others go on: workers never wait on each other
    inflight check       the checkpoint is still sealed-not-completed (control slot), at t
    HGET applied, HMGET rec/unit of the touched keys, HGETALL bkt, GET agg    (one pipeline)
    numpy                Chan-merge every touched token (float64), bucket and agg deltas
    per piece, one round trip for all of them (:mod:`embgeom.store.piece_writes`):
      WATCH              the part's keys (lock, applied, dead, records, bkt, agg, name, gate)
      GUARD_PIECE        fence still ours, piece not yet applied, check younger than the
                         horizon, keys of the right type; a refusal touches ``gate``
      MULTI .. EXEC      plain HSET of records, bkt, agg (and the names of hashed word keys
                         new to the shard), the piece's marker; the part's last piece
                         releases the lock. EXEC writes nothing if a watched key changed
                         since WATCH (a refusal, another writer, the lock's lease lapsed)

A piece already marked applied in a part (a checkpoint redelivered after a crash) is
skipped there, and its tokens are not merged again in that group. A lost lock (a lease that
expired) redoes that part's remaining pieces from a fresh read: a conflict redoes one part,
never the checkpoint.
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import redis

from embgeom.keyspace import is_word_key
from embgeom.stats import (BUCKET_EDGES, TokenMoments, add_compensated, bucket_index, chan_merge,
                           compensated_sum)
from embgeom.store import codec
from embgeom.store.conf import PairConf, shard_of
from embgeom.store.keys import PartKeys
from embgeom.store.piece_writes import PieceWriter

__all__ = ["ApplyStats", "ShardWriter", "pieces_of", "piece_tokens_for", "split_bkt"]

NUM_BUCKETS = len(BUCKET_EDGES)
# The running sums of ``bkt`` and ``agg`` are kept compensated: beside bucket b's row
# (field "b", the correctly rounded sum, the layout readers know) the field "c<b>" holds
# the part of the exact sum float64 cannot (L d floats), and "cw" that of agg's within
# sums (L). A shard written before these fields existed has them as zeros.
COMP_PREFIX = b"c"
WITHIN_COMP = b"cw"


def split_bkt(raw: dict, L: int, d: int) -> tuple[dict, dict, np.ndarray]:
    """A shard's ``bkt`` hash (HGETALL) as ``(rows, comps, within_comp)``: bucket ->
    float64[2 + L d], bucket -> float64[L d] (zeros where absent), float64[L]."""
    rows = {int(b): np.frombuffer(v, dtype=codec.F64).copy() for b, v in raw.items()
            if not b.startswith(COMP_PREFIX)}
    comps = {b: np.zeros(L * d) for b in rows}
    within = np.zeros(L)
    for f, v in raw.items():
        if f == WITHIN_COMP:
            within = np.frombuffer(v, dtype=codec.F64).copy()
        elif f.startswith(COMP_PREFIX):
            comps[int(f[len(COMP_PREFIX):])] = np.frombuffer(v, dtype=codec.F64).copy()
    return rows, comps, within


@dataclass
class ApplyStats:
    shards: int = 0
    pieces: int = 0
    pieces_skipped: int = 0
    rounds: int = 0
    busy: int = 0          # shard lock attempts that found another writer
    lost: int = 0          # pieces whose lock expired before they were written
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: dict = field(default_factory=lambda: {"lock": 0.0, "read": 0.0, "merge": 0.0,
                                                    "write": 0.0})


def pieces_of(ids: np.ndarray, conf: PairConf, piece_tokens: int) -> list[tuple[int, int, np.ndarray]]:
    """``(shard, piece, rows)`` of a checkpoint: rows into ``ids`` (sorted keys)."""
    shards = shard_of(ids, conf.shards)
    order = np.argsort(shards, kind="stable")  # within a shard, keys stay sorted
    bounds = np.searchsorted(shards[order], np.arange(conf.shards + 1))
    out = []
    for s in range(conf.shards):
        rows = order[bounds[s]:bounds[s + 1]]
        for p, start in enumerate(range(0, len(rows), piece_tokens)):
            out.append((s, p, rows[start:start + piece_tokens]))
    return out


def record_bytes(conf: PairConf) -> int:
    """Bytes one token writes to a part of ``conf`` (a group's view): rec, scal, unit."""
    per_token = 8 * (1 + conf.L + conf.L * conf.d) + 8 * conf.scal_width
    if conf.self_similarity:
        per_token += 8 * conf.L * conf.d
    return per_token


def piece_tokens_for(conf: PairConf, piece_bytes: int) -> int:
    """Tokens per piece: one piece of the largest layer group within ``piece_bytes``
    (every group is cut into the same pieces, so a redelivery finds the same ones)."""
    largest = max(record_bytes(conf.group_view(g)) for g in range(len(conf.groups)))
    return max(1, piece_bytes // largest)


class ShardWriter:
    """Applies checkpoints' token moments to a pair's shards."""

    def __init__(self, client: redis.Redis, worker_id: str, lock_ms: int = 30_000,
                 max_age_ms: int = 600_000, group_bytes: int = 256 << 20):
        self.r = client
        self.worker_id = worker_id
        # A piece's EXEC lands only while the lock it watches lives, and the lock is taken
        # before the in-flight check: a lease within max_age keeps every write younger
        # than max_age, however long the client stalls after its guard.
        self.lock_ms = min(lock_ms, max_age_ms)
        self.group_bytes = group_bytes
        self.pieces = PieceWriter(client, max_age_ms)

    def apply(self, parts: PartKeys, conf: PairConf, cp: str, tokens: TokenMoments,
              piece_tokens: int, check: Callable[[], int],
              names: Optional[dict] = None) -> ApplyStats:
        """Apply ``tokens`` (sorted keys) as checkpoint ``cp``; returns what it took.

        ``check()`` verifies the checkpoint is still in flight and returns Redis's time
        in ms (raising if it was completed meanwhile). ``names`` holds the name of every
        hashed word key among ``tokens`` (word-unit collections)."""
        names = names or {}
        stats = ApplyStats()
        groups = range(len(conf.groups))
        # Part (shard, group) -> its pieces; the same pieces in every group of a shard.
        pending: dict[tuple[int, int], list[tuple[int, np.ndarray]]] = {}
        for s, p, rows in pieces_of(tokens.ids, conf, piece_tokens):
            for g in groups:
                pending.setdefault((s, g), []).append((p, rows))
        stats.shards = len({s for s, _ in pending})
        per_token = [record_bytes(conf.group_view(g)) for g in groups]
        while pending:
            # A set of parts whose touched records fit the memory budget of one round.
            group, size = [], 0
            for part in sorted(pending, key=lambda part: random.random()):
                n = sum(len(rows) for _, rows in pending[part]) * per_token[part[1]] * 3
                if group and size + n > self.group_bytes:
                    break
                group.append(part)
                size += n
            done = self._round(parts, conf, cp, tokens, {part: pending[part] for part in group},
                               check, stats, names)
            for part in done:
                pending.pop(part)
            if len(done) < len(group):
                stats.busy += len(group) - len(done)
                time.sleep(0.002 + 0.01 * random.random())
        return stats

    # ------------------------------------------------------------------ one round
    def _round(self, parts, conf, cp, tokens, group, check, stats, names) -> list:
        """Lock, read, merge and write a set of parts ``(shard, group)``; returns the parts
        finished."""
        stats.rounds += 1
        t0 = time.perf_counter()
        fence = f"{self.worker_id}:{uuid.uuid4().hex[:12]}"
        with self.r.pipeline(transaction=False) as p:
            for part in group:
                p.set(parts.shard(*part).lock, fence, nx=True, px=self.lock_ms)
            got = p.execute()
        locked = [part for part, ok in zip(group, got) if ok]
        stats.seconds["lock"] += time.perf_counter() - t0
        if not locked:
            return []
        try:
            checked = check()
            t1 = time.perf_counter()
            state = self._read(parts, conf, cp, tokens, {part: group[part] for part in locked}, stats)
            t2 = time.perf_counter()
            stats.seconds["read"] += t2 - t1
            merged_before = stats.seconds["merge"]
            # A part's pieces are sent while the next part is merged (the merge clocks
            # itself): the host's numpy and Redis's writes overlap.
            finished = self.pieces.write(parts, cp, fence, checked,
                                   self._merge(conf, cp, tokens, state, stats, names), stats)
            stats.seconds["write"] += (time.perf_counter() - t2
                                       - (stats.seconds["merge"] - merged_before))
            return finished
        except BaseException:
            self._unlock(parts, locked, fence)
            raise

    def _unlock(self, parts, locked, fence) -> None:
        try:
            with self.r.pipeline(transaction=False) as p:
                for part in locked:
                    # Only our own lock: a compare-and-delete (no script needed for a hint).
                    p.get(parts.shard(*part).lock)
                mine = [part for part, v in zip(locked, p.execute()) if v == fence.encode()]
            if mine:
                with self.r.pipeline(transaction=False) as p:
                    for part in mine:
                        p.delete(parts.shard(*part).lock)
                    p.execute()
        except redis.RedisError:
            pass  # the lease expires on its own

    def _read(self, parts, conf, cp, tokens, group, stats) -> dict:
        """Markers, agg, bkt and the touched records of each part: one HMGET per piece
        (rec, and unit with self-similarity), so no read carries more than a piece does."""
        wanted = ("rec", "unit") if conf.self_similarity else ("rec",)
        with self.r.pipeline(transaction=False) as p:
            for part, pieces in group.items():
                keys = parts.shard(*part)
                p.hget(keys.applied, cp)
                p.get(keys.agg)
                p.hgetall(keys.bkt)
                for _, rows in pieces:
                    fields = [str(int(i)) for i in tokens.ids[rows].tolist()]
                    for name in wanted:
                        p.hmget(getattr(keys, name), fields)
            replies = iter(p.execute())
        state = {}
        for part, pieces in group.items():
            applied_raw = next(replies)
            marks = "" if applied_raw is None else applied_raw.decode()
            applied = {int(x) for x in marks.split(",")} if marks else set()
            agg_raw, bkt_raw = next(replies), next(replies)
            got = {name: [] for name in wanted}
            for _ in pieces:
                for name in wanted:
                    got[name].extend(next(replies))
            stats.bytes_read += sum(len(r) for values in got.values() for r in values if r)
            state[part] = {"pieces": pieces, "applied": applied, "marks": marks,
                           "agg": agg_raw, "bkt": bkt_raw,
                           "rec": got["rec"], "unit": got.get("unit")}
        return state

    def _merge(self, conf: PairConf, cp, tokens: TokenMoments, state: dict, stats,
               names: dict):
        """Yields, part by part, ``((shard, group), {"marks": its applied marker as read,
        "calls": per piece, the field/value lists it writes (None: applied before)})``,
        adding its own time to ``stats.seconds["merge"]``. A part's records are those of a
        pair keeping only its group's layers (``group_view``)."""
        for (s, g), st in state.items():
            t = time.perf_counter()
            view = conf.group_view(g)
            L, d = view.L, view.d
            # The group's layers of every token (views: nothing copied until a piece's take).
            in_group = tokens.layers(conf.group_span(g))
            offset = 0
            agg = (np.frombuffer(st["agg"], dtype=codec.F64).copy() if st["agg"]
                   else np.zeros(2 + L))
            bkt, comp, within_comp = split_bkt(st["bkt"], L, d)
            calls = []
            for p, rows in st["pieces"]:
                span = slice(offset, offset + len(rows))
                offset += len(rows)
                if p in st["applied"]:
                    stats.pieces_skipped += 1
                    calls.append((p, None))
                    continue
                present, old = codec.unpack_rows(st["rec"][span], 1 + L + L * d)
                n_old, m2_old, mean_old = codec.from_rec(old, L, d)
                new = in_group.take(rows)
                # Counts are per token, the same at every layer: (k, 1) broadcasts.
                n, mean, m2, _ = chan_merge(n_old[:, None], mean_old, m2_old,
                                            new.n[:, None], new.mean, new.m2)
                n = n[:, 0]
                ids = [str(int(i)) for i in new.ids.tolist()]
                rec = codec.pack_rows(codec.rec_rows(n, m2, mean))
                unit, unit_sum = [], None
                if view.self_similarity:
                    _, unit_old = codec.unpack_rows(st["unit"][span], L * d)
                    unit_sum = unit_old + new.unit_sum.reshape(len(rows), -1)
                    unit = codec.pack_rows(unit_sum)
                # ||U||^2 from the merged sum (a generation stored before has no room for it).
                scal = codec.pack_rows(codec.scal_rows(
                    n, mean, m2, unit_sum.reshape(-1, L, d) if view.stores_unit_norms else None))
                # Bucket deltas: each token leaves its old bucket and enters its new one.
                touched = self._bucket_delta(bkt, comp, present, n_old, mean_old, n, mean, L, d)
                agg[0] += float((~present).sum())  # counts: integers, exact in float64
                agg[1] += float(new.n.sum())
                # sum m2_t gains each new m2 and loses the old one: both terms given to
                # the compensated sum, so the old value leaves exactly as it entered.
                s_old, e_old = compensated_sum(m2_old[present])
                total, within_comp = add_compensated(agg[2:], within_comp, -s_old, -e_old)
                agg[2:], within_comp = add_compensated(total, within_comp, *compensated_sum(m2))
                bkt_fields = [(f, memoryview(v.tobytes())) for b in sorted(touched)
                              for f, v in ((str(b), bkt[b]), (f"c{b}", comp[b]))]
                bkt_fields.append((WITHIN_COMP.decode(), memoryview(within_comp.tobytes())))
                # A hashed word key's name goes with its first record in this shard's group
                # 0 (that part's lock makes ``present`` exact): written once, in its slot.
                fresh = [int(k) for k in new.ids[~present & is_word_key(new.ids)].tolist()] \
                    if g == 0 else []
                name_fields = [(str(k), names[k].encode("utf-8", "surrogatepass")) for k in fresh]
                calls.append((p, {"rec": list(zip(ids, rec)), "unit": list(zip(ids, unit)),
                                  "scal": list(zip(ids, scal)), "bkt": bkt_fields,
                                  "name": name_fields, "agg": agg.tobytes()}))
            stats.seconds["merge"] += time.perf_counter() - t
            yield (s, g), {"marks": st["marks"], "calls": calls}

    @staticmethod
    def _bucket_delta(bkt: dict, comp: dict, present, n_old, mean_old, n, mean, L, d) -> set:
        """Move the tokens' contributions between count buckets, in place; returns the
        buckets touched.

        A token leaves its old bucket with ``-n_old mean_old`` and enters its new one with
        ``n mean``: the same float64 products as when they were added (the stored means),
        summed exactly (:func:`compensated_sum`) into the compensated running sum, so a
        bucket's vector stays the rounded sum of its present tokens' ``n_t mean_t``
        however many times tokens came and went."""
        b_old, b_new = bucket_index(np.maximum(n_old, 1)), bucket_index(n)
        touched = set(b_new.tolist()) | set(b_old[present].tolist())
        for b in sorted(touched):  # a loop over the (few) buckets, not the tokens
            out_rows, in_rows = present & (b_old == b), b_new == b
            row = bkt.setdefault(b, np.zeros(2 + L * d))
            row[0] += in_rows.sum() - out_rows.sum()
            row[1] += n[in_rows].sum() - n_old[out_rows].sum()
            total, c = row[2:], comp.get(b, np.zeros(L * d))
            if out_rows.any():
                s, e = compensated_sum(n_old[out_rows, None] * mean_old[out_rows].reshape(-1, L * d))
                total, c = add_compensated(total, c, -s, -e)
            s, e = compensated_sum(n[in_rows, None] * mean[in_rows].reshape(-1, L * d))
            row[2:], comp[b] = add_compensated(total, c, s, e)
        return touched
