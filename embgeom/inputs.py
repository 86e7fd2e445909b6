"""Reading texts from files and cutting them into jobs (``embgeom ingest``).

A file is one text per line, or JSONL, CSV or Parquet records (the ``field`` of each);
its texts are cut into jobs of at most ``max_texts`` texts and :data:`MAX_JOB_BYTES` of
UTF-8, each sent under an ``Idempotency-Key`` derived from what it sends (collection,
model, include_special, the file's SHA-256, the chunk's index and content): sending the
same file again after an interruption returns the jobs already submitted instead of
counting their texts twice.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from pathlib import Path
from typing import Optional, Sequence

__all__ = [
    "MAX_JOB_BYTES", "INPUT_FORMATS", "InputError", "read_texts", "input_format", "read_input_texts",
    "chunk_texts", "idempotency_key",
]

# The smallest per-job byte limit a service may be configured with (Settings.max_job_bytes
# has ge=1_000_000), so a chunk of at most this many bytes is accepted by every service.
MAX_JOB_BYTES = 1_000_000

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

