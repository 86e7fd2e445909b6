"""A checkpoint that cannot finish ends: bounded tries, a dead letter with a reason, and a
retry that completes it exactly -- against a real Redis.

Store level (synthetic windows, numpy yardstick of :mod:`tests.test_store`): a shard key
of the wrong type makes every apply of one checkpoint fail the same way. Each run gives it
up (``CheckpointRefused``, not the retried ``StoreUnavailable``), the second is its last
try: it is dead-lettered (out of ``inflight``, its jobs failed with a reason that says how
much of it was applied). Once the key is fixed, ``retry_dead`` queues its jobs again; the
adopter applies only the missing pieces and every count and moment equals the two-pass
reference: nothing is lost or counted twice.

Worker level (MiniLM, an in-process worker): the same fault used to wedge the worker (its
applier retried forever while the heartbeat renewed the lease). Now the job fails with
the reason within seconds, ``applying`` is back to 0, ``/metrics`` counts it, and the
worker serves the next pair's job with exact counts.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import numpy as np
import pytest
import redis
from fastapi.testclient import TestClient

from embgeom.errors import CheckpointRefused, EmbgeomError, StoreUnavailable
from embgeom.stats import WindowMoments
from embgeom.store import keys as K
from embgeom.store.checkpoints import Checkpointer, Held, checkpoint_health, new_checkpoint_id
from embgeom.store.conf import shard_of
from embgeom.store.delivery import WorkerQueue
from embgeom.store.piece_writes import refusal
from embgeom.store.shards import pieces_of
from tests.conftest import WorkerThread, test_settings
from tests.test_store import assert_matches, held_jobs, make_conf, points_window, reference


@pytest.fixture
def r(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def test_error_replies_are_classified():
    """Transient replies are retried (StoreUnavailable); a refusal a retry meets again is
    not (CheckpointRefused), also when redis-py prefixes it with a pipeline's command."""
    wrong = redis.ResponseError("Command # 3 (EVAL local x ...) of pipeline caused error: "
                                "WRONGTYPE Operation against a key holding the wrong kind of value")
    assert isinstance(refusal(wrong), CheckpointRefused)
    assert isinstance(refusal(redis.exceptions.OutOfMemoryError(
        "command not allowed when used memory > 'maxmemory'.")), CheckpointRefused)
    assert isinstance(refusal(redis.ResponseError("ERR Error running script (call to f_1): "
                                                  "@user_script:3: bad")), CheckpointRefused)
    for transient in (redis.ResponseError("BUSY Redis is busy running a script."),
                      redis.exceptions.ReadOnlyError("You can't write against a read only replica."),
                      redis.ResponseError("Command # 1 (SET a) of pipeline caused error: "
                                          "TRYAGAIN Multiple keys request during rehashing of slot")):
        assert isinstance(refusal(transient), StoreUnavailable), transient


def a_window(r, name: str, seed: int, size: int):
    """A pair, its conf, a random window (raw keys, points, moments) and 2 held jobs."""
    pair = K.PairKeys(name, "m")
    conf = make_conf(r, pair)
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 40, size=size)
    x, tok, lay = points_window(rng, keys)
    return pair, conf, keys, x, WindowMoments(tok, lay), held_jobs(r, pair, 2)


def held_of(record: dict) -> list[Held]:
    """The jobs of an adopted checkpoint, as its adopter holds them (new epochs)."""
    return [Held(j, e, ep, 7) for j, e, ep in zip(record["jobs"], record["entries"], record["epochs"])]


def test_refused_checkpoint_is_dead_lettered_then_retried_exactly(r):
    pair, conf, keys, x, window, jobs = a_window(r, "dl", 5, 200)
    tok = window.tokens
    shards = shard_of(tok.ids, conf.shards)
    bad = int(shards[0])
    assert len(set(shards.tolist())) == conf.shards  # the other shards are applied
    planted = pair.parts(0).shard(bad).scal
    r.set(planted, "not a hash")

    owner = Checkpointer(r, "owner", lease_ms=60_000)
    cp = new_checkpoint_id()
    assert owner.seal(pair, 0, cp, jobs, pair.jobs, 3).status == "sealed"
    with pytest.raises(CheckpointRefused, match="wrong type"):
        owner.apply_and_complete(pair, conf, cp, window, jobs, 3)
    # First try given up: recorded, lease released (the owner is alive, yet it can be
    # adopted at once), still in flight.
    assert owner.give_up(pair, conf, cp, "refused", max_tries=2) == "abandoned"
    assert r.zcard(pair.inflight) == 1
    adopter = Checkpointer(r, "adopter")
    record = adopter.adopt(pair, cp, max_tries=2)
    assert record is not None and record["status"] == "adopted"
    with pytest.raises(CheckpointRefused):
        adopter.apply_and_complete(pair, conf, cp, window, held_of(record), 3)
    assert adopter.give_up(pair, conf, cp, "refused again", max_tries=2) == "dead"

    # Visible and ended: out of flight (readers' applying is 0), in the dead letters; the
    # jobs failed with the reason and what was applied; their entries acknowledged.
    assert r.zcard(pair.inflight) == 0 and r.zrange(pair.deadletter, 0, -1) == [cp.encode()]
    good_pieces = [pc for pc in pieces_of(tok.ids, conf, 3) if pc[0] != bad]
    assert adopter.applied(pair, conf, cp) == (len(good_pieces), conf.shards - 1, 0)
    q = WorkerQueue(r)
    for j in jobs:
        st = q.status(j.job_id)
        assert st["status"] == "failed", st
        assert "given up after 2 tries: refused again" in st["error"], st
        assert f"{len(good_pieces)} token pieces in {conf.shards - 1} shards" in st["error"], st
    assert r.xlen(pair.jobs) == 0 and r.xpending(pair.jobs, K.GROUP)["pending"] == 0
    assert [d["cp"] for d in adopter.dead_letters(pair)] == [cp]
    # A late writer of a dead-lettered checkpoint completes nothing; a delivery adopts nothing.
    assert owner.complete(pair, conf, cp, jobs, [])[0] == "already"
    assert Checkpointer(r, "late").adopt(pair, cp, max_tries=2) is None
    health = checkpoint_health(r)
    assert health["counters"] == {"abandoned": 2, "dead_lettered": 1, "adopted": 1}
    assert health["pairs"]["dl:m"] == {"in_flight": 0, "dead": 1, "oldest_sealed_ms": None}

    # The cause fixed, the dead letter is retried: its jobs come back, their delivery
    # adopts it, only the missing shard is applied, and everything is counted once.
    r.delete(planted)
    assert adopter.retry_dead(pair, cp) == "queued"
    assert r.zcard(pair.inflight) == 1 and r.zcard(pair.deadletter) == 0
    d = q.take("w2", [pair.model], 60, block_ms=0, only=pair.jobs)
    assert d is not None and d.checkpoint == cp
    record = Checkpointer(r, "w2").adopt(pair, cp, max_tries=2)
    assert record["status"] == "adopted" and record["entries"] != [j.entry_id for j in jobs]
    out = Checkpointer(r, "w2").apply_and_complete(pair, conf, cp, window, held_of(record), 3)
    assert out.status == "completed"
    assert out.shards.pieces_skipped == len(good_pieces)
    assert out.shards.pieces == len(pieces_of(tok.ids, conf, 3)) - len(good_pieces)
    assert_matches(r, pair, reference(keys, x))
    for j in jobs:
        assert q.status(j.job_id)["status"] == "done"
    q.ack_many(pair.jobs, record["entries"])
    assert r.xlen(pair.jobs) == 0


def test_a_piece_refused_half_way_writes_nothing_so_the_next_try_merges_it_once(r):
    """A shard whose ``scal`` key holds the wrong type used to fail inside the piece's
    script after its records were merged and before its applied-marker was set: the next
    try read the merged records and merged the piece again (its tokens counted twice)."""
    pair, conf, keys, x, window, jobs = a_window(r, "half", 7, 200)
    planted = pair.parts(0).shard(int(shard_of(window.tokens.ids, conf.shards)[0])).scal
    r.set(planted, "not a hash")
    owner = Checkpointer(r, "owner", lease_ms=1)
    cp = new_checkpoint_id()
    assert owner.seal(pair, 0, cp, jobs, pair.jobs, 3).status == "sealed"
    with pytest.raises(EmbgeomError):
        owner.apply_and_complete(pair, conf, cp, window, jobs, 3)
    r.delete(planted)  # the cause removed; the next try (an adopter) finishes it
    time.sleep(0.01)
    adopter = Checkpointer(r, "adopter")
    record = adopter.adopt(pair, cp)
    assert adopter.apply_and_complete(pair, conf, cp, window, held_of(record), 3).status == "completed"
    assert_matches(r, pair, reference(keys, x))


def test_exhausted_checkpoint_of_a_dead_owner_is_dead_lettered_on_adoption(r):
    """Owners that die (SIGKILL) without giving up count tries too: the adoption past the
    limit dead-letters instead of trying forever. Nothing applied: nothing counted."""
    pair = K.PairKeys("sigkills", "m")
    conf = make_conf(r, pair)
    jobs = held_jobs(r, pair, 1)
    cp = new_checkpoint_id()
    assert Checkpointer(r, "dies", lease_ms=1).seal(pair, 0, cp, jobs, pair.jobs, 3).status == "sealed"
    time.sleep(0.01)
    assert Checkpointer(r, "dies-too", lease_ms=1).adopt(pair, cp, max_tries=2)["status"] == "adopted"
    time.sleep(0.01)
    record = Checkpointer(r, "third").adopt(pair, cp, max_tries=2)
    assert record["status"] == "exhausted" and record["tries"] == 2
    assert Checkpointer(r, "third").dead_letter(pair, conf, cp, "its workers stopped while applying it")
    st = WorkerQueue(r).status(jobs[0].job_id)
    assert st["status"] == "failed" and "None of it was applied" in st["error"], st
    assert r.zcard(pair.inflight) == 0


def test_runs_that_make_progress_are_not_failed_tries(r):
    """Tries count runs without progress. Each run here applies some pieces, then its
    worker stops (killed, or too slow on a loaded host to renew its lease): the third run
    used to find the checkpoint exhausted and dead-letter it, its jobs failed while the
    pieces applied stayed counted (the 20-minute soak counted 2,062 tokens of two failed
    jobs). Now every adoption after progress is a new budget, and the third run completes
    it exactly. A run that applies nothing still spends a try
    (test_exhausted_checkpoint_of_a_dead_owner_is_dead_lettered_on_adoption)."""
    pair, conf, keys, x, window, jobs = a_window(r, "progress", 9, 200)
    shards = sorted(set(shard_of(window.tokens.ids, conf.shards).tolist()))
    planted = [pair.parts(0).shard(s).scal for s in shards[:2]]
    for key in planted:
        r.set(key, "not a hash")
    cp = new_checkpoint_id()
    owner = Checkpointer(r, "owner", lease_ms=1)
    assert owner.seal(pair, 0, cp, jobs, pair.jobs, 3).status == "sealed"
    with pytest.raises(EmbgeomError):
        owner.apply_and_complete(pair, conf, cp, window, jobs, 3)  # all but two shards
    first = owner.applied(pair, conf, cp)[0]
    assert first > 0
    r.delete(planted[0])
    time.sleep(0.01)
    second = Checkpointer(r, "second", lease_ms=1)
    record = second.adopt(pair, cp, max_tries=2)
    assert record["status"] == "adopted"
    with pytest.raises(EmbgeomError):
        second.apply_and_complete(pair, conf, cp, window, held_of(record), 3)  # one shard more
    assert second.applied(pair, conf, cp)[0] > first
    r.delete(planted[1])
    time.sleep(0.01)
    third = Checkpointer(r, "third")
    record = third.adopt(pair, cp, max_tries=2)
    assert record["status"] == "adopted", record
    assert third.apply_and_complete(pair, conf, cp, window, held_of(record), 3).status == "completed"
    assert_matches(r, pair, reference(keys, x))
    assert r.zcard(pair.deadletter) == 0
    for j in jobs:
        assert WorkerQueue(r).status(j.job_id)["status"] == "done"


def test_out_of_memory_gives_up_then_an_adopter_completes_exactly(r):
    """Redis out of memory (maxmemory, noeviction) refuses every write: the owner gives up
    at once (no blind retry), cannot even record it (its lease runs out by itself);
    once memory is back, the adopter completes it, every count exact."""
    pair, conf, keys, x, window, jobs = a_window(r, "oom", 6, 150)
    owner = Checkpointer(r, "owner", lease_ms=300)
    cp = new_checkpoint_id()
    assert owner.seal(pair, 0, cp, jobs, pair.jobs, 3).status == "sealed"
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", 1)
    try:
        with pytest.raises(CheckpointRefused, match="maxmemory"):
            owner.apply_and_complete(pair, conf, cp, window, jobs, 3)
        with pytest.raises(redis.ResponseError):
            owner.give_up(pair, conf, cp, "out of memory", max_tries=3)
    finally:
        r.config_set("maxmemory", 0)
    assert owner.applied(pair, conf, cp) == (0, 0, 0)
    time.sleep(0.4)  # the owner's lease runs out (nothing renews it)
    adopter = Checkpointer(r, "adopter")
    record = adopter.adopt(pair, cp, max_tries=3)
    assert record["status"] == "adopted"
    assert adopter.apply_and_complete(pair, conf, cp, window, held_of(record), 3).status == "completed"
    assert_matches(r, pair, reference(keys, x))


def test_a_sealed_job_delivered_past_its_limit_ends(redis_server, r):
    """Sealed jobs skipped the attempt limit: a job whose checkpoint never completes (its
    owner keeps the lease) came back forever. Past the bound derived from the settings
    the delivery dead-letters the checkpoint: the job ends failed, with the reason."""
    from embgeom.worker import Worker

    pair, conf, keys, x, window, jobs = a_window(r, "owner-alive", 8, 50)
    cp = new_checkpoint_id()
    assert Checkpointer(r, "owner", lease_ms=600_000).seal(pair, 0, cp, jobs, pair.jobs, 3).status == "sealed"
    worker = Worker(redis.Redis.from_url(redis_server.url), test_settings(redis_server.url),
                    worker_id="w")
    d = worker.queue.own_pending("w", [pair.model])  # the job comes back (a redelivery)
    assert d is not None and d.checkpoint == cp
    assert worker.adopt(d) == "duplicate"  # its owner is alive: not adopted, not ended
    assert worker.queue.status(d.job_id)["status"] == "running"
    limit = worker.adoption.sealed_delivery_limit()
    assert worker.adopt(dataclasses.replace(d, attempts=limit + 1)) == "dead"
    st = worker.queue.status(d.job_id)
    assert st["status"] == "failed" and f"delivered {limit + 1} times" in st["error"], st
    assert r.zcard(pair.inflight) == 0 and r.zcard(pair.deadletter) == 1


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(what)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@pytest.mark.slow
def test_worker_does_not_wedge_on_a_checkpoint_redis_refuses(redis_server):
    from service.app import create_app

    settings = test_settings(redis_server.url, shards=4, checkpoint_apply_attempts=2,
                             checkpoint_seconds=0.2)
    rdb = redis.Redis.from_url(redis_server.url)
    bad, good = K.PairKeys("refused", "minilm"), K.PairKeys("fine", "minilm")
    # Every shard of the pair refuses its writes: a script error inside the shard write.
    for s in range(settings.shards):
        rdb.set(bad.parts(0).shard(s).scal, "not a hash")
    texts_bad = ["The wedge would hold this checkpoint forever.", "Its lease renewed by the heartbeat."]
    texts_good = ["Another pair is served meanwhile.", "Counts are exact there.", "Every token once."]
    with TestClient(create_app(settings), raise_server_exceptions=False) as client, \
            WorkerThread(settings) as worker:
        job_bad = client.post("/v1/jobs", json={"collection": "refused", "model": "minilm",
                                                "texts": texts_bad}).json()["job_id"]
        failed = _wait(lambda: (lambda s: s if s["status"] in ("failed", "done") else None)(
            client.get(f"/v1/jobs/{job_bad}").json()), 90, "the refused job never ended")
        assert failed["status"] == "failed", failed
        assert "given up after 2 tries" in failed["error"] and "wrong type" in failed["error"], failed
        assert "None of it was applied" in failed["error"], failed
        assert rdb.zcard(bad.inflight) == 0  # readers' applying is back to 0
        assert rdb.zcard(bad.deadletter) == 1

        job_good = client.post("/v1/jobs", json={"collection": "fine", "model": "minilm",
                                                 "texts": texts_good}).json()["job_id"]
        done = _wait(lambda: (lambda s: s if s["status"] in ("failed", "done") else None)(
            client.get(f"/v1/jobs/{job_good}").json()), 90, "the worker wedged: the next job never ended")
        assert done["status"] == "done", done
        tokenizer = worker.registry.tokenizer("minilm")
        want = Counter()
        for ids in tokenizer(texts_good, add_special_tokens=False)["input_ids"]:
            want.update(ids)
        layers = client.get("/v1/collections/fine/models/minilm/layers").json()["layers"]
        assert {row["n"] for row in layers} == {sum(want.values())}
        assert rdb.zcard(good.inflight) == 0

        text = client.get("/metrics").text
        assert _metric(text, "embgeom_checkpoint_dead_lettered_total") == 1
        assert _metric(text, "embgeom_checkpoint_abandoned_total") == 2
        assert 'embgeom_checkpoints_dead_letter{pair="refused:minilm"} 1.0' in text
        assert 'embgeom_checkpoints_in_flight{pair="refused:minilm"} 0.0' in text
