"""The benchmark harness at a tiny size: its figures exist and mean what they say.

No wall-clock time is asserted here (STYLE.md): only that a replay goes through the real
worker and store (every job done, the stored counts equal the recorded ones), and that
the report helpers parse and compare what they are given.
"""

from __future__ import annotations

import numpy as np

from benchmarks import run
from benchmarks.replay import record_bbc
from benchmarks.shapes import DENSE_MODELS, REPLAY_SHAPES


def test_recording_is_the_services_own_batching():
    rec = record_bbc(limit=400)
    assert rec.tokens == sum(b[2] for b in rec.batches) > 0
    assert sorted(i for job in rec.jobs for i in job) == list(range(len(rec.batches)))
    for ids, n, N in rec.batches:
        assert np.all(np.diff(ids) > 0) and n.sum() == N  # unique sorted keys, exact counts


def test_replay_goes_through_the_real_worker_and_store():
    slowest = run.Slowest()
    rec = record_bbc()
    with run.replay_store("minilm_nosim", 2, slowest) as (out, server, client):
        assert out["jobs"] == 2 and out["checkpoints"] >= 1
        assert out["tokens"] == sum(rec.batches[b][2] for j in range(2) for b in rec.jobs[j])
        assert out["types"] == len(np.unique(np.concatenate([rec.batches[b][0] for j in range(2)
                                                             for b in rec.jobs[j]])))
        # the store holds what was replayed
        from embgeom.store.keys import PairKeys
        from embgeom.store.reader import Reader, run_sync

        state = run_sync(client, Reader().pair_state(PairKeys("c", "minilm")))
        assert run_sync(client, Reader().aggs(state))["count"] == out["tokens"]
        assert state.conf.self_similarity is False and state.conf.L == REPLAY_SHAPES["minilm_nosim"]["layers"]
        ratio = run.over_raw(out, "minilm_nosim")
        assert 0.5 < ratio < 10
    assert slowest.ms >= 0


def test_wrk_output_is_parsed():
    sample = """Running 5s test @ http://127.0.0.1:1
  Latency Distribution
     50%    2.50ms
     75%    3.00ms
     90%    4.00ms
     99%  812.00us
  1000 requests in 5.00s, 1.00MB read
  Non-2xx or 3xx responses: 3
Requests/sec:    200.00
"""
    import re

    def ms(label):
        m = re.search(rf"^\s*{label}%\s+([\d.]+)(us|ms|s)\s*$", sample, re.M)
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]

    assert ms("50") == 2.5 and abs(ms("99") - 0.812) < 1e-12


def test_table_marks_targets_met_and_missed():
    res = {"e2e_cpu": {"bare_forward_tok_s": 100.0, "service_tok_s": 99.0, "ratio": 0.99},
           "reads": {"token_p99_ms_32": 25.0}}
    text = run.table(res)
    assert "e2e_cpu.ratio" in text and "met" in text
    assert "reads.token_p99_ms_32" in text and "MISSED" in text


def test_dense_shapes_are_what_the_design_quotes():
    v, layers, d = DENSE_MODELS["SmolLM2-135M"]
    assert round(v * layers * d * 8 / 1e9, 1) == 9.8 or v * layers * d * 8 > 7e9
