"""The steady-state replay (benchmarks/steady_state.py): a store seeded with the
vocabulary before the timed windows, tokens counted as replayed, counts as recorded."""

from __future__ import annotations

from collections import Counter

import numpy as np

from benchmarks.replay import Recording
from benchmarks.steady_state import (MODEL, SteadyEngine, jobs_for, load_recording,
                                     save_recording, steady_shape)
from embgeom.store.keys import PairKeys
from embgeom.store.reader import Reader, run_sync


def synthetic_recording(jobs: int = 4, batches: int = 2, vocab: int = 1500, seed: int = 1) -> Recording:
    """Jobs of sorted unique ids with counts, as record_bbc makes them."""
    rng = np.random.default_rng(seed)
    out, job_list = [], []
    for _ in range(jobs):
        job = []
        for _ in range(batches):
            ids = np.unique(rng.integers(0, vocab, 300))
            counts = rng.integers(1, 5, len(ids))
            job.append(len(out))
            out.append((ids.astype(np.int64), counts.astype(np.int64), int(counts.sum())))
        job_list.append(job)
    rec = Recording(out, job_list, sum(b[2] for b in out), 0.0)
    rec.window = 512
    return rec


def test_recording_round_trip(tmp_path):
    rec = synthetic_recording()
    save_recording(rec, tmp_path / "r.npz")
    back = load_recording(tmp_path / "r.npz")
    assert back.jobs == rec.jobs and back.tokens == rec.tokens and back.window == 512
    for (a, b, n), (x, y, m) in zip(rec.batches, back.batches):
        assert np.array_equal(a, x) and np.array_equal(b, y) and n == m


def test_cycled_jobs_reach_tokens():
    rec = synthetic_recording()
    per = [sum(rec.batches[b][2] for b in job) for job in rec.jobs]
    for tokens in (1, per[0], per[0] + 1, sum(per), 2 * sum(per) + per[0] + 1):
        n = jobs_for(rec, tokens)
        got = [per[j % len(per)] for j in range(n)]
        assert sum(got) >= tokens and sum(got[:-1]) < tokens


def test_seed_jobs_cover_the_vocabulary_once():
    rec = synthetic_recording()
    vocab = np.unique(np.concatenate([b[0] for b in rec.batches]))
    engine = SteadyEngine(rec, 2, 8, False, "cpu", vocab, seed_rows=400)
    ids = []
    for i in range(len(engine.seed_jobs)):
        job = engine.prepare([f"seed:{i}"])
        for b in job.batches:
            tokens, layers = engine.run(b)
            assert tokens.n.eq(1).all() and layers.n == len(tokens.ids)
            ids.append(tokens.ids.numpy())
        assert sum(len(engine.run(b)[0].ids) for b in job.batches) <= 400
    assert np.array_equal(np.sort(np.concatenate(ids)), vocab)


def test_steady_state_replay_into_a_seeded_store():
    rec = synthetic_recording()
    tokens = 2 * rec.tokens + 100  # two cycles and a part of the third
    seen = {}

    def on_store(client, jobs):
        state = run_sync(client, Reader().pair_state(PairKeys("c", MODEL)))
        scal = run_sync(client, Reader().scalars(state))
        seen["store"] = dict(zip(scal.ids.tolist(), scal.n.tolist()))
        seen["jobs"] = jobs

    res = steady_shape("minilm", rec, tokens, "cpu", sweep=(1500,), on_store=on_store)
    # The store held the vocabulary before the timed windows: none of them added a type.
    vocab = set(np.concatenate([b[0] for b in rec.batches]).tolist())
    assert res["types_before"] == res["types_after"] == len(vocab) == res["vocabulary"]
    assert res["new_types"] == 0
    # Tokens as replayed: recorded job j mod J for each cycled job j, in every row.
    main_jobs, sweep_jobs = seen["jobs"][0], seen["jobs"][1:]
    assert len(sweep_jobs) == 1 and len(res["by_window"]) == 2
    per_job = [sum(rec.batches[b][2] for b in job) for job in rec.jobs]
    assert res["tokens"] == sum(per_job[j % len(rec.jobs)] for j in range(main_jobs)) >= tokens
    assert res["by_window"][1]["tokens"] == sum(per_job[j % len(rec.jobs)] for j in range(sweep_jobs[0]))
    assert sum(w["tokens"] for w in res["windows"]) == res["tokens"]
    # Counts: 1 per type from the seed, plus every replayed job's counts.
    expected = Counter({t: 1 for t in vocab})
    for n in seen["jobs"]:
        for j in range(n):
            for b in rec.jobs[j % len(rec.jobs)]:
                ids, counts, _ = rec.batches[b]
                for t, c in zip(ids.tolist(), counts.tolist()):
                    expected[t] += c
    assert seen["store"] == dict(expected)
