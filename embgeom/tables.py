"""Tables of the service's answers: printed (``embgeom table``) or as pandas DataFrames.

:func:`format_table` prints rows as markdown, CSV or JSON; :func:`to_frame` turns rows into
a DataFrame (pandas is the ``notebook`` extra, imported only when a frame is asked for).
"""

from __future__ import annotations

import csv
import io
import json
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["TABLE_COLUMNS", "ISOTROPY_COLUMNS", "to_frame", "square_frame", "format_table", "isotropy_rows"]

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


def _pandas():
    try:
        import pandas as pd
    except ImportError as exc:  # pragma: no cover - the message is the point
        raise ImportError("as_frame=True needs pandas: pip install 'embgeom[notebook]'") from exc
    return pd


def to_frame(rows: Sequence[Mapping], attrs: Optional[Mapping[str, Any]] = None) -> "pd.DataFrame":
    """A DataFrame with one row per item of ``rows`` and one column per field, values as
    the JSON gave them (a null is NaN in a float column, None otherwise); ``attrs`` (the
    rest of the answer: ``as_of``, the filters) go into ``DataFrame.attrs``."""
    pd = _pandas()
    frame = pd.DataFrame.from_records(list(rows))
    frame.attrs.update(attrs or {})
    return frame


def square_frame(labels: Sequence, matrix: Sequence[Sequence], attrs: Optional[Mapping[str, Any]] = None,
                 name: str = "layer") -> "pd.DataFrame":
    """An L x L matrix (the ``.../similarity`` answer's) as a float DataFrame whose index and
    columns are ``labels`` (both named ``name``); a null is NaN; ``attrs`` as :func:`to_frame`'s."""
    pd = _pandas()
    index = pd.Index(list(labels), name=name)
    frame = pd.DataFrame([[float("nan") if v is None else v for v in row] for row in matrix],
                         index=index, columns=index.copy(), dtype="float64")
    frame.attrs.update(attrs or {})
    return frame


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

def isotropy_rows(client, collection: str, model: str, threshold: float = 5.0,
                  min_count: int = 1, rogue: int = 3) -> list[dict]:
    """Per layer: isotropy figures, outlier dimensions and the top rogue dimensions
    (``client`` an :class:`embgeom.client.EmbgeomClient`)."""
    rows = []
    for layer in (row["layer"] for row in client.layers(collection, model)["layers"]):
        iso = client.isotropy(collection, model, layer, min_count=min_count)
        out = client.outliers(collection, model, layer, threshold=threshold, top=rogue)
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

