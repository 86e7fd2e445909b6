"""Faults in the middle of a checkpoint, with real processes: a worker SIGKILLed while it
applies a checkpoint of several jobs across many shards (the next delivery adopts and
finishes it), and Redis SIGKILLed at that moment (restarted from its AOF; the worker
resumes the same checkpoint).

The instant is observed, not guessed: the test polls Redis until the checkpoint is
sealed with several jobs and some, not all, of its shards hold pieces of it, then fires
the signal. Shard writes are cut into pieces of one token each (``EMBGEOM_PIECE_BYTES``)
so that window lasts seconds.

Yardstick: every per-token count equals the tokenizer's own count of the texts, at every
layer, and every per-token Q/M/V equals the one-text-at-a-time float64 reference
(:mod:`embgeom.testing.reference`) within 1e-4 of Q_t (float32 forward noise across batch
compositions is ~1e-5; a token counted twice or missed is an O(1) error).
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
import redis
from transformers import AutoModel

from embgeom.corpora import bbc_texts
from embgeom.sources import minilm_path
from embgeom.store import keys as K
from embgeom.store.server import RedisServer, free_port
from embgeom.testing.reference import raw_hidden_states, token_stats
from tests.test_scale_out import (
    MODEL, api, expected_counts, fleet, post_job, redis_at, stream_state, wait_for_jobs,
    walk_tokens,
)

pytestmark = pytest.mark.slow

TEXTS = [p for p in bbc_texts("paragraphs") if 60 <= len(p) <= 200][3000:3240]
JOBS = [TEXTS[i::6] for i in range(6)]
FAULT_ENV = {
    "EMBGEOM_PIECE_BYTES": "65536",       # one token per piece: a checkpoint lasts seconds
    "EMBGEOM_SHARDS": "64",
    "EMBGEOM_CHECKPOINT_SECONDS": "60",   # one window of all the jobs queued
    "EMBGEOM_TOKEN_BUDGET": "4096",
}
REL = 1e-4


@pytest.fixture(scope="module")
def reference(registry):
    model = AutoModel.from_pretrained(str(minilm_path())).eval()
    raw = raw_hidden_states(model, registry.tokenizer(MODEL), TEXTS)
    return {layer: token_stats(raw.ids, raw.states[layer]) for layer in (0, 3, 6)}


@pytest.fixture(scope="module")
def registry():
    from embgeom.compute.catalogue import ModelRegistry
    from tests.test_scale_out import api_settings

    return ModelRegistry.from_settings(api_settings("redis://unused"))


def mid_checkpoint(rdb: redis.Redis, collection: str, timeout: float = 300) -> dict:
    """Wait until a checkpoint of >= 2 jobs is sealed and partly applied; returns it."""
    pair = K.PairKeys(collection, MODEL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cps = rdb.zrange(pair.inflight, 0, -1)
        for cp in cps:
            cp = cp.decode()
            record = rdb.hget(pair.checkpoint(cp), "record")
            if record is None:
                continue
            rec = json.loads(record)
            conf = json.loads(rdb.get(pair.conf(0)))
            with rdb.pipeline(transaction=False) as p:
                for s in range(conf["shards"]):
                    p.hget(pair.parts(0).shard(s).applied, cp)
                applied = sum(x is not None for x in p.execute())
            if len(rec["jobs"]) >= 2 and 2 <= applied <= conf["shards"] - 8:
                return {"cp": cp, "jobs": rec["jobs"], "shards_applied": applied}
        time.sleep(0.002)
    raise TimeoutError("never saw a multi-job checkpoint mid-way")


def check(client, rdb, collection: str, reference: dict, tokenizer) -> float:
    want: Counter = Counter()
    for texts in JOBS:
        want += expected_counts(tokenizer, texts)
    worst = 0.0
    for layer, ref in reference.items():
        got = walk_tokens(client, collection, layer)
        assert Counter({t: v[0] for t, v in got.items()}) == want, f"layer {layer}: counts"
        for i, t in enumerate(ref["ids"].tolist()):
            n, Q, M, V = got[t][:4]
            scale = ref["Q"][i]
            for x, y in ((Q, ref["Q"][i]), (M, ref["M"][i]), (V, ref["V"][i])):
                worst = max(worst, abs(x - y) / scale)
    assert worst <= REL, worst
    rows = client.get(f"/v1/collections/{collection}/models/{MODEL}/layers").json()["layers"]
    assert {r["n"] for r in rows} == {sum(want.values())}
    assert stream_state(rdb) == (0, 0)
    return worst


def test_worker_sigkill_mid_multi_job_multi_shard_checkpoint(tmp_path, reference, registry):
    with redis_at(tmp_path / "redis") as server, fleet(server.url, tmp_path, FAULT_ENV) as fl, \
            api(server.url) as client:
        rdb = redis.Redis.from_url(server.url)
        victim = fl.start()
        ids = [post_job(client, texts, "killed") for texts in JOBS]
        at = mid_checkpoint(rdb, "killed")
        fl.sigkill(victim)
        print(f"\nSIGKILL during checkpoint {at['cp']}: {len(at['jobs'])} jobs, "
              f"{at['shards_applied']} of 64 shards applied")
        fl.start()  # the replacement adopts the checkpoint once the victim's lease expires
        final = wait_for_jobs(client, ids, timeout=600)
        assert all(s["status"] == "done" for s in final), (final, fl.logs())
        adopted = [s for s in final if s["job_id"] in at["jobs"]]
        assert all(s["worker"] != victim for s in adopted), adopted  # finished by the adopter
        assert "adopting checkpoint " + at["cp"] in fl.logs()
        worst = check(client, rdb, "killed", reference, registry.tokenizer(MODEL))
        print(f"max |error| / Q_t against the one-text-at-a-time reference: {worst:.2e}")


def test_redis_sigkill_mid_checkpoint_resumes(tmp_path, reference, registry):
    data, port = tmp_path / "redis", free_port()
    server = RedisServer(data, port=port).start(timeout=120)
    try:
        with fleet(server.url, tmp_path, FAULT_ENV) as fl, api(server.url) as client:
            rdb = redis.Redis.from_url(server.url)
            fl.start()
            ids = [post_job(client, texts, "crash") for texts in JOBS]
            at = mid_checkpoint(rdb, "crash")
            server.kill()
            time.sleep(1.0)
            server = RedisServer(data, port=port).start(timeout=120)
            print(f"\nRedis SIGKILLed during checkpoint {at['cp']} ({at['shards_applied']} shards "
                  "applied) and restarted from its AOF")
            final = wait_for_jobs(client, ids, timeout=600)
            assert all(s["status"] == "done" for s in final), (final, fl.logs())
            assert fl.alive() == ["w1"]  # the worker rode the outage out
            worst = check(client, redis.Redis.from_url(server.url), "crash", reference,
                          registry.tokenizer(MODEL))
            print(f"max |error| / Q_t against the one-text-at-a-time reference: {worst:.2e}")
    finally:
        server.kill()


def test_redis_down_past_the_retry_deadline_gives_up_then_completes_once(tmp_path, reference, registry):
    """Redis gone for longer than EMBGEOM_CHECKPOINT_APPLY_SECONDS: the owner stops
    retrying (and renewing) instead of holding the checkpoint forever; once Redis is back
    from its AOF the checkpoint is adopted (here by the same worker, reading its own
    entries back) and completed: every count exact, nothing twice."""
    data, port = tmp_path / "redis", free_port()
    server = RedisServer(data, port=port).start(timeout=120)
    env = {**FAULT_ENV, "EMBGEOM_CHECKPOINT_APPLY_SECONDS": "2"}
    try:
        with fleet(server.url, tmp_path, env) as fl, api(server.url) as client:
            rdb = redis.Redis.from_url(server.url)
            fl.start()
            ids = [post_job(client, texts, "outage") for texts in JOBS]
            at = mid_checkpoint(rdb, "outage")
            server.kill()
            time.sleep(8.0)  # past the 2 s of retries (backoff 0.2, 0.4, 0.8, 1.6 s)
            server = RedisServer(data, port=port).start(timeout=120)
            final = wait_for_jobs(client, ids, timeout=600)
            assert all(s["status"] == "done" for s in final), (final, fl.logs())
            logs = (tmp_path / "worker-w1.log").read_text(errors="replace")  # whole, not a tail
            assert f"gives checkpoint {at['cp']}" in logs and f"adopting checkpoint {at['cp']}" in logs, logs
            worst = check(client, redis.Redis.from_url(server.url), "outage", reference,
                          registry.tokenizer(MODEL))
            print(f"\ngiven up during the outage, adopted after: max |error| / Q_t {worst:.2e}")
    finally:
        server.kill()
