"""Per-token exports of one layer: one row per token type, as CSV or Parquet, written
chunk by chunk.

    prepare(reader, pair, layer, count_filter, means, tokenizer) -> Plan -> Export
    stream(export, read, fmt)                                    -> iterator of bytes

Columns, in order:

========================  =========================================================
``token_id`` (int64)      the token's key: its vocabulary id (for a collection keyed
                          by string, the smallest id of its canonical string), as in
                          ``.../layers/{l}/tokens``
``token`` (string)        the token's string (canonical with string keys)
``n`` (int64)             occurrences counted
``Q``, ``M``, ``V``       mean squared norm, squared norm of the mean, variance
(float64)
``self_similarity``       mean cosine between distinct occurrences; null when the
(float64, nullable)       collection keeps no unit sums, or for n = 1
``mean`` (list<float64>)  only with ``means=True``: the mean vector (d,); in CSV a
                          JSON array
========================  =========================================================

Rows are ordered by ``token_id``. Every value equals what the JSON token endpoints
answer, bit for bit: ``n, Q, M, V`` come from one read of the per-token scalars (the
read that ``.../tokens`` makes), ``self_similarity`` from
:func:`embgeom.reports.self_similarities`; floats in CSV are written in Python's shortest
round-trip form (pandas >= 3 reads them back exactly with its default parser).

Reading an export back, in one line::

    pandas.read_parquet(url)            # or polars.read_parquet(url)
    pandas.read_csv(url, keep_default_na=False, na_values={"self_similarity": [""]})

(``keep_default_na=False`` keeps token strings such as ``nan`` or ``null`` as strings.)

Memory: the scalars (k x (1 + 2L) floats, what every filtered read holds anyway) are read
once; unit sums and mean vectors are then read for :data:`CHUNK_BYTES` worth of rows at a
time, each chunk written (a Parquet row group, or CSV lines) before the next is read. The
``as_of`` of the scalars read is the export's (in the Parquet schema metadata under
``embgeom``); unit sums and means are read chunk by chunk after it, so rows exported while
checkpoints land may pair a newer mean with the scalars' n.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import numpy as np
import orjson

from embgeom import reports
from embgeom.errors import InvalidInput
from embgeom.store.keys import PairKeys
from embgeom.store.reader import PairState, Plan, Reader

__all__ = ["FORMATS", "MEDIA_TYPES", "COLUMNS", "CHUNK_BYTES", "Export", "check_format", "prepare",
           "chunks", "stream", "write_csv", "write_parquet"]

FORMATS = ("parquet", "csv")
MEDIA_TYPES = {"parquet": "application/vnd.apache.parquet", "csv": "text/csv; charset=utf-8"}
COLUMNS = ("token_id", "token", "n", "Q", "M", "V", "self_similarity")
MEAN_COLUMN = "mean"
CHUNK_BYTES = 16 << 20
MIN_CHUNK_ROWS, MAX_CHUNK_ROWS = 16, 65536


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise InvalidInput(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}",
                           type="invalid_format", format=fmt, formats=list(FORMATS))
    return fmt


@dataclass
class Export:
    """What an export writes: the kept rows' scalars, read once, and how to read the rest."""

    reader: Reader
    state: PairState
    layer: int
    position: Optional[int]
    ids: np.ndarray
    n: np.ndarray
    Q: np.ndarray
    M: np.ndarray
    V: np.ndarray
    means: bool
    tokenizer: Any
    count_filter: reports.CountFilter
    metadata: dict = field(default_factory=dict)
    unit_norms: Optional[np.ndarray] = None  # ||U||^2 of the kept rows, when the scalars hold it

    @property
    def rows(self) -> int:
        return int(self.ids.shape[0])

    def chunk_rows(self, budget: int = CHUNK_BYTES) -> int:
        """Rows per chunk: what one chunk reads (unit sums and records are whole inside
        Redis, every layer of the layer's group, per key) stays within ``budget`` bytes."""
        conf = self.state.conf
        per_row = 64
        if conf is not None:
            L = conf.L if self.position is None else len(conf.groups[conf.group_of(self.position)[0]])
            if conf.self_similarity and not conf.stores_unit_norms:
                per_row += 8 * L * conf.d
            if self.means:
                per_row += 8 * (1 + L + L * conf.d) + 24 * conf.d
        return int(min(MAX_CHUNK_ROWS, max(MIN_CHUNK_ROWS, budget // per_row)))


def prepare(reader: Reader, pair: PairKeys, layer: int, count_filter: reports.CountFilter,
            means: bool, tokenizer) -> Plan:
    """The export's scalars: ``collection_not_found``, ``model_not_in_collection`` and
    ``layer_not_kept`` are raised here, before anything is written."""
    state = yield from reader.pair_state(pair)
    empty = np.zeros(0)
    meta = {"collection": pair.collection, "model": pair.model, "layer": layer,
            **count_filter.to_dict(), "means": means, "as_of": state.as_of()}
    if state.empty:
        return Export(reader, state, layer, None, np.zeros(0, dtype=np.int64), empty, empty, empty,
                      empty, means, tokenizer, count_filter, meta)
    (pos,) = reports._positions(state, [layer])
    scal = yield from reader.scalars(state)
    M, V, Q = scal.at(pos)
    keep = count_filter.mask(scal.n)
    meta.update({"key": state.conf.key, "unit": state.conf.unit,
                 "self_similarity_kept": state.conf.self_similarity})
    norms = scal.unit_norms_at(pos)
    return Export(reader, state, layer, pos, scal.ids[keep], scal.n[keep], Q[keep], M[keep], V[keep],
                  means, tokenizer, count_filter, meta, None if norms is None else norms[keep])


def chunks(export: Export, read: Callable[[Plan], Any], rows: Optional[int] = None) -> Iterator[dict]:
    """The export's rows, a chunk at a time: dicts of column -> list (ndarray for floats;
    ``mean`` a list of ndarrays or None)."""
    rows = rows or export.chunk_rows()
    state, pos = export.state, export.position
    for start in range(0, export.rows, rows):
        sl = slice(start, start + rows)
        ids = export.ids[sl]
        n = export.n[sl]
        keys = ids.tolist()
        norms = None if export.unit_norms is None else export.unit_norms[sl]
        chunk = {
            "token_id": ids,
            "token": read(reports.token_strings(export.reader, state, export.tokenizer, ids)),
            "n": n.astype(np.int64),
            "Q": export.Q[sl], "M": export.M[sl], "V": export.V[sl],
            "self_similarity": read(reports.self_similarities(export.reader, state, keys, n, pos, norms)),
        }
        if export.means:
            rec_n, _, mean = read(export.reader.means_of(state, keys, [pos]))
            chunk[MEAN_COLUMN] = [mean[i, 0] if rec_n[i] > 0 else None for i in range(len(keys))]
        yield chunk


# ------------------------------------------------------------------ CSV

def _csv_float(x) -> str:
    return "" if x is None else repr(float(x))


def write_csv(export: Export, parts: Iterator[dict]) -> Iterator[bytes]:
    """A header line, then the rows of each chunk (UTF-8, ``\\n`` line ends, quoted only
    where needed); a missing value is an empty field."""
    columns = COLUMNS + ((MEAN_COLUMN,) if export.means else ())
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    yield buf.getvalue().encode("utf-8")
    for chunk in parts:
        buf.seek(0)
        buf.truncate()
        means = chunk.get(MEAN_COLUMN)
        for i in range(len(chunk["token_id"])):
            row = [int(chunk["token_id"][i]), chunk["token"][i], int(chunk["n"][i]),
                   _csv_float(chunk["Q"][i]), _csv_float(chunk["M"][i]), _csv_float(chunk["V"][i]),
                   _csv_float(chunk["self_similarity"][i])]
            if means is not None:
                m = means[i]
                row.append("" if m is None else orjson.dumps(m, option=orjson.OPT_SERIALIZE_NUMPY).decode())
            writer.writerow(row)
        yield buf.getvalue().encode("utf-8")


# ------------------------------------------------------------------ Parquet

class _Sink:
    """A write-only file that hands out what was written since the last :meth:`take`."""

    def __init__(self):
        self._parts: list[bytes] = []
        self._pos = 0
        self.closed = False

    def write(self, data) -> int:
        data = bytes(data)
        self._parts.append(data)
        self._pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts = []
        return out


def parquet_schema(export: Export):
    import pyarrow as pa

    fields = [("token_id", pa.int64()), ("token", pa.string()), ("n", pa.int64()),
              ("Q", pa.float64()), ("M", pa.float64()), ("V", pa.float64()),
              ("self_similarity", pa.float64())]
    if export.means:
        fields.append((MEAN_COLUMN, pa.list_(pa.float64())))
    return pa.schema(fields, metadata={b"embgeom": json.dumps(export.metadata).encode()})


def _list_array(vectors: list):
    """A list<float64> column from vectors (None: null) without a Python float per value."""
    import pyarrow as pa

    present = np.array([v is not None for v in vectors], dtype=bool)
    lengths = np.array([0 if v is None else len(v) for v in vectors], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = (np.concatenate([v for v in vectors if v is not None]) if present.any()
              else np.zeros(0)).astype(np.float64)
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), pa.array(values),
                                    mask=pa.array(~present))


def write_parquet(export: Export, parts: Iterator[dict]) -> Iterator[bytes]:
    """One row group per chunk, each handed out as soon as it is written, then the
    footer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = parquet_schema(export)
    sink = _Sink()
    writer = pq.ParquetWriter(sink, schema, compression="zstd")
    try:
        for chunk in parts:
            columns = [pa.array(chunk[name], type=schema.field(name).type) for name in schema.names
                       if name != MEAN_COLUMN]
            if export.means:
                columns.append(_list_array(chunk[MEAN_COLUMN]))
            writer.write_table(pa.Table.from_arrays(columns, schema=schema))
            out = sink.take()
            if out:
                yield out
    finally:
        writer.close()
    yield sink.take()


def stream(export: Export, read: Callable[[Plan], Any], fmt: str) -> Iterator[bytes]:
    """The export encoded as ``fmt``, piece by piece."""
    parts = chunks(export, read)
    return write_parquet(export, parts) if check_format(fmt) == "parquet" else write_csv(export, parts)
