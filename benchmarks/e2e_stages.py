"""Where the service's ingestion time goes: the end-to-end run of ``make bench``, with the
worker's stage clock.

``python -m benchmarks.e2e_stages [--texts 2000]`` starts ``embgeom serve`` on its
embedded default, sends the held-out BBC sentences as 8 jobs (as ``e2e_cpu`` does), and
prints tokens/s with the seconds each worker stage took meanwhile, read from the
``embgeom_worker_stage_seconds`` gauges of ``/metrics`` before and after:
``forward_reduce`` (the model and the reduction, which adds each batch's sums straight
into the window) and ``prepare`` run on the worker's main and feeder threads; ``shards.*``, ``layers`` and
``export`` are the checkpoint, applied by another thread while the next window runs.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.run import e2e_texts, run_jobs, serve_process, split_jobs

def stage_seconds(metrics_text: str) -> dict[str, float]:
    """Seconds per stage in a ``/metrics`` text, summed over the live workers."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "embgeom_worker_stage_seconds":
            for sample in family.samples:
                stage = sample.labels["stage"]
                out[stage] = out.get(stage, 0.0) + sample.value
    return out


def read_stages(url: str) -> dict[str, float]:
    return stage_seconds(httpx.get(f"{url}/metrics", timeout=30).text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=2000)
    args = parser.parse_args(argv)
    texts = e2e_texts(args.texts)
    jobs = split_jobs(texts)
    tmp = Path(tempfile.mkdtemp(prefix="embgeom-bench-stages-"))
    serve = serve_process(tmp)
    try:
        serve.wait_ready(180)
        with httpx.Client(base_url=serve.url, timeout=120) as client:
            run_jobs(client, "warm", [texts[:10]])  # the worker loads its model
            time.sleep(3)  # a few heartbeats: the gauges then include the warm-up
            before = read_stages(serve.url)
            seconds, tokens = run_jobs(client, "stages", jobs)
            time.sleep(2)
            after = read_stages(serve.url)
    finally:
        serve.terminate()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"service: {tokens:,} tokens in {seconds:.1f} s = {tokens / seconds:,.0f} tokens/s")
    for stage in sorted(after):
        spent = after[stage] - before.get(stage, 0.0)
        if spent >= 0.01:
            print(f"  {stage:<16} {spent:8.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
