"""The 1-D outlier-dimension probe on BBC topics, through the service's HTTP API.

    python scripts/probe_bbc.py --url http://127.0.0.1:8080 --model minilm \
        --topics sports business --per-topic 200 --layers 1 3 6 --pooling mean cls

Prints one markdown row per (layer, pooling): the best single dimension's test accuracy
(chosen on the training split), the mean over the top-k dimensions, the logistic
regression on all dimensions and the majority baseline.
"""

from __future__ import annotations

import argparse
import random

import httpx

from embgeom.corpora import bbc_articles


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--model", default="minilm")
    p.add_argument("--topics", nargs=2, default=["sports", "business"])
    p.add_argument("--per-topic", type=int, default=200)
    p.add_argument("--layers", type=int, nargs="+", default=[1, 3, 6])
    p.add_argument("--pooling", nargs="+", default=["mean", "cls"])
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    texts, labels = [], []
    for topic in args.topics:
        pool = [t for top, t in bbc_articles() if top == topic]
        for text in random.Random(args.seed).sample(pool, args.per_topic):
            texts.append(text)
            labels.append(topic)
    client = httpx.Client(base_url=args.url, timeout=3600)
    print(f"{args.model}, BBC {args.topics[0]} vs {args.topics[1]}, {len(texts)} articles, "
          f"30% held out (stratified, seed {args.seed}), top-{args.top_k} variance dimensions\n")
    print("| layer | pooling | best dim (var. ratio) | its test acc. | mean test acc. top-k "
          "| logistic regression (all dims) | majority |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for layer in args.layers:
        for pooling in args.pooling:
            r = client.post("/v1/probes/outlier-dimension", json={
                "model": args.model, "layer": layer, "texts": texts, "labels": labels,
                "pooling": pooling, "top_k": args.top_k, "seed": args.seed})
            r.raise_for_status()
            b = r.json()
            best = b["best_dimension"]
            mean_acc = sum(d["test_accuracy"] for d in b["dimensions"]) / len(b["dimensions"])
            print(f"| {layer} | {pooling} | {best['dim']} ({best['variance_ratio']:.1f}x) "
                  f"| {best['test_accuracy']:.3f} | {mean_acc:.3f} "
                  f"| {b['logistic_regression']['test_accuracy']:.3f} "
                  f"| {b['majority_baseline']['test_accuracy']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
