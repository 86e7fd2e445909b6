"""Drift of the shards' running sums over many checkpoints, and what keeping them costs.

A shard keeps, per count bucket, ``sum n_t mean_t`` of its tokens, and ``sum_t m2_t`` per
layer (``agg``), as running sums updated by each checkpoint: a token leaves its old
bucket and enters its new one. This drives a real Redis with many small checkpoints of
adversarial data (a large common offset, every token crossing count buckets many times)
through the store's own :class:`~embgeom.store.shards.ShardWriter`, then compares the
stored sums with exact ones recomputed from the stored records (``math.fsum`` of the
same float64 products), and the filtered V_B those sums give with the two-pass V_B over
the records' means.

``python -m benchmarks.aggregates [--checkpoints 1500] [--against DIR]`` prints the drift
and the apply path's merge time (MiniLM's shape); ``--against DIR`` runs the same in a
child process importing ``embgeom`` from DIR (another checkout, e.g. ``git archive main``),
alternated, and prints both side by side with their ratio. Nothing is asserted here; the
test ``tests/test_store.py::test_running_sums_do_not_drift_over_many_checkpoints`` pins it.

Only the store's interfaces older checkouts also have are used (``ShardWriter.apply``,
the ``rec``/``bkt``/``agg`` layouts), so ``--against`` measures them unchanged.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from embgeom.stats import BUCKET_EDGES, TokenMoments, bucket_index, decomposition
from embgeom.store import codec
from embgeom.store.conf import CollectionSettings, PairConf
from embgeom.store.keys import PairKeys
from embgeom.store.scripts import NOW
from embgeom.store.shards import ShardWriter, piece_tokens_for

U = float(np.finfo(np.float64).eps) / 2


def adversarial_conf(L: int = 2, d: int = 8, shards: int = 2, self_similarity: bool = False) -> PairConf:
    return PairConf.resolve(CollectionSettings(self_similarity=self_similarity), 0, L, d, 10**9,
                            shards, 1 << 20)


def apply_checkpoints(r, pair: PairKeys, conf: PairConf, checkpoints: int, seed: int = 0,
                      offset: float = 1e3, keys: int = 64, per_checkpoint: int = 8,
                      piece_tokens: int = 4) -> dict:
    """Apply ``checkpoints`` small windows: ``per_checkpoint`` of ``keys`` tokens each, 1-3
    occurrences, means ``offset`` + N(0, 1) per token (a per-token centre), so every token
    climbs through the count buckets (1, 2, 3, 5, 10, 20, 50, 100, 101, 200, ...).
    Returns the seconds the writer spent, by stage, summed."""
    rng = np.random.default_rng(seed)
    L, d = conf.L, conf.d
    centre = offset + rng.standard_normal((keys, L, d))
    writer = ShardWriter(r, "drift")
    parts = pair.parts(conf.gen)
    lock = parts.shard(0).lock
    seconds: dict = {}
    for c in range(checkpoints):
        ids = np.sort(rng.choice(keys, size=per_checkpoint, replace=False)).astype(np.int64)
        n = rng.integers(1, 4, size=per_checkpoint)
        mean = centre[ids] + 0.1 * rng.standard_normal((per_checkpoint, L, d))
        m2 = n[:, None] * rng.random((per_checkpoint, L)) * d * 0.01
        unit = rng.standard_normal((per_checkpoint, L, d)) if conf.self_similarity else None
        tokens = TokenMoments(ids, n, mean, m2, unit)
        out = writer.apply(parts, conf, f"cp{c}", tokens, piece_tokens,
                           check=lambda: int(NOW(r, [lock], [])))
        for k, v in out.seconds.items():
            seconds[k] = seconds.get(k, 0.0) + v
    return seconds


def stored_state(r, pair: PairKeys, conf: PairConf) -> list[dict]:
    """Per shard: its records (ids, n, m2, mean) and its stored bucket rows and agg (of a
    pair whose layers are one layer group, as :func:`adversarial_conf`'s are)."""
    assert len(conf.groups) == 1, "stored_state reads group 0's records only"
    L, d = conf.L, conf.d
    parts = pair.parts(conf.gen)
    out = []
    for s in range(conf.shards):
        keys = parts.shard(s)
        rec = r.hgetall(keys.rec)
        ids = np.array(sorted(int(k) for k in rec), dtype=np.int64)
        rows = np.stack([np.frombuffer(rec[str(i).encode()], dtype=codec.F64) for i in ids]) \
            if len(ids) else np.zeros((0, 1 + L + L * d))
        n, m2, mean = codec.from_rec(rows, L, d)
        bkt = {int(b): np.frombuffer(v, dtype=codec.F64) for b, v in r.hgetall(keys.bkt).items()
               if b.isdigit()}  # bucket rows only (a newer layout keeps more fields beside)
        agg = r.get(keys.agg)
        out.append({"ids": ids, "n": n, "m2": m2, "mean": mean, "bkt": bkt,
                    "agg": np.frombuffer(agg, dtype=codec.F64) if agg else np.zeros(2 + L)})
    return out


def drift(shards: list[dict], L: int, d: int) -> dict:
    """Max errors of the stored running sums against exact sums from the records.

    ``bucket_rel``: ``|stored - fsum(n_t mean_t)|`` over every component of every bucket,
    relative to the shard's largest ``fsum |n_t mean_t|`` (a bucket the tokens all left
    must hold 0, and its residue counts relative to that scale); ``within_rel``:
    ``|stored - fsum(m2_t)| / fsum(m2_t)`` per layer; ``emptied_abs``: the largest stored
    component of a bucket with no token (exactly 0 in exact arithmetic); ``counts_exact``:
    types and counts of every bucket and agg equal the records'."""
    worst = {"bucket_rel": 0.0, "within_rel": 0.0, "emptied_abs": 0.0, "emptied_scale": 0.0,
             "counts_exact": True}
    for sh in shards:
        n, mean, m2 = sh["n"], sh["mean"], sh["m2"]
        terms = n[:, None] * mean.reshape(len(n), L * d)  # the float64 products summed
        b_of = bucket_index(np.maximum(n, 1))
        exact = {}
        for b in range(len(BUCKET_EDGES)):
            rows = terms[b_of == b]
            exact[b] = (np.array([math.fsum(rows[:, j]) for j in range(L * d)]),
                        np.array([math.fsum(np.abs(rows[:, j])) for j in range(L * d)]),
                        int((b_of == b).sum()), float(n[b_of == b].sum()))
        scale = max(float(e[1].max()) for e in exact.values())
        for b, row in sh["bkt"].items():
            ref, _, types, count = exact[b]
            worst["counts_exact"] &= bool(row[0] == types and row[1] == count)
            worst["bucket_rel"] = max(worst["bucket_rel"], float(np.max(np.abs(row[2:] - ref))) / scale)
            if types == 0:
                worst["emptied_abs"] = max(worst["emptied_abs"], float(np.max(np.abs(row[2:]))))
                worst["emptied_scale"] = max(worst["emptied_scale"], scale)
        within = np.array([math.fsum(m2[:, l]) for l in range(L)])
        worst["within_rel"] = max(worst["within_rel"],
                                  float(np.max(np.abs(sh["agg"][2:] - within) / within)))
        worst["counts_exact"] &= bool(sh["agg"][0] == len(n) and sh["agg"][1] == float(n.sum()))
    return worst


def filtered_vb(shards: list[dict], L: int, d: int, min_count: int = 10) -> list[dict]:
    """Per layer, V_B over the types with ``n_t >= min_count`` (an aligned filter) from the
    stored bucket sums (``sum n_t ||mu_t||^2 / n - ||sum n_t mu_t / n||^2``, sums exact
    but for the vector) against the two-pass V_B over the records' means."""
    buckets = [b for b, e in enumerate(BUCKET_EDGES) if e >= min_count]
    n = np.concatenate([s["n"] for s in shards])
    mean = np.concatenate([s["mean"] for s in shards])
    keep = n >= min_count
    vector = sum(s["bkt"][b][2:] for s in shards for b in buckets if b in s["bkt"])
    out = []
    for l in range(L):
        ref = decomposition(n[keep], mean[keep, l], np.zeros(int(keep.sum())))["V_B"]
        total = float(n[keep].sum())
        mu = vector.reshape(L, d)[l] / total
        a = math.fsum(n[keep] * np.einsum("kd,kd->k", mean[keep, l], mean[keep, l])) / total
        got = a - float(mu @ mu)
        out.append({"V_B": ref, "V_B_from_sums": got, "rel": abs(got - ref) / ref,
                    "V_B/M": ref / float(mu @ mu)})
    return out


def _redis():
    from embgeom.store.connection import redis_client
    from embgeom.store.server import RedisServer
    tmp = tempfile.mkdtemp(prefix="aggbench")
    server = RedisServer(Path(tmp) / "redis").start()
    return server, redis_client(server.url)


def measure(checkpoints: int, cost_checkpoints: int) -> dict:
    """The drift after ``checkpoints`` adversarial checkpoints, and the merge seconds of
    ``cost_checkpoints`` windows of MiniLM's shape (7 x 384, 2,000 tokens of a 3,000-token
    vocabulary each, the service's piece size)."""
    server, r = _redis()
    try:
        conf = adversarial_conf()
        pair = PairKeys("drift", "m")
        apply_checkpoints(r, pair, conf, checkpoints)
        state = stored_state(r, pair, conf)
        result = {"checkpoints": checkpoints, **drift(state, conf.L, conf.d),
                  "filtered_vb": filtered_vb(state, conf.L, conf.d)}
        big = PairConf.resolve(CollectionSettings(self_similarity=False), 0, 7, 384, 30522, 16, 1 << 20)
        seconds = apply_checkpoints(r, PairKeys("cost", "m"), big, cost_checkpoints, keys=3000,
                                    per_checkpoint=2000, piece_tokens=piece_tokens_for(big, 2 << 20))
        result["merge_s_per_checkpoint"] = seconds["merge"] / cost_checkpoints
        result["apply_s_per_checkpoint"] = sum(seconds.values()) / cost_checkpoints
        return result
    finally:
        r.close()
        server.kill()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", type=int, default=1500)
    ap.add_argument("--cost-checkpoints", type=int, default=20)
    ap.add_argument("--against", help="another checkout whose embgeom to measure beside this one")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON result (child mode)")
    args = ap.parse_args(argv)
    if args.json or not args.against:
        result = measure(args.checkpoints, args.cost_checkpoints)
        print(json.dumps(result) if args.json else json.dumps(result, indent=1))
        return
    trees = {"this": str(Path(__file__).resolve().parent.parent), "against": args.against}
    runs: dict = {k: [] for k in trees}
    for _ in range(args.repeats):  # alternated, so load on the machine hits both alike
        for label, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=tree)
            out = subprocess.run([sys.executable, __file__, "--json", "--checkpoints",
                                  str(args.checkpoints), "--cost-checkpoints",
                                  str(args.cost_checkpoints)],
                                 env=env, capture_output=True, text=True, check=True)
            runs[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'':28s}{'this':>14s}{'against':>14s}{'ratio':>10s}")
    for key in ("bucket_rel", "within_rel", "emptied_abs", "merge_s_per_checkpoint",
                "apply_s_per_checkpoint"):
        a = statistics.median(x[key] for x in runs["this"])
        b = statistics.median(x[key] for x in runs["against"])
        print(f"{key:28s}{a:14.3e}{b:14.3e}{(a / b if b else float('nan')):10.3f}")
    for label in trees:
        vb = runs[label][0]["filtered_vb"]
        print(label, "filtered V_B rel error per layer:", [f"{x['rel']:.2e}" for x in vb],
              "V_B/M:", [f"{x['V_B/M']:.1e}" for x in vb])
    print("counts exact:", {k: all(x["counts_exact"] for x in v) for k, v in runs.items()})


if __name__ == "__main__":
    main()
