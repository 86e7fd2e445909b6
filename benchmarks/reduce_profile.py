"""The reduction's cost beside the forward's, in CPU seconds: robust to a shared machine.

``python -m benchmarks.reduce_profile [--texts 300] [--layers all] [--profile]`` runs
MiniLM over BBC paragraphs as a worker batches them (one torch thread), records the hidden
states once, then times, alternated ``--repeat`` times (medians of ``time.process_time``):
the bare forward of the batches, and the reduction of the recorded hidden states into a
window (:func:`embgeom.compute.reduce.reduce_batch` with the window as its sinks, then
``WindowAccumulator.add``: the worker's path), the window allocated beforehand. It prints
both and ``forward / (forward + reduction)``, the share of a device's time the forward
would keep; ``--profile`` adds torch.profiler's table of the reduction's operators.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=300)
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from embgeom.compute.catalogue import ModelRegistry
    from embgeom.compute.engine import CountingRule, Engine
    from embgeom.compute.models import ModelPool
    from embgeom.compute.window import WindowAccumulator
    from embgeom.corpora import bbc_texts
    from embgeom.settings import Settings

    torch.set_num_threads(1)
    settings = Settings()
    loaded = ModelPool(ModelRegistry.from_settings(settings), device="cpu").get(args.model)
    L, d = loaded.info.num_layers + 1, loaded.info.hidden_size
    engine = Engine(loaded, CountingRule(layers=tuple(range(L))), settings.token_budget)
    job = engine.prepare(bbc_texts("paragraphs")[:args.texts])
    with torch.inference_mode():
        hidden = [loaded.hidden_states(b["input_ids"], b["attention"]) for b in job.batches]

    def forward() -> None:
        with torch.inference_mode():
            for b in job.batches:
                loaded.hidden_states(b["input_ids"], b["attention"])

    def reduction(acc: WindowAccumulator) -> None:
        from embgeom.compute.reduce import reduce_batch

        for b, h in zip(job.batches, hidden):
            acc.add(*reduce_batch(h, engine.rule.layers, b["keys"], b["counted"], True,
                                  engine.precision, acc.layers, acc))

    def window() -> WindowAccumulator:
        return WindowAccumulator(L, d, True, capacity=job.counted)

    def cpu(f, *a) -> float:
        t0 = time.process_time()
        f(*a)
        return time.process_time() - t0

    reduction(window())  # warm-up
    fwd, red = [], []
    for _ in range(args.repeat):
        acc = window()
        fwd.append(cpu(forward))
        red.append(cpu(reduction, acc))
    f, r = statistics.median(fwd), statistics.median(red)
    print(f"{args.model}, {job.counted:,} tokens in {len(job.batches)} batches, {L} layers, 1 thread: "
          f"forward {f:.2f} CPU s, reduction into the window {r:.2f} CPU s, "
          f"forward / (forward + reduction) {f / (f + r):.3f}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acc = window()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            reduction(acc)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
