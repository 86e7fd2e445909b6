"""Shared geometry of two models over BBC paragraphs, through a running service.

Ingests a subset of the BBC corpus with both models (idempotent: re-running counts
nothing twice), then asks every geometry endpoint and prints, for each, the equivalent
curl command and the numbers (markdown), and writes the raw answers to ``--out`` (and,
with ``--figures DIR``, the figure of each comparison as PNG). docs/geometry.md holds runs
of it: MiniLM vs MPNet (the default pair) and SmolLM2 vs gemma-3-270m
(``--models smollm2,gemma3``).

    embgeom serve --data-dir /tmp/embgeom-geometry &
    .venv/bin/python scripts/geometry_bbc.py --url http://127.0.0.1:8080 --out geometry.json

The layers compared: each model's last layer, its middle one (L // 2), the input
embeddings and layer 0.

The subset: BBC paragraphs of 60 to 260 characters, every ``--every``-th one in corpus
order (all five topics). The steering texts are sport and business paragraphs outside it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import time

import httpx

from embgeom.corpora import bbc_articles, bbc_texts



def subset(every: int, offset: int = 0) -> list[str]:
    paras = [p for p in bbc_texts("paragraphs") if 60 <= len(p) <= 260]
    return paras[offset::every]


def topic_paragraphs(topic: str, every: int, count: int) -> list[str]:
    """Paragraphs of one topic that are not in the subset (the next residue class)."""
    chosen = set(subset(every))
    out = [line.strip() for _, text in bbc_articles([topic]) for line in text.split("\n")
           if 60 <= len(line.strip()) <= 260 and line.strip() not in chosen]
    return out[:count]


def curl(url: str, method: str, path: str, body=None, params=None) -> str:
    target = url + path
    if params:
        target += "?" + "&".join(f"{k}={v}" for k, v in params.items())
    if body is None:
        return f"curl -s {shlex.quote(target)}"
    text = json.dumps(body)
    if len(text) > 300:
        text = text[:140] + " ... " + text[-60:]
    return f"curl -s -XPOST {shlex.quote(target)} -H 'content-type: application/json' -d {shlex.quote(text)}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--models", default="minilm,mpnet", help="the two model aliases, a,b")
    ap.add_argument("--figures", default=None, help="write the comparisons' figures (PNG) here")
    ap.add_argument("--no-steering", action="store_true", help="skip the Emb2Emb transfers")
    ap.add_argument("--collection", default="bbc_geo")
    ap.add_argument("--every", type=int, default=3, help="keep 1 in N paragraphs of 60..260 characters")
    ap.add_argument("--min-count", type=int, default=5)
    ap.add_argument("--steering-texts", type=int, default=50, help="per side")
    ap.add_argument("--out", default=None, help="write every answer here (JSON)")
    ap.add_argument("--skip-ingest", action="store_true")
    args = ap.parse_args()

    client = httpx.Client(base_url=args.url, timeout=600)
    MODELS = tuple(args.models.split(","))
    if len(MODELS) != 2 or MODELS[0] == MODELS[1]:
        ap.error("--models takes two different aliases, a,b")
    ma, mb = MODELS
    infos = {m["name"]: m for m in client.get("/v1/models").json()}
    LAST = {m: infos[m]["num_layers"] for m in MODELS}
    MID = {m: LAST[m] // 2 for m in MODELS}
    answers: dict[str, dict] = {}
    texts = subset(args.every)
    c, mc = args.collection, args.min_count
    print(f"corpus: {len(texts)} BBC paragraphs (60..260 characters, 1 in {args.every}), "
          f"{sum(map(len, texts))} characters; collection {c!r}; min_count {mc}\n")

    if not args.skip_ingest:
        started = time.monotonic()
        ids = []
        for model in MODELS:
            r = client.post("/v1/jobs", json={"collection": c, "model": model, "texts": texts},
                            headers={"Idempotency-Key": f"geometry-{c}-{model}-{args.every}"})
            r.raise_for_status()
            ids.append(r.json()["job_id"])
        while True:
            jobs = [client.get(f"/v1/jobs/{j}").json() for j in ids]
            if all(j["status"] in ("done", "failed") for j in jobs):
                break
            time.sleep(2)
        assert all(j["status"] == "done" for j in jobs), jobs
        done = ", ".join(f"{j['model']} {j['tokens']} tokens" for j in jobs)
        print(f"ingested: {done} in {time.monotonic() - started:.0f} s\n")

    def ask(name: str, method: str, path: str, body=None, params=None) -> dict:
        started = time.monotonic()
        r = client.request(method, path, json=body, params=params)
        r.raise_for_status()
        answers[name] = r.json()
        print(f"### {name}\n\n```\n{curl(args.url, method, path, body, params)}\n```\n"
              f"({time.monotonic() - started:.1f} s)\n")
        return answers[name]

    def space(model, layer):
        return {"collection": c, "model": model, "layer": layer}

    def figure(name: str, a: dict, b: dict, params: dict) -> None:
        if not args.figures:
            return
        import pathlib

        query = {"a": f"{c}:{a['model']}:{a['layer']}", "b": f"{c}:{b['model']}:{b['layer']}", **params}
        started = time.monotonic()
        r = client.get(f"/v1/compare/figures/{name}", params=query)
        r.raise_for_status()
        out = pathlib.Path(args.figures) / f"{name}-{a['model']}-{a['layer']}-{b['model']}-{b['layer']}.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(r.content)
        print(f"figure {out} ({time.monotonic() - started:.1f} s):\n```\n"
              f"{curl(args.url, 'GET', f'/v1/compare/figures/{name}', None, query)} > {out.name}\n```\n")

    # Global similarity.
    rows = []
    for la, lb in ((LAST[ma], LAST[mb]), ("input", "input"), (MID[ma], MID[mb]), (0, 0)):
        g = ask(f"global {ma}/{la} vs {mb}/{lb}", "POST", "/v1/compare/global",
                {"a": space(ma, la), "b": space(mb, lb), "min_count": mc})
        rows.append((f"{ma} {la} vs {mb} {lb}", g))
        if la == LAST[ma]:
            figure("global", space(ma, la), space(mb, lb), {"min_count": mc})
    g = ask(f"global {ma}/{LAST[ma]} vs itself", "POST", "/v1/compare/global",
            {"a": space(ma, LAST[ma]), "b": space(ma, LAST[ma]), "min_count": mc})
    rows.append((f"{ma} {LAST[ma]} vs itself", g))
    print("| spaces | shared | Pearson (baseline) | CKA (baseline) | Procrustes (baseline) |")
    print("|---|---|---|---|---|")
    for label, g in rows:
        b = g["baseline"]
        print(f"| {label} | {g['shared_tokens']} ({g['matched_by']}) | {g['pearson_cosine']:.3f} "
              f"({b['pearson_cosine']:.3f}) | {g['cka_linear']:.3f} ({b['cka_linear']:.3f}) | "
              f"{g['procrustes_residual']:.3f} ({b['procrustes_residual']:.3f}) |")
    print()

    # LLE.
    rows = []
    for xa, la, xb, lb in ((ma, LAST[ma], mb, LAST[mb]), (ma, "input", mb, "input"),
                           (ma, MID[ma], ma, LAST[ma])):
        g = ask(f"lle {xa}/{la} vs {xb}/{lb}", "POST", "/v1/compare/lle",
                {"a": space(xa, la), "b": space(xb, lb), "k": 10, "min_count": mc})
        rows.append((f"{xa} {la} -> {xb} {lb}", g))
        if xb != xa and la == LAST[xa]:
            figure("lle", space(xa, la), space(xb, lb), {"k": 10, "min_count": mc})
    print("| spaces (k=10) | tokens | transfer | own | random | transfer/random | overlap (chance) |")
    print("|---|---|---|---|---|---|---|")
    for label, g in rows:
        print(f"| {label} | {g['tokens_used']} | {g['transfer_error']:.3f} | {g['own_error']:.3f} | "
              f"{g['random_error']:.3f} | {g['transfer_over_random']:.3f} | "
              f"{g['neighbor_overlap']:.3f} ({g['chance_overlap']:.3f}) |")
    print()

    # Intrinsic dimension, with neighbours.
    for model in MODELS:
        d = ask(f"intrinsic dimension {model}/{LAST[model]}", "GET",
                f"/v1/collections/{c}/models/{model}/layers/{LAST[model]}/intrinsic-dimension",
                params={"k": 20, "method": "local_pca", "threshold": 0.9, "min_count": mc,
                        "limit": 8, "neighbors": 4})
        if args.figures:
            import pathlib

            path = f"/v1/collections/{c}/models/{model}/layers/{LAST[model]}/figures/intrinsic_dimension"
            params = {"k": 20, "method": "local_pca", "threshold": 0.9, "min_count": mc}
            r = client.get(path, params=params)
            r.raise_for_status()
            out = pathlib.Path(args.figures) / f"intrinsic_dimension-{model}-{LAST[model]}.png"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(r.content)
            print(f"figure {out}:\n```\n{curl(args.url, 'GET', path, None, params)} > {out.name}\n```\n")
        print(f"{d['tokens']} tokens, mean local PCA dimension {d['mean']:.2f} "
              f"(median {d['median']:.0f})\n")
        print("| end | token (n) | dimension | nearest by cosine |")
        print("|---|---|---|---|")
        for end in ("lowest", "highest"):
            for t in d[end]:
                near = ", ".join(f"{x['token']} {x['cosine']:.2f}" for x in t["neighbors"])
                print(f"| {end} | {t['token']} ({t['n']}) | {t['estimate']:.0f} | {near} |")
        print()
        for method in ("twonn", "mle"):
            e = ask(f"intrinsic dimension {model}/{LAST[model]} {method}", "GET",
                    f"/v1/collections/{c}/models/{model}/layers/{LAST[model]}/intrinsic-dimension",
                    params={"k": 20, "method": method, "min_count": mc, "limit": 5})
            print(f"{method}: global {e['dimension']:.2f}, per-token median {e['median']:.2f}; "
                  f"lowest {', '.join(t['token'] for t in e['lowest'])}; "
                  f"highest {', '.join(t['token'] for t in e['highest'])}\n")

    # Emb2Emb.
    pos = topic_paragraphs("sports", args.every, args.steering_texts)
    neg = topic_paragraphs("business", args.every, args.steering_texts)
    for la, lb in () if args.no_steering else ((LAST[ma], LAST[mb]), (MID[ma], MID[mb]), ("input", "input")):
        s = ask(f"steering {ma}/{la} -> {mb}/{lb}", "POST", "/v1/steering/transfer",
                {"a": space(ma, la), "b": space(mb, lb), "positive_texts": pos,
                 "negative_texts": neg, "min_count": 2, "ridge": 1.0, "held_out": 0.2,
                 "return_vector": False})
        m, b = s["map"], s["baseline"]
        print(f"sport ({len(pos)}) - business ({len(neg)}) paragraphs, map on {m['train_tokens']} "
              f"tokens (held out {m['held_out_tokens']}): held-out R^2 {m['r2']:.3f}, mean cosine "
              f"{m['mean_cosine']:.3f} (b's mean: {m['mean_baseline_cosine']:.3f}); "
              f"cos(v_a W, v_b) = {s['cosine']:.3f}; random maps {b['random_map']['mean']:.3f} "
              f"+- {b['random_map']['std']:.3f} (max |.| {b['random_map']['max_abs']:.3f}); "
              f"shuffled-pairs map {b['shuffled_map']['cosine']:.3f}\n")

    if args.out:
        with open(args.out, "w") as f:
            json.dump(answers, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
