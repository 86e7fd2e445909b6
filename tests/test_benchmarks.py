"""The benchmark harness at a tiny size: its figures exist and mean what they say.

No wall-clock time is asserted here (STYLE.md): only that a replay goes through the real
worker and store (every job done, the stored counts equal the recorded ones), and that
the report helpers parse and compare what they are given.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from benchmarks import run
from embgeom.compute.engine import CountingRule, Engine
from embgeom.compute.catalogue import ModelRegistry
from embgeom.compute.models import ModelPool
from embgeom.corpora import bbc_texts
from embgeom.settings import Settings
from embgeom.testing.models import DENSE_MODELS
from benchmarks.replay import record_bbc
from benchmarks.shapes import REPLAY_SHAPES


def test_recording_is_the_services_own_batching():
    """The recorded batches are those a worker's engine prepares for the same job (the
    model's window length, the service's token budget), not a restatement of them."""
    rec = record_bbc(limit=400)
    assert rec.tokens == sum(b[2] for b in rec.batches) > 0
    assert sorted(i for job in rec.jobs for i in job) == list(range(len(rec.batches)))
    for ids, n, N in rec.batches:
        assert np.all(np.diff(ids) > 0) and n.sum() == N  # unique sorted keys, exact counts
    settings = Settings()
    registry = ModelRegistry.from_settings(settings)
    engine = Engine(ModelPool(registry, "cpu", 1).get("minilm"), CountingRule(layers=(0,)),
                    settings.token_budget)
    job = engine.prepare(bbc_texts("paragraphs")[:250])
    assert engine.window == registry.info("minilm").max_length == 512
    assert len(job.batches) == len(rec.jobs[0])
    for batch, b in zip(job.batches, rec.jobs[0]):
        keys, counts = np.unique(batch["keys"][batch["counted"]].numpy(), return_counts=True)
        np.testing.assert_array_equal(keys, rec.batches[b][0])
        np.testing.assert_array_equal(counts, rec.batches[b][1])


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
    assert run.parse_wrk(sample) == {"p50_ms": 2.5, "p99_ms": 0.812, "req_s": 200.0, "non_2xx": 3}


def test_table_marks_targets_met_and_missed():
    res = {"e2e_cpu": {"bare_forward_tok_s": 100.0, "service_tok_s": 99.0, "ratio": 0.99, "texts": 8},
           "e2e_cpu_20k": {"bare_forward_tok_s": 100.0, "service_tok_s": 60.0, "ratio": 0.6, "texts": 8},
           "reads": {"token_p99_ms_32": 25.0}}
    lines = {line.split()[0]: line for line in run.table(res).splitlines() if line.strip()}
    assert lines["e2e_cpu.ratio"].split()[1:5] == ["0.990", ">=", "0.9", "met"]
    assert "bare forward 100" in lines["e2e_cpu.ratio"]
    assert lines["e2e_cpu_20k.ratio"].split()[1:7] == ["0.600", ">=", "0.95", "MISSED:", "0.63", "of"]
    assert lines["reads.token_p99_ms_32"].split()[1:6] == ["25.0", "<=", "20", "MISSED:", "1.25x"]
    xl = run.table({"cross_layer": {"tok_s_off": 2000.0, "tok_s_on": 1500.0, "ratio": 0.75}})
    assert [line.split()[:2] for line in xl.splitlines()][1:] == [
        ["cross_layer.tok_s_off", "2,000"], ["cross_layer.tok_s_on", "1,500"], ["cross_layer.ratio", "0.750"]]


def test_dense_shapes_are_what_the_design_quotes():
    v, layers, d = DENSE_MODELS["SmolLM2-135M"]
    assert round(v * layers * d * 8 / 1e9, 1) == 9.8 or v * layers * d * 8 > 7e9


# ------------------------------------------------------------- benchmarks/gpu.py (pure parts)


def test_flops_count_the_matmul_weights_and_the_attention_square():
    import torch
    from transformers import BertConfig, BertModel, GPT2Config, GPT2Model, LlamaConfig, LlamaModel

    from benchmarks import gpu

    torch.manual_seed(0)
    # GPT-2 (Conv1D): 12 d^2 a block; d_attn = d
    g = GPT2Model(GPT2Config(vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=4))
    assert gpu.matmul_params(g) == 12 * 2 * 64 ** 2
    assert gpu.attention_shape(g.config) == (2, 64)
    # BERT: 4 d^2 + 2 d d_ff a block; the pooler (one token a sequence) left out
    b = BertModel(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=64, max_position_embeddings=32))
    assert b.pooler is not None and gpu.matmul_params(b) == 2 * (4 * 32 * 32 + 2 * 32 * 64)
    # Llama with grouped KV heads and an explicit head width: q, o d x (h x hd); k, v d x (kv x hd)
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64)
    assert gpu.matmul_params(LlamaModel(cfg)) == 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64
    assert gpu.attention_shape(cfg) == (1, 32)
    # 2 P n + 4 L d_attn n^2, summed over sequences: lengths 3 and 4
    P, L, d = 1000, 2, 64
    assert gpu.forward_flops(3 + 4, 9 + 16, P, L, d) == 2 * P * 7 + 4 * L * d * 25


def test_peak_bf16_is_looked_up_by_device_name():
    from benchmarks.gpu import peak_bf16_flops

    assert peak_bf16_flops("NVIDIA H200") == 989e12
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_bf16_flops("NVIDIA L4") == 121e12
    assert peak_bf16_flops("NVIDIA L40S") == 362e12
    assert peak_bf16_flops("Tesla T4") is None and peak_bf16_flops("") is None


def test_gpt2_random_is_seeded_and_loads_as_an_alias(tmp_path):
    import torch

    from embgeom.testing.models import build_gpt2_random
    from embgeom.compute.catalogue import ModelRegistry
    from embgeom.compute.models import ModelPool
    from embgeom.settings import ModelSource
    from embgeom.sources import minilm_path

    shape = dict(n_layer=1, n_embd=32, n_head=2, n_positions=64)
    a = build_gpt2_random(tmp_path / "a", minilm_path(), seed=0, **shape)
    b = build_gpt2_random(tmp_path / "b", minilm_path(), seed=0, **shape)
    registry = ModelRegistry({"ga": ModelSource(source=str(a)), "gb": ModelSource(source=str(b))},
                             tmp_path / "cache")
    info = registry.info("ga")
    assert (info.architecture, info.num_layers, info.hidden_size, info.max_length) == ("GPT2Model", 1, 32, 64)
    pool = ModelPool(registry, "cpu", max_models=2)
    wa, wb = pool.get("ga").model.h[0].attn.c_attn.weight, pool.get("gb").model.h[0].attn.c_attn.weight
    assert torch.equal(wa, wb) and wa.std() > 0
    ids = torch.tensor([[101, 2000, 102]])
    assert len(pool.get("ga").hidden_states(ids, torch.ones_like(ids))) == 2


def test_gpu_table_marks_the_ratio_target_and_records_skips():
    from benchmarks import gpu

    res = {"device": "cuda", "gpu": {"name": "NVIDIA H200"}, "peak_bf16_flop_s": 989e12,
           "runs": {"mpnet.bf16": {"bare_tok_s": 1e6, "forward_only_tok_s": 2e6, "service_tok_s": 7e5,
                                   "ratio": 0.7, "ratio_target": 0.8, "gflop_per_token": 0.2,
                                   "bare_flop_s": 2e14, "bare_frac_peak_bf16": 0.2},
                    "minilm.bf16": {"skipped": "budget: 10 s left"},
                    "smollm2.fp32": {"bare_tok_s": 1e5, "error": "Traceback\nRuntimeError: boom"}}}
    text = gpu.table(res)
    assert "MISSED" in text and "budget: 10 s left" in text and "RuntimeError: boom" in text
    assert "20.00%" in text and "989 TFLOP/s" in text


def test_gpu_table_prints_the_merge_and_steady_state_steps_or_why_not():
    from benchmarks import gpu

    res = {"device": "cuda", "runs": {},
           "merge": {"merge_over_bare": 0.85, "merge_tok_s": 2e7, "bare_tok_s": 2.35e7, "tokens": 240_000,
                     "device": "cuda"},
           "steady_state": {"minilm": {"tok_s": 6e5, "tokens": 10**7, "window_tokens": 2e6, "checkpoint_s": 0.5,
                                       "device": "cuda", "short_of_1e7": False},
                            "mpnet_shape": {"error": "Traceback\nRuntimeError: boom", "device": "cuda"},
                            "1b_shape": {"skipped": "budget: 12 s left for 1 shapes", "device": "cuda"}}}
    lines = gpu.table(res).splitlines()
    assert any(line.startswith("merge.merge_over_bare: 0.850") and ">= 0.8: met" in line and "device cuda" in line
               for line in lines)
    assert any(line.startswith("steady_state.minilm.tok_s: 600,000") and ">= 500,000: met" in line for line in lines)
    assert "steady_state.mpnet_shape: error: RuntimeError: boom" in lines
    assert "steady_state.1b_shape: skipped (budget: 12 s left for 1 shapes)" in lines
    res["merge"] = {"error": "Traceback\nValueError: shapes", "device": "cuda"}
    assert "merge: error: ValueError: shapes" in gpu.table(res).splitlines()


def test_gpu_texts_cycle_bbc_beyond_its_size():
    texts = run.e2e_texts(50_000, held_out=False, cycle=True)
    assert len(texts) == 50_000 and texts[0] in texts[1:] and all(30 <= len(t) <= 200 for t in texts[:100])
    assert len(run.e2e_texts(100)) == 100  # the make-bench default is unchanged


@pytest.mark.slow
def test_gpu_sh_runs_every_step_on_the_cpu(tmp_path):
    """``GPU_BENCH_CPU=1 bash benchmarks/gpu.sh`` (``--device cpu``) at tiny sizes, as a
    subprocess: the e2e ratio, the merge over bare and the steady state all run, the JSON
    records the device and their figures, and the table prints them."""
    import json
    import math
    import subprocess
    import sys

    env = {**os.environ, "GPU_BENCH_CPU": "1", "OUT": str(tmp_path), "EMBGEOM_GPU_PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(run.REPO / "benchmarks" / "gpu.sh"), "--models", "minilm", "--dtypes", "fp32",
         "--texts", "40", "--texts-per-job", "20", "--repeat", "1", "--no-ceiling",
         "--merge-jobs", "1", "--merge-repeat", "1", "--steady-shapes", "minilm", "--steady-tokens", "5000"],
        env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert res["device"] == "cpu" and not res.get("error") and not res.get("interrupted")
    e2e = res["runs"]["minilm.fp32"]
    assert e2e["ratio"] > 0 and e2e["bare_tok_s"] > 0 and not e2e.get("service_error")
    merge = res["merge"]
    assert merge["device"] == "cpu", merge
    for key in ("merge_over_bare", "merge_tok_s", "bare_tok_s"):
        assert isinstance(merge[key], float) and math.isfinite(merge[key]) and merge[key] > 0, key
    steady = res["steady_state"]["minilm"]
    assert steady["device"] == "cpu" and steady["tok_s"] > 0 and steady["tokens"] >= 5000
    lines = proc.stdout.splitlines()
    row = next(line.split() for line in lines if line.startswith("minilm "))
    assert row[:2] == ["minilm", "fp32"] and row[5] == f"{e2e['ratio']:.3f}"
    assert any(line.startswith("device: cpu") for line in lines)
    assert any(line.startswith(f"merge.merge_over_bare: {merge['merge_over_bare']:.3f}") and "device cpu" in line
               for line in lines)
    assert any(line.startswith(f"steady_state.minilm.tok_s: {steady['tok_s']:,.0f}") and "device cpu" in line
               for line in lines)


def test_slowest_names_a_scripts_keys_from_a_real_slowlog(redis_server):
    """Redis logs an EVAL with its body cut to 128 characters: the figure must still say
    which script it was, by its keys."""
    from embgeom.store.connection import redis_client

    client = redis_client(redis_server.url)
    slowest = run.Slowest()
    slowest.watch(client)
    # A script over 128 characters that keeps Redis busy for 15 ms (by Redis's own clock).
    body = ("\n-- a body long enough to be cut in the slow log" * 4 + "\n"
            "local t0 = redis.call('TIME')\n"
            "repeat local t = redis.call('TIME') until (t[1] - t0[1]) * 1e6 + (t[2] - t0[2]) > 15000\n"
            "return 1\n")
    client.eval(body, 2, "eg:{p}:s3:lock", "eg:{p}:s3:rec", "an-argument")
    client.get("eg:fast")
    slowest.collect(client, "here")
    assert slowest.ms >= 15
    assert slowest.command == "here: EVAL keys eg:{p}:s3:lock eg:{p}:s3:rec"
    assert slowest.over_50ms == (slowest.ms > 50)  # 15 ms of Redis's clock; more on a busy host


def test_stage_seconds_sum_the_workers_gauges_of_a_metrics_text():
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    from benchmarks.e2e_stages import stage_seconds

    registry = CollectorRegistry()
    gauge = Gauge("embgeom_worker_stage_seconds", "per stage", ["worker", "stage"], registry=registry)
    gauge.labels("w1", "forward_reduce").set(2.5)
    gauge.labels("w2", "forward_reduce").set(1.25)
    gauge.labels("w1", "shards.write").set(0.5)
    Gauge("embgeom_jobs_pending", "other", registry=registry).set(7)
    assert stage_seconds(generate_latest(registry).decode()) == {"forward_reduce": 3.75, "shards.write": 0.5}


# ------------------------------------------------------ the harness measures the service's own


def test_bench_redis_persists_as_the_embedded_service(tmp_path):
    """The servers the benchmark starts keep the persistence of the Redis an embedded
    ``embgeom serve`` starts (read from both servers, not restated), and ``machine``
    reports it."""
    from embgeom.settings import Settings
    from service.runtime import Runtime

    rt = Runtime.open(Settings(data_dir=tmp_path / "data", embedded_workers=0))
    try:
        service = {k: v for name in ("appendonly", "appendfsync", "save")
                   for k, v in rt.redis.config_get(name).items()}
    finally:
        rt.close()
    with run.redis_server() as (_, client):
        bench = {k: v for name in ("appendonly", "appendfsync", "save")
                 for k, v in client.config_get(name).items()}
        described = run.machine(client)
    assert bench == service and service["appendonly"] == "yes"
    assert {k: described["redis"][k] for k in service} == service
    assert described["cores"] >= 1 and described["memory_bytes"] > 0
    assert described["redis_data_filesystem"]["type"]
    assert len(described["load_average_start"]) == 3


def test_bare_forward_uses_the_services_batches_and_the_serve_its_defaults(monkeypatch):
    """The bare forward runs the batches a worker's engine prepares (token budget and
    window from Settings and the registry); the measured serve differs from the default
    only in its worker's niceness and device (those of the bare forward)."""
    settings = Settings()
    registry = ModelRegistry.from_settings(settings)
    loaded = ModelPool(registry, "cpu", 1).get("minilm")
    engine = Engine(loaded, CountingRule(layers=(0,)), settings.token_budget)
    texts = run.e2e_texts(120)
    seen = []
    _, counted = run.bare_forward(loaded, [texts], settings.token_budget,
                                  on_batch=lambda b: seen.append(b.keys[b.counted]))
    job = engine.prepare(texts)
    assert counted == job.counted and len(seen) == len(job.batches) >= 1
    for keys, batch in zip(seen, job.batches):
        np.testing.assert_array_equal(keys, batch["keys"][batch["counted"]].numpy())
    for name, value in run.serve_env().items():
        monkeypatch.setenv(name, value)
    served = Settings().model_dump()
    assert served.pop("embedded_worker_nice") == os.getpriority(os.PRIO_PROCESS, 0) == 0
    assert served.pop("device") == str(loaded.device) == "cpu"
    default = settings.model_dump()
    default.pop("embedded_worker_nice"), default.pop("device")
    assert served == default


def test_run_jobs_times_to_the_last_finished_at_not_to_the_poll():
    """The end-to-end clock stops at the jobs' own completion time, whatever the poll
    period (a poll of 0.5 s must not add up to 0.5 s)."""
    import httpx

    t_post, polls = [], []

    def handler(request):
        if request.method == "POST":
            t_post.append(time.time())
            return httpx.Response(202, json={"job_id": f"j{len(t_post)}", "status": "queued", "created": True})
        polls.append(time.time())
        ids = request.url.params["ids"].split(",")
        done = len(polls) > 1
        return httpx.Response(200, json=[{"status": "done" if done else "running", "tokens": 10,
                                          "finished_at": t_post[0] + 0.125 if done else None,
                                          "progress": 1.0 if done else 0.5} for _ in ids])

    with httpx.Client(base_url="http://bench", transport=httpx.MockTransport(handler)) as client:
        seconds, tokens = run.run_jobs(client, "c", [["a"], ["b"]], poll_s=0.5)
    assert tokens == 20 and len(polls) == 2 and polls[1] - polls[0] >= 0.5
    assert 0.1 < seconds < 0.2


def test_slowest_keeps_a_command_the_slowlog_dropped(redis_server):
    """1,500 logged commands after a slow one push it out of a 1,024-entry SLOWLOG
    before any drain: the latency monitor's ``command`` maximum still has it. Drained
    every poll, the SLOWLOG itself loses nothing of later bursts."""
    from embgeom.store.connection import redis_client

    client = redis_client(redis_server.url)
    slowest = run.Slowest(slow_us=0)  # every command is logged
    slowest.POLL_S = 60
    slowest.watch(client, "here")
    client.eval("local t0 = redis.call('TIME')\n"
                "repeat local t = redis.call('TIME') until (t[1] - t0[1]) * 1e6 + (t[2] - t0[2]) > 15000\n"
                "return 1\n", 0)
    with client.pipeline(transaction=False) as p:
        for i in range(1500):
            p.get(f"k{i}")
        p.execute()
    slowest.collect(client, "here")
    assert slowest.slowlog_ms < 15 <= slowest.ms and slowest.latency_command_ms >= 15
    assert "latency monitor" in slowest.command

    polled = run.Slowest(slow_us=0)
    polled.POLL_S = 0.05
    polled.watch(client, "again")
    for _ in range(2):
        with client.pipeline(transaction=False) as p:
            for i in range(900):
                p.get(f"k{i}")
            p.execute()
        time.sleep(0.3)
    polled.collect(client, "again")
    assert polled.slowlog_entries >= 1800  # more than the log holds at once


def test_store_and_merge_sections_at_a_tiny_size():
    """The new sections run end to end on one replayed job: their figures exist under
    the issue's names, are finite, and count what was written."""
    import math

    slowest = run.Slowest()
    rec = record_bbc()
    with run.replay_store("minilm_nosim", 1, slowest) as (out, server, client):
        store = run.bench_store(out, client)
        fields = sum(client.hlen(k) for k in client.scan_iter() if client.type(k) == b"hash")
        assert not list(client.scan_iter(match="raw:*"))  # the raw copy is removed
    assert store["fields"] == fields > 0
    assert store["apply_bytes"] == out["bytes_written"] > 0 and store["raw_bytes"] >= store["apply_bytes"]
    merge = run.bench_merge(1, 1, shape="minilm_nosim")
    assert merge["tokens"] == sum(rec.batches[b][2] for b in rec.jobs[0])
    assert merge["types"] == len(np.unique(np.concatenate([rec.batches[b][0] for b in rec.jobs[0]])))
    res = {"store": store, "merge": merge, "reads": slowest.figures(),
           "machine": {"cores": 2, "redis": {"appendfsync": "always"}}}
    for name in ("store.apply_over_raw_redis", "merge.merge_over_bare", "reads.redis_slowest_command_ms"):
        value = run._get(res, name)
        assert isinstance(value, float) and math.isfinite(value) and value > 0, name
    text = run.table(res)
    for name in ("store.apply_over_raw_redis", "merge.merge_over_bare", "reads.redis_slowest_command_ms"):
        op, goal = run.TARGETS[name]
        target = f"{op} {goal:,}"
        line = next(line for line in text.splitlines() if line.startswith(name))
        assert target in line and ("met" in line or "MISSED" in line)
    assert "appendfsync always" in text


def test_steady_state_section_calls_its_module_and_reports_every_name(tmp_path, monkeypatch, capsys):
    """``--only steady_state`` calls ``benchmarks.steady_state.bench_steady_state`` (here
    an in-memory stand-in with its signature) and puts what it returns under
    ``steady_state.<shape>`` in bench.json and in the table, beside ``machine``."""
    import json
    import math
    import sys
    import types

    calls = []

    def bench_steady_state(quick, slowest, device="cpu", budget_s=None):
        calls.append((quick, type(slowest).__name__, device, budget_s))
        return {shape: {"tok_s": 1000.0 * (i + 1), "window_tokens": 2_000_000, "types_per_window": 25_000,
                        "checkpoint_s": 1.5, "checkpoint_bytes": 3e8, "tokens": 10_000_000}
                for i, shape in enumerate(run.STEADY_SHAPES)}

    module = types.ModuleType("benchmarks.steady_state")
    module.bench_steady_state = bench_steady_state
    monkeypatch.setitem(sys.modules, "benchmarks.steady_state", module)
    monkeypatch.setenv("BENCH_JSON", str(tmp_path / "bench.json"))
    assert run.main(["--quick", "--only", "steady_state", "--device", "cpu"]) == 0
    assert calls and calls[0][:3] == (True, "Slowest", "cpu") and 60 <= calls[0][3] <= run.STEADY_MAX_S
    res = json.loads((tmp_path / "bench.json").read_text())
    for shape in run.STEADY_SHAPES:
        for field in ("tok_s", "window_tokens", "types_per_window", "checkpoint_s", "checkpoint_bytes"):
            assert math.isfinite(run._get(res, f"steady_state.{shape}.{field}"))
    assert res["machine"]["redis"]["appendfsync"] and res["machine"]["load_average_end"]
    assert math.isfinite(res["reads"]["redis_slowest_command_ms"])
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert lines["steady_state.1b_shape.tok_s"].split()[1:5] == ["3,000", ">=", "20,000", "MISSED:"]
    assert "steady_state.7b_shape_5_layers.tok_s" in lines
