"""The reader reads only the layers a request uses, and its caches stay bounded and safe
when the event loop and the thread pool share it.

Records are written through the real store writer (checkpoints of synthetic windows) to a
real redis-server; bytes moved are Redis's own count (``INFO stats``
``total_net_output_bytes``), and values are compared with float64 references computed from
the raw points.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time

import numpy as np
import pytest

from embgeom import exports, reports
from embgeom.store import keys as K
from embgeom.store.collections import Collections
from embgeom.store.conf import CollectionSettings, PairConf
from embgeom.store.connection import async_redis_client, redis_client
from embgeom.store.pair_state import BoundedCache
from embgeom.store.reader import Reader, run_async, run_sync
from tests.test_store import checkpoint, held_jobs, points_window

L, D = 12, 64  # a record of every layer is L times the one layer a request uses


@pytest.fixture
def r(redis_server):
    client = redis_client(redis_server.url)
    yield client
    client.close()


class VocabTokenizer:
    """What a token page asks of a tokenizer: a string per vocabulary id."""

    @staticmethod
    def convert_ids_to_tokens(ids):
        return [f"t{i}" for i in ids]


def stored_pair(r, name="page", types=300, points=1500, seed=0, unit_norms=True):
    """A pair with ``types`` token types written by one checkpoint: (pair, keys, x).
    ``unit_norms=False``: a generation resolved before scal records carried ||U||^2 (its
    stored configuration lacks the flag)."""
    pair = K.PairKeys(name, "m")
    conf = PairConf.resolve(CollectionSettings(), 0, L, D, 10**6, 4, 4096)
    if not unit_norms:
        old = json.loads(conf.to_json())
        del old["scal_unit_norms"]
        conf = PairConf.from_json(json.dumps(old))
    conf = Collections(r).ensure_conf(pair, conf)
    rng = np.random.default_rng(seed)
    keys = np.r_[np.arange(types), rng.integers(0, types, size=points - types)]
    x, tok, lay = points_window(rng, keys, shape=(L, D))
    checkpoint(r, pair, conf, tok, lay, held_jobs(r, pair, 1), piece_tokens=64)
    r.sadd(K.PAIRS, pair.pair)
    return pair, keys, x


def output_bytes(r) -> int:
    return int(r.info("stats")["total_net_output_bytes"])


def assert_page_matches(page, keys, x, layer):
    """Every row of a token page against float64 references from the raw points of the
    asked layer."""
    xl = x[:, layer]
    for row in page["tokens"]:
        pts = xl[keys == row["token_id"]]
        n = len(pts)
        mean = pts.mean(0)
        M, V = float(mean @ mean), float(((pts - mean) ** 2).sum() / n)
        scale = float((pts ** 2).sum(1).mean())  # the size of Q: values of this order
        assert row["n"] == n
        assert row["M"] == pytest.approx(M, abs=1e-12 * scale)
        assert row["V"] == pytest.approx(V, abs=1e-12 * scale)
        assert row["Q"] == pytest.approx(M + V, abs=1e-12 * scale)
        if n < 2:
            assert row["self_similarity"] is None
            continue
        u = pts / np.linalg.norm(pts, axis=1, keepdims=True)
        cos = u @ u.T
        expected = (cos.sum() - np.trace(cos)) / (n * (n - 1))  # mean over distinct pairs
        # cosines are <= 1: sums of n^2 of them in float64 agree to ~n^2 * 1e-16
        assert row["self_similarity"] == pytest.approx(expected, abs=1e-12)


def test_a_token_page_reads_only_its_layer(r, redis_server):
    redis_url = redis_server.url
    pair, keys, x = stored_pair(r)
    rd = Reader()
    run_sync(r, rd.pair_state(pair))  # the pair's configuration cached, as on a served API
    layer, k = 7, 300
    before = output_bytes(r)
    page = run_sync(r, reports.token_page(rd, pair, layer, VocabTokenizer(), limit=k))
    moved = output_bytes(r) - before
    assert len(page["tokens"]) == k
    # What a page must move: the asked layer's unit sums (k x D float64) and every type's
    # scalars (k x (1 + 2L)); a quarter more for the protocol, 16 kB for the small replies.
    # Reading whole unit records would move k x L x D x 8 = 1.8 MB.
    bound = 1.25 * 8 * k * (D + 1 + 2 * L) + 16_384
    assert moved < bound, (moved, bound)
    assert bound < 8 * k * L * D / 4

    # The API's driver (redis.asyncio) reads the same page.
    async def served():
        client = async_redis_client(redis_url)
        try:
            return await run_async(client, reports.token_page(rd, pair, layer, VocabTokenizer(), limit=k))
        finally:
            await client.aclose()

    assert asyncio.run(served())["tokens"] == page["tokens"]

    assert_page_matches(page, keys, x, layer)


def script_calls(r) -> int:
    """Scripts Redis ran so far (EVAL and EVALSHA): a sliced read of records is one."""
    stats = r.info("commandstats")
    return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("eval", "evalsha"))


def test_a_token_page_reads_no_unit_record(r):
    """Self-similarity needs only n and ||U_{t,l}||^2, kept in the scalar record: a page
    moves a few floats per token, whatever L and d, and no record is cut inside Redis."""
    pair, keys, x = stored_pair(r, "norms")
    rd = Reader()
    state = run_sync(r, rd.pair_state(pair))
    assert state.conf.stores_unit_norms
    layer, k = 5, 300
    before, scripts = output_bytes(r), script_calls(r)
    page = run_sync(r, reports.token_page(rd, pair, layer, VocabTokenizer(), limit=k))
    moved = output_bytes(r) - before
    assert len(page["tokens"]) == k
    # Every type's scalars, k x (1 + 3L) float64; a quarter more for the protocol, 16 kB
    # for the small replies. No term in d: one layer's unit sums alone are k x d x 8 bytes.
    bound = 1.25 * 8 * k * (1 + 3 * L) + 16_384
    assert moved < bound, (moved, bound)
    assert bound < 8 * k * (D + 1 + 2 * L)  # what the page moved reading unit slices
    assert script_calls(r) == scripts  # no unit record copied inside Redis
    assert_page_matches(page, keys, x, layer)
    # One token's detail reads its scalars only, and agrees with its row.
    row = page["tokens"][0]
    before = output_bytes(r)
    detail = run_sync(r, reports.token_detail(rd, pair, layer, row["token_id"], VocabTokenizer()))
    assert output_bytes(r) - before < 8 * L * D  # less than one unit record of every layer
    assert detail["self_similarity"] == row["self_similarity"]
    # An export of the layer: its self-similarity column from the scalars too.
    scripts = script_calls(r)
    ex = run_sync(r, exports.prepare(rd, pair, layer, reports.CountFilter(), False, VocabTokenizer()))
    got = [v for chunk in exports.chunks(ex, lambda plan: run_sync(r, plan), rows=64)
           for v in chunk["self_similarity"]]
    assert script_calls(r) == scripts
    by_id = {t["token_id"]: t["self_similarity"] for t in page["tokens"]}
    assert got == [by_id[int(i)] for i in ex.ids]


def test_an_older_generation_without_unit_norms_answers_the_same(r):
    """Scal records written before they carried ||U||^2 (1 + 2L floats; the generation's
    configuration lacks the flag) are read as they are, and self-similarity comes from the
    layer's unit slices: the same page, the same values."""
    old_pair, keys, x = stored_pair(r, "old", unit_norms=False)
    new_pair, _, _ = stored_pair(r, "new")  # the same points (same seed)
    rd = Reader()
    state = run_sync(r, rd.pair_state(old_pair))
    assert not state.conf.scal_unit_norms and not state.conf.stores_unit_norms
    shard = old_pair.parts(0).shard(0).scal
    field, raw = next(iter(r.hgetall(shard).items()))
    assert len(raw) == 8 * (1 + 2 * L)
    assert len(r.hget(new_pair.parts(0).shard(0).scal, field)) == 8 * (1 + 3 * L)
    scal = run_sync(r, rd.scalars(state))
    assert scal.unit_norms is None
    layer, k = 7, 300
    old = run_sync(r, reports.token_page(rd, old_pair, layer, VocabTokenizer(), limit=k))
    new = run_sync(r, reports.token_page(rd, new_pair, layer, VocabTokenizer(), limit=k))
    assert_page_matches(old, keys, x, layer)
    assert [t["token_id"] for t in old["tokens"]] == [t["token_id"] for t in new["tokens"]]
    for a, b in zip(old["tokens"], new["tokens"]):
        assert (a["n"], a["Q"], a["M"], a["V"]) == (b["n"], b["Q"], b["M"], b["V"])
        if b["self_similarity"] is None:
            assert a["self_similarity"] is None
        else:  # ||U||^2 summed in another order: n^2 cosines <= 1, ~n^2 * 1e-16 apart
            assert a["self_similarity"] == pytest.approx(b["self_similarity"], abs=1e-12)
    row = old["tokens"][0]
    detail = run_sync(r, reports.token_detail(rd, old_pair, layer, row["token_id"], VocabTokenizer()))
    assert detail["self_similarity"] == pytest.approx(row["self_similarity"], abs=1e-12)
    ex = run_sync(r, exports.prepare(rd, old_pair, layer, reports.CountFilter(), False, VocabTokenizer()))
    got = [v for chunk in exports.chunks(ex, lambda plan: run_sync(r, plan), rows=64)
           for v in chunk["self_similarity"]]
    by_id = {t["token_id"]: t["self_similarity"] for t in old["tokens"]}
    assert got == [by_id[int(i)] for i in ex.ids]


def test_reads_of_some_layers_equal_the_reference_and_move_only_those_layers(r):
    pair, keys, x = stored_pair(r, "some", types=120, points=700, seed=1)
    rd = Reader()
    state = run_sync(r, rd.pair_state(pair))
    ids = np.unique(keys)
    n_ref = np.array([(keys == i).sum() for i in ids])
    mean_ref = np.stack([x[keys == i].mean(0) for i in ids])                      # (k, L, D)
    m2_ref = np.stack([((x[keys == i] - mean_ref[j]) ** 2).sum((0, 2)) for j, i in enumerate(ids)])
    q = float(np.max((x ** 2).sum(2)))  # the largest squared norm: scale of means, m2 / n
    for positions in ([0], [L - 1], [3, 4, 9]):
        # A scan of every record.
        before = output_bytes(r)
        got_ids, n, m2, mean = run_sync(r, rd.means(state, positions))
        moved = output_bytes(r) - before
        np.testing.assert_array_equal(got_ids, ids)
        np.testing.assert_array_equal(n, n_ref)
        np.testing.assert_allclose(mean, mean_ref[:, positions], rtol=0, atol=1e-13 * np.sqrt(q))
        np.testing.assert_allclose(m2, m2_ref[:, positions], rtol=0, atol=1e-12 * n_ref.max() * q)
        wanted = 8 * len(ids) * (1 + len(positions) * (D + 1))
        assert moved < 1.25 * wanted + 16_384, (moved, wanted)
        # Some keys, one never seen.
        asked = np.r_[ids[::7], 10**6 - 1]
        n, m2, mean = run_sync(r, rd.means_of(state, asked, positions, step_bytes=4096))
        np.testing.assert_array_equal(n, np.r_[n_ref[::7], 0])
        np.testing.assert_allclose(mean[:-1], mean_ref[::7][:, positions], rtol=0, atol=1e-13 * np.sqrt(q))
        np.testing.assert_array_equal(mean[-1], 0.0)
        np.testing.assert_allclose(m2[:-1], m2_ref[::7][:, positions], rtol=0,
                                   atol=1e-12 * n_ref.max() * q)
        # Bucket sums at those layers are the same numbers as at every layer.
        every = run_sync(r, rd.buckets(state, range(8)))
        some = run_sync(r, rd.buckets(state, range(8), positions))
        assert (some["types"], some["count"]) == (every["types"], every["count"]) == (len(ids), len(keys))
        np.testing.assert_array_equal(some["vector"], every["vector"][positions])
    # Unit sums of one layer: a never seen key is None.
    asked = [int(ids[5]), 10**6 - 1, int(ids[0])]
    units = run_sync(r, rd.units(state, asked, 2))
    assert units[1] is None
    for key, got in ((asked[0], units[0]), (asked[2], units[2])):
        pts = x[keys == key, 2]
        np.testing.assert_allclose(got, (pts / np.linalg.norm(pts, axis=1, keepdims=True)).sum(0),
                                   rtol=0, atol=1e-12 * len(pts))


def test_reader_caches_are_bounded_across_deletes(r):
    """Every DELETE makes a generation; the reader keeps one per pair, and a bounded number
    of pairs."""
    collections = Collections(r)
    rd = Reader()
    pair = K.PairKeys("cycled", "m")
    for gen in range(30):
        collections.ensure_conf(pair, PairConf.resolve(CollectionSettings(), gen, L, D, 10**6, 4, 4096))
        r.sadd(K.PAIRS, pair.pair)
        state = run_sync(r, rd.pair_state(pair))
        assert state.gen == gen and state.conf.gen == gen
        run_sync(r, rd.scalars(state))
        collections.delete_pair(pair)
    assert len(rd.states._confs) == 1
    assert len(rd._scalars) == 1

    rd = Reader(scalar_cache_entries=2, conf_cache_entries=3)
    for i in range(10):
        other = K.PairKeys(f"many{i}", "m")
        collections.ensure_conf(other, PairConf.resolve(CollectionSettings(), 0, L, D, 10**6, 4, 4096))
        r.sadd(K.PAIRS, other.pair)
        run_sync(r, rd.scalars(run_sync(r, rd.pair_state(other))))
    assert len(rd.states._confs) == 3 and len(rd._scalars) == 2


class Replay:
    """Replies recorded from a real Redis, answered again without I/O: threads then spend
    their time in the reader's own code, where its caches are shared."""

    def __init__(self, client):
        self.client = client
        self.replies: dict = {}

    @staticmethod
    def _key(command):
        return repr(command)

    def record(self, plan):
        try:
            commands = next(plan)
            while True:
                replies = []
                for command in commands:
                    name, *args = command
                    reply = getattr(self.client, name)(*args)
                    self.replies[self._key(command)] = reply
                    replies.append(reply)
                commands = plan.send(replies)
        except StopIteration as stop:
            return stop.value

    def run(self, plan):
        try:
            commands = next(plan)
            while True:
                commands = plan.send([self.replies[self._key(c)] for c in commands])
        except StopIteration as stop:
            return stop.value


class YieldingStr(str):
    """A pair name whose hashing lets other threads run, as any Python-level work between a
    cache's lookup and its update may: a race in a shared cache then shows within a second
    instead of once in millions of reads."""

    def __hash__(self):
        time.sleep(0)
        return str.__hash__(self)


def test_reader_cache_eviction_is_safe_under_threads(r):
    """Threads sharing one reader with tiny caches over several pairs: every read answers
    (the eviction of a shared cache never raises) and with the values of its own pair."""
    pairs = [stored_pair(r, f"p{i}", types=20, points=60, seed=i)[0] for i in range(4)]
    for pair in pairs:
        pair.pair = YieldingStr(pair.pair)
    replay = Replay(r)
    expected = {}
    for pair in pairs:
        rd = Reader()
        state = replay.record(rd.pair_state(pair))
        expected[pair.pair] = replay.record(rd.scalars(state)).n.sum()
        replay.record(Reader().pair_state(pair))  # the state read of a first (uncached) read

    shared = Reader(scalar_cache_entries=1)
    errors = []

    def hammer(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(300):
                pair = pairs[rng.integers(len(pairs))]
                state = replay.run(shared.pair_state(pair))
                assert replay.run(shared.scalars(state)).n.sum() == expected[pair.pair]
        except Exception as exc:  # noqa: BLE001 - any failure of a thread is the finding
            errors.append(repr(exc))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show up
    try:
        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert len(shared._scalars) <= 1 and len(shared.states._confs) <= len(pairs)


def test_bounded_cache_is_least_recently_used():
    cache = BoundedCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "a" used last: "b" goes first
    cache.put("c", 3)
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (1, None, 3)
    cache.discard("b")  # absent: no error
    cache.discard("a")
    assert len(cache) == 1 and cache.get("a", "none") == "none"


class Recording:
    """A client whose pipelines record every command a plan sends (then run it)."""

    def __init__(self, client):
        self.client, self.commands = client, []

    def pipeline(self, transaction=False):
        pipe, commands = self.client.pipeline(transaction=transaction), self.commands

        class Pipe:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                pipe.reset()

            def __getattr__(self, name):
                def call(*args):
                    commands.append((name, *args))
                    return getattr(pipe, name)(*args)
                return call

            def execute(self):
                return pipe.execute()
        return Pipe()


def value_bytes_touched(r, commands) -> dict:
    """Stored bytes of the hash values each recorded script read inside Redis, by key:
    the named fields of a sliced read (SLICES), every field of a scanned hash (SCAN_SLICES,
    each value visited once however many pages)."""
    from embgeom.store.scripts import SCAN_SLICES, SLICES
    out: dict = {}
    for name, *args in commands:
        if name != "execute_command" or args[0] != "EVAL":
            continue
        source, key, rest = args[1], args[3], args[4:]
        if source == SLICES.source:
            fields = rest[1 + 2 * int(rest[0]):]
            out[key] = out.get(key, 0) + sum(r.hstrlen(key, f) for f in fields)
        elif source == SCAN_SLICES.source:
            out[key] = sum(r.hstrlen(key, f) for f in r.hkeys(key))
    return out


def test_a_read_of_one_layer_touches_only_its_group(r):
    """With records cut into layer groups (here 4 groups of 3 layers), a read of one
    layer's means (a scan, and the records of some keys) reads inside Redis only that
    group's records, ~ d values a token per layer of the group instead of L d; the values
    are those of the one-group layout and of the raw points, and a token page is too."""
    one, keys, x = stored_pair(r, "onegroup", types=200, points=900, seed=3)
    pair = K.PairKeys("fourgroups", "m")
    per_layer = 8 * (2 * D + 4)  # rec, unit and scal bytes of one layer (self-similarity)
    conf = PairConf.resolve(CollectionSettings(), 0, L, D, 10**6, 4, 4096,
                            record_bytes=16 + 3 * per_layer)
    assert conf.groups == ((0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10, 11))
    conf = Collections(r).ensure_conf(pair, conf)
    rng = np.random.default_rng(3)
    keys2 = np.r_[np.arange(200), rng.integers(0, 200, size=700)]
    _, tok, lay = points_window(rng, keys2, shape=(L, D))
    np.testing.assert_array_equal(keys2, keys)  # the same points as the one-group pair
    checkpoint(r, pair, conf, tok, lay, held_jobs(r, pair, 1), piece_tokens=64)
    r.sadd(K.PAIRS, pair.pair)
    layer, k = 7, 200
    rd = Reader()
    got, touched = {}, {}
    for p in (one, pair):
        state = run_sync(r, rd.pair_state(p))
        rec = Recording(r)
        scan = run_sync(rec, rd.means(state, [layer]))
        some = run_sync(rec, rd.means_of(state, np.arange(0, k, 3), [layer]))
        got[p.pair], touched[p.pair] = (scan, some), value_bytes_touched(r, rec.commands)
    for a, b in zip(got[one.pair], got[pair.pair]):
        for u, v in zip(a, b):
            np.testing.assert_array_equal(u, v)
    ids, n, m2, mean = got[pair.pair][0]
    want = np.stack([x[keys == i, layer].mean(0) for i in ids])
    np.testing.assert_allclose(mean[:, 0], want, rtol=0, atol=1e-12 * np.abs(x).max())
    # Only group 2's rec hashes (tag ...:s<s>l2}), and their values are 3 layers wide.
    assert all(":s" in key and key.split(":s")[1].split("}")[0].endswith("l2")
               for key in touched[pair.pair]), touched[pair.pair]
    grouped, whole = sum(touched[pair.pair].values()), sum(touched[one.pair].values())
    reads = k + len(range(0, k, 3))  # records visited: the scan's and the point reads'
    assert grouped == reads * 8 * (1 + 3 * (1 + D))
    assert whole == reads * 8 * (1 + L * (1 + D))  # every layer's record: 4x as many bytes
    # A token page of the grouped pair (scalars joined across groups) is the reference.
    page = run_sync(r, reports.token_page(rd, pair, layer, VocabTokenizer(), limit=k))
    assert_page_matches(page, keys, x, layer)
    assert page["tokens"] == run_sync(r, reports.token_page(rd, one, layer, VocabTokenizer(), limit=k))["tokens"]
