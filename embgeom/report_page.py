"""The report page: one self-contained HTML5 document of a (collection, model) pair.

    build_report(title, summary, layer_rows, isotropy_rows, figures, links) -> str

It takes what the JSON endpoints answer (plain dicts and lists) and the encoded figures
of :mod:`embgeom.figures`, and returns the page as text; no web code, no store.

Self-contained: inline CSS, no script, no external font, stylesheet or image. Figures are
embedded as ``<img src="data:...;base64,...">``: PNG (recommended: its size does not grow
with the number of token types) or SVG (``image/svg+xml``). A data URI rather than
inline ``<svg>`` markup keeps each figure's element ids (matplotlib's glyph and clip-path
ids) out of the page's id space, so figures never collide with each other or with the
section ids, and nothing inside an SVG can run. A Content-Security-Policy meta tag
(``default-src 'none'``) makes the browser refuse any external load.

Numbers: each table cell shows 6 significant digits and carries the exact value in
``data-value`` (Python's shortest round-trip ``repr``, the same text the JSON encoder
writes), so a browser test can compare the page with the JSON endpoints exactly. A
missing or non-finite value is an em dash with ``data-value=""``.

Every string is escaped with :func:`html.escape`.
"""

from __future__ import annotations

import base64
import html
import math
import numbers
import struct
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from embgeom.figure_names import FIGURES

__all__ = ["build_report", "LAYER_COLUMNS", "ISOTROPY_COLUMNS"]

# (header, keys tried in order, kind); kind "int" shows an integer, "num" 6 digits.
LAYER_COLUMNS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("layer", ("layer",), "int"),
    ("n", ("n",), "int"),
    ("types", ("num_types", "types"), "int"),
    ("Q", ("Q",), "num"),
    ("M", ("M",), "num"),
    ("V", ("V",), "num"),
    ("V_W", ("V_W",), "num"),
    ("V_B", ("V_B",), "num"),
    ("cv_Q", ("cv_Q",), "num"),
    ("slope", ("slope",), "num"),
    ("r2", ("r2",), "num"),
    ("M/Q", ("M/Q",), "num"),
    ("V_W/Q", ("V_W/Q",), "num"),
    ("V_B/Q", ("V_B/Q",), "num"),
)
ISOTROPY_COLUMNS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("layer", ("layer",), "int"),
    ("n", ("n",), "int"),
    ("isoscore", ("isoscore",), "num"),
    ("mean_cosine", ("mean_cosine",), "num"),
    ("effective_rank", ("effective_rank",), "num"),
    ("participation_ratio", ("participation_ratio",), "num"),
    ("top_eigenvalue_ratio", ("top_eigenvalue_ratio",), "num"),
    ("partition_isotropy", ("partition_isotropy",), "num"),
)

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_DASH = "\u2014"
_SAFE_SCHEMES = ("http://", "https://")

_CSS = """
:root { color-scheme: light; --fg: #1d1f21; --muted: #5f6368; --line: #d7dbe0; --head: #f3f5f7; }
* { box-sizing: border-box; }
body { margin: 0 auto; max-width: 1200px; padding: 1.5rem; color: var(--fg); background: #fff;
       font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
h1 { font-size: 1.6rem; margin: 0 0 .4rem; }
h2 { font-size: 1.25rem; margin: 2rem 0 .6rem; border-bottom: 1px solid var(--line); padding-bottom: .2rem; }
h3 { font-size: 1.05rem; margin: 1.4rem 0 .4rem; }
header dl, .summary { display: grid; grid-template-columns: max-content 1fr; gap: .15rem 1rem; margin: .5rem 0; }
dt { color: var(--muted); }
dd { margin: 0; font-variant-numeric: tabular-nums; }
.table-wrap { overflow-x: auto; }
table { border-collapse: collapse; font-size: .85rem; font-variant-numeric: tabular-nums; }
th, td { padding: .25rem .55rem; border-bottom: 1px solid var(--line); white-space: nowrap; }
th { background: var(--head); text-align: right; position: sticky; top: 0; }
td { text-align: right; font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
td.missing { color: var(--muted); }
figure { margin: 0; }
figure img { max-width: 100%; height: auto; border: 1px solid var(--line); }
figcaption { color: var(--muted); font-size: .85rem; margin-top: .2rem; }
p.missing { color: var(--muted); font-style: italic; }
ul.links { padding-left: 1.2rem; }
footer { margin-top: 2.5rem; color: var(--muted); font-size: .8rem; }
"""


# ------------------------------------------------------------------ values

def _e(s: Any) -> str:
    return html.escape("" if s is None else str(s), quote=True)


def _number(x: Any) -> Optional[Union[int, float]]:
    """``x`` as a Python int or finite float; None for anything else."""
    if x is None or isinstance(x, bool):
        return None
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        v = float(x)
        return v if math.isfinite(v) else None
    return None


def _repr(value: Any) -> str:
    """Exact text of a number (Python's round-trip repr, as JSON writes it); "" if none."""
    v = _number(value)
    return "" if v is None else repr(v)


def _cell(value: Any, kind: str, column: str) -> str:
    v = _number(value)
    col = _e(column)
    if v is None:
        return f'<td class="missing" data-column="{col}" data-value="">{_DASH}</td>'
    if kind == "int" and (isinstance(v, int) or v.is_integer()):
        shown = str(int(v))
    else:
        shown = f"{v:.6g}"
    return f'<td data-column="{col}" data-value="{_e(_repr(v))}">{_e(shown)}</td>'


def _lookup(row: Mapping, keys: Sequence[str], header: str) -> Any:
    for k in keys:
        if k in row:
            return row[k]
    if "/" in header:  # a ratio the row lacks: compute it from its parts
        num, den = header.split("/")
        a, b = _number(row.get(num)), _number(row.get(den))
        if a is not None and b:
            return a / b
    return None


def _table(table_id: str, caption: str, columns, rows: Iterable[Mapping]) -> str:
    head = "".join(f'<th scope="col">{_e(h)}</th>' for h, _, _ in columns)
    body = []
    for row in rows or []:
        if not isinstance(row, Mapping):
            continue
        layer = _number(row.get("layer"))
        attr = f' data-layer="{_e(layer)}"' if layer is not None else ""
        cells = "".join(_cell(_lookup(row, keys, h), kind, h) for h, keys, kind in columns)
        body.append(f"<tr{attr}>{cells}</tr>")
    if not body:
        body.append(f'<tr><td class="missing" colspan="{len(columns)}">no data</td></tr>')
    return (f'<div class="table-wrap"><table id="{_e(table_id)}">'
            f"<caption hidden>{_e(caption)}</caption>"
            f"<thead><tr>{head}</tr></thead><tbody>\n" + "\n".join(body) + "\n</tbody></table></div>")


def _when(ts: Any) -> str:
    v = _number(ts)
    if v is None:
        return _e(ts) if isinstance(ts, str) else _DASH
    try:
        return datetime.fromtimestamp(v, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return _e(repr(v))


def _value(v: Any) -> str:
    """A summary value: numbers with data-value, anything else escaped text."""
    n = _number(v)
    if n is not None:
        shown = str(n) if isinstance(n, int) else f"{n:.6g}"
        return f'<span data-value="{_e(_repr(n))}">{_e(shown)}</span>'
    if v is None:
        return _DASH
    return _e(v)


# ------------------------------------------------------------------ figures

def _data_uri(content: Union[bytes, str]) -> tuple[str, Optional[tuple[int, int]]]:
    """``(data URI, (width, height) in px or None)`` of a PNG or SVG figure."""
    if isinstance(content, str):
        content = content.encode("utf-8")
    if content.startswith(_PNG_SIGNATURE):
        width, height = struct.unpack(">II", content[16:24])
        return "data:image/png;base64," + base64.b64encode(content).decode("ascii"), (width, height)
    head = content[:512].lstrip()
    if head.startswith(b"<?xml") or head.startswith(b"<svg") or b"<svg" in head:
        return "data:image/svg+xml;base64," + base64.b64encode(content).decode("ascii"), None
    raise ValueError("a figure must be PNG or SVG bytes")


def _figure(name: str, content: Union[bytes, str, None]) -> str:
    description = FIGURES.get(name, name)
    parts = [f'<section class="figure"><h3 id="{_e(name)}">{_e(name)}</h3>']
    if content is None:
        parts.append(f'<p class="missing">{_e(name)}: not available</p>')
    else:
        uri, size = _data_uri(content)
        dims = f' width="{size[0]}" height="{size[1]}"' if size else ""
        parts.append(f'<figure><img data-figure="{_e(name)}" src="{uri}"{dims} '
                     f'alt="{_e(description)}"><figcaption>{_e(description)}</figcaption></figure>')
    parts.append("</section>")
    return "".join(parts)


def _similarity_section(similarity: Mapping[str, Any], figure: Union[bytes, str, None]) -> list[str]:
    """The layer-by-layer CKA section: a note on what the numbers are, the heatmap, the matrix."""
    layers = list(similarity.get("layers") or [])
    n = _number(similarity.get("n"))
    columns = [("layer", ("layer",), "int")] + [(str(l), (str(l),), "num") for l in layers]
    rows = [{"layer": l, **{str(m): v for m, v in zip(layers, row)}}
            for l, row in zip(layers, similarity.get("matrix") or [])]
    return [
        '<h2 id="cka-section">Layer-by-layer linear CKA</h2>',
        "<p>Linear CKA (Kornblith et al. 2019) of every pair of kept layers, exact over all "
        f'<span data-field="cka_n">{_value(n)}</span> occurrences ingested: it is computed from '
        "the streamed co-moment of the concatenated layers, not from a sample or by averaging "
        "minibatches. It is the usual (biased) estimator; its bias shrinks as 1/n, and n here is "
        "every occurrence (the debiased estimator matters for a few thousand points, as in "
        "<code>POST /v1/compare/global</code>'s <code>unbiased_cka</code>).</p>",
        _figure("cka", figure),
        _table("cka-table", "layer-by-layer linear CKA", columns, rows),
    ]


def _link(label: Any, href: Any) -> str:
    href = "" if href is None else str(href)
    lowered = href.strip().lower()
    # Relative paths and http(s) only: never a javascript: or data: link.
    if lowered.startswith(_SAFE_SCHEMES) or (":" not in lowered.split("/", 1)[0] and lowered):
        return f'<li><a href="{_e(href)}">{_e(label)}</a> <code>{_e(href)}</code></li>'
    return f"<li>{_e(label)} <code>{_e(href)}</code></li>"


# ------------------------------------------------------------------ page

def build_report(title: str, summary: Mapping[str, Any], layer_rows: Sequence[Mapping],
                 isotropy_rows: Sequence[Mapping],
                 figures: Union[Mapping[str, Union[bytes, str, None]], Iterable[tuple[str, Any]]],
                 links: Iterable[tuple[str, str]],
                 isotropy_columns: Sequence[tuple[str, tuple[str, ...], str]] = ISOTROPY_COLUMNS,
                 similarity: Optional[Mapping[str, Any]] = None) -> str:
    """One self-contained HTML5 page of a (collection, model) pair.

    Parameters
    ----------
    title : the page title.
    summary : dict with "collection", "model" and "as_of" (``{"version", "updated_at"}``,
        ``updated_at`` in Unix seconds, shown in UTC); any other key is listed under them.
    layer_rows : the ``.../layers`` rows: layer, n, num_types (or types), Q, M, V, V_W,
        V_B, cv_Q, slope, r2, M/Q, V_W/Q, V_B/Q (a missing ratio is computed from its
        parts; None is an em dash).
    isotropy_rows : the ``.../layers/{l}/isotropy`` answers, one per layer.
    figures : name -> PNG or SVG bytes (or SVG text, or None for "not available"), in
        page order; also an iterable of (name, content) pairs. Each is a section whose
        heading has ``id=name`` and whose ``<img>`` has ``data-figure=name``.
    links : (label, href) pairs to the JSON endpoints; only relative and http(s) hrefs
        become links.
    isotropy_columns : the isotropy table's columns, :data:`ISOTROPY_COLUMNS` (or a
        selection of them) by default.
    similarity : the ``.../similarity?metric=linear_cka`` answer (``layers``, ``matrix``,
        ``n``) of a cross_layer collection, or None. Given, the page has a section of its
        own: a note, the ``cka`` figure of ``figures`` (taken out of the figure list) and
        the matrix as a table (``id="cka-table"``, a row per layer).

    Returns
    -------
    str : the HTML document. The same input gives the same text.
    """
    summary = dict(summary or {})
    as_of = summary.pop("as_of", None) or {}
    collection, model = summary.pop("collection", None), summary.pop("model", None)
    fig_items = list(figures.items()) if isinstance(figures, Mapping) else list(figures or [])
    cka_section = []
    if similarity is not None:
        cka_figure = dict(fig_items).get("cka")
        fig_items = [(name, content) for name, content in fig_items if name != "cka"]
        cka_section = _similarity_section(similarity, cka_figure)

    header = [
        f"<h1>{_e(title)}</h1>",
        "<dl>",
        f'<dt>collection</dt><dd data-field="collection">{_e(collection)}</dd>',
        f'<dt>model</dt><dd data-field="model">{_e(model)}</dd>',
        f'<dt>as of</dt><dd data-field="as_of">version {_value(as_of.get("version"))}, '
        f'<span data-value="{_e(_repr(as_of.get("updated_at")))}">{_when(as_of.get("updated_at"))}</span></dd>',
    ]
    for key, value in summary.items():
        if isinstance(value, Mapping):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        header.append(f'<dt>{_e(key)}</dt><dd data-field="{_e(key)}">{_value(value)}</dd>')
    header.append("</dl>")

    nav = ['<nav><ul class="links">',
           '<li><a href="#layer-table-section">per-layer statistics</a></li>',
           '<li><a href="#isotropy-table-section">isotropy per layer</a></li>']
    if cka_section:
        nav.append('<li><a href="#cka-section">layer-by-layer CKA</a></li>')
    # "figure:" keeps the isotropy figure's entry apart from the isotropy table's.
    nav += [f'<li><a href="#{_e(name)}">figure: {_e(name)}</a></li>' for name, _ in fig_items]
    nav.append("</ul></nav>")

    body = [
        '<h2 id="layer-table-section">Per-layer statistics</h2>',
        "<p>Q = M + V_W + V_B per layer, and the V-on-M regression over the token types "
        "passing the count filter (Yamagiwa &amp; Shimodaira).</p>",
        _table("layer-table", "per-layer statistics", LAYER_COLUMNS, layer_rows),
        '<h2 id="isotropy-table-section">Isotropy</h2>',
        _table("isotropy-table", "isotropy per layer", isotropy_columns, isotropy_rows),
        *cka_section,
        '<h2 id="figures-section">Figures</h2>',
        *(_figure(str(name), content) for name, content in fig_items),
        '<h2 id="links-section">JSON endpoints</h2>',
        '<ul class="links">', *(_link(label, href) for label, href in (links or [])), "</ul>",
    ]

    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<meta http-equiv=\"Content-Security-Policy\" "
        "content=\"default-src 'none'; img-src data:; style-src 'unsafe-inline'\">",
        f"<title>{_e(title)}</title>",
        f"<style>{_CSS}</style>",
        "</head>",
        "<body>",
        "<header>", *header, "</header>",
        *nav,
        "<main>", *body, "</main>",
        "<footer>Generated by embgeom. Numbers show 6 significant digits; "
        "<code>data-value</code> holds each one exactly.</footer>",
        "</body>",
        "</html>",
        "",
    ])
