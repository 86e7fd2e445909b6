"""The paper's Fig. 2, 4 and 5, drawn by the service, for MiniLM and MPNet on the BBC corpus.

What a user would do, end to end, through the HTTP API:

1. start ``embgeom serve`` on its embedded default (own Redis, in-process worker) on a free
   port, with ``--data-dir`` (a temporary folder unless ``--data-dir`` is given; or use a
   running service with ``--url``);
2. ``PUT /v1/collections/{c}`` with ``{"preset": "paper"}`` (tokens keyed by their string,
   special tokens counted);
3. ingest the BBC paragraphs (``embgeom.corpora.bbc_texts("paragraphs")``, 12,860
   paragraphs, all of them unless ``--limit``) with each model, in jobs of
   ``--texts-per-job`` texts submitted with :class:`embgeom.client.EmbgeomClient` under
   ``Idempotency-Key`` s (re-running on the same ``--data-dir`` counts nothing twice), and
   wait for them;
4. GET the figures with the paper's filter (``min_count=10&max_count=100000``, PNG):
   ``vm_scatter`` (Fig. 2) of each model at its middle and last layer, ``layer_summary``
   with ``?models=minilm,mpnet`` (Fig. 4, both models overlaid) and ``decomposition``
   (Fig. 5) of each model, into ``<out>/figures/``;
5. a full-page screenshot of the report page of the first model (``.../report`` with the
   same filter) in Debian's chromium, headless, driven by selenium (as
   ``tests/test_report_browser.py`` does);
6. the per-layer numbers of ``.../layers?min_count=10&max_count=100000`` of every model
   (cv_Q, slope, R^2, M/Q, V_W/Q, V_B/Q, ...), the corpus size and the wall times, as
   ``<out>/figures/paper_numbers.json`` and ``.md``.

    python scripts/paper_figures.py --limit 300 --out /tmp/paper-try    # a quick try
    nice -n 10 python scripts/paper_figures.py --out docs                # docs/figures/...

On a slow machine, ``--budget-minutes 60 --budget-model mpnet`` ingests MPNet first,
submitting jobs of ``--texts-per-job`` paragraphs a few at a time and no new one after 60
minutes, then every other model on exactly the prefix MPNet reached; the log and
``paper_numbers.json`` say which (``--limit N`` reproduces it). With ``--data-dir``, a
re-run on the same data ingests nothing twice (every job carries an ``Idempotency-Key``),
so figures can be drawn again without counting anything again.

Files written (``<out>/figures/``):

    fig2_vm_scatter_<model>_layer<l>.png      V against M per token type (Fig. 2)
    fig4_layer_summary_<m1>_<m2>.png          cv_Q, slope, R^2 across layers (Fig. 4)
    fig5_decomposition_<model>.png            Q = M + V_W + V_B shares per layer (Fig. 5)
    report_<model>.png                        the report page (``--screenshot`` to move it)
    paper_numbers.json, paper_numbers.md      the numbers, corpus size, timings
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import httpx  # noqa: E402

from embgeom.client import EmbgeomClient  # noqa: E402
from embgeom.inputs import chunk_texts, idempotency_key  # noqa: E402
from embgeom.corpora import bbc_texts  # noqa: E402
from embgeom.store.server import free_port  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MIN_COUNT, MAX_COUNT = 10, 100_000
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
BROWSER_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--hide-scrollbars", "--window-size=1280,1000")
NUMBER_COLUMNS = ("layer", "n", "num_types", "cv_Q", "slope", "r2", "M/Q", "V_W/Q", "V_B/Q", "V_W/V")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------------- service
class Service:
    """``embgeom serve`` on its embedded default, as a child process (its own session)."""

    def __init__(self, data_dir: Path, port: int):
        self.data_dir = data_dir
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 300) -> "Service":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        logfile = open(self.data_dir / "serve.log", "ab")
        command = [sys.executable, "-m", "embgeom.cli", "serve", "--port", str(self.port),
                   "--data-dir", str(self.data_dir)]
        log(f"starting: {' '.join(command[1:])} (log: {self.data_dir / 'serve.log'})")
        self.process = subprocess.Popen(command, cwd=REPO, stdout=logfile, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"embgeom serve exited with {self.process.returncode}; "
                                   f"see {self.data_dir / 'serve.log'}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.url} not ready after {timeout}s")

    def stop(self, timeout: float = 120) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)


# ----------------------------------------------------------------------- ingest
def ensure_collection(client: EmbgeomClient, collection: str) -> dict:
    """``PUT /v1/collections/{c}`` ``{"preset": "paper"}``: 201 created, 200 already there
    with the same rule (a re-run on the same data); 409 (other settings) raises."""
    return client.create_collection(collection, preset="paper")


def ingest(client: EmbgeomClient, collection: str, model: str, texts: list[str],
           texts_per_job: int, corpus_sha: str, budget: float | None = None, ahead: int = 3,
           include_special: bool = True) -> dict:
    """Submit ``texts`` in jobs (``include_special`` as the collection says: the paper
    preset counts special tokens) and wait for them.

    With ``budget`` (seconds), jobs are submitted ``ahead`` at a time and no new one after
    ``budget`` seconds: the jobs in flight finish, and what was ingested is the prefix of
    ``texts`` those jobs carried (``texts`` in the answer).
    """
    started = time.monotonic()
    chunks = chunk_texts(texts, texts_per_job)
    ids: list[str] = []
    latest: dict[str, dict] = {}
    pending: list[str] = []
    last_log = started

    def submit(i: int) -> None:
        chunk = chunks[i]
        job_id = client.submit(chunk, collection, model, include_special=include_special,
                               idempotency_key=idempotency_key(collection, model, include_special, corpus_sha,
                                                               i, chunk))
        ids.append(job_id)
        pending.append(job_id)

    while True:
        elapsed = time.monotonic() - started
        open_for_more = budget is None or elapsed < budget
        while open_for_more and len(ids) < len(chunks) and (budget is None or len(pending) < ahead):
            submit(len(ids))
        if pending:
            for status in client.jobs(pending[:64]):
                latest[status["job_id"]] = status
            pending[:] = [j for j in pending if latest.get(j, {}).get("status") not in ("done", "failed")]
        if not pending and (len(ids) == len(chunks) or not open_for_more):
            break
        now = time.monotonic()
        if now - last_log >= 30:
            last_log = now
            finished = [latest[j] for j in ids if j not in pending]
            log(f"{model}: {sum(len(chunks[i]) for i, j in enumerate(ids) if j not in pending)}"
                f"/{len(texts)} texts, {sum(s['tokens'] or 0 for s in finished)} tokens done, "
                f"{len(pending)} jobs in flight, {now - started:.0f}s")
        time.sleep(2.0)

    seconds = time.monotonic() - started
    final = [latest[j] for j in ids]
    failed = [s for s in final if s["status"] != "done"]
    if failed:
        raise RuntimeError(f"{model}: {len(failed)} jobs failed, e.g. {failed[0]}")
    done_texts = sum(len(chunks[i]) for i in range(len(ids)))
    tokens = sum(s["tokens"] for s in final)
    cut = "" if done_texts == len(texts) else f" (budget of {budget:.0f}s reached: the first {done_texts})"
    log(f"{model}: {done_texts} texts{cut}, {tokens} tokens in {seconds:.0f}s ({tokens / seconds:.0f} tokens/s)")
    return {"jobs": len(ids), "texts": done_texts, "tokens": tokens, "seconds": round(seconds, 1)}


# ---------------------------------------------------------------------- figures
def screenshot(url: str, path: Path) -> None:
    """A full-page PNG of ``url`` in headless chromium (selenium + Debian's chromedriver)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service as DriverService

    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        raise RuntimeError("needs Debian's chromium and chromium-driver (make setup installs them)")
    workdir = tempfile.TemporaryDirectory(prefix="paper-figures-chromium-")
    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in BROWSER_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={Path(workdir.name) / 'profile'}")
    driver = webdriver.Chrome(service=DriverService(str(CHROMEDRIVER),
                                                    log_output=str(Path(workdir.name) / "chromedriver.log")),
                              options=options)
    try:
        driver.set_page_load_timeout(600)
        driver.get(url)
        images = driver.execute_script(
            "return Array.from(document.querySelectorAll('img[data-figure]')).map(i => i.naturalWidth);")
        if not images or not all(images):
            raise RuntimeError(f"the report page's figures did not load: {images}")
        height = driver.execute_script("return document.documentElement.scrollHeight;")
        driver.set_window_size(1280, min(int(height) + 40, 16000))
        path.parent.mkdir(parents=True, exist_ok=True)
        if not driver.save_screenshot(str(path)):
            raise RuntimeError("chromium did not save the screenshot")
    finally:
        driver.quit()
        workdir.cleanup()


def numbers_markdown(numbers: dict) -> str:
    lines = []
    for model, body in numbers["models"].items():
        lines.append(f"**{model}** ({body['corpus']['texts']} texts, {body['corpus']['tokens']} tokens, "
                     f"n_t in [{MIN_COUNT}, {MAX_COUNT}])\n")
        lines.append("| " + " | ".join(NUMBER_COLUMNS) + " |")
        lines.append("|" + "|".join("---:" for _ in NUMBER_COLUMNS) + "|")
        for row in body["layers"]:
            cells = []
            for col in NUMBER_COLUMNS:
                v = row.get(col)
                cells.append("" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs", help="figures go to OUT/figures/ (default: docs)")
    ap.add_argument("--data-dir", default=None,
                    help="the embedded service's data (default: a temporary folder, removed at the end)")
    ap.add_argument("--url", default=None, help="use this running service instead of starting one")
    ap.add_argument("--models", default="minilm,mpnet")
    ap.add_argument("--collection", default="bbc_paper")
    ap.add_argument("--limit", type=int, default=None, help="only the first N BBC paragraphs")
    ap.add_argument("--texts-per-job", type=int, default=100)
    ap.add_argument("--budget-minutes", type=float, default=None,
                    help="ingest --budget-model first and submit no new job after this many minutes; "
                         "every other model then ingests the same prefix of the corpus (printed, so "
                         "--limit reproduces it)")
    ap.add_argument("--budget-model", default=None, help="default: the last of --models")
    ap.add_argument("--report-model", default=None, help="the model whose report page is shot (default: the first)")
    ap.add_argument("--screenshot", default=None,
                    help="where the report page's screenshot goes (default OUT/figures/report_<model>.png; "
                         "'none' for no screenshot)")
    args = ap.parse_args()

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    out = Path(args.out)
    figdir = out / "figures"
    figdir.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t0 = time.monotonic()

    texts = bbc_texts("paragraphs")
    total_paragraphs = len(texts)
    # Keys name (corpus, chunk index, chunk content): a run with --limit on the same data
    # gets back the jobs of a longer run's chunks that it shares.
    corpus_sha = hashlib.sha256("\n".join(texts).encode("utf-8")).hexdigest()
    if args.limit is not None:
        texts = texts[:args.limit]
    log(f"corpus: {len(texts)} of {total_paragraphs} BBC paragraphs, {sum(map(len, texts))} characters")

    tmp = None
    service = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        if args.data_dir:
            data_dir = Path(args.data_dir).resolve()
        else:
            tmp = tempfile.TemporaryDirectory(prefix="paper-figures-")
            data_dir = Path(tmp.name) / "data"
        started = time.monotonic()
        service = Service(data_dir, free_port()).start()
        timings["service start"] = round(time.monotonic() - started, 1)
        url = service.url
        log(f"service ready at {url} in {timings['service start']}s")

    try:
        with EmbgeomClient(url, timeout=900) as client:
            info = ensure_collection(client, args.collection)
            log(f"collection {args.collection}: {json.dumps(info.get('settings', info))}")
            available = {m["name"]: m for m in client.models()}
            corpus = {}
            order = list(models)
            budget = None
            if args.budget_minutes is not None:
                first = args.budget_model or models[-1]
                order = [first] + [m for m in models if m != first]
                budget = args.budget_minutes * 60
            for model in order:
                corpus[model] = ingest(client, args.collection, model, texts, args.texts_per_job,
                                       corpus_sha, budget=budget)
                timings[f"ingest {model}"] = corpus[model]["seconds"]
                if budget is not None:
                    texts, budget = texts[:corpus[model]["texts"]], None
                    log(f"corpus for every model: the first {len(texts)} paragraphs "
                        f"(--limit {len(texts)}), {sum(map(len, texts))} characters")

            started = time.monotonic()
            counts = {"min_count": MIN_COUNT, "max_count": MAX_COUNT}
            written = []

            def get_figure(name: str, model: str, filename: str, **params) -> None:
                t = time.monotonic()
                content = client.figure(args.collection, model, name, "png", min_count=MIN_COUNT,
                                        max_count=MAX_COUNT, **params)
                path = figdir / filename
                path.write_bytes(content)
                written.append(path)
                log(f"{path} ({len(content)} bytes, {time.monotonic() - t:.1f}s)")

            numbers = {"collection": args.collection, "preset": "paper", **counts,
                       "corpus": {"source": "embgeom.corpora.bbc_texts('paragraphs')",
                                  "paragraphs": len(texts), "of_paragraphs": total_paragraphs,
                                  "characters": sum(map(len, texts)),
                                  "budget_minutes": args.budget_minutes,
                                  "reproduce_with": f"--limit {len(texts)}"},
                       "models": {}}
            for model in models:
                num_layers = available[model]["num_layers"]
                for layer in sorted({num_layers // 2, num_layers}):
                    get_figure("vm_scatter", model, f"fig2_vm_scatter_{model}_layer{layer}.png", layer=layer)
                get_figure("decomposition", model, f"fig5_decomposition_{model}.png")
                body = client.layers(args.collection, model, MIN_COUNT, MAX_COUNT)
                numbers["models"][model] = {"corpus": corpus[model], "num_layers": num_layers,
                                            "as_of": body["as_of"], "layers": body["layers"]}
            get_figure("layer_summary", models[0], f"fig4_layer_summary_{'_'.join(models)}.png", models=models)
            timings["figures"] = round(time.monotonic() - started, 1)

            if args.screenshot != "none":
                started = time.monotonic()
                shown = args.report_model or models[0]
                shot = Path(args.screenshot) if args.screenshot else figdir / f"report_{shown}.png"
                page = (f"{url}/v1/collections/{args.collection}/models/{shown}/report"
                        f"?min_count={MIN_COUNT}&max_count={MAX_COUNT}")
                screenshot(page, shot)
                written.append(shot)
                timings["report screenshot"] = round(time.monotonic() - started, 1)
                log(f"{shot} ({shot.stat().st_size} bytes, {timings['report screenshot']}s)")

        timings["total"] = round(time.monotonic() - t0, 1)
        numbers["timings_seconds"] = timings
        numbers["command"] = "python scripts/paper_figures.py " + " ".join(sys.argv[1:])
        (figdir / "paper_numbers.json").write_text(json.dumps(numbers, indent=2) + "\n")
        md = numbers_markdown(numbers)
        md += "\nWall times (s): " + ", ".join(f"{k} {v}" for k, v in timings.items()) + "\n"
        (figdir / "paper_numbers.md").write_text(md)
        print(md)
        for k, v in timings.items():
            log(f"time: {k}: {v}s")
        return 0
    finally:
        if service is not None:
            service.stop()
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
