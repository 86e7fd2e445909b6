"""The checkpoint protocol against a real Redis, with synthetic windows (no model).

Each window's moments are built two-pass from raw random points; the yardstick is a
two-pass float64 computation over *all* points of all windows (numpy only). Faults are
injected at the instants a SIGKILL could hit (after some shard pieces, between the shards
and the layer segments, before the completion) and the checkpoint is then redelivered
(adopted) and finished: counts must stay exact and values two-pass.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest
import redis

from embgeom.errors import CheckTooOld
from embgeom.reports import CountFilter, layer_rows
from embgeom.stats import LayerMoments, TokenMoments, WindowMoments, bucket_index
from embgeom.store import keys as K
from embgeom.store.checkpoints import Checkpointer, Held, new_checkpoint_id
from embgeom.store.collections import Collections
from embgeom.store.conf import CollectionSettings, PairConf, shard_of
from embgeom.store.connection import async_redis_client, redis_client
from embgeom.store.delivery import WorkerQueue
from embgeom.store.jobs import JobRequest
from embgeom.store.piece_writes import PieceWriter
from embgeom.store.reader import Reader, run_async, run_sync
from embgeom.store.scripts import NOW
from embgeom.store.shards import ShardWriter, pieces_of
from embgeom.store.submission import JobSubmitter

L, D = 3, 5


def points_window(rng, keys, offset=0.0, shape=(L, D)):
    """Raw points of one window: keys (m,) and x (m, *shape), plus its moments two-pass."""
    x = offset + rng.standard_normal((len(keys), *shape)) + keys[:, None, None] % 7
    ids = np.unique(keys)
    n = np.array([(keys == i).sum() for i in ids])
    mean = np.stack([x[keys == i].mean(0) for i in ids])
    m2 = np.stack([((x[keys == i] - mean[j]) ** 2).sum((0, 2)) for j, i in enumerate(ids)])
    u = x / np.linalg.norm(x, axis=2, keepdims=True)
    unit = np.stack([u[keys == i].sum(0) for i in ids])
    mu = x.mean(0)
    com = np.einsum("mli,mlj->lij", x - mu, x - mu)
    tokens = TokenMoments(ids.astype(np.int64), n, mean, m2, unit)
    layers = LayerMoments(len(keys), mu, com, u.sum(0), (u * u).sum(0))
    return x, tokens, layers


def reference(all_keys, all_x):
    """Two-pass float64 from the raw points: per type n, mean, m2, unit sums; per layer
    mean and co-moment; per count bucket the types, count and sum of the points."""
    ids = np.unique(all_keys)
    n = np.array([(all_keys == i).sum() for i in ids])
    mean = np.stack([all_x[all_keys == i].mean(0) for i in ids])
    m2 = np.stack([((all_x[all_keys == i] - mean[j]) ** 2).sum((0, 2)) for j, i in enumerate(ids)])
    u = all_x / np.linalg.norm(all_x, axis=2, keepdims=True)
    unit = np.stack([u[all_keys == i].sum(0) for i in ids])
    mu = all_x.mean(0)
    com = np.einsum("mli,mlj->lij", all_x - mu, all_x - mu)
    bucket_of_point = bucket_index(n)[np.searchsorted(ids, all_keys)]
    buckets = {int(b): (int((bucket_index(n) == b).sum()), int((bucket_of_point == b).sum()),
                        all_x[bucket_of_point == b].sum(0)) for b in np.unique(bucket_index(n))}
    unit_norms = (unit ** 2).sum(2)  # (k, L)
    return {"ids": ids, "n": n, "mean": mean, "m2": m2, "com": com, "mu": mu, "unit": unit,
            "unit_norms": unit_norms, "buckets": buckets, "keys": all_keys, "x": all_x}


def two_pass_decomposition(ref, layer: int, min_count: int) -> dict:
    """Q, M, V_W, V_B of the points whose type has n_t >= min_count, from the raw points."""
    keep_types = ref["ids"][ref["n"] >= min_count]
    points = np.isin(ref["keys"], keep_types)
    x = ref["x"][points, layer]
    mu = x.mean(0)
    mean_of_point = ref["mean"][np.searchsorted(ref["ids"], ref["keys"][points]), layer]
    return {"n": int(points.sum()), "num_types": len(keep_types),
            "Q": float((x * x).sum(1).mean()), "M": float(mu @ mu),
            "V_W": float(((x - mean_of_point) ** 2).sum(1).mean()),
            "V_B": float(((mean_of_point - mu) ** 2).sum(1).mean())}


def assert_buckets_units_and_filters(r, pair, ref, rel):
    """What unfiltered reads do not show: each count bucket's sums, every token's
    unit-vector sums (self-similarity), and decompositions filtered by count (the bucket
    path, n_t >= 2 and >= 5) and unfiltered, against the raw points."""
    rd = Reader()
    state = run_sync(r, rd.pair_state(pair))
    scale = float(np.sqrt(np.max(np.sum(ref["x"] ** 2, axis=2))))  # largest ||x||
    for b, (types, count, vector) in ref["buckets"].items():
        got = run_sync(r, rd.buckets(state, [b]))
        assert (got["types"], got["count"]) == (types, count), b
        # a sum of `count` points: rounding ~ u count scale; an algebra slip is O(scale)
        np.testing.assert_allclose(got["vector"], vector, rtol=0, atol=rel * count * scale)
    if state.conf.self_similarity:
        for p in range(L):
            units = run_sync(r, rd.units(state, ref["ids"].tolist(), p))
            err = np.abs(np.stack(units) - ref["unit"][:, p]).max(axis=1)
            assert np.all(err <= rel * ref["n"]), (p, err.max())  # sums of n_t unit vectors
    for min_count in (1, 2, 5):
        rows, _ = run_sync(r, layer_rows(rd, pair, None, CountFilter(min_count), with_summary=False))
        for p, row in enumerate(rows):
            want = two_pass_decomposition(ref, p, min_count)
            assert (row["n"], row["num_types"]) == (want["n"], want["num_types"]), min_count
            # V_B within its own stated rounding bound, plus the stored means' own error
            # (each mean ~ rel sqrt(Q) off moves V_B by at most 2 rel sqrt(V_B Q))
            tol_b = row["V_B_error"] + 2 * rel * np.sqrt(want["V_B"] * want["Q"])
            assert abs(row["V_B"] - want["V_B"]) <= tol_b, (min_count, p, row, want)
            for key in ("Q", "M", "V_W"):
                assert abs(row[key] - want[key]) <= rel * want["Q"] + tol_b, (min_count, key)


@pytest.fixture
def r(redis_server):
    client = redis_client(redis_server.url)
    yield client
    client.close()


# Per-token record bytes (Settings.record_bytes) giving L = 3 layers of D = 5 in one layer
# group (the default), in two (2 + 1 layers: 112 bytes a layer with self-similarity) and
# in three (one layer each).
RECORD_BYTES = {1: 256 << 10, 2: 16 + 2 * 112, 3: 16 + 112}


def make_conf(r, pair, shards=4, chunk_bytes=100, self_similarity=True, groups=1):
    conf = PairConf.resolve(CollectionSettings(self_similarity=self_similarity), 0, L, D, 10**9,
                            shards, chunk_bytes, record_bytes=RECORD_BYTES[groups])
    assert len(conf.chunks) > 2  # several co-moment chunks per layer are exercised
    assert len(conf.groups) == groups
    return Collections(r).ensure_conf(pair, conf)


def applied_parts(r, pair, conf, cp) -> int:
    """(shard, layer group) parts holding a piece of checkpoint ``cp``."""
    return sum(r.hexists(keys.applied, cp) for *_, keys in pair.parts(conf.gen).shard_parts(conf))


def held_jobs(r, pair, count):
    """Jobs submitted and delivered (status running, with epochs), as a worker holds them."""
    submitter, q = JobSubmitter(r), WorkerQueue(r)
    for i in range(count):
        submitter.submit(JobRequest(pair.collection, pair.model, [f"text {i}"]), [pair.model])
    out = []
    for _ in range(count):
        d = q.take("w", [pair.model], 60, block_ms=0, only=pair.jobs)
        out.append(Held(d.job_id, d.entry_id, d.epoch, tokens=7))
    return out


def checkpoint(r, pair, conf, tokens, layers, jobs, piece_tokens=3, cpr=None):
    cpr = cpr or Checkpointer(r, "w")
    cp = new_checkpoint_id()
    assert cpr.seal(pair, conf.gen, cp, jobs, pair.jobs, piece_tokens).status == "sealed"
    out = cpr.apply_and_complete(pair, conf, cp, WindowMoments(tokens, layers), jobs, piece_tokens)
    return cp, out


def read_all(r, pair):
    rd = Reader()
    state = run_sync(r, rd.pair_state(pair))
    return (state, run_sync(r, rd.heads(state)), run_sync(r, rd.aggs(state)),
            run_sync(r, rd.scalars(state)),
            [run_sync(r, rd.covariance(state, p)) for p in range(L)],
            run_sync(r, rd.means(state, list(range(L)))))


def assert_matches(r, pair, ref, rel=1e-10):
    state, heads, aggs, scal, covs, (ids, n, m2, mean) = read_all(r, pair)
    np.testing.assert_array_equal(scal.ids, ref["ids"])
    np.testing.assert_array_equal(scal.n, ref["n"])
    np.testing.assert_array_equal(ids, ref["ids"])
    np.testing.assert_array_equal(n, ref["n"])
    N = int(ref["n"].sum())
    assert heads["n"] == N and aggs["count"] == N and aggs["types"] == len(ref["ids"])
    q = float(np.max(np.sum(ref["mean"] ** 2, axis=2))) + float(np.max(ref["m2"] / ref["n"][:, None]))
    np.testing.assert_allclose(mean, ref["mean"], rtol=0, atol=rel * np.sqrt(q))
    np.testing.assert_allclose(m2, ref["m2"], rtol=0, atol=rel * N * q)
    np.testing.assert_allclose(scal.m2, ref["m2"], rtol=0, atol=rel * N * q)
    np.testing.assert_allclose(scal.M, np.sum(ref["mean"] ** 2, axis=2), rtol=0, atol=rel * q)
    if state.conf.stores_unit_norms:  # ||U||^2 <= n^2: of the merged sums, counted once
        np.testing.assert_allclose(scal.unit_norms, ref["unit_norms"], rtol=0,
                                   atol=rel * float(ref["n"].max()) ** 2)
    np.testing.assert_allclose(aggs["within"], ref["m2"].sum(0), rtol=0, atol=rel * N * q)
    np.testing.assert_allclose(heads["mean"], ref["mu"], rtol=0, atol=rel * np.sqrt(q))
    for p in range(L):
        np.testing.assert_allclose(covs[p]["comoment"], ref["com"][p], rtol=0, atol=rel * N * q)
        assert covs[p]["n"] == N
    assert state.applying == 0
    assert_buckets_units_and_filters(r, pair, ref, rel)
    return state


def test_checkpoints_merge_exactly(r):
    pair = K.PairKeys("c", "m")
    conf = make_conf(r, pair)
    rng = np.random.default_rng(0)
    all_k, all_x = [], []
    for w in range(4):
        keys = rng.integers(0, 30, size=60 + 10 * w)
        x, tok, lay = points_window(rng, keys)
        all_k.append(keys), all_x.append(x)
        cp, out = checkpoint(r, pair, conf, tok, lay, held_jobs(r, pair, 2))
        assert out.status == "completed" and out.version == w + 1
        assert out.shards.pieces >= conf.shards  # several pieces per shard (3 tokens each)
    state = assert_matches(r, pair, reference(np.concatenate(all_k), np.concatenate(all_x)))
    assert state.version == 4
    # every job of the windows is done, with the tokens its worker counted
    for raw in r.keys("eg:{c:m}:job:*"):
        assert r.hget(raw, "status") == b"done" and r.hget(raw, "tokens") == b"7"
    assert not r.keys("eg:{c:m}:payload:*")


def test_layer_segments_fold_without_changing_a_value(r):
    pair = K.PairKeys("f", "m")
    conf = make_conf(r, pair)
    rng = np.random.default_rng(1)
    cpr = Checkpointer(r, "w", max_segments=2)
    all_k, all_x = [], []
    folded = 0
    for w in range(7):
        keys = rng.integers(0, 20, size=40)
        x, tok, lay = points_window(rng, keys, offset=50.0)
        all_k.append(keys), all_x.append(x)
        folded += checkpoint(r, pair, conf, tok, lay, held_jobs(r, pair, 1), cpr=cpr)[1].folded
    assert folded > 0
    head = r.hgetall(pair.parts(0).head.seg)
    assert b"base" in head and len(head) <= 3
    assert_matches(r, pair, reference(np.concatenate(all_k), np.concatenate(all_x)))


def test_cross_layer_segments_fold_and_read_as_a_two_pass(r):
    """A cross_layer pair's (L D x L D) co-moment goes through the same segments, folds and
    merges as a layer's co-moment: read back, it is the two-pass co-moment of the
    concatenated layers; its diagonal blocks are the per-layer co-moments."""
    pair = K.PairKeys("x", "m")
    conf = Collections(r).ensure_conf(pair, PairConf.resolve(
        CollectionSettings(cross_layer=True), 0, L, D, 10**9, 4, 300))
    assert conf.cross_layer and len(conf.cross_chunks) > 2  # several chunks exercised
    rng = np.random.default_rng(5)
    cpr = Checkpointer(r, "w", max_segments=2)
    all_x, folded = [], 0
    for _ in range(5):
        keys = rng.integers(0, 20, size=30)
        x, tok, lay = points_window(rng, keys, offset=40.0)
        flat = x.reshape(len(keys), -1)
        lay.cross = np.einsum("mi,mj->ij", flat - flat.mean(0), flat - flat.mean(0))
        all_x.append(flat)
        folded += checkpoint(r, pair, conf, tok, lay, held_jobs(r, pair, 1), cpr=cpr)[1].folded
    assert folded > 0
    X = np.concatenate(all_x)
    want = np.einsum("mi,mj->ij", X - X.mean(0), X - X.mean(0))
    rd = Reader()
    state = run_sync(r, rd.pair_state(pair))
    got = run_sync(r, rd.cross_layer(state))
    assert got["n"] == X.shape[0]
    # Chan merges of exact window moments: relative rounding ~ windows x eps x offset^2 / var
    np.testing.assert_allclose(got["comoment"], want, rtol=0, atol=1e-9 * np.abs(want).max())
    np.testing.assert_allclose(got["mean"], X.mean(0), rtol=1e-12)
    per_layer = run_sync(r, rd.covariance(state, 1))["comoment"]
    np.testing.assert_allclose(got["comoment"][D:2 * D, D:2 * D], per_layer, rtol=0,
                               atol=1e-9 * np.abs(per_layer).max())


class Crash(Exception):
    pass


class CrashingPieces(PieceWriter):
    """Dies (raises) after writing ``after`` rounds of shard pieces."""

    def __init__(self, *args, after, **kwargs):
        super().__init__(*args, **kwargs)
        self.after = after

    def write(self, *args, **kwargs):
        if self.after == 0:
            raise Crash()
        self.after -= 1
        return super().write(*args, **kwargs)


@pytest.mark.parametrize("crash_after,groups", [(0, 1), (1, 1), (3, 1), (1, 3), (4, 3), (5, 2)])
def test_checkpoint_redelivered_after_some_shards_counts_once(r, crash_after, groups):
    """A worker dies mid-checkpoint (after some parts' pieces: a shard may have some of
    its layer groups written and not the others); the next delivery of one of its jobs
    adopts the checkpoint, recomputes it and applies only what is missing."""
    pair = K.PairKeys(f"crash{crash_after}g{groups}", "m")
    conf = make_conf(r, pair, groups=groups)
    rng = np.random.default_rng(2)
    # An earlier checkpoint first: the crashed one moves tokens between count buckets and
    # adds to unit sums already stored, so a piece redone or skipped wrongly shows there.
    keys0 = rng.integers(0, 40, size=150)
    x0, tok0, lay0 = points_window(rng, keys0)
    checkpoint(r, pair, conf, tok0, lay0, held_jobs(r, pair, 1))
    keys = rng.integers(0, 40, size=200)
    x, tok, lay = points_window(rng, keys)
    jobs = held_jobs(r, pair, 3)
    dying = Checkpointer(r, "dying", lease_ms=200)
    dying.shards = ShardWriter(r, "dying", lock_ms=200)
    dying.shards.pieces = CrashingPieces(r, after=crash_after)
    dying.shards.group_bytes = 1  # one part per round: the crash lands between parts
    cp = new_checkpoint_id()
    assert dying.seal(pair, 0, cp, jobs, pair.jobs, 3).status == "sealed"
    with pytest.raises(Crash):
        dying.apply_and_complete(pair, conf, cp, WindowMoments(tok, lay), jobs, 3)
    assert applied_parts(r, pair, conf, cp) == crash_after
    crashed_pieces = Checkpointer(r, "x").progress(pair, {"gen": 0, "cp": cp})
    assert r.zcard(pair.inflight) == 1  # sealed, not complete: never abandoned

    # The job comes back; its delivery names the checkpoint; the adopter takes it over
    # (only once the dead owner's lease is gone) and redoes it from the same texts.
    adopter = Checkpointer(r, "adopter")
    time.sleep(0.3)
    record = adopter.adopt(pair, cp)
    assert record is not None and record["jobs"] == [j.job_id for j in jobs]
    assert record["epochs"] == [j.epoch + 1 for j in jobs]  # the dead owner is fenced
    again = [Held(j, e, ep, 7) for j, e, ep in zip(record["jobs"], record["entries"], record["epochs"])]
    out = adopter.apply_and_complete(pair, conf, cp, WindowMoments(tok, lay), again,
                                     record["piece_tokens"])
    assert out.status == "completed"
    total_pieces = len(pieces_of(tok.ids, conf, 3)) * groups  # each piece once per group
    assert out.shards.pieces + out.shards.pieces_skipped == total_pieces
    # Progress (what adoption compares) counts each part's pieces: the crashed run's are
    # exactly those skipped, and in the end every piece of every group is marked once.
    assert out.shards.pieces_skipped == crashed_pieces
    assert adopter.applied(pair, conf, cp)[0] == total_pieces
    assert (out.shards.pieces_skipped > 0) == (crash_after > 0)
    both = reference(np.concatenate([keys0, keys]), np.concatenate([x0, x]))
    assert_matches(r, pair, both)
    # a late completion by the dead owner's code path finds it done: nothing twice
    assert dying.complete(pair, conf, cp, jobs, [])[0] == "already"
    assert_matches(r, pair, both)


def test_adopt_waits_for_a_live_owner(r):
    pair = K.PairKeys("live", "m")
    conf = make_conf(r, pair)
    jobs = held_jobs(r, pair, 1)
    cp = new_checkpoint_id()
    owner = Checkpointer(r, "owner", lease_ms=60_000)
    assert owner.seal(pair, conf.gen, cp, jobs, pair.jobs, 3).status == "sealed"
    assert Checkpointer(r, "other").adopt(pair, cp) is None  # its owner is alive
    assert owner.renew(pair, cp)


def test_seal_refuses_a_job_taken_over(r):
    pair = K.PairKeys("fence", "m")
    conf = make_conf(r, pair)
    jobs = held_jobs(r, pair, 2)
    r.hincrby(pair.job(jobs[1].job_id), "epoch", 1)  # a newer delivery owns job 2
    res = Checkpointer(r, "w").seal(pair, conf.gen, new_checkpoint_id(), jobs, pair.jobs, 3)
    assert res.status == "lost" and res.lost == jobs[1].job_id
    assert r.zcard(pair.inflight) == 0 and r.hget(pair.job(jobs[0].job_id), "checkpoint") == b""


def test_two_writers_on_the_same_shards_both_count(r):
    """Concurrent checkpoints touching the same tokens: fenced try-locks serialise each
    shard, nothing is lost or doubled."""
    pair = K.PairKeys("race", "m")
    conf = make_conf(r, pair, shards=2)
    rng = np.random.default_rng(4)
    keys = [rng.integers(0, 12, size=80) for _ in range(6)]
    windows = [points_window(rng, k) for k in keys]
    jobs = [held_jobs(r, pair, 1) for _ in windows]
    errors = []

    def run(i):
        try:
            _, tok, lay = windows[i]
            checkpoint(r, pair, conf, tok, lay, jobs[i], cpr=Checkpointer(r, f"w{i}"))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    state = assert_matches(r, pair, reference(np.concatenate(keys),
                                              np.concatenate([w[0] for w in windows])))
    assert state.version == 6


@pytest.mark.parametrize("groups", [1, 3])
def test_deleted_generation_refuses_late_writes_and_voids_the_jobs(r, groups):
    pair = K.PairKeys(f"gone{groups}", "m")
    conf = make_conf(r, pair, groups=groups)
    rng = np.random.default_rng(5)
    x, tok, lay = points_window(rng, rng.integers(0, 10, size=30))
    checkpoint(r, pair, conf, tok, lay, held_jobs(r, pair, 1))
    jobs = held_jobs(r, pair, 1)
    cp = new_checkpoint_id()
    cpr = Checkpointer(r, "w")
    assert cpr.seal(pair, 0, cp, jobs, pair.jobs, 3).status == "sealed"
    r.sadd(K.PAIRS, pair.pair)
    Collections(r).delete_pair(pair)  # DELETE lands mid-checkpoint
    assert int(r.get(pair.gen)) == 1
    every = pair.parts(0).shard_parts(conf)
    assert len(every) == conf.shards * groups
    assert not any(r.exists(keys.rec) or r.exists(keys.scal) for *_, keys in every)
    assert all(r.exists(keys.dead) for *_, keys in every)
    out = cpr.apply_and_complete(pair, conf, cp, WindowMoments(tok, lay), jobs, 3)
    assert out.status == "void"
    assert cpr.complete(pair, conf, cp, jobs, [])[0] == "already"
    assert r.hget(pair.job(jobs[0].job_id), "status") == b"failed"
    assert not any(r.exists(keys.rec) for *_, keys in every)  # nothing resurrected


def test_stale_in_flight_check_is_refused(r):
    pair = K.PairKeys("stale", "m")
    conf = make_conf(r, pair)
    rng = np.random.default_rng(6)
    _, tok, lay = points_window(rng, rng.integers(0, 10, size=30))
    jobs = held_jobs(r, pair, 1)
    cpr = Checkpointer(r, "w", horizon_ms=2000)
    cp = new_checkpoint_id()
    cpr.seal(pair, 0, cp, jobs, pair.jobs, 3)
    long_ago = int(NOW(r, [pair.done], [])) - 10_000
    with pytest.raises(CheckTooOld):
        cpr.shards.apply(pair.parts(0), conf, cp, tok, 3, lambda: long_ago)
    assert not r.exists(pair.parts(0).shard(0).rec)  # refused before writing a byte


@pytest.mark.parametrize("groups", [1, 3])
def test_markers_are_pruned_after_the_horizon(r, groups):
    pair = K.PairKeys(f"prune{groups}", "m")
    conf = make_conf(r, pair, groups=groups)
    rng = np.random.default_rng(7)
    _, tok, lay = points_window(rng, rng.integers(0, 10, size=30))
    cpr = Checkpointer(r, "w", horizon_ms=400)
    cp, _ = checkpoint(r, pair, conf, tok, lay, held_jobs(r, pair, 1), cpr=cpr)
    assert cpr.prune(pair, conf) == 0  # completed just now: its markers are still needed
    shards = sorted(set(shard_of(tok.ids, conf.shards).tolist()))
    assert all(r.hexists(pair.parts(0).shard(s, g).applied, cp) for s in shards for g in range(groups))
    assert applied_parts(r, pair, conf, cp) == len(shards) * groups
    time.sleep(0.45)
    assert cpr.prune(pair, conf) == 1
    assert applied_parts(r, pair, conf, cp) == 0
    assert r.zcard(pair.done) == 0


def test_async_reads_equal_sync_reads(r, redis_server):
    pair = K.PairKeys("async", "m")
    conf = make_conf(r, pair)
    rng = np.random.default_rng(8)
    _, tok, lay = points_window(rng, rng.integers(0, 25, size=90))
    checkpoint(r, pair, conf, tok, lay, held_jobs(r, pair, 1))
    r.sadd(K.PAIRS, pair.pair)
    rd = Reader()

    async def both():
        a = async_redis_client(redis_server.url)
        try:
            state = await run_async(a, rd.pair_state(pair))
            return (await run_async(a, rd.scalars(state)), await run_async(a, rd.heads(state)),
                    await run_async(a, rd.covariance(state, 1)))
        finally:
            await a.aclose()

    scal_a, heads_a, cov_a = asyncio.run(both())
    state = run_sync(r, rd.pair_state(pair))
    scal_s = run_sync(r, Reader().scalars(state))
    np.testing.assert_array_equal(scal_a.ids, scal_s.ids)
    np.testing.assert_array_equal(scal_a.M, scal_s.M)
    np.testing.assert_array_equal(heads_a["mean"], run_sync(r, rd.heads(state))["mean"])
    np.testing.assert_array_equal(cov_a["comoment"], run_sync(r, rd.covariance(state, 1))["comoment"])


def test_pieces_are_deterministic_and_cover_each_token_once():
    conf = PairConf.resolve(CollectionSettings(), 0, L, D, 10**9, 7, 1 << 20)
    ids = np.unique(np.random.default_rng(9).integers(0, 10**6, size=500))
    a, b = pieces_of(ids, conf, 11), pieces_of(ids, conf, 11)
    assert [(s, p, rows.tolist()) for s, p, rows in a] == [(s, p, rows.tolist()) for s, p, rows in b]
    rows = np.concatenate([rows for _, _, rows in a])
    assert sorted(rows.tolist()) == list(range(len(ids)))
    assert all(len(rows) <= 11 for _, _, rows in a)
    for s, _, rows in a:
        assert (shard_of(ids[rows], conf.shards) == s).all()


def test_ended_jobs_expire_and_a_redelivery_past_the_horizon_counts_nothing(r):
    """Job records live ``retention_seconds`` after their checkpoint completes; an entry
    redelivered after that (an ack lost with its worker) is acknowledged, not recounted,
    and leaves no record behind."""
    pair = K.PairKeys("retained", "m")
    conf = make_conf(r, pair)
    rng = np.random.default_rng(8)
    keys = rng.integers(0, 10, size=30)
    x, tok, lay = points_window(rng, keys)
    jobs = held_jobs(r, pair, 2)
    checkpoint(r, pair, conf, tok, lay, jobs, cpr=Checkpointer(r, "w", retention_seconds=1))
    q = WorkerQueue(r, retention_seconds=1)
    q.retire_refs([j.job_id for j in jobs])
    for j in jobs:
        assert q.status(j.job_id)["status"] == "done"
        assert 0 < r.pttl(pair.job(j.job_id)) <= 1000
        assert 0 < r.pttl(K.jobref(j.job_id)) <= 1000
        assert not r.exists(pair.payload(j.job_id))
    time.sleep(1.2)
    assert not any(r.exists(pair.job(j.job_id), K.jobref(j.job_id)) for j in jobs)
    # The second job's entry was acknowledged; the first one's ack was lost with its
    # worker: it is still pending, and another worker reclaims it after its lease.
    q.ack_many(pair.jobs, [jobs[1].entry_id])
    assert q.take("w2", [pair.model], 0.5, block_ms=0, only=pair.jobs) is None
    assert not r.exists(pair.job(jobs[0].job_id))  # no counters recreated
    assert r.xlen(pair.jobs) == 0 and r.xpending(pair.jobs, K.GROUP)["pending"] == 0
    assert_matches(r, pair, reference(keys, x))  # counted once


def test_a_job_of_a_deleted_collection_is_voided_at_delivery_without_running(r):
    pair = K.PairKeys("voided", "m")
    job_id, _ = JobSubmitter(r).submit(JobRequest(pair.collection, pair.model, ["a text"]), [pair.model])
    Collections(r).delete(pair.collection)
    q = WorkerQueue(r)
    assert q.take("w", [pair.model], 60, block_ms=0, only=pair.jobs) is None
    status = q.status(job_id)
    assert status["status"] == "failed" and "deleted" in status["error"]
    assert not r.exists(pair.payload(job_id))
    assert r.xlen(pair.jobs) == 0


def test_one_idempotency_key_raced_for_two_pairs_names_one_job(r):
    """The cross-pair claim is atomic: of two submissions racing with one key for two
    collections, exactly one is accepted, the other is refused (422)."""
    from embgeom.errors import InvalidInput

    for round_ in range(20):
        key, outcomes = f"race-{round_}", []
        barrier = threading.Barrier(2)

        def submit(collection):
            q = JobSubmitter(r)  # a client is thread-safe: each command takes a pooled connection
            barrier.wait()
            try:
                outcomes.append(q.submit(JobRequest(collection, "m", ["t"]), ["m"], key)[1])
            except InvalidInput as exc:
                outcomes.append(exc.type)

        threads = [threading.Thread(target=submit, args=(c,)) for c in (f"a{round_}", f"b{round_}")]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert sorted(map(str, outcomes)) == ["True", "idempotency_key_reused"], outcomes


def test_running_sums_do_not_drift_over_many_checkpoints(r):
    """600 small checkpoints of adversarial data (common offset 1e3, every token climbing
    through the count buckets 1, 2, 3, 5, 10, 20, 50, ...: it leaves and enters buckets
    again and again). The shards' bucket vectors and within sums must stay the rounded
    exact sums of their present tokens' stored terms (``math.fsum`` over the records):
    within 2 u of the shard's scale (one rounding of the stored value, u = 2^-53), and a
    bucket every token has left holds 0 up to u^2 of that scale. Add/subtract deltas
    drift with the number of checkpoints (measured ~1e-15 and residues of ~1e-9 after
    300; ``python -m benchmarks.aggregates``)."""
    from benchmarks.aggregates import U, adversarial_conf, apply_checkpoints, drift, stored_state
    pair = K.PairKeys("drift", "m")
    conf = adversarial_conf()
    apply_checkpoints(r, pair, conf, 600)
    state = stored_state(r, pair, conf)
    worst = drift(state, conf.L, conf.d)
    assert worst["counts_exact"]
    assert worst["emptied_scale"] > 0, "no bucket was emptied: the data does not test it"
    assert worst["bucket_rel"] <= 2 * U, worst
    assert worst["within_rel"] <= 2 * U, worst
    assert worst["emptied_abs"] <= U * U * worst["emptied_scale"], worst


def test_head_reads_do_not_depend_on_redis_hash_order():
    """Redis may return a hash's fields in another order after it reloads its data; the
    merged head must be the same bits (a restart changed the last bit of M before)."""
    from embgeom.store import codec
    from embgeom.store.layers import merge_head, ordered_segments

    rng = np.random.default_rng(3)
    L_, d_ = 2, 8
    fields = {}
    for name in (b"base", b"cp-01", b"cp-02", b"cp-03", b"cp-04"):
        n = int(rng.integers(1, 1000))
        row = np.concatenate([np.full((L_, 1), float(n)), 1e3 + rng.standard_normal((L_, d_)),
                              rng.random((L_, 1)) * 1e3, rng.standard_normal((L_, d_)),
                              rng.random((L_, d_))], axis=1)
        fields[name] = row.astype(codec.F64).tobytes()
    reversed_fields = dict(reversed(list(fields.items())))

    def head(f):
        return merge_head([codec.from_head(v, L_, d_) for v in ordered_segments(f)], L_, d_)

    a, b = head(fields), head(reversed_fields)
    assert ordered_segments(reversed_fields)[0] == fields[b"base"]
    for key in ("mean", "m2", "unit_sum"):
        np.testing.assert_array_equal(a[key], b[key])
    # the order matters to the bits: merging in the other order is not the same
    c = merge_head([codec.from_head(v, L_, d_) for v in reversed_fields.values()], L_, d_)
    assert not all(np.array_equal(a[k], c[k]) for k in ("mean", "m2"))



def test_layer_groups_read_as_the_reference_and_as_one_group(r):
    """The same windows into pairs whose records are cut into 1, 2 and 3 layer groups:
    every read (scalars, scans, point reads, buckets, aggregates, unit sums, a token,
    filtered decompositions) equals the two-pass reference, and the grouped layouts give
    the very same float64 values as the one-group layout (each layer's merge is the same
    arithmetic, wherever its record lives)."""
    rng = np.random.default_rng(11)
    keys = [rng.integers(0, 40, size=90 + 7 * w) for w in range(3)]
    windows = [points_window(rng, k) for k in keys]
    pairs = {}
    for groups in (1, 2, 3):
        pairs[groups] = pair = K.PairKeys(f"groups{groups}", "m")
        conf = make_conf(r, pair, groups=groups)
        for _, tok, lay in windows:
            checkpoint(r, pair, conf, tok, lay, held_jobs(r, pair, 1))
    ref = reference(np.concatenate(keys), np.concatenate([w[0] for w in windows]))
    rd = Reader()
    reads = {}
    for groups, pair in pairs.items():
        assert_matches(r, pair, ref)
        state = run_sync(r, rd.pair_state(pair))
        parts = pair.parts(0)
        # Group k's records hold its layers only: 1 + L_k + L_k D floats.
        for g, members in enumerate(state.conf.groups):
            widths = {len(raw) for s in range(state.conf.shards) for raw in r.hvals(parts.shard(s, g).rec)}
            assert widths == {8 * (1 + len(members) * (1 + D))}, (groups, g, widths)
        scal = run_sync(r, rd.scalars(state))
        reads[groups] = {"scal": (scal.ids, scal.n, scal.M, scal.m2, scal.unit_norms),
                         "means": run_sync(r, rd.means(state, [2, 0])),
                         "means_of": run_sync(r, rd.means_of(state, [3, 10**6, 17], [1, 2])),
                         "token": run_sync(r, rd.token(pair, 17))[1],
                         "aggs": run_sync(r, rd.aggs(state)),
                         "buckets": [run_sync(r, rd.buckets(state, [b], [2, 1])) for b in range(6)],
                         "units": run_sync(r, rd.units(state, [3, 17], 2)),
                         "rows": run_sync(r, layer_rows(rd, pair, None, CountFilter(2),
                                                        with_summary=False))[0]}
    for groups in (2, 3):
        a, b = reads[1], reads[groups]
        for key in ("scal", "means", "means_of", "token"):
            for x, y in zip(a[key], b[key]):
                np.testing.assert_array_equal(x, y, err_msg=key)
        assert (a["aggs"]["types"], a["aggs"]["count"]) == (b["aggs"]["types"], b["aggs"]["count"])
        np.testing.assert_array_equal(a["aggs"]["within"], b["aggs"]["within"])
        for x, y in zip(a["buckets"], b["buckets"]):
            assert (x["types"], x["count"]) == (y["types"], y["count"])
            np.testing.assert_array_equal(x["vector"], y["vector"])
        for x, y in zip(a["units"], b["units"]):
            np.testing.assert_array_equal(x, y)
        assert a["rows"] == b["rows"]


def test_a_configuration_stored_before_layer_groups_keeps_its_layout(r):
    """A generation whose stored configuration has no ``layer_groups`` (written before
    they existed) is one group of every layer, in exactly the keys it was written in
    (``{c:m:g:s<s>}``, records of all L layers): read and written with no migration."""
    pair = K.PairKeys("before", "m")
    conf = PairConf.resolve(CollectionSettings(), 0, L, D, 10**9, 4, 100,
                            record_bytes=RECORD_BYTES[3])
    old = json.loads(conf.to_json())
    del old["layer_groups"]
    conf = Collections(r).ensure_conf(pair, PairConf.from_json(json.dumps(old)))
    assert conf.groups == (tuple(range(L)),)
    rng = np.random.default_rng(12)
    keys = [rng.integers(0, 30, size=80) for _ in range(2)]
    windows = [points_window(rng, k) for k in keys]
    for _, tok, lay in windows:
        checkpoint(r, pair, conf, tok, lay, held_jobs(r, pair, 1))
    tags = {k.decode().split("}")[0] + "}" for k in r.keys("eg:{before:m:0:s*")}
    assert tags == {f"eg:{{before:m:0:s{s}}}" for s in range(conf.shards)}
    rec = [v for s in range(conf.shards) for v in r.hvals(pair.parts(0).shard(s).rec)]
    assert {len(v) for v in rec} == {8 * (1 + L + L * D)}
    assert_matches(r, pair, reference(np.concatenate(keys), np.concatenate([w[0] for w in windows])))


def test_layer_groups_follow_the_record_bytes():
    """Groups are contiguous, balanced, cover every layer once and stay within the byte
    target: MiniLM and MPNet shapes stay one group at the default, a 33 x 4096 one does not."""
    from embgeom.settings import Settings
    from embgeom.store.conf import layer_bytes, layer_groups_for
    target = Settings().record_bytes
    for L_, d_, selfsim, groups in ((7, 384, True, 1), (13, 768, True, 1), (33, 4096, True, None),
                                    (5, 2048, False, 1), (33, 4096, False, None)):
        got = layer_groups_for(L_, d_, selfsim, target)
        assert [p for g in got for p in g] == list(range(L_))
        sizes = [len(g) for g in got]
        assert max(sizes) - min(sizes) <= 1
        assert 16 + max(sizes) * layer_bytes(d_, selfsim) <= target or max(sizes) == 1
        if groups is not None:
            assert len(got) == groups, (L_, d_, got)
        else:
            assert len(got) > 1
            # the fewest groups: one fewer would not fit
            assert 16 + -(-L_ // (len(got) - 1)) * layer_bytes(d_, selfsim) > target


def test_a_token_half_applied_across_groups_reads_each_layer_at_its_own_count(r):
    """A worker dies after writing one (shard, group) part of a checkpoint: that group's
    layers of the shard's tokens hold both windows, their other layers the first only.
    Each layer's V (m2 / n) is read at that layer's own count, against the raw points."""
    pair = K.PairKeys("half", "m")
    conf = make_conf(r, pair, groups=3)
    rng = np.random.default_rng(13)
    keys0, keys1 = rng.integers(0, 30, size=120), rng.integers(0, 30, size=120)
    x0, tok0, lay0 = points_window(rng, keys0)
    x1, tok1, lay1 = points_window(rng, keys1)
    checkpoint(r, pair, conf, tok0, lay0, held_jobs(r, pair, 1))
    jobs = held_jobs(r, pair, 1)
    dying = Checkpointer(r, "dying")
    dying.shards = ShardWriter(r, "dying")
    dying.shards.pieces = CrashingPieces(r, after=1)
    dying.shards.group_bytes = 1  # one part per round
    cp = new_checkpoint_id()
    dying.seal(pair, 0, cp, jobs, pair.jobs, 3)
    with pytest.raises(Crash):
        dying.apply_and_complete(pair, conf, cp, WindowMoments(tok1, lay1), jobs, 3)
    ((s_done, g_done),) = [(s, g) for s, g, keys in pair.parts(0).shard_parts(conf)
                           if r.hexists(keys.applied, cp)]
    state = run_sync(r, Reader().pair_state(pair))
    scal = run_sync(r, Reader().scalars(state))
    first, both = reference(keys0, x0), reference(np.r_[keys0, keys1], np.r_[x0, x1])
    in_part = shard_of(scal.ids, conf.shards) == s_done
    assert in_part.any() and not in_part.all()
    for p in range(L):
        g, _ = conf.group_of(p)
        _, V, _ = scal.at(p)
        for j, key in enumerate(scal.ids):
            ref = both if (in_part[j] and g == g_done) else first
            if key not in ref["ids"]:
                continue
            i = int(np.searchsorted(ref["ids"], key))
            # a token new in the half-applied checkpoint is counted by group 0 only
            if not (ref is first and key not in first["ids"]):
                assert V[j] == pytest.approx(ref["m2"][i, p] / ref["n"][i], rel=1e-9), (p, key)
