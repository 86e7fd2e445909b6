"""The checks of ``make container-test``, run on the host against the containers.

docker/container-test.sh starts Redis, the API and two workers as containers of one pod
and runs this with the project's venv. It ingests BBC paragraphs with MiniLM through the
API, crashes and restarts the Redis container (SIGKILL, then start: its append-only file
on a volume is fsynced on every write) once some jobs are done and others are not,
restarts the container of a worker while that worker runs a job (SIGTERM with the
worker's grace), and then checks:

- every job done, none failed, each submission one job (Idempotency-Key retries);
- counts exact and nothing lost or counted twice: at every layer ``n`` is the number of
  non-special tokens the host's own tokenizer gives for the texts, ``num_types`` the
  number of distinct ids, and the whole ``/tokens`` listing is that Counter, id by id;
- every kind of read answers and agrees with the others: layers, tokens (listing, one
  token, neighbours), decomposition (= the layer's row; Q = M + V_W + V_B), isotropy and
  outliers (over all n tokens), intrinsic dimension, outliers per model (every layer),
  figures (PNG and SVG), exports (CSV and Parquet, read back: the tokenizer's counts), the
  report page, models, collections, jobs (by ids) and metrics.

The expected counts come from the host (transformers' tokenizer of the packaged MiniLM,
special tokens dropped by its own ``special_tokens_mask``), not from the image's code.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import subprocess
import sys
import time
from collections import Counter

import httpx

MODEL = "minilm"
NUM_LAYERS = 7  # MiniLM: embedding output + 6 blocks
COLLECTION = "ct"
REL_TOL = 1e-9  # the float64 identities Q = M + V_W + V_B of one read: rounding only


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def corpus(count: int) -> list[str]:
    """BBC paragraphs of moderate length (each fits MiniLM's 512 tokens), in corpus order."""
    from embgeom.corpora import bbc_texts

    texts = [p for p in bbc_texts("paragraphs") if 60 <= len(p) <= 260][:count]
    assert len(texts) == count, f"only {len(texts)} paragraphs"
    return texts


def expected_counts(texts: list[str]) -> Counter:
    """Per token id, its occurrences in ``texts`` without the tokenizer's special tokens."""
    from transformers import AutoTokenizer

    from embgeom.sources import minilm_path

    tok = AutoTokenizer.from_pretrained(str(minilm_path()))
    counts: Counter = Counter()
    batch = tok(texts, return_special_tokens_mask=True)
    for ids, special in zip(batch["input_ids"], batch["special_tokens_mask"]):
        assert len(ids) <= tok.model_max_length
        counts.update(i for i, s in zip(ids, special) if not s)
    return counts


# --------------------------------------------------------------------------- the pod


def podman(*args: str) -> None:
    done = subprocess.run(["podman", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # Without systemd podman cannot time an image's own health check and says so each start.
    for line in done.stderr.splitlines():
        if "unable to get systemd connection" not in line:
            print(line, file=sys.stderr)
    done.check_returncode()


def ready(client: httpx.Client) -> dict:
    try:
        r = client.get("/readyz")
        return r.json() | {"status_code": r.status_code}
    except (httpx.HTTPError, ValueError):
        return {"status_code": 0}


def wait_ready(client: httpx.Client, workers: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        state = ready(client)
        if state["status_code"] == 200 and state.get("workers", 0) >= workers:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready with {workers} workers: {state}")
        time.sleep(0.5)


def post_job(client: httpx.Client, texts: list[str], key: str, timeout: float = 120) -> str:
    """POST /v1/jobs until acknowledged; 503s (Redis restarting) and lost connections are
    retried with the same Idempotency-Key, so a retried submission stays one job."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = client.post("/v1/jobs", json={"collection": COLLECTION, "model": MODEL, "texts": texts},
                            headers={"Idempotency-Key": key})
            if r.status_code == 202:
                return r.json()["job_id"]
            assert r.status_code == 503, r.text
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "POST /v1/jobs never acknowledged"
        time.sleep(0.3)


def statuses(client: httpx.Client, job_ids: list[str]) -> list[dict]:
    r = client.get("/v1/jobs", params={"ids": ",".join(job_ids)})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [j["job_id"] for j in out] == job_ids, out
    return out


def wait_until(client, job_ids, predicate, what: str, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            s = statuses(client, job_ids)
            if predicate(s):
                return s
            assert not any(j["status"] == "failed" for j in s), [j for j in s if j["status"] == "failed"]
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


# --------------------------------------------------------------------------- reads


def get(client: httpx.Client, path: str, **params) -> httpx.Response:
    r = client.get(path, params=params)
    assert r.status_code == 200, f"GET {path} {params}: {r.status_code} {r.text[:500]}"
    return r


def listing(client: httpx.Client, base: str, layer: int) -> dict[int, dict]:
    page = get(client, f"{base}/layers/{layer}/tokens", limit=10000).json()
    assert page["next_cursor"] is None, "more than 10000 types: use fewer texts"
    return {t["token_id"]: t for t in page["tokens"]}


def check_counts(client: httpx.Client, base: str, counts: Counter) -> dict:
    total = sum(counts.values())
    rows = get(client, f"{base}/layers").json()["layers"]
    assert [r["layer"] for r in rows] == list(range(NUM_LAYERS)), [r["layer"] for r in rows]
    for row in rows:
        assert row["n"] == total, (row["layer"], row["n"], total)
        assert row["num_types"] == len(counts), (row["layer"], row["num_types"], len(counts))
    for layer in range(NUM_LAYERS):
        got = {i: t["n"] for i, t in listing(client, base, layer).items()}
        if got != dict(counts):
            diff = {i: (got.get(i), counts.get(i)) for i in set(got) | set(counts) if got.get(i) != counts.get(i)}
            raise AssertionError(f"layer {layer}: {len(diff)} token ids differ (got, want): "
                                 f"{dict(list(diff.items())[:10])}")
    return {"tokens": total, "types": len(counts), "layers": len(rows)}


def close(a: float, b: float, scale: float) -> bool:
    return abs(a - b) <= REL_TOL * abs(scale)


def check_reads(client: httpx.Client, base: str, counts: Counter) -> list[str]:
    """One request of every kind of read, each checked against another source."""
    seen = []
    layer = 3
    row = get(client, f"{base}/layers").json()["layers"][layer]

    models = {m["name"]: m for m in get(client, "/v1/models").json()}
    assert models[MODEL]["num_layers"] + 1 == NUM_LAYERS, models[MODEL]
    collections = get(client, "/v1/collections").json()
    assert any(c["name"] == COLLECTION and MODEL in c["models"] for c in collections), collections
    assert MODEL in get(client, f"/v1/collections/{COLLECTION}").json()["models"]
    seen += ["models", "collections", "collection"]

    dec = get(client, f"{base}/layers/{layer}/decomposition").json()
    for q in ("n", "num_types", "Q", "M", "V", "V_W", "V_B"):
        assert dec[q] == row[q], (q, dec[q], row[q])
    assert close(dec["Q"], dec["M"] + dec["V_W"] + dec["V_B"], dec["Q"]), dec
    assert close(dec["V"], dec["V_W"] + dec["V_B"], dec["Q"]), dec
    seen.append("decomposition")

    top_id, top_n = counts.most_common(1)[0]
    listed = listing(client, base, layer)
    one = get(client, f"{base}/layers/{layer}/tokens/{top_id}").json()
    assert one["n"] == top_n and one["token_id"] == top_id, (one, top_n)
    for q in ("Q", "M", "V"):
        assert one[q] == listed[top_id][q], (q, one[q], listed[top_id][q])
    neighbors = get(client, f"{base}/layers/{layer}/tokens/{top_id}/neighbors", k=5).json()
    assert len(neighbors["neighbors"]) == 5, neighbors
    assert top_id not in [n["token_id"] for n in neighbors["neighbors"]]
    seen += ["token", "neighbors"]

    total = sum(counts.values())
    iso = get(client, f"{base}/layers/{layer}/isotropy").json()
    assert iso["n"] == total and 0.0 <= iso["isoscore"] <= 1.0, iso
    ident = get(client, f"{base}/layers/{layer}/intrinsic-dimension", method="twonn").json()
    assert ident["tokens"] > 0 and 0 < ident["dimension"] <= 384, ident  # MiniLM is 384-d
    out_layer = get(client, f"{base}/layers/{layer}/outliers").json()
    assert out_layer["n"] == total and out_layer["layer"] == layer, out_layer
    out_model = get(client, f"{base}/outliers").json()
    assert len(out_model["layers"]) == NUM_LAYERS, out_model
    seen += ["isotropy", "intrinsic-dimension", "outliers (layer)", "outliers (model)"]

    png = get(client, f"{base}/figures/layer_summary").content
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000, png[:16]
    svg = get(client, f"{base}/figures/vm_scatter", layer=layer, format="svg").text
    assert "<svg" in svg[:2000], svg[:200]
    seen += ["figure png", "figure svg"]

    text = get(client, f"{base}/layers/{layer}/export", format="csv").text
    exported = {int(r["token_id"]): int(r["n"]) for r in csv.DictReader(io.StringIO(text))}
    assert exported == dict(counts), "CSV export's counts differ from the tokenizer's"
    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(get(client, f"{base}/layers/{layer}/export", format="parquet").content))
    assert dict(zip(table.column("token_id").to_pylist(), table.column("n").to_pylist())) == dict(counts)
    seen += ["export csv", "export parquet"]

    page = get(client, f"{base}/report").text
    assert page.lstrip().lower().startswith("<!doctype html") and "data:image/png;base64," in page
    seen.append("report page")

    metrics = get(client, "/metrics").text
    assert "embgeom" in metrics
    seen.append("metrics")
    return seen


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--redis", required=True, help="the Redis container")
    ap.add_argument("--worker", action="append", required=True, metavar="WORKER_ID=CONTAINER")
    ap.add_argument("--texts", type=int, default=600)
    ap.add_argument("--jobs", type=int, default=24)
    args = ap.parse_args(argv)
    workers = dict(w.split("=", 1) for w in args.worker)
    client = httpx.Client(base_url=args.url, timeout=120)
    base = f"/v1/collections/{COLLECTION}/models/{MODEL}"

    t0 = time.monotonic()
    texts = corpus(args.texts)
    counts = expected_counts(texts)
    log(f"{len(texts)} texts, {sum(counts.values())} tokens of {len(counts)} types (host tokenizer)")
    wait_ready(client, len(workers), timeout=300)
    log(f"API ready with {len(workers)} workers")

    size = math.ceil(len(texts) / args.jobs)
    chunks = [texts[i:i + size] for i in range(0, len(texts), size)]
    half = len(chunks) // 2
    ids = [post_job(client, c, f"ct-{i}") for i, c in enumerate(chunks[:half])]
    log(f"{len(ids)} jobs posted")

    # Redis: crashed once some jobs are done and others are not (or, should a fast machine
    # finish them all between two looks, between the halves), then started again.
    s = wait_until(client, ids, lambda s: any(j["status"] == "done" for j in s), "no job done", 600)
    log(f"Redis killed and restarted with {sum(j['status'] == 'done' for j in s)}/{len(s)} jobs done, "
        f"{sum(j['status'] == 'running' for j in s)} running")
    podman("kill", "--signal", "KILL", args.redis)
    podman("start", args.redis)
    ids += [post_job(client, c, f"ct-{half + i}") for i, c in enumerate(chunks[half:])]
    log(f"{len(ids)} jobs posted in all")

    # A worker: restarted (SIGTERM, its grace) while it runs a job.
    s = wait_until(client, ids, lambda s: any(j["status"] == "running" and j.get("worker") in workers
                                              for j in s), "no job running", 600)
    victim = next(j["worker"] for j in s if j["status"] == "running" and j.get("worker") in workers)
    done = sum(j["status"] == "done" for j in s)
    log(f"worker {victim} restarted while it runs a job ({done}/{len(s)} jobs done)")
    podman("restart", workers[victim])

    s = wait_until(client, ids, lambda s: all(j["status"] == "done" for j in s), "jobs not done", 900)
    assert len(set(ids)) == len(chunks), "a retried submission made a second job"
    assert all(j["collection"] == COLLECTION and j["model"] == MODEL for j in s), s
    assert sum(j["texts"] for j in s) == len(texts), [j["texts"] for j in s]
    log(f"all {len(ids)} jobs done (GET /v1/jobs?ids=...)")
    wait_ready(client, len(workers), timeout=120)

    summary = check_counts(client, base, counts)
    log(f"counts exact at every layer: n = {summary['tokens']} tokens, num_types = "
        f"{summary['types']}, per-token n = the tokenizer's, at all {summary['layers']} layers")
    seen = check_reads(client, base, counts)
    log(f"read and checked: {', '.join(seen)}")
    log(f"checks passed in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
