"""The benchmark at a tiny size: every figure is there and its correctness checks hold.

No wall-clock time is asserted here (STYLE.md): only that figures exist, are finite and
positive where they must be, and that the equalities the bench checks hold.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from embgeom import bench
from embgeom.reduce import reduce_batch


@pytest.fixture(scope="module")
def results():
    loaded = bench.load_model("minilm", device="cpu")
    return bench.run_bench(texts=10, repeat=1, loaded=loaded)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


EXPECTED = {
    "ingest": ["texts", "windows", "batches", "tokens", "forward_s", "full_s",
               "forward_tokens_per_s", "full_tokens_per_s", "overhead_ratio",
               "full_share_forward", "full_share_reduce", "full_share_accumulate"],
    "reduce": ["batch_tokens", "batch_types", "layers", "reduce_s", "naive_s", "speedup",
               "comoment_share", "max_rel_error"],
    "store": ["distinct_tokens", "payload_bytes", "layer_state_bytes", "insert_s", "merge_s",
              "insert_aof_bytes", "merge_aof_bytes", "insert_net_bytes", "merge_net_bytes",
              "redis_used_memory", "redis_used_memory_dataset", "redis_bytes_per_token",
              "read_unfiltered_s", "read_filtered_s", "read_ratio", "read_filtered_bytes",
              "read_agreement"],
    "memory": ["distinct_tokens", "accumulator_live_bytes", "accumulator_allocated_bytes",
               "dense_this_model_bytes", "dense_over_live"],
}


def test_every_figure_is_present_and_finite(results):
    for section, names in EXPECTED.items():
        for name in names:
            value = results[section][name]
            assert _finite(value), f"{section}.{name} = {value!r}"
    positive = [("ingest", "forward_tokens_per_s"), ("ingest", "full_tokens_per_s"),
                ("reduce", "reduce_s"), ("reduce", "naive_s"), ("store", "insert_s"),
                ("store", "merge_s"), ("store", "insert_aof_bytes"), ("store", "redis_used_memory"),
                ("store", "read_unfiltered_s"), ("store", "read_filtered_s")]
    for section, name in positive:
        assert results[section][name] > 0, f"{section}.{name}"
    assert results["ingest"]["texts"] == 10
    assert results["repeat"] == 1


def test_correctness_checks_hold(results):
    assert results["reduce"]["max_rel_error"] <= bench.REDUCE_TOLERANCE
    assert results["store"]["read_agreement"] <= bench.REDUCE_TOLERANCE
    inv = results["invariance"]
    assert inv["budgets"] == list(bench.BUDGETS)
    assert inv["max_rel"] <= bench.INVARIANCE_TOLERANCE
    assert inv["max_rel_Q"][bench.BUDGETS[-1]] == 0.0  # the reference against itself
    # The commit stores what the job accumulated, per token and per layer.
    assert results["store"]["distinct_tokens"] == results["memory"]["distinct_tokens"] > 0
    assert results["reduce"]["batch_tokens"] <= results["ingest"]["tokens"]


def test_memory_figures_are_computed_not_allocated(results):
    mem = results["memory"]
    k = mem["distinct_tokens"]
    assert mem["accumulator_live_bytes"] == k * 7 * 384 * 8 * 2
    assert mem["accumulator_allocated_bytes"] >= mem["accumulator_live_bytes"]
    assert mem["dense_this_model_bytes"] == 30522 * 7 * 384 * 8
    dense = mem["dense_bytes"]
    assert round(dense["all-MiniLM-L6-v2"] / 1e9, 2) == 0.66
    assert dense["SmolLM2-135M"] == 49152 * 31 * 576 * 8
    assert round(dense["SmolLM2-135M"] / 1e9) == 7
    assert dense["gemma-3-270m"] == 262144 * 19 * 640 * 8
    assert set(dense) == set(bench.DENSE_MODELS)


def test_table_has_a_row_for_every_figure(results):
    table = bench.format_table(results)
    rows = bench.figures(results)
    for label, value, _ in rows:
        assert label in table and value in table
    for needle in ("forward only", "forward + reduce + accumulate", "overhead ratio",
                   "reduce_batch (index_add_)", "naive Python loop", "speed ratio",
                   "max relative difference", "insert (new tokens)", "merge (existing tokens)",
                   "bytes written", "unfiltered decomposition", "filtered decomposition (min_count=2",
                   "ratio (filtered / unfiltered)", "TokenAccumulator", "SmolLM2-135M",
                   "gemma-3-270m", "all-mpnet-base-v2", "used_memory", "budget 512",
                   "budget 4096", "0.66 GB", "7.02 GB"):
        assert needle in table, needle


def test_main_prints_the_table_or_json(results, monkeypatch, capsys):
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: results)
    assert bench.main(["--texts", "10", "--repeat", "1"]) == 0
    assert "overhead ratio" in capsys.readouterr().out
    assert bench.main(["--texts", "10", "--repeat", "1", "--json"]) == 0
    parsed = json.loads(capsys.readouterr().out)
    assert set(EXPECTED) <= set(parsed)
    assert parsed["ingest"]["tokens"] == results["ingest"]["tokens"]
    with pytest.raises(SystemExit):
        bench.main(["--repeat", "0"])


def test_naive_reduce_equals_reduce_batch_on_adversarial_states():
    """Large common offset, a repeated vector, a zero vector and padding."""
    gen = torch.Generator().manual_seed(0)
    L, B, T, d = 3, 4, 9, 16
    hidden = [1e3 + torch.randn(B, T, d, generator=gen, dtype=torch.float32) for _ in range(L)]
    keys = torch.randint(0, 6, (B, T), generator=gen)
    counted = torch.ones(B, T, dtype=torch.bool)
    counted[2, 5:] = False
    counted[3, 7:] = False
    for h in hidden:
        h[0, 1] = h[1, 1]
        h[1, 2] = 0.0
    keys[0, 1] = keys[1, 1]
    fast = reduce_batch(hidden, keys, counted)
    naive = bench.naive_reduce(hidden, keys, counted)
    errors = bench._reduce_errors(fast, naive)
    assert max(errors.values()) <= bench.REDUCE_TOLERANCE, errors
    assert np.array_equal(fast[0].ids, naive[0].ids)


def test_naive_reduce_and_bench_detect_a_wrong_count():
    hidden = [torch.randn(1, 4, 3)]
    keys = torch.tensor([[1, 1, 2, 2]])
    counted = torch.ones(1, 4, dtype=torch.bool)
    fast = reduce_batch(hidden, keys, counted)
    other = bench.naive_reduce(hidden, torch.tensor([[1, 2, 2, 2]]), counted)
    with pytest.raises(AssertionError):
        bench._reduce_errors(fast, other)
