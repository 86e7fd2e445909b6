"""docs/similarity.md's figures and table, made by the service over HTTP, offline.

1. start ``embgeom serve`` on its embedded default (own Redis, in-process worker) on a free
   port with a temporary ``--data-dir`` (or ``--data-dir DIR``; or a running service with
   ``--url``);
2. ``PUT /v1/collections/{c}`` ``{"cross_layer": true}`` (the default settings otherwise:
   keyed by token id, special tokens not counted, every layer kept);
3. ingest the first ``--texts`` BBC paragraphs (``embgeom.corpora.bbc_texts("paragraphs")
   [:N]``, corpus order) with MiniLM and MPNet, in jobs under ``Idempotency-Key`` s;
4. ``GET .../similarity?metric=linear_cka`` and ``.../figures/cka`` (PNG) of each model:
   ``<out>/figures/cka_<model>.png``;
5. ``POST /v1/compare/global`` MiniLM against MPNet at ``--pairs`` layer pairs (``k``,
   ``min_count``): linear (biased) CKA, unbiased CKA, mutual k-NN and CKNNA, each beside
   its shuffled baseline;
6. the numbers as ``<out>/figures/similarity_numbers.json`` and the markdown table on stdout.

    python scripts/similarity_figures.py --texts 400 --out docs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paper_figures import Service, ingest, log  # noqa: E402  (the same serve and ingest)

from embgeom.client import EmbgeomClient  # noqa: E402
from embgeom.corpora import bbc_texts  # noqa: E402
from embgeom.store.server import free_port  # noqa: E402

MODELS = ("minilm", "mpnet")
SCORES = ("cka_linear", "unbiased_cka", "mutual_knn", "cknna")


def table(rows: list[dict], k: int) -> str:
    """Markdown: one row per layer pair, each score with its shuffled baseline in brackets."""
    head = ("| MiniLM layer | MPNet layer | shared tokens | linear CKA (biased) | unbiased CKA | "
            f"mutual k-NN (k={k}) | CKNNA |")
    lines = [head, "|" + "---:|" * (head.count("|") - 1)]
    for r in rows:
        cells = [f"{r[s]:.3f} ({r['baseline'][s]:.3f})" for s in SCORES]
        lines.append(f"| {r['a']['layer']} | {r['b']['layer']} | {r['tokens_used']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running service (default: start embgeom serve)")
    ap.add_argument("--data-dir", default=None, help="embgeom serve's data (default: a temporary folder)")
    ap.add_argument("--texts", type=int, default=400, help="the first N BBC paragraphs")
    ap.add_argument("--collection", default="bbc_sim")
    ap.add_argument("--pairs", default="0:0,3:3,3:6,6:12", help="MiniLM:MPNet layer pairs")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--min-count", type=int, default=5)
    ap.add_argument("--texts-per-job", type=int, default=50)
    ap.add_argument("--out", required=True, help="writes <out>/figures/cka_<model>.png and the numbers")
    args = ap.parse_args()

    figures_dir = Path(args.out) / "figures"
    figures_dir.mkdir(parents=True, exist_ok=True)
    texts = bbc_texts("paragraphs")[:args.texts]
    corpus_sha = hashlib.sha256("\n".join(texts).encode("utf-8")).hexdigest()
    pairs = [tuple(int(x) for x in p.split(":")) for p in args.pairs.split(",")]

    service = None
    scratch = None
    if args.url is None:
        if args.data_dir is None:
            scratch = tempfile.TemporaryDirectory(prefix="similarity-figures-")
        service = Service(Path(args.data_dir or scratch.name), free_port()).start()
    url = args.url or service.url
    numbers: dict = {"corpus": f"bbc_texts('paragraphs')[:{args.texts}]", "texts": len(texts),
                     "characters": sum(map(len, texts)), "corpus_sha256": corpus_sha,
                     "collection": args.collection, "k": args.k, "min_count": args.min_count}
    try:
        with EmbgeomClient(url, timeout=1800) as client:
            made = client.create_collection(args.collection, cross_layer=True)
            log(f"collection {args.collection}: {made['settings']}")
            numbers["ingest"] = {m: ingest(client, args.collection, m, texts, args.texts_per_job, corpus_sha,
                                           include_special=False) for m in MODELS}
            numbers["similarity"] = {}
            for m in MODELS:
                started = time.monotonic()
                sim = client.similarity(args.collection, m)
                seconds = time.monotonic() - started
                client.figure(args.collection, m, "cka").save(figures_dir / f"cka_{m}.png")
                numbers["similarity"][m] = {**sim, "read_seconds": round(seconds, 2)}
                log(f"{m}: n = {sim['n']:,}, {len(sim['layers'])} layers, read in {seconds:.1f}s -> "
                    f"{figures_dir / f'cka_{m}.png'}")
            rows = []
            for la, lb in pairs:
                r = client.compare_global((args.collection, MODELS[0], la), (args.collection, MODELS[1], lb),
                                          min_count=args.min_count, k=args.k)
                rows.append(r)
                log(f"minilm {la} vs mpnet {lb}: " + ", ".join(
                    f"{s} {r[s]:.3f} (baseline {r['baseline'][s]:.3f})" for s in SCORES))
            numbers["compare_global"] = rows
    finally:
        if service is not None:
            service.stop()
        if scratch is not None:
            scratch.cleanup()
    (figures_dir / "similarity_numbers.json").write_text(json.dumps(numbers, indent=2) + "\n")
    print(table(rows, args.k))
    return 0


if __name__ == "__main__":
    sys.exit(main())
