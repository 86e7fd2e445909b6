"""The ``embgeom`` command: ``serve``, ``worker``, ``ingest``, ``table`` and ``report``.

``ingest``, ``table`` and ``report`` talk to a service through
:class:`embgeom.client.EmbgeomClient`; ``ingest`` reads and cuts its file with
:mod:`embgeom.inputs` (a second run of the same command counts nothing twice), ``table``
prints with :mod:`embgeom.tables`.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal
import sys
from pathlib import Path

__all__ = ["main"]


def _settings(args, **overrides):
    """The settings, from the environment and ``.env`` (not with ``--no-env-file``)."""
    from embgeom.settings import Settings

    if getattr(args, "no_env_file", False):
        overrides["_env_file"] = None
    return Settings(**overrides)


def _serve(args) -> int:
    import uvicorn

    from service.app import create_app

    overrides = {}
    if args.data_dir is not None:
        overrides["data_dir"] = Path(args.data_dir)
    if args.redis_url is not None:
        overrides["redis_url"] = args.redis_url
    settings = _settings(args, **overrides)
    if args.workers > 1:
        if settings.redis_url is None:
            print("--workers > 1 needs a Redis (--redis-url): the embedded Redis and workers "
                  "belong to one process", file=sys.stderr)
            return 2
        # Each API process builds its own app from the same settings (passed as EMBGEOM_*).
        os.environ.update(settings.environment())
        uvicorn.run("service.app:create_app", factory=True, workers=args.workers, host=args.host,
                    port=args.port, log_level=args.log_level, timeout_graceful_shutdown=30)
        return 0
    if settings.redis_url is None:
        from embgeom.store.server import DataDirBusy, DataDirLock

        try:  # here for a one-line message; the server takes the lock itself at start
            DataDirLock.check(settings.data_dir / "redis")
        except DataDirBusy as exc:
            print(f"embgeom serve: {exc}", file=sys.stderr)
            return 1
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=30)
    return 0


def _worker(args) -> int:
    from embgeom.worker import Worker, redis_client

    overrides = {}
    if args.redis_url:
        overrides["redis_url"] = args.redis_url
    if args.models:
        overrides["worker_models"] = args.models
    if args.dtype:
        overrides["dtype"] = args.dtype
    settings = _settings(args, **overrides)
    if not settings.redis_url:
        print("embgeom worker needs --redis-url or EMBGEOM_REDIS_URL", file=sys.stderr)
        return 2
    worker = Worker(redis_client(settings.redis_url), settings, worker_id=args.worker_id)

    def _stop(signum, frame):
        logging.getLogger(__name__).info("signal %s: finishing the current job", signum)
        worker.request_stop(grace_seconds=args.grace)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    worker.run()
    return 0


def _quiet_http_logs() -> None:
    """httpx logs every request at INFO; a command's own output says what happened."""
    log = logging.getLogger("httpx")
    if not log.isEnabledFor(logging.DEBUG):
        log.setLevel(logging.WARNING)


def _read_input(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    return Path(path).read_bytes()


def ingest_file(args) -> int:
    """``embgeom ingest``: submit a file's texts in jobs, wait, summarise.

    Returns 0 when every job is done (or, with ``--no-wait``, submitted), 1 when a job
    failed or the service refused a request, 2 when the file cannot be read, 130 on
    Ctrl-C. Submitted jobs keep running on the service either way; the same command
    resumes without counting anything twice.
    """
    import httpx
    from tqdm import tqdm

    from embgeom.client import TERMINAL, ApiError, EmbgeomClient
    from embgeom.inputs import InputError, chunk_texts, idempotency_key, input_format, read_input_texts

    _quiet_http_logs()
    fmt = input_format(args.file, getattr(args, "input_format", "auto"))
    field = getattr(args, "field", "text")
    try:
        data = _read_input(args.file)
        texts = read_input_texts(data, fmt, field)
    except OSError as exc:
        print(f"embgeom ingest: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as exc:
        print(f"embgeom ingest: {args.file} is not UTF-8 ({exc})", file=sys.stderr)
        return 2
    except InputError as exc:
        print(f"embgeom ingest: {args.file}: {exc}", file=sys.stderr)
        return 2
    if args.texts_per_job < 1:
        print("embgeom ingest: --texts-per-job must be at least 1", file=sys.stderr)
        return 2
    if not texts:
        print(f"embgeom ingest: no texts in {args.file}", file=sys.stderr)
        return 0
    chunks = chunk_texts(texts, args.texts_per_job)
    file_sha256 = hashlib.sha256(data).hexdigest()

    with EmbgeomClient(args.url, api_key=args.api_key) as client:
        job_ids: list[str] = []
        try:
            for index, chunk in enumerate(chunks):
                key = idempotency_key(args.collection, args.model, args.include_special,
                                      file_sha256, index, chunk)
                job_ids.append(client.submit(chunk, args.collection, args.model,
                                             args.include_special, idempotency_key=key))
        except (ApiError, httpx.HTTPError) as exc:
            print(f"embgeom ingest: submitting job {len(job_ids) + 1} of {len(chunks)} failed: {exc}",
                  file=sys.stderr)
            if job_ids:
                print(f"{len(job_ids)} jobs were submitted; the same command resumes without "
                      "counting them twice", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(f"\ninterrupted after submitting {len(job_ids)} of {len(chunks)} jobs; "
                  "the same command resumes without counting them twice", file=sys.stderr)
            return 130
        if args.no_wait:
            for job_id in job_ids:
                print(job_id)
            print(f"submitted {len(job_ids)} jobs, {len(texts)} texts", file=sys.stderr)
            return 0

        sizes = [len(c) for c in chunks]
        bar = tqdm(total=len(texts), unit="text", disable=args.quiet, file=sys.stderr,
                   desc=f"{args.collection}/{args.model}")

        def on_progress(statuses: list) -> None:
            done = 0.0
            for size, status in zip(sizes, statuses):
                if status is not None:
                    done += size if status["status"] in TERMINAL else size * status["progress"]
            bar.update(int(round(done)) - bar.n)

        try:
            final = client.wait(job_ids, on_progress=on_progress)
            stored = {c["name"]: c["models"] for c in client.collections()}
        except KeyboardInterrupt:
            print("\ninterrupted; the jobs keep running on the service, and the same command "
                  "resumes waiting for them", file=sys.stderr)
            return 130
        except (ApiError, httpx.HTTPError) as exc:
            print(f"embgeom ingest: waiting for the jobs failed: {exc}", file=sys.stderr)
            return 1
        finally:
            bar.close()

    failed = [s for s in final if s["status"] == "failed"]
    tokens = sum(s["tokens"] for s in final if s["status"] == "done")
    print(f"jobs: {len(final)}  texts: {len(texts)}  tokens: {tokens}  failed: {len(failed)}")
    for status in failed:
        print(f"failed job {status['job_id']}: {status['error']}", file=sys.stderr)
    if len(failed) < len(final) and args.model not in stored.get(args.collection, []):
        # The jobs are done but their counts are gone: the collection was deleted after
        # they ran. The service keeps Idempotency-Keys across a DELETE, so this command
        # got the old jobs back instead of counting the file again.
        print(f"embgeom ingest: collection {args.collection!r} holds nothing for {args.model!r}: it was "
              "deleted after these jobs ran, and the service returned the old jobs for this file "
              "instead of counting it again; ingest into another --collection", file=sys.stderr)
        return 1
    return 1 if failed else 0


def report_command(args) -> int:
    """``embgeom report``: write the report page and every figure into ``--out``.

    The page is ``report.html``; each figure is ``<name>.<format>``. The per-layer
    figures show ``--layer``, by default the layer the service's page shows (the middle
    kept one). Returns 0, 1 when the service refuses, 2 when ``--out`` cannot be written.
    """
    import httpx

    from embgeom.client import ApiError, EmbgeomClient
    from embgeom.figure_names import FIGURES, LAYER_FIGURES

    _quiet_http_logs()
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"embgeom report: cannot create {out}: {exc}", file=sys.stderr)
        return 2
    written = []
    try:
        with EmbgeomClient(args.url, api_key=args.api_key, timeout=300) as client:
            page, layer = client.report(args.collection, args.model, args.min_count, args.max_count,
                                        args.layer, args.format)
            path = out / "report.html"
            path.write_text(page, encoding="utf-8")
            written.append(path)
            for name in FIGURES:
                if name in LAYER_FIGURES and layer is None:
                    continue  # nothing ingested yet: no layer to show
                try:
                    content = client.figure(args.collection, args.model, name, args.format,
                                            layer if name in LAYER_FIGURES else None,
                                            args.min_count, args.max_count)
                except ApiError as exc:
                    if exc.type == "cross_layer_not_kept":
                        continue  # cka: the collection was made without cross_layer
                    raise
                path = out / f"{name}.{args.format}"
                path.write_bytes(content)
                written.append(path)
    except (ApiError, httpx.HTTPError) as exc:
        print(f"embgeom report: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"embgeom report: cannot write into {out}: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


def table_command(args) -> int:
    """``embgeom table``: print /layers of a collection and model as a table."""
    import httpx

    from embgeom.client import ApiError, EmbgeomClient
    from embgeom.tables import ISOTROPY_COLUMNS, format_table, isotropy_rows

    _quiet_http_logs()
    try:
        with EmbgeomClient(args.url, api_key=args.api_key) as client:
            if getattr(args, "kind", "layers") == "isotropy":
                rows = isotropy_rows(client, args.collection, args.model, args.threshold,
                                     args.min_count)
                print(format_table(rows, args.format, ISOTROPY_COLUMNS))
                return 0
            body = client.layers(args.collection, args.model, args.min_count, args.max_count)
    except (ApiError, httpx.HTTPError) as exc:
        print(f"embgeom table: {exc}", file=sys.stderr)
        return 1
    print(format_table(body["layers"], args.format))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="embgeom", description=__doc__)
    parser.add_argument("--log-level", default=None, help="default EMBGEOM_LOG_LEVEL, else info")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the HTTP service (embedded Redis + worker by default)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--data-dir", default=None, help="embedded Redis data (default ./data)")
    serve.add_argument("--redis-url", default=None,
                       help="production mode: serve HTTP and enqueue only (also EMBGEOM_REDIS_URL)")
    serve.add_argument("--workers", type=int, default=1,
                       help="API processes (production mode only; reads scale with cores)")
    serve.set_defaults(func=_serve)

    worker = sub.add_parser("worker", help="process jobs from a Redis")
    worker.add_argument("--redis-url", default=None, help="default EMBGEOM_REDIS_URL")
    worker.add_argument("--models", default=None, help="comma-separated aliases to serve (default all)")
    worker.add_argument("--worker-id", default=None)
    worker.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                        help="dtype of the forward pass (statistics stay float64; also EMBGEOM_DTYPE)")
    worker.add_argument("--grace", type=float, default=30.0,
                        help="seconds to finish the current job after SIGTERM before handing it back")
    worker.add_argument("--no-env-file", action="store_true",
                        help="settings from the environment only, not .env (an embedded serve "
                             "passes every setting a worker reads, and no keys)")
    worker.set_defaults(func=_worker)

    ingest = sub.add_parser("ingest", help="send a file's texts in jobs and wait: one text per line, "
                                           "or JSONL, CSV, Parquet records")
    ingest.add_argument("file", help="text file, one text per line ('-' for stdin); .jsonl/.ndjson, "
                                     ".csv, .parquet/.pq files are read as records")
    ingest.add_argument("--field", default="text",
                        help="the record field holding the text (JSONL, CSV, Parquet; default: text)")
    ingest.add_argument("--input-format", choices=("auto", "lines", "jsonl", "csv", "parquet"),
                        default="auto", help="default: by the file's extension (lines otherwise)")
    ingest.add_argument("--model", default="minilm")
    ingest.add_argument("--collection", default="default")
    ingest.add_argument("--url", default=None,
                        help="default EMBGEOM_URL, else http://127.0.0.1:8080")
    ingest.add_argument("--texts-per-job", type=int, default=1000)
    ingest.add_argument("--include-special", action="store_true", default=None,
                        help="count the special tokens (only for a collection made by its "
                             "first job; otherwise the collection's settings decide)")
    ingest.add_argument("--api-key", default=None, help="default EMBGEOM_API_KEY")
    ingest.add_argument("--no-wait", action="store_true", help="submit and return")
    ingest.add_argument("--quiet", action="store_true", help="no progress bar")
    ingest.set_defaults(func=ingest_file)

    table = sub.add_parser("table", help="print the per-layer table of a collection and model")
    table.add_argument("--url", default=None,
                        help="default EMBGEOM_URL, else http://127.0.0.1:8080")
    table.add_argument("--collection", default="default")
    table.add_argument("--model", default="minilm")
    table.add_argument("--min-count", type=int, default=1, help="keep token types with n >= this")
    table.add_argument("--max-count", type=int, default=None, help="keep token types with n <= this")
    table.add_argument("--format", choices=("markdown", "csv", "json"), default="markdown")
    table.add_argument("--kind", choices=("layers", "isotropy"), default="layers",
                       help="layers: Q/M/V decomposition and summary; isotropy: IsoScore, "
                            "mean cosine, spectrum, I(W), outlier and rogue dimensions")
    table.add_argument("--threshold", type=float, default=5.0, help="outlier threshold (isotropy)")
    table.add_argument("--api-key", default=None, help="default EMBGEOM_API_KEY")
    table.set_defaults(func=table_command)

    report = sub.add_parser("report", help="write the report page and every figure of a collection "
                                           "and model into a folder")
    report.add_argument("--url", default=None,
                        help="default EMBGEOM_URL, else http://127.0.0.1:8080")
    report.add_argument("--collection", default="default")
    report.add_argument("--model", default="minilm")
    report.add_argument("--out", required=True, help="folder to write report.html and <figure>.<format> into")
    report.add_argument("--format", choices=("png", "svg"), default="png", help="figure format")
    report.add_argument("--layer", type=int, default=None,
                        help="layer of vm_scatter, frequency and spectrum (default: the middle kept layer)")
    report.add_argument("--min-count", type=int, default=1, help="keep token types with n >= this")
    report.add_argument("--max-count", type=int, default=None, help="keep token types with n <= this")
    report.add_argument("--api-key", default=None, help="default EMBGEOM_API_KEY")
    report.set_defaults(func=report_command)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    settings = _settings(args)
    for name in ("url", "api_key"):  # the client commands' defaults
        if hasattr(args, name) and getattr(args, name) is None:
            setattr(args, name, getattr(settings, name))
    args.log_level = (args.log_level or settings.log_level or "info").lower()
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Read by huggingface_hub itself: models come from packages and the local cache.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
