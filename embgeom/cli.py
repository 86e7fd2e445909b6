"""The ``embgeom`` command: ``serve``, ``worker``, ``ingest``, ``table`` and ``report``."""

from __future__ import annotations

import argparse
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


def _ingest(args) -> int:
    from embgeom.client import ingest_file

    return ingest_file(args)


def _table(args) -> int:
    from embgeom.client import table_command

    return table_command(args)


def _report(args) -> int:
    from embgeom.client import report_command

    return report_command(args)


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
    ingest.set_defaults(func=_ingest)

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
    table.set_defaults(func=_table)

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
    report.set_defaults(func=_report)
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
