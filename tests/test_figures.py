"""Figures (:mod:`embgeom.figures`) and the report page (:mod:`embgeom.report_page`).

Every figure is rendered in both formats from small synthetic data and from edge cases
(no data, one point, None / NaN / inf, slope None); PNG must decode to the documented
size, SVG must parse with an <svg> root, and the same input must give the same bytes.
The report page is checked with a strict html.parser pass (every end tag closes the
element it opened), for its ids and exact ``data-value`` numbers, its self-containment
and its escaping.
"""

from __future__ import annotations

import html
import io
import math
import re
import threading
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import numpy as np
import pytest
from matplotlib.image import imread

from embgeom import figures as F
from embgeom.report_page import build_report
from embgeom.stats import layer_summary as stats_layer_summary

# A glyph missing from the bundled font, a layout that cannot be applied, a math-mode
# parse error: all show up as warnings first, and none is acceptable here.
# matplotlib's warnings (a missing glyph, an impossible layout, a math-mode error) fail
# the test; others (say, a connection another test left to the garbage collector) do not.
pytestmark = [pytest.mark.filterwarnings("error::UserWarning"),
              pytest.mark.filterwarnings("error::RuntimeWarning"),
              pytest.mark.filterwarnings("error::DeprecationWarning")]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SVG_NS = "{http://www.w3.org/2000/svg}"
NAN, INF = float("nan"), float("inf")


# ------------------------------------------------------------------ data

def _tokens(k: int = 60, seed: int = 0, slope: float = -0.9):
    rng = np.random.default_rng(seed)
    n = rng.integers(10, 5000, k)
    M = rng.uniform(0.0, 10.0, k)
    V = 12.0 + slope * M + rng.normal(0.0, 0.3, k)
    Q = M + V
    return n, Q, M, V


def _layer_rows(num_layers: int = 7, seed: int = 1):
    rng = np.random.default_rng(seed)
    rows = []
    for layer in range(num_layers):
        M, V_W, V_B = rng.uniform(1, 5), rng.uniform(5, 20), rng.uniform(1, 10)
        Q, V = M + V_W + V_B, V_W + V_B
        rows.append({"layer": layer, "n": int(rng.integers(1000, 9000)),
                     "num_types": int(rng.integers(100, 900)),
                     "Q": Q, "M": M, "V": V, "V_W": V_W, "V_B": V_B,
                     "cv_Q": float(rng.uniform(0.05, 0.5)), "slope": float(rng.uniform(-1.1, -0.2)),
                     "intercept": float(rng.uniform(5, 20)), "r2": float(rng.uniform(0.3, 1.0)),
                     "M/Q": M / Q, "V_W/Q": V_W / Q, "V_B/Q": V_B / Q, "V_W/V": V_W / V})
    return rows


def _isotropy_rows(num_layers: int = 7):
    return [{"layer": l, "n": 1000 + l, "isoscore": 0.1 + 0.05 * l, "mean_cosine": 0.6 - 0.04 * l,
             "effective_rank": 50.0 + 7.5 * l, "participation_ratio": 10.0 + l,
             "top_eigenvalue_ratio": 0.2 / (l + 1), "partition_isotropy": 0.9 - 0.1 * l}
            for l in range(num_layers)]


def _outlier_rows():
    return [{"layer": l, "dimensions": [{"dim": 5, "ratio": 6.0 + l}, {"dim": 300, "ratio": 40.0 / (l + 1) + 5}]}
            for l in range(7)]


def _rows_with_gaps():
    rows = _layer_rows()
    rows[2].update({"cv_Q": None, "slope": NAN, "r2": INF, "M/Q": None})
    rows[4].update({"V_W/V": None, "V_W": None})
    rows.append({"layer": None, "cv_Q": 0.3})  # no layer: skipped
    return rows


N, Q, M, V = _tokens()
SUMMARY = stats_layer_summary(N, Q, M, V)

# name -> {case: kwargs}; every case of every figure renders in both formats.
CASES = {
    "vm_scatter": {
        "data": dict(M=M, V=V, n=N, slope=SUMMARY["slope"], intercept=SUMMARY["intercept"],
                     r2=SUMMARY["r2"], layer=3, model="minilm", title_extra="(10 <= n)"),
        "empty": dict(M=[], V=[], n=[], slope=None, intercept=None, r2=None, layer=0, model="m"),
        "one_point": dict(M=[1.0], V=[2.0], n=[5], slope=None, intercept=None, r2=None, layer=0, model="m"),
        "bad_values": dict(M=[1.0, None, NAN, 2.0, 3.0, INF], V=[2.0, 1.0, 1.0, None, 0.5, 1.0],
                           n=[5, 6, 7, 8, 0, 9], slope=NAN, intercept=None, r2=None, layer=1, model="m"),
        "all_bad": dict(M=[None, NAN], V=[INF, 1.0], n=[1, -1], slope=-1.0, intercept=1.0, r2=1.0,
                        layer=1, model="m"),
        "slope_no_intercept": dict(M=M, V=V, n=N, slope=-0.9, intercept=None, r2=None, layer=2, model="m"),
        "equal_counts": dict(M=[1.0, 2.0, 3.0], V=[3.0, 2.0, 1.0], n=[10, 10, 10], slope=-1.0,
                             intercept=4.0, r2=1.0, layer=2, model="m"),
    },
    "layer_summary": {
        "data": dict(series=[{"model": "minilm", "layers": _layer_rows()},
                             {"model": "_private$model$", "layers": _layer_rows(13, seed=2)}]),
        "gaps": dict(series=[{"model": "minilm", "layers": _rows_with_gaps()}]),
        "empty": dict(series=[]),
        "all_none": dict(series=[{"model": "m", "layers": [{"layer": 0, "cv_Q": None, "slope": None, "r2": None}]}]),
    },
    "decomposition": {
        "data": dict(rows=_layer_rows(), model="minilm"),
        "computed_ratios": dict(rows=[{k: v for k, v in r.items() if "/" not in k} for r in _layer_rows()],
                                model="minilm"),
        "gaps": dict(rows=_rows_with_gaps(), model="m"),
        "empty": dict(rows=[], model="m"),
        "one_layer_zero_Q": dict(rows=[{"layer": 0, "Q": 0.0, "M": 0.0, "V_W": 0.0, "V_B": 0.0}], model="m"),
    },
    "within_ratio": {
        "data": dict(rows=_layer_rows(), model="minilm"),
        "gaps": dict(rows=_rows_with_gaps(), model="m"),
        "empty": dict(rows=[], model="m"),
        "one_layer": dict(rows=[{"layer": 0, "V_W": 1.0, "V": 2.0}], model="m"),
    },
    "frequency": {
        "data": dict(n=N, Q=Q, M=M, V=V, layer=3, model="minilm"),
        "bad_values": dict(n=[1, 0, None, 10], Q=[1.0, 2.0, 3.0, NAN], M=[None, 1.0, 1.0, 1.0],
                           V=[INF, 1.0, 1.0, 0.5], layer=0, model="m"),
        "empty": dict(n=[], Q=[], M=[], V=[], layer=0, model="m"),
        "one_point": dict(n=[3], Q=[1.0], M=[0.5], V=[0.5], layer=0, model="m"),
    },
    "isotropy": {
        "data": dict(rows=_isotropy_rows(), model="minilm"),
        "gaps": dict(rows=[{"layer": 0, "isoscore": None, "mean_cosine": 0.5, "effective_rank": NAN},
                           {"layer": 1, "isoscore": 0.2, "mean_cosine": None, "effective_rank": None}],
                     model="m"),
        "empty": dict(rows=[], model="m"),
    },
    "outliers": {
        "data": dict(rows=_outlier_rows(), model="minilm"),
        "endpoint_answer": dict(rows={"threshold": 5.0, "layers": _outlier_rows()}, model="minilm"),
        "one_dim": dict(rows=[{"layer": 2, "dimensions": [{"dim": 7, "ratio": 9.0}]}], model="m"),
        "bad_values": dict(rows=[{"layer": 0, "dimensions": [{"dim": None, "ratio": 9.0},
                                                             {"dim": 3, "ratio": NAN}, {"dim": 4, "ratio": 0.0}]},
                                 {"layer": None, "dimensions": [{"dim": 1, "ratio": 6.0}]},
                                 {"layer": 1, "dimensions": None}], model="m"),
        "empty": dict(rows=[], model="m"),
    },
    "spectrum": {
        "data": dict(eigenvalues=np.sort(np.random.default_rng(3).exponential(1.0, 384))[::-1] ** 3,
                     layer=6, model="minilm"),
        "unsorted_with_bad": dict(eigenvalues=[0.5, None, 3.0, -1e-12, NAN, 0.0, INF, 1.0], layer=1, model="m"),
        "one": dict(eigenvalues=[2.0], layer=0, model="m"),
        "all_zero": dict(eigenvalues=[0.0, 0.0, -1e-15], layer=0, model="m"),
        "empty": dict(eigenvalues=None, layer=0, model="m"),
    },
    "cka": {
        "data": dict(result={"layers": [0, 1, 2, 3], "n": 1234, "matrix": [
            [1.0, 0.8, 0.5, 0.3], [0.8, 1.0, 0.7, 0.4], [0.5, 0.7, 1.0, 0.9], [0.3, 0.4, 0.9, 1.0]]},
            model="minilm"),
        "undefined_layer": dict(result={"layers": [0, 5], "n": 3, "matrix": [[None, None], [None, 1.0]]},
                                model="m"),
        "no_occurrences": dict(result={"layers": [0, 1], "n": 0, "matrix": [[None, None], [None, None]]},
                               model="m"),
        "not_kept": dict(result=None, model="m"),
    },
}

ALL_CASES = [(name, case) for name, cases in CASES.items() for case in cases]


def _render(name: str, case: str, fmt: str) -> bytes:
    return getattr(F, name)(**CASES[name][case], fmt=fmt)


def _check_png(data: bytes, name: str) -> None:
    assert data.startswith(PNG_SIGNATURE)
    image = imread(io.BytesIO(data), format="png")
    width, height = F.SIZES[name]
    assert image.shape[:2] == (round(height * F.DPI), round(width * F.DPI))


def _check_svg(data: bytes, name: str) -> ET.Element:
    root = ET.fromstring(data)
    assert root.tag == f"{SVG_NS}svg"
    width, height = F.SIZES[name]
    assert root.get("width") == f"{width * 72:g}pt" and root.get("height") == f"{height * 72:g}pt"
    return root


# ------------------------------------------------------------------ figures

def test_figures_names_the_public_functions():
    assert set(F.FIGURES) == {"vm_scatter", "layer_summary", "decomposition", "within_ratio",
                              "frequency", "isotropy", "outliers", "spectrum", "cka"}
    assert set(F.FIGURES) == set(F.SIZES) == set(CASES)
    for name in F.FIGURES:
        assert callable(getattr(F, name)) and getattr(F, name).__doc__


@pytest.mark.parametrize("name,case", ALL_CASES)
def test_figure_renders_both_formats_deterministically(name, case):
    png = _render(name, case, "png")
    _check_png(png, name)
    svg = _render(name, case, "svg")
    _check_svg(svg, name)
    # Same input, same bytes (SVG ids are salted hashes, no date in the metadata).
    assert _render(name, case, "svg") == svg
    assert _render(name, case, "png") == png


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("fmt", ["pdf", "PNG", "", None])
def test_unknown_format_is_a_value_error(name, fmt):
    with pytest.raises(ValueError, match="fmt"):
        _render(name, next(iter(CASES[name])), fmt)


@pytest.mark.parametrize("name,case", [
    ("vm_scatter", "empty"), ("vm_scatter", "all_bad"), ("layer_summary", "empty"),
    ("layer_summary", "all_none"), ("decomposition", "empty"), ("decomposition", "one_layer_zero_Q"),
    ("within_ratio", "empty"), ("frequency", "empty"), ("isotropy", "empty"),
    ("spectrum", "empty"), ("spectrum", "all_zero"),
])
def test_nothing_to_show_says_no_data(name, case):
    assert "<!-- no data -->" in _render(name, case, "svg").decode()


def test_no_outlier_dimensions_is_said():
    assert "<!-- no outlier dimensions -->" in _render("outliers", "empty", "svg").decode()


def test_vm_scatter_mismatched_lengths_is_a_value_error():
    with pytest.raises(ValueError, match="same length"):
        F.vm_scatter([1.0, 2.0], [1.0], [1, 2], None, None, None, 0, "m")


def _crimson_segments(svg: str) -> list[tuple[float, float, float, float]]:
    """Straight two-point paths stroked in the regression line's colour (crimson)."""
    out = []
    for m in re.finditer(r'<path d="M ([-\d.]+) ([-\d.]+)\s+L ([-\d.]+) ([-\d.]+)\s*"[^>]*stroke: #dc143c', svg):
        out.append(tuple(float(v) for v in m.groups()))
    return out


def test_vm_scatter_draws_the_given_negative_slope():
    """Paper Fig. 2 from tokens with a known slope of -0.8: the regression of
    embgeom.stats recovers it, and the figure shows exactly that slope and R^2."""
    rng = np.random.default_rng(7)
    k = 400
    n = rng.integers(10, 100_000, k)
    M_t = rng.uniform(0.5, 8.0, k)
    V_t = 15.0 - 0.8 * M_t + rng.normal(0.0, 0.2, k)
    s = stats_layer_summary(n, M_t + V_t, M_t, V_t)
    assert s["slope"] == pytest.approx(-0.8, abs=0.02) and s["r2"] > 0.95
    svg = F.vm_scatter(M_t, V_t, n, s["slope"], s["intercept"], s["r2"], 4, "synthetic",
                       fmt="svg").decode()
    assert f"<!-- slope = {s['slope']:.4g}, R\u00b2 = {s['r2']:.4g} -->" in svg
    assert "<!-- least squares V = a + b\u00b7M -->" in svg
    assert f"<!-- token types (k = {k}) -->" in svg
    # The drawn line runs down to the right (SVG y grows downwards); the widest crimson
    # segment is the line over the M range, the legend's sample is horizontal.
    x1, y1, x2, y2 = max(_crimson_segments(svg), key=lambda p: abs(p[2] - p[0]))
    assert x2 > x1 and y2 > y1


def test_vm_scatter_without_slope_draws_no_line():
    svg = _render("vm_scatter", "bad_values", "svg").decode()
    assert "<!-- no regression line (slope undefined) -->" in svg
    assert not _crimson_segments(svg)
    svg = _render("vm_scatter", "one_point", "svg").decode()
    assert "no regression line" in svg and not _crimson_segments(svg)


def test_model_names_are_shown_literally():
    # "$...$" would start math mode; a leading "_" would hide the legend entry.
    svg = _render("layer_summary", "data", "svg").decode()
    assert "<!--  _private$model$ -->" in svg
    assert "<!-- minilm -->" in svg


def test_large_scatter_is_rasterized_in_svg():
    n, Q_t, M_t, V_t = _tokens(k=F.RASTERIZE_ABOVE + 1, seed=4)
    svg = F.vm_scatter(M_t, V_t, n, -0.9, 12.0, 0.9, 0, "m", fmt="svg")
    _check_svg(svg, "vm_scatter")
    assert b"<image" in svg and len(svg) < 400_000


def test_concurrent_renders_match_serial_ones():
    """No pyplot, no shared figure: threads rendering at once get the serial bytes."""
    jobs = [("vm_scatter", "data", "png"), ("layer_summary", "data", "svg"),
            ("spectrum", "data", "png"), ("outliers", "data", "svg")]
    expected = [_render(*j) for j in jobs]
    results: list = [None] * len(jobs)

    def work(i):
        results[i] = _render(*jobs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected


# ------------------------------------------------------------------ report page

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class StrictParser(HTMLParser):
    """Collects ids, data-values, links and image sources; any mis-nesting is an error."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.ids: list[str] = []
        self.cells: list[dict] = []  # {"layer", "table", "column", "value", "text"}
        self.hrefs: list[str] = []
        self.imgs: list[dict] = []
        self.heading_ids: list[str] = []
        self.text: list[str] = []
        self._table = None
        self._layer = None
        self._cell = None
        self.doctype = None

    def handle_decl(self, decl):
        self.doctype = decl

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.append(a["id"])
            if tag in ("h2", "h3"):
                self.heading_ids.append(a["id"])
        if tag == "table":
            self._table = a.get("id")
        if tag == "tr":
            self._layer = a.get("data-layer")
        if tag == "td" and "data-value" in a:
            self._cell = {"table": self._table, "layer": self._layer, "column": a.get("data-column"),
                          "value": a["data-value"], "text": ""}
        if tag == "a":
            self.hrefs.append(a.get("href"))
        if tag == "img":
            self.imgs.append(a)
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.errors.append(f"self-closing <{tag}/>")

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1] if self.stack else 'nothing'}")
            return
        self.stack.pop()
        if tag == "td" and self._cell is not None:
            self.cells.append(self._cell)
            self._cell = None

    def handle_data(self, data):
        self.text.append(data)
        if self._cell is not None:
            self._cell["text"] += data


def _parse(page: str) -> StrictParser:
    p = StrictParser()
    p.feed(page)
    p.close()
    assert p.doctype == "DOCTYPE html"
    assert not p.errors, p.errors
    assert not p.stack, f"unclosed: {p.stack}"
    return p


EVIL = "<script>alert(1)</script>"
LINKS = [("layers (JSON)", "/v1/collections/default/models/minilm/layers"),
         ("isotropy of layer 3", "http://localhost:8000/v1/collections/default/models/minilm/layers/3/isotropy"),
         ("outliers & more", "https://example.org/v1/outliers?a=1&b=2"),
         ("bad", "javascript:alert(1)")]


def _report(model: str = "minilm", layer_rows=None, isotropy_rows=None, figures=None) -> str:
    if figures is None:
        figures = {"vm_scatter": _render("vm_scatter", "data", "png"),
                   "layer_summary": _render("layer_summary", "data", "svg"),
                   "decomposition": _render("decomposition", "data", "png"),
                   "spectrum": None}
    return build_report(
        f"embgeom report: {model}",
        {"collection": "default", "model": model, "as_of": {"version": 42, "updated_at": 1_700_000_000.25},
         "min_count": 10, "max_count": None, "architecture": "BertModel"},
        _layer_rows() if layer_rows is None else layer_rows,
        _isotropy_rows() if isotropy_rows is None else isotropy_rows,
        figures, LINKS)


def test_report_is_well_formed_with_every_figure():
    page = _report()
    p = _parse(page)
    for name in ("vm_scatter", "layer_summary", "decomposition", "spectrum"):
        assert name in p.heading_ids
    assert len(p.ids) == len(set(p.ids)), "ids must be unique"
    by_fig = {img["data-figure"]: img for img in p.imgs}
    assert set(by_fig) == {"vm_scatter", "layer_summary", "decomposition"}
    assert by_fig["vm_scatter"]["src"].startswith("data:image/png;base64,")
    assert (by_fig["vm_scatter"]["width"], by_fig["vm_scatter"]["height"]) == ("700", "500")
    assert by_fig["layer_summary"]["src"].startswith("data:image/svg+xml;base64,")
    assert "spectrum: not available" in "".join(p.text)
    assert "default" in page and "version" in page and "2023-11-14 22:13:20 UTC" in page
    assert 'data-value="1700000000.25"' in page
    assert _report() == page  # deterministic


def test_report_numbers_carry_their_exact_values():
    rows, iso = _layer_rows(), _isotropy_rows()
    rows[3]["slope"] = None
    rows[5]["r2"] = NAN
    del rows[6]["M/Q"]  # computed from M and Q
    rows[1]["Q"] = np.float64(rows[1]["Q"])  # numpy scalars write like floats
    p = _parse(_report(layer_rows=rows, isotropy_rows=iso))
    cells = {(c["table"], c["layer"], c["column"]): c for c in p.cells}
    columns = {"layer", "n", "types", "Q", "M", "V", "V_W", "V_B", "cv_Q", "slope", "r2",
               "M/Q", "V_W/Q", "V_B/Q"}
    assert {c for (t, _, c) in cells if t == "layer-table"} == columns
    for row in rows:
        for column in columns:
            key = "num_types" if column == "types" else column
            cell = cells[("layer-table", str(row["layer"]), column)]
            value = row.get(key, row["M"] / row["Q"] if key == "M/Q" else None)
            if value is None or (isinstance(value, float) and not math.isfinite(value)):
                assert cell["value"] == "" and cell["text"] == "\u2014"
            elif isinstance(value, int):
                assert cell["value"] == repr(value) and cell["text"] == str(value)
            else:
                assert cell["value"] == repr(float(value))
                assert float(cell["value"]) == value
                assert cell["text"] == f"{value:.6g}"
    for row in iso:
        for column, value in row.items():
            cell = cells[("isotropy-table", str(row["layer"]), column)]
            assert cell["value"] == repr(value)


def test_report_is_self_contained():
    page = _report()
    allowed = {href for _, href in LINKS if href.startswith("http")}
    found = re.findall(r"https?://[^\s\"'<>]*", page)
    assert found, "the absolute links given must be there"
    for url in found:
        assert any(html.unescape(url) == a for a in allowed), url
    p = _parse(page)
    assert all(img["src"].startswith("data:image/") for img in p.imgs)
    assert "<script" not in page.lower() and "<link" not in page.lower()
    assert "@import" not in page and "url(" not in page


def test_report_links_are_listed_and_unsafe_ones_are_not_links():
    p = _parse(_report())
    assert "/v1/collections/default/models/minilm/layers" in p.hrefs
    assert "https://example.org/v1/outliers?a=1&b=2" in p.hrefs
    assert not any(h and h.lower().startswith("javascript:") for h in p.hrefs)
    assert "outliers & more" in "".join(p.text)


def test_report_escapes_a_malicious_model_name():
    page = _report(model=EVIL, figures={EVIL: _render("spectrum", "one", "png")},
                   layer_rows=[{"layer": 0, "n": 1, "num_types": 1, "Q": 1.0, "note": EVIL}])
    assert EVIL not in page and "<script" not in page.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    p = _parse(page)
    assert EVIL in p.heading_ids  # the id survives as text, escaped in the markup
    assert EVIL in "".join(p.text)


def test_report_with_no_rows_or_figures():
    page = build_report("empty", {}, [], [], {}, [])
    p = _parse(page)
    assert "no data" in "".join(p.text)
    assert not p.imgs


def test_report_rejects_a_figure_that_is_not_an_image():
    with pytest.raises(ValueError, match="PNG or SVG"):
        build_report("t", {}, [], [], {"vm_scatter": b"GIF89a"}, [])
