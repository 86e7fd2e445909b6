"""Token records by layer group: checkpoint apply and one-layer reads, side by side.

For a model shape and each layer grouping (every kept layer in one group, as a
generation stored before groups; groups of 2 layers; one layer a group), one pair in the
same Redis is written through the real :class:`embgeom.store.shards.ShardWriter` into a fresh Redis with
the service's persistence (:class:`embgeom.store.server.RedisServer`): a first checkpoint
of every type (new records), then ``--checkpoints`` checkpoints of the same types (steady
state: each one reads, merges and rewrites every record). Then reads of one layer: a scan
of every token's mean (:meth:`Reader.means`), the means of 300 keys
(:meth:`Reader.means_of`), and every token's scalars (:meth:`Reader.scalars`, what a token
page reads).

The layouts' checkpoints and reads are interleaved, the order rotated each round.
Printed per layout: apply seconds (median) and bytes per steady checkpoint, pieces, the
slowest Redis command (SLOWLOG over 1 ms), and the read latencies (median of 3) with the bytes
that left Redis (``total_net_output_bytes``) and the record bytes read inside Redis (the
values the scripts cut: types x the group's record). Timings are noisy on a shared
machine: compare the layouts' ratios, measured in one run.

``python -m benchmarks.record_layout [--shapes minilm,1b_shape] [--checkpoints 3]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from embgeom.settings import Settings
from embgeom.stats import TokenMoments
from embgeom.store.conf import CollectionSettings, PairConf, layer_bytes
from embgeom.store.keys import PairKeys
from embgeom.store.reader import Reader, run_sync
from embgeom.store.scripts import NOW
from embgeom.store.shards import ShardWriter, piece_tokens_for, record_bytes

# (hidden states, d, kept layers, self-similarity, types per checkpoint)
SHAPES = {
    "minilm": (7, 384, None, True, 2000),
    "mpnet_shape": (13, 768, None, True, 600),
    "1b_shape": (17, 2048, (0, 4, 8, 12, 16), False, 800),
    "7b_shape_5_layers": (33, 4096, (0, 8, 16, 24, 32), False, 300),
    "7b_shape_all_layers": (33, 4096, None, False, 100),
}
PIECE_BYTES = Settings().piece_bytes  # the service's default


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


def _out_bytes(r) -> int:
    return int(r.info("stats")["total_net_output_bytes"])


class Layout:
    """One pair of a shape with one layer grouping, in a shared Redis."""

    def __init__(self, r, shape: str, per_group, seed: int = 0):
        self.r, self.shape, self.conf = r, shape, layout_conf(shape, per_group)
        self.per_group = per_group or self.conf.L
        self.pair = PairKeys(f"{shape}-{self.per_group}", "m")
        r.set(self.pair.conf(0), self.conf.to_json())
        r.sadd("eg:pairs", self.pair.pair)
        self.types = SHAPES[shape][4]
        self.rng = np.random.default_rng(seed)
        self.writer = ShardWriter(r, "layout")
        self.parts = self.pair.parts(0)
        self.piece_tokens = piece_tokens_for(self.conf, PIECE_BYTES)
        self.applies: list = []
        self.reads: dict = {}
        self.apply("cp0")  # every type new: later checkpoints are steady state
        self.applies.clear()

    def _check(self) -> int:
        return int(NOW(self.r, [self.parts.shard(0).lock], []))

    def apply(self, cp: str) -> None:
        """One checkpoint of every type, timed; the slowest command it ran (SLOWLOG)."""
        tok = window(self.rng, self.conf, self.types)
        self.r.slowlog_reset()
        t0 = time.perf_counter()
        stats = self.writer.apply(self.parts, self.conf, cp, tok, self.piece_tokens, self._check)
        seconds = time.perf_counter() - t0
        top = max(self.r.slowlog_get(10000), key=lambda e: e["duration"], default=None)
        what = top["command"].split()[0].decode() if top else ""
        self.applies.append((seconds, stats, top["duration"] / 1000 if top else 0.0, what))

    def read(self) -> None:
        """Reads of one layer (the middle kept layer), and every token's scalars, timed."""
        r, conf = self.r, self.conf
        self.r.hset(self.pair.meta, "version", 1 + len(self.applies))
        rd = Reader()
        state = run_sync(r, rd.pair_state(self.pair))
        position = conf.L // 2
        keys = (np.arange(0, self.types, max(1, self.types // 300))[:300] * 7 + 3)
        for name, plan, count in (("scan_one_layer", lambda: rd.means(state, [position]), self.types),
                                  ("means_of_300_keys", lambda: rd.means_of(state, keys, [position]),
                                   len(keys)),
                                  ("scalars_all_layers", lambda: Reader().scalars(state), self.types)):
            before = _out_bytes(r)
            t0 = time.perf_counter()
            run_sync(r, plan())
            seconds = time.perf_counter() - t0
            self.reads.setdefault(name, []).append((seconds, (_out_bytes(r) - before) / count))

    def result(self) -> dict:
        conf = self.conf
        g, _ = conf.group_of(conf.L // 2)
        last = self.applies[-1][1]
        apply_s = statistics.median(a[0] for a in self.applies)
        return {"shape": self.shape, "layers_per_group": self.per_group, "groups": len(conf.groups),
                "record_bytes_per_token_group": record_bytes(conf.group_view(g)),
                "piece_tokens": self.piece_tokens, "types": self.types,
                "apply_s_median": round(apply_s, 3), "apply_tok_s": round(self.types / apply_s, 1),
                "apply_s_all": [round(a[0], 3) for a in self.applies],
                "apply_stage_s": {k: round(v, 3) for k, v in last.seconds.items()},
                "bytes_written": last.bytes_written, "bytes_read": last.bytes_read,
                "pieces": last.pieces,
                "slowest_command_ms": max(a[2] for a in self.applies),
                "slowest_command": max(self.applies, key=lambda a: a[2])[3],
                "record_bytes_read_in_redis_per_token": 8 * (1 + len(conf.groups[g]) * (1 + conf.d)),
                "reads": {name: {"ms": round(1000 * statistics.median(t for t, _ in v), 2),
                                 "bytes_out_per_token": round(statistics.median(b for _, b in v), 1)}
                          for name, v in self.reads.items()}}


def measure_shape(r, shape: str, checkpoints: int, repeats: int = 3,
                  groupings=(None, 2, 1)) -> list[dict]:
    """Every grouping of ``shape`` side by side: checkpoints and reads interleaved (the
    order rotated each round), so a busy moment of the machine falls on all of them."""
    L = len(SHAPES[shape][2] or range(SHAPES[shape][0]))
    layouts = [Layout(r, shape, per) for per in groupings if per is None or per < L]
    r.config_set("slowlog-log-slower-than", 1000)
    r.config_set("slowlog-max-len", 10000)
    for c in range(checkpoints):
        for layout in layouts[c % len(layouts):] + layouts[:c % len(layouts)]:
            layout.apply(f"cp{c + 1}")
    for k in range(repeats):
        for layout in layouts[k % len(layouts):] + layouts[:k % len(layouts)]:
            layout.read()
    return [layout.result() for layout in layouts]


def run(shapes: list[str], checkpoints: int, groupings=(None, 2, 1)) -> list[dict]:
    from embgeom.store.connection import redis_client
    from embgeom.testing.redis import private_redis

    out = []
    for shape in shapes:
        with private_redis(timeout=120, prefix="embgeom-layout-") as server:
            r = redis_client(server.url)
            try:
                for res in measure_shape(r, shape, checkpoints, groupings=groupings):
                    print(json.dumps(res), flush=True)
                    out.append(res)
            finally:
                r.close()
    return out


def table(results: list[dict]) -> str:
    lines = ["shape              per_group groups rec_B/tok piece_tok apply_s  x_all bytes_w(MB) "
             "slowest_ms command scan_ms x_all means_of_ms scal_ms rec_B_read/tok"]
    base = {}
    for r in results:
        if r["groups"] == 1:
            base[r["shape"]] = r
        b = base.get(r["shape"], r)
        lines.append(
            f"{r['shape']:<18} {r['layers_per_group']:>9} {r['groups']:>6} "
            f"{r['record_bytes_per_token_group']:>9} {r['piece_tokens']:>9} "
            f"{r['apply_s_median']:>7.3f} {r['apply_s_median'] / b['apply_s_median']:>6.2f} "
            f"{r['bytes_written'] / 2**20:>11.1f} {r['slowest_command_ms']:>10.1f} {r['slowest_command'][:7]:<7} "
            f"{r['reads']['scan_one_layer']['ms']:>7.1f} "
            f"{r['reads']['scan_one_layer']['ms'] / b['reads']['scan_one_layer']['ms']:>5.2f} "
            f"{r['reads']['means_of_300_keys']['ms']:>11.1f} "
            f"{r['reads']['scalars_all_layers']['ms']:>7.1f} "
            f"{r['record_bytes_read_in_redis_per_token']:>14}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="minilm,1b_shape")
    ap.add_argument("--checkpoints", type=int, default=3)
    ap.add_argument("--layers-per-group", default="all,2,1",
                    help="groupings to compare: 'all' (one group) or layers per group")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args(argv)
    groupings = tuple(None if g == "all" else int(g) for g in args.layers_per_group.split(","))
    results = run(args.shapes.split(","), args.checkpoints, groupings)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
