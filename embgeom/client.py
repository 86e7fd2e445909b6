"""A small HTTP client for the embgeom service, and the ``ingest``, ``table`` and
``report`` commands.

:class:`EmbgeomClient` wraps the v1 API of DESIGN.md section 2: every error body
``{"type", "message", "detail"}`` is raised as :class:`ApiError`, and a 429 (the queue
is full) is retried after the server's ``Retry-After``, or after an exponential backoff
when it gives none.

``embgeom ingest FILE`` reads a text file (one text per line), or a JSONL, CSV or
Parquet file (the ``--field`` of each record), and cuts its texts into jobs of at most
``--texts-per-job`` texts and :data:`MAX_JOB_BYTES` of UTF-8, and submits each under
an ``Idempotency-Key`` derived from what it sends (collection, model, include_special,
the file's SHA-256, the chunk's index and content): running the same command again
after an interruption returns the jobs already submitted instead of counting their
texts twice.
"""

from __future__ import annotations

import csv
import email.utils
import hashlib
import io
import json
import logging
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import httpx

__all__ = [
    "ApiError", "EmbgeomClient", "MAX_JOB_BYTES", "TABLE_COLUMNS", "ISOTROPY_COLUMNS", "isotropy_rows",
    "read_texts", "chunk_texts", "idempotency_key", "ingest_file", "format_table", "table_command",
    "INPUT_FORMATS", "InputError", "input_format", "read_input_texts", "report_command",
]

# The smallest per-job byte limit a service may be configured with (Settings.max_job_bytes
# has ge=1_000_000), so a chunk of at most this many bytes is accepted by every service.
MAX_JOB_BYTES = 1_000_000

TERMINAL = ("done", "failed")

# Column of the printed table -> field of a /layers row.
TABLE_COLUMNS = {
    "layer": "layer", "n": "n", "types": "num_types", "Q": "Q", "M": "M", "V": "V",
    "V_W": "V_W", "V_B": "V_B", "cv_Q": "cv_Q", "slope": "slope", "r2": "r2",
}

# Column -> field of the rows built by :func:`isotropy_rows`.
ISOTROPY_COLUMNS = {
    "layer": "layer", "n": "n", "IsoScore": "isoscore", "mean cos": "mean_cosine",
    "eff. rank": "effective_rank", "PR": "participation_ratio", "top eig": "top_eigenvalue_ratio",
    "log10 I(W)": "partition_isotropy_log10", "outlier dims (ratio)": "outliers", "top rogue dims (CC share)": "rogue",
}


class ApiError(Exception):
    """An error answered by the service: HTTP status, stable ``type``, human ``message``."""

    def __init__(self, status: int, type: str, message: str, detail: Optional[dict] = None):
        super().__init__(f"{status} {type}: {message}")
        self.status = status
        self.type = type
        self.message = message
        self.detail = detail or {}

    @classmethod
    def from_response(cls, response: httpx.Response) -> "ApiError":
        try:
            body = response.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and "type" in body:
            return cls(response.status_code, str(body["type"]), str(body.get("message", "")),
                       body.get("detail") or {})
        # Not the service's error shape (a proxy in between, for instance).
        return cls(response.status_code, "http_error", response.text[:500] or response.reason_phrase)


def _retry_after(response: httpx.Response) -> Optional[float]:
    """Seconds from a ``Retry-After`` header: delta-seconds or an HTTP date."""
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


class EmbgeomClient:
    """The v1 API over HTTP.

    Parameters
    ----------
    url : base URL of the service, e.g. ``http://127.0.0.1:8080``.
    api_key : sent as ``Authorization: Bearer <key>`` when given.
    timeout : seconds per request.
    max_retries : 429 answers retried before :class:`ApiError` is raised.
    max_backoff : upper bound, in seconds, of one wait between retries.
    transport : an ``httpx`` transport (tests pass ``httpx.MockTransport``).
    sleep : the function that waits (tests pass a recorder).
    """

    def __init__(self, url: str, api_key: Optional[str] = None, timeout: float = 60.0,
                 max_retries: int = 10, max_backoff: float = 30.0,
                 transport: Optional[httpx.BaseTransport] = None,
                 sleep: Callable[[float], None] = time.sleep):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout,
                                  transport=transport)
        self.max_retries = max_retries
        self.max_backoff = max_backoff
        self._sleep = sleep

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "EmbgeomClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- transport
    def _send(self, method: str, path: str, **kwargs) -> httpx.Response:
        """The response of a request (429 retried); an error answer raises :class:`ApiError`."""
        for attempt in range(self.max_retries + 1):
            response = self._http.request(method, path, **kwargs)
            if response.status_code != 429 or attempt == self.max_retries:
                break
            delay = _retry_after(response)
            if delay is None:  # full jitter, so many clients do not come back together
                delay = random.uniform(0, 0.5 * 2 ** attempt)
            self._sleep(min(delay, self.max_backoff))
        if response.is_error:
            raise ApiError.from_response(response)
        return response

    def _request(self, method: str, path: str, **kwargs) -> dict:
        return self._send(method, path, **kwargs).json()

    # --------------------------------------------------------------------- jobs
    def submit(self, texts: Sequence[str], collection: str = "default", model: str = "minilm",
               include_special: Optional[bool] = None, idempotency_key: Optional[str] = None) -> str:
        """Queue ``texts``; returns the job id (the first job's, for a repeated key).

        ``include_special`` None leaves it to the collection's settings (a job that says
        otherwise than an existing collection is refused with 409)."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        body = {"collection": collection, "model": model, "texts": list(texts)}
        if include_special is not None:
            body["include_special"] = include_special
        return self._request("POST", "/v1/jobs", json=body, headers=headers)["job_id"]

    def job(self, job_id: str) -> dict:
        return self._request("GET", f"/v1/jobs/{job_id}")

    def jobs(self, job_ids: Sequence[str]) -> list[dict]:
        """Status of many jobs in one request (``GET /v1/jobs?ids=``), in order."""
        return self._request("GET", "/v1/jobs", params={"ids": ",".join(job_ids)})

    def wait(self, job_ids: Sequence[str], on_progress: Optional[Callable[[list], None]] = None,
             timeout: Optional[float] = None, poll_interval: float = 0.5,
             window: int = 64) -> list[dict]:
        """Poll until every job is done or failed; returns their final statuses, in order.

        ``on_progress(statuses)`` is called after each round with the latest status of
        every job (``None`` for one not polled yet). A round asks for the ``window`` oldest
        unfinished jobs in one request: workers take jobs in order, so later ones rarely
        moved. Raises ``TimeoutError`` after ``timeout`` seconds.
        """
        ids = list(dict.fromkeys(job_ids))
        latest: dict[str, Optional[dict]] = {j: None for j in ids}
        pending = list(ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for status in self.jobs(pending[:window]):
                latest[status["job_id"]] = status
            pending = [j for j in pending if (latest[j] or {}).get("status") not in TERMINAL]
            if on_progress is not None:
                on_progress([latest[j] for j in job_ids])
            if not pending:
                return [latest[j] for j in job_ids]
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{len(pending)} jobs not finished after {timeout}s: "
                                   f"{', '.join(pending[:5])}{' ...' if len(pending) > 5 else ''}")
            self._sleep(poll_interval)

    # ---------------------------------------------------------------- reports
    def models(self) -> list[dict]:
        return self._request("GET", "/v1/models")

    def collections(self) -> list[dict]:
        return self._request("GET", "/v1/collections")

    def delete_collection(self, collection: str) -> dict:
        return self._request("DELETE", f"/v1/collections/{collection}")

    @staticmethod
    def _counts(min_count: int, max_count: Optional[int]) -> dict:
        params = {"min_count": min_count}
        if max_count is not None:
            params["max_count"] = max_count
        return params

    def layers(self, collection: str, model: str, min_count: int = 1,
               max_count: Optional[int] = None) -> dict:
        """``{"layers": [row per layer], "as_of": ..., ...}`` as the service answers it."""
        return self._request("GET", f"/v1/collections/{collection}/models/{model}/layers",
                             params=self._counts(min_count, max_count))

    def decomposition(self, collection: str, model: str, layer: int, min_count: int = 1,
                      max_count: Optional[int] = None) -> dict:
        return self._request(
            "GET", f"/v1/collections/{collection}/models/{model}/layers/{layer}/decomposition",
            params=self._counts(min_count, max_count))

    def tokens(self, collection: str, model: str, layer: int, order_by: str = "n",
               desc: bool = True, min_count: int = 1, max_count: Optional[int] = None,
               token: Optional[str] = None, page_size: int = 1000) -> Iterator[dict]:
        """Every token type's stats at ``layer``, following ``next_cursor`` page by page."""
        params = {"order_by": order_by, "desc": str(desc).lower(), "limit": page_size,
                  **self._counts(min_count, max_count)}
        if token is not None:
            params["token"] = token
        path = f"/v1/collections/{collection}/models/{model}/layers/{layer}/tokens"
        while True:
            page = self._request("GET", path, params=params)
            yield from page["tokens"]
            if not page.get("next_cursor"):
                return
            params["cursor"] = page["next_cursor"]

    def token(self, collection: str, model: str, layer: int, token_id: int) -> dict:
        return self._request(
            "GET", f"/v1/collections/{collection}/models/{model}/layers/{layer}/tokens/{token_id}")

    # ---------------------------------------------------------- figures, report
    def figure(self, collection: str, model: str, name: str, fmt: str = "png",
               layer: Optional[int] = None, min_count: int = 1, max_count: Optional[int] = None,
               models: Optional[Sequence[str]] = None) -> bytes:
        """One figure's PNG or SVG bytes (``layer`` for vm_scatter, frequency, spectrum;
        ``models`` to overlay in layer_summary)."""
        params: dict = {"format": fmt, **self._counts(min_count, max_count)}
        if layer is not None:
            params["layer"] = layer
        if models:
            params["models"] = ",".join(models)
        return self._send("GET", f"/v1/collections/{collection}/models/{model}/figures/{name}",
                          params=params).content

    def report(self, collection: str, model: str, min_count: int = 1, max_count: Optional[int] = None,
               layer: Optional[int] = None, fmt: str = "png") -> tuple[str, Optional[int]]:
        """The report page (HTML) and the layer its per-layer figures show."""
        params: dict = {"format": fmt, **self._counts(min_count, max_count)}
        if layer is not None:
            params["layer"] = layer
        response = self._send("GET", f"/v1/collections/{collection}/models/{model}/report", params=params)
        shown = response.headers.get("x-embgeom-layer")
        return response.text, (int(shown) if shown is not None else None)

    def export(self, collection: str, model: str, layer: int, out, fmt: str = "parquet",
               min_count: int = 1, max_count: Optional[int] = None, means: bool = False) -> int:
        """Stream a layer's per-token export into the binary file ``out``; returns bytes written."""
        params = {"format": fmt, "means": str(bool(means)).lower(), **self._counts(min_count, max_count)}
        path = f"/v1/collections/{collection}/models/{model}/layers/{layer}/export"
        written = 0
        with self._http.stream("GET", path, params=params) as response:
            if response.is_error:
                response.read()
                raise ApiError.from_response(response)
            for piece in response.iter_bytes():
                out.write(piece)
                written += len(piece)
        return written


# ----------------------------------------------------------------------- ingest
def read_texts(data: str) -> list[str]:
    """One text per line; lines that are empty or only whitespace are skipped.

    Only ``\\n`` (and a ``\\r`` before it) ends a line: other characters that
    ``str.splitlines`` would split on (form feed, U+2028, ...) stay inside the text.
    """
    texts = []
    for line in data.split("\n"):
        if line.endswith("\r"):
            line = line[:-1]
        if line.strip():
            texts.append(line)
    return texts


INPUT_FORMATS = ("lines", "jsonl", "csv", "parquet")
_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet",
               ".pq": "parquet"}


class InputError(ValueError):
    """A file that cannot be read as the format it was taken for."""


def input_format(path: str, fmt: str = "auto") -> str:
    """The format of an input file: ``fmt`` unless "auto", else by extension (``.jsonl``,
    ``.ndjson``, ``.csv``, ``.parquet``, ``.pq``); anything else, and stdin, is one text
    per line."""
    if fmt != "auto":
        if fmt not in INPUT_FORMATS:
            raise ValueError(f"unknown input format {fmt!r}: auto, {', '.join(INPUT_FORMATS)}")
        return fmt
    return "lines" if path == "-" else _EXTENSIONS.get(Path(path).suffix.lower(), "lines")


def _field_text(value, field: str, where: str) -> Optional[str]:
    """The text of one record's field: None (skipped) when null or blank."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InputError(f"{where}: field {field!r} is a {type(value).__name__}, not a string")
    return value if value.strip() else None


def read_input_texts(data: bytes, fmt: str, field: str = "text") -> list[str]:
    """The texts of a file's bytes, in file order.

    ``lines``: one text per line (:func:`read_texts`). ``jsonl``: one JSON object per
    line, its ``field``. ``csv``: a header row naming ``field``, one record per row
    (quoted fields may hold newlines). ``parquet``: the string column ``field``. Blank
    lines, and records whose field is null, empty or whitespace, are skipped; a record
    without the field, a value that is not a string, or a line that is not JSON is an
    :class:`InputError` naming where. Text files are UTF-8 (a BOM is ignored).
    """
    if fmt == "lines":
        return read_texts(data.decode("utf-8-sig"))
    texts: list[str] = []
    if fmt == "jsonl":
        for number, line in enumerate(data.decode("utf-8-sig").split("\n"), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise InputError(f"line {number} is not JSON ({exc})") from None
            if not isinstance(record, dict):
                raise InputError(f"line {number} is not a JSON object")
            if field not in record:
                raise InputError(f"line {number} has no field {field!r}")
            text = _field_text(record[field], field, f"line {number}")
            if text is not None:
                texts.append(text)
        return texts
    if fmt == "csv":
        reader = csv.DictReader(io.StringIO(data.decode("utf-8-sig"), newline=""))
        if reader.fieldnames is None:
            return []
        if field not in reader.fieldnames:
            raise InputError(f"no column {field!r}; columns: {', '.join(reader.fieldnames)}")
        for record in reader:
            text = _field_text(record[field], field, f"record {reader.line_num}")
            if text is not None:
                texts.append(text)
        return texts
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            source = pq.ParquetFile(io.BytesIO(data))
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"not a Parquet file ({exc})") from None
        schema = source.schema_arrow
        if field not in schema.names:
            raise InputError(f"no column {field!r}; columns: {', '.join(schema.names)}")
        kind = schema.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise InputError(f"column {field!r} is {kind}, not strings")
        for batch in source.iter_batches(columns=[field]):
            texts.extend(t for t in batch.column(0).to_pylist() if t is not None and t.strip())
        return texts
    raise ValueError(f"unknown input format {fmt!r}")


def chunk_texts(texts: Sequence[str], max_texts: int, max_bytes: int = MAX_JOB_BYTES) -> list[list[str]]:
    """Consecutive chunks of at most ``max_texts`` texts and ``max_bytes`` UTF-8 bytes.

    A single text longer than ``max_bytes`` goes alone in its chunk (texts are never cut:
    the service windows long texts itself); the service decides whether it accepts it.
    """
    if max_texts < 1:
        raise ValueError("max_texts must be at least 1")
    chunks: list[list[str]] = []
    current: list[str] = []
    size = 0
    for text in texts:
        n = len(text.encode("utf-8"))
        if current and (len(current) == max_texts or size + n > max_bytes):
            chunks.append(current)
            current, size = [], 0
        current.append(text)
        size += n
    if current:
        chunks.append(current)
    return chunks


def idempotency_key(collection: str, model: str, include_special: bool, file_sha256: str,
                    index: int, chunk: Sequence[str]) -> str:
    """The key of one chunk of one file: the same command sends the same keys.

    The chunk's own content is part of it, so a run with another ``--texts-per-job``
    never receives a job that carried different texts.
    """
    h = hashlib.sha256()
    h.update(json.dumps([collection, model, bool(include_special), file_sha256, index],
                        ensure_ascii=False).encode())
    for text in chunk:
        h.update(hashlib.sha256(text.encode("utf-8")).digest())
    return f"embgeom-ingest-v1:{h.hexdigest()}"


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
    from tqdm import tqdm

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


# ----------------------------------------------------------------------- report
def report_command(args) -> int:
    """``embgeom report``: write the report page and every figure into ``--out``.

    The page is ``report.html``; each figure is ``<name>.<format>``. The per-layer
    figures show ``--layer``, by default the layer the service's page shows (the middle
    kept one). Returns 0, 1 when the service refuses, 2 when ``--out`` cannot be written.
    """
    from embgeom.figures import FIGURES
    from embgeom.renders import LAYER_FIGURES

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
                content = client.figure(args.collection, args.model, name, args.format,
                                        layer if name in LAYER_FIGURES else None,
                                        args.min_count, args.max_count)
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


# ------------------------------------------------------------------------ table
def _cell(value, fmt: str) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and fmt == "markdown":
        return f"{value:.6g}"
    return repr(value) if isinstance(value, float) else str(value)


def _listed(items, most: int = 5) -> str:
    """At most ``most`` items, then how many more."""
    items = list(items)
    if not items:
        return "-"
    more = f" +{len(items) - most} more" if len(items) > most else ""
    return " ".join(items[:most]) + more


def isotropy_rows(client: "EmbgeomClient", collection: str, model: str, threshold: float = 5.0,
                  min_count: int = 1, rogue: int = 3) -> list[dict]:
    """Per layer: isotropy figures, outlier dimensions and the top rogue dimensions."""
    base = f"/v1/collections/{collection}/models/{model}"
    layers = client._request("GET", f"{base}/layers")["layers"]
    rows = []
    for layer in (row["layer"] for row in layers):
        iso = client._request("GET", f"{base}/layers/{layer}/isotropy", params={"min_count": min_count})
        out = client._request("GET", f"{base}/layers/{layer}/outliers",
                              params={"threshold": threshold, "top": rogue})
        rows.append({
            **{k: iso.get(k) for k in ("layer", "n", "isoscore", "mean_cosine", "effective_rank",
                                       "participation_ratio", "top_eigenvalue_ratio",
                                       "partition_isotropy_log10")},
            "outliers": _listed(f"{d['dim']}({d['ratio']:.1f})" for d in out["dimensions"]),
            "rogue": " ".join(f"{d['dim']}({d['share']:.2f})" for d in (out["rogue"] or [])) or "-",
        })
    return rows


def format_table(rows: Sequence[dict], fmt: str = "markdown", columns: Optional[dict] = None) -> str:
    """The per-layer table of :data:`TABLE_COLUMNS` from /layers rows.

    ``csv`` and ``json`` keep every float exactly (shortest repr); ``markdown`` shows six
    significant digits. A value the service left null is an empty cell (``null`` in json).
    """
    columns = columns or TABLE_COLUMNS
    table = [{col: row.get(field) for col, field in columns.items()} for row in rows]
    if fmt == "json":
        return json.dumps(table, indent=2)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([_cell(r[c], fmt) for c in columns] for r in table)
        return out.getvalue().rstrip("\n")
    if fmt != "markdown":
        raise ValueError(f"unknown format {fmt!r}: markdown, csv or json")
    cells = [list(columns)] + [[_cell(r[c], fmt) for c in columns] for r in table]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["| " + " | ".join(c.rjust(w) for c, w in zip(line, widths)) + " |" for line in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    return "\n".join(lines)


def table_command(args) -> int:
    """``embgeom table``: print /layers of a collection and model as a table."""
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
