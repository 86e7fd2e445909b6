"""Token records by layer group: checkpoint apply and one-layer reads, side by side.

For a model shape and each layer grouping (every kept layer in one group, as a
generation stored before groups; groups of 2 layers; one layer a group), one pair is
written through the real :class:`embgeom.store.shards.ShardWriter` into a fresh Redis with
the service's persistence (:class:`embgeom.store.server.RedisServer`): a first checkpoint
of every type (new records), then ``--checkpoints`` checkpoints of the same types (steady
state: each one reads, merges and rewrites every record). Then reads of one layer: a scan
of every token's mean (:meth:`Reader.means`), the means of 300 keys
(:meth:`Reader.means_of`), and every token's scalars (:meth:`Reader.scalars`, what a token
page reads).

Printed per layout: apply seconds and bytes per steady checkpoint, pieces, the slowest
Redis command (SLOWLOG over 1 ms), and the read latencies (median of 3) with the bytes
that left Redis (``total_net_output_bytes``) and the record bytes read inside Redis (the
values the scripts cut: types x the group's record). Timings are noisy on a shared
machine: compare the layouts' ratios, measured in one run.

``python -m benchmarks.record_layout [--shapes minilm,1b_shape] [--checkpoints 3]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from embgeom.stats import TokenMoments
from embgeom.store.conf import CollectionSettings, PairConf, layer_bytes
from embgeom.store.keys import PairKeys
from embgeom.store.reader import Reader, run_sync
from embgeom.store.scripts import NOW
from embgeom.store.shards import ShardWriter, piece_tokens_for, record_bytes

# (hidden states, d, kept layers, self-similarity, types per checkpoint)
SHAPES = {
    "minilm": (7, 384, None, True, 3000),
    "1b_shape": (17, 2048, (0, 4, 8, 12, 16), False, 800),
    "7b_shape_5_layers": (33, 4096, (0, 8, 16, 24, 32), False, 300),
}
PIECE_BYTES = 2 << 20  # the service's default (Settings.piece_bytes)


def layout_conf(shape: str, per_group) -> PairConf:
    """The shape's configuration with ``per_group`` layers a group (None: all in one)."""
    states, d, keep, selfsim, _ = SHAPES[shape]
    settings = CollectionSettings(layers=keep, self_similarity=selfsim)
    L = len(keep) if keep else states
    target = 16 + (per_group or L) * layer_bytes(d, selfsim)
    return PairConf.resolve(settings, 0, states, d, 10**6, 32, 2 << 20, record_bytes=target)


def window(rng, conf: PairConf, types: int) -> TokenMoments:
    """A checkpoint's token moments: ``types`` distinct keys, 1-20 occurrences each."""
    ids = np.arange(types, dtype=np.int64) * 7 + 3
    n = rng.integers(1, 21, size=types)
    mean = rng.standard_normal((types, conf.L, conf.d))
    m2 = n[:, None] * rng.random((types, conf.L)) * conf.d
    unit = rng.standard_normal((types, conf.L, conf.d)) if conf.self_similarity else None
    return TokenMoments(ids, n, mean, m2, unit)


def _median_time(fn, repeat: int = 3) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _out_bytes(r) -> int:
    return int(r.info("stats")["total_net_output_bytes"])


def measure_layout(r, shape: str, per_group, checkpoints: int, seed: int = 0) -> dict:
    conf = layout_conf(shape, per_group)
    pair = PairKeys(f"{shape}-{per_group or 'all'}", "m")
    r.set(pair.conf(0), conf.to_json())
    r.sadd("eg:pairs", pair.pair)
    types = SHAPES[shape][4]
    rng = np.random.default_rng(seed)
    writer = ShardWriter(r, "layout")
    parts = pair.parts(0)
    lock = parts.shard(0).lock
    check = lambda: int(NOW(r, [lock], []))  # noqa: E731 - no checkpoint record here
    piece_tokens = piece_tokens_for(conf, PIECE_BYTES)
    writer.apply(parts, conf, "cp0", window(rng, conf, types), piece_tokens, check)  # new types
    r.config_set("slowlog-log-slower-than", 1000)
    r.slowlog_reset()
    steady = []
    for c in range(checkpoints):
        tok = window(rng, conf, types)
        t0 = time.perf_counter()
        stats = writer.apply(parts, conf, f"cp{c + 1}", tok, piece_tokens, check)
        steady.append((time.perf_counter() - t0, stats))
    slow = r.slowlog_get(1000)
    slowest_ms = max((e["duration"] for e in slow), default=0) / 1000
    r.hset(pair.meta, "version", checkpoints + 1)
    rd = Reader()
    state = run_sync(r, rd.pair_state(pair))
    position = conf.L // 2
    g, _ = conf.group_of(position)
    group_record = record_bytes(conf.group_view(g))
    keys = np.arange(0, types, max(1, types // 300))[:300] * 7 + 3
    reads = {}
    for name, plan in (("scan_one_layer", lambda: rd.means(state, [position])),
                       ("means_of_300_keys", lambda: rd.means_of(state, keys, [position])),
                       ("scalars_all_layers", lambda: Reader().scalars(state))):
        before = _out_bytes(r)
        seconds, _ = _median_time(lambda: run_sync(r, plan()))
        reads[name] = {"ms": round(1000 * seconds, 2),
                       "bytes_out_per_token": round((_out_bytes(r) - before) / 3
                                                    / (types if name != "means_of_300_keys" else len(keys)), 1)}
    rec_bytes = 8 * (1 + len(conf.groups[g]) * (1 + conf.d))
    reads["scan_one_layer"]["record_bytes_read_in_redis_per_token"] = rec_bytes
    reads["means_of_300_keys"]["record_bytes_read_in_redis_per_token"] = rec_bytes
    apply_s = [s for s, _ in steady]
    last = steady[-1][1]
    return {"shape": shape, "layers_per_group": per_group or conf.L, "groups": len(conf.groups),
            "record_bytes_per_token_group": group_record, "piece_tokens": piece_tokens,
            "types": types,
            "apply_s_median": round(statistics.median(apply_s), 3),
            "apply_tok_s": round(types / statistics.median(apply_s), 1),
            "apply_stage_s": {k: round(v, 3) for k, v in last.seconds.items()},
            "bytes_written": last.bytes_written, "bytes_read": last.bytes_read,
            "pieces": last.pieces, "slowest_command_ms": slowest_ms, "reads": reads}


def run(shapes: list[str], checkpoints: int) -> list[dict]:
    from embgeom.store.connection import redis_client
    from embgeom.store.server import RedisServer

    out = []
    for shape in shapes:
        L = len(SHAPES[shape][2] or range(SHAPES[shape][0]))
        for per_group in (None, 2, 1):
            if per_group is not None and per_group >= L:
                continue
            # A fresh server per layout: one layout's memory and AOF do not slow the next.
            folder = Path(tempfile.mkdtemp(prefix="embgeom-layout-"))
            server = RedisServer(folder / "redis").start(timeout=120)
            r = redis_client(server.url)
            try:
                res = measure_layout(r, shape, per_group, checkpoints)
            finally:
                r.close()
                server.kill()
                shutil.rmtree(folder, ignore_errors=True)
            print(json.dumps(res), flush=True)
            out.append(res)
    return out


def table(results: list[dict]) -> str:
    lines = ["shape              per_group groups rec_B/tok piece_tok apply_s  x_all bytes_w(MB) "
             "slowest_ms scan_ms x_all means_of_ms scal_ms rec_B_read/tok"]
    base = {}
    for r in results:
        if r["groups"] == 1:
            base[r["shape"]] = r
        b = base.get(r["shape"], r)
        lines.append(
            f"{r['shape']:<18} {r['layers_per_group']:>9} {r['groups']:>6} "
            f"{r['record_bytes_per_token_group']:>9} {r['piece_tokens']:>9} "
            f"{r['apply_s_median']:>7.3f} {r['apply_s_median'] / b['apply_s_median']:>6.2f} "
            f"{r['bytes_written'] / 2**20:>11.1f} {r['slowest_command_ms']:>10.1f} "
            f"{r['reads']['scan_one_layer']['ms']:>7.1f} "
            f"{r['reads']['scan_one_layer']['ms'] / b['reads']['scan_one_layer']['ms']:>5.2f} "
            f"{r['reads']['means_of_300_keys']['ms']:>11.1f} "
            f"{r['reads']['scalars_all_layers']['ms']:>7.1f} "
            f"{r['reads']['scan_one_layer']['record_bytes_read_in_redis_per_token']:>14}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="minilm,1b_shape")
    ap.add_argument("--checkpoints", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args(argv)
    results = run(args.shapes.split(","), args.checkpoints)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
