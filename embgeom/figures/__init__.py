"""Figures of embedding geometry, rendered to PNG or SVG bytes.

Each public function takes the plain data a JSON endpoint already answers (dicts, lists,
numpy arrays) and returns the encoded image::

    vm_scatter(M, V, n, slope, intercept, r2, layer, model, fmt="png") -> bytes

The figures mirror those of Yamagiwa & Shimodaira, "Norm of Mean Contextualized
Embeddings Determines their Variance" (2024), plus the isotropy diagnostics of
:mod:`embgeom.diagnostics`. :data:`FIGURES` names them; the service serves exactly these
names at ``/v1/collections/{c}/models/{m}/figures/{name}``.

Thread safety: no ``pyplot``. Every call builds its own :class:`matplotlib.figure.Figure`
on its own :class:`~matplotlib.backends.backend_agg.FigureCanvasAgg` (SVG is printed from
the same figure) and drops it, so nothing global is registered and concurrent requests
never share a figure.

Determinism: the same input gives the same bytes. PNG carries no ``Software`` text chunk;
SVG carries no date and its element ids are hashes salted with a fixed string
(matplotlib otherwise salts them with a random UUID). That salt is matplotlib's
``svg.hashsalt`` setting: it is set here, once, only when nobody has set it.

Robustness: NaN, inf and None are skipped point by point; a panel with nothing left says
"no data". Strings that come from users (model names) are shown literally: ``$`` is
escaped so it never starts matplotlib's math mode.

Sizes: :data:`DPI` = 100; a single-panel figure is 7 x 5 in (700 x 500 px as PNG,
504 x 360 pt as SVG); the multi-panel ones are wider (see :data:`SIZES`). Scatter plots
with more than :data:`RASTERIZE_ABOVE` points rasterize their markers inside the SVG so
its size stays bounded on a 50k-type vocabulary.
"""

from __future__ import annotations

import io
import math
from typing import Any, Iterable, Mapping, Optional, Sequence

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import FormatStrFormatter, MaxNLocator

from embgeom.figure_names import FIGURES, FORMATS

__all__ = [
    "FIGURES", "FORMATS", "DPI", "SIZES",
    "vm_scatter", "layer_summary", "decomposition", "within_ratio", "frequency",
    "isotropy", "outliers", "spectrum", "cka",
]

DPI = 100
SIZES: dict[str, tuple[float, float]] = {
    "vm_scatter": (7.0, 5.0),
    "layer_summary": (13.0, 4.5),
    "decomposition": (7.0, 5.0),
    "within_ratio": (7.0, 5.0),
    "frequency": (13.0, 4.5),
    "isotropy": (11.0, 4.5),
    "outliers": (7.0, 5.0),
    "spectrum": (7.0, 5.0),
    "cka": (7.0, 6.0),
}
RASTERIZE_ABOVE = 5000


_SVG_SALT = "embgeom"
_NO_DATA = "no data"
_SQ = "\u00b2"  # superscript two


# ------------------------------------------------------------------ helpers

def _check_fmt(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


def _new_figure(name: str) -> Figure:
    fig = Figure(figsize=SIZES[name], dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    fig.patch.set_facecolor("white")
    return fig


def _render(fig: Figure, fmt: str) -> bytes:
    buf = io.BytesIO()
    if fmt == "svg":
        if matplotlib.rcParams["svg.hashsalt"] is None:
            matplotlib.rcParams["svg.hashsalt"] = _SVG_SALT
        fig.savefig(buf, format="svg", dpi=DPI, metadata={"Date": None})
    else:
        fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


def _num(x: Any) -> float:
    """``x`` as a float; NaN for None, non-numbers and non-finite values."""
    if x is None or isinstance(x, (bool, np.bool_)):
        return math.nan
    try:
        v = float(x)
    except (TypeError, ValueError):
        return math.nan
    return v if math.isfinite(v) else math.nan


def _array(values: Any) -> np.ndarray:
    """1-D float64 array with NaN wherever a value is missing or not finite."""
    if values is None:
        return np.zeros(0)
    if isinstance(values, np.ndarray) and values.dtype.kind in "iuf":
        a = values.astype(np.float64).ravel()
    else:
        a = np.array([_num(v) for v in values], dtype=np.float64)
    a[~np.isfinite(a)] = np.nan
    return a


def _text(s: Any, limit: int = 80) -> str:
    """A user string shown literally: no math mode, bounded length."""
    s = "" if s is None else str(s)
    if len(s) > limit:
        s = s[: limit - 1] + "\u2026"
    return s.replace("$", r"\$")


def _label(s: Any) -> str:
    # matplotlib hides legend entries whose label starts with "_".
    s = _text(s, 40)
    return " " + s if s.startswith("_") else s


def _fmt(x: Optional[float], digits: int = 4) -> str:
    return "\u2014" if x is None or not math.isfinite(x) else f"{x:.{digits}g}"


def _no_data(ax, message: str = _NO_DATA) -> None:
    ax.text(0.5, 0.5, message, transform=ax.transAxes, ha="center", va="center",
            fontsize=12, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _title(model: Any, what: str, layer: Any = None, extra: str = "") -> str:
    parts = [_text(model)] if model not in (None, "") else []
    if layer is not None:
        parts.append(f"layer {_text(layer, 12)}")
    head = ", ".join(parts)
    title = f"{head}: {what}" if head else what
    return f"{title} {_text(extra)}".rstrip() if extra else title


def _rows(rows: Any, key: str = "layers") -> list[dict]:
    """The row dicts of ``rows``; also accepts the endpoint's wrapper ``{key: [...]}``."""
    if rows is None:
        return []
    if isinstance(rows, Mapping):
        rows = rows.get(key) or []
    return [r for r in rows if isinstance(r, Mapping)]


def _by_layer(rows: Iterable[Mapping], columns: Sequence[str]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Layers (sorted) and one float column per name, NaN for missing values."""
    kept = [(_num(r.get("layer")), r) for r in rows]
    kept = sorted(((lay, r) for lay, r in kept if not math.isnan(lay)), key=lambda t: t[0])
    layers = np.array([lay for lay, _ in kept], dtype=np.float64)
    cols = {c: np.array([_num(r.get(c)) for _, r in kept], dtype=np.float64) for c in columns}
    return layers, cols


def _layer_rows(rows) -> tuple[list[Mapping], np.ndarray]:
    """The rows that name a layer, sorted by it, and their layers (float64)."""
    kept = sorted((r for r in _rows(rows) if not math.isnan(_num(r.get("layer")))),
                  key=lambda r: _num(r.get("layer")))
    return kept, np.array([_num(r.get("layer")) for r in kept], dtype=np.float64)


def _ratio(rows: Sequence[Mapping], num: str, den: str, key: str) -> np.ndarray:
    """Column ``key`` of the rows, or ``num / den`` where ``key`` is absent."""
    out = []
    for r in rows:
        if key in r:
            out.append(_num(r.get(key)))
        else:
            d = _num(r.get(den))
            out.append(_num(r.get(num)) / d if d and not math.isnan(d) else math.nan)
    return np.array(out, dtype=np.float64)


def _integer_layers(ax) -> None:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer (0 = embedding output)")


# ------------------------------------------------------------------ figures

def vm_scatter(M, V, n, slope, intercept, r2, layer, model, title_extra: str = "",
               fmt: str = "png") -> bytes:
    """V against M per token type at one layer: the paper's Fig. 2.

    Parameters
    ----------
    M, V, n : array-like of shape (k,)
        Squared norm of the mean, variance and count of each token type (what
        ``.../layers/{l}/tokens`` answers).
    slope, intercept, r2 : float or None
        The least-squares fit ``V = intercept + slope * M`` of the layer summary; the
        line is drawn over the range of M. ``intercept`` None with a slope: taken as
        ``mean(V) - slope * mean(M)`` over the points shown. ``slope`` None: no line.
    layer, model : shown in the title; ``title_extra`` is appended to it.
    fmt : "png" or "svg".

    Points whose M, V or n is missing or not finite, or whose n <= 0, are skipped.
    """
    _check_fmt(fmt)
    M, V, n = _array(M), _array(V), _array(n)
    if not (M.shape == V.shape == n.shape):
        raise ValueError(f"M, V and n must have the same length, got {M.size}, {V.size}, {n.size}")
    keep = np.isfinite(M) & np.isfinite(V) & np.isfinite(n) & (n > 0)
    M, V, n = M[keep], V[keep], n[keep]
    fig = _new_figure("vm_scatter")
    ax = fig.add_subplot()
    ax.set_title(_title(model, "V against M per token type", layer, title_extra))
    if M.size == 0:
        _no_data(ax)
        return _render(fig, fmt)
    c = np.log10(n)
    lo, hi = float(c.min()), float(c.max())
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    sc = ax.scatter(M, V, c=c, cmap="viridis", norm=Normalize(lo, hi), s=9, alpha=0.75,
                    linewidths=0, rasterized=M.size > RASTERIZE_ABOVE,
                    label=f"token types (k = {M.size})")
    fig.colorbar(sc, ax=ax, label="log10 n (occurrences of the type)")
    s, b, r = _num(slope), _num(intercept), _num(r2)
    if not math.isnan(s):
        if math.isnan(b):
            b = float(V.mean() - s * M.mean())
        x = np.array([M.min(), M.max()]) if M.max() > M.min() else np.array([M[0]] * 2)
        ax.plot(x, b + s * x, color="crimson", linewidth=1.8,
                label=f"least squares V = a + b\u00b7M\nslope = {_fmt(s)}, R{_SQ} = {_fmt(r)}")
    else:
        ax.plot([], [], " ", label="no regression line (slope undefined)")
    ax.set_xlabel(f"M = \u2016mean\u2016{_SQ}  (squared embedding units)")
    ax.set_ylabel(f"V = mean \u2016x \u2212 mean\u2016{_SQ}  (squared embedding units)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=9)
    return _render(fig, fmt)


def layer_summary(series, fmt: str = "png") -> bytes:
    """cv_Q, slope and R^2 of the V-on-M regression across layers: the paper's Fig. 4.

    Parameters
    ----------
    series : list of {"model": str, "layers": [row, ...]}
        One entry per model, overlaid as one line per model; a row has "layer", "cv_Q",
        "slope", "r2" (the ``.../layers`` answer). None values are gaps in the line.
    fmt : "png" or "svg".
    """
    _check_fmt(fmt)
    if isinstance(series, Mapping):
        series = [series]
    series = [s for s in (series or []) if isinstance(s, Mapping)]
    fig = _new_figure("layer_summary")
    axes = fig.subplots(1, 3)
    panels = (("cv_Q", "cv_Q = std(Q_t) / mean(Q_t)", "coefficient of variation (unitless)"),
              ("slope", "slope of V on M", "slope (unitless)"),
              ("r2", f"R{_SQ} of V on M", f"R{_SQ} (unitless)"))
    fig.suptitle("Norm-variance trade-off across layers")
    data = [(s.get("model"), *_by_layer(_rows(s.get("layers")), ("cv_Q", "slope", "r2"))) for s in series]
    handles: dict[str, Any] = {}
    for ax, (key, title, ylabel) in zip(axes, panels):
        ax.set_title(title)
        if not any(np.isfinite(cols[key]).any() for _, _, cols in data):
            _no_data(ax)
            continue
        for i, (model, layers, cols) in enumerate(data):
            (line,) = ax.plot(layers, cols[key], marker="o", markersize=4, color=f"C{i % 10}",
                              label=_label(model))
            handles.setdefault(f"{i}", line)
        if key == "slope":
            ax.axhline(-1.0, color="0.5", linestyle=":", linewidth=1)
        _integer_layers(ax)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    if handles:
        lines = list(handles.values())
        fig.legend(lines, [h.get_label() for h in lines], loc="outside lower center",
                   ncols=min(len(lines), 5), fontsize=9)
    return _render(fig, fmt)


def decomposition(rows, model, fmt: str = "png") -> bytes:
    """Q = M + V_W + V_B as stacked shares of Q per layer: the paper's Fig. 5.

    Parameters
    ----------
    rows : list of dict with "layer", "M/Q", "V_W/Q", "V_B/Q"; where a ratio key is
        absent it is computed from "Q", "M", "V_W", "V_B". A layer with any share
        missing is left out.
    model : shown in the title.
    fmt : "png" or "svg".
    """
    _check_fmt(fmt)
    rows, layers = _layer_rows(rows)
    parts = [("M/Q", _ratio(rows, "M", "Q", "M/Q"), "M / Q (norm of the mean)"),
             ("V_W/Q", _ratio(rows, "V_W", "Q", "V_W/Q"), "V_W / Q (within token types)"),
             ("V_B/Q", _ratio(rows, "V_B", "Q", "V_B/Q"), "V_B / Q (between token types)")]
    keep = np.ones(layers.shape, dtype=bool)
    for _, col, _ in parts:
        keep &= np.isfinite(col)
    fig = _new_figure("decomposition")
    ax = fig.add_subplot()
    ax.set_title(_title(model, "Q = M + V_W + V_B, shares of Q"))
    if not keep.any():
        _no_data(ax)
        return _render(fig, fmt)
    x = layers[keep]
    bottom = np.zeros(x.shape)
    for i, (_, col, label) in enumerate(parts):
        ax.bar(x, col[keep], bottom=bottom, width=0.8, color=f"C{i}", label=label)
        bottom = bottom + col[keep]
    _integer_layers(ax)
    ax.set_ylabel("share of Q (unitless)")
    ax.grid(True, axis="y", alpha=0.3)
    fig.legend(loc="outside lower center", ncols=3, fontsize=8)
    return _render(fig, fmt)


def within_ratio(rows, model, fmt: str = "png") -> bytes:
    """Share of the variance within token types, V_W / V, per layer: the paper's Fig. 6.

    Parameters
    ----------
    rows : list of dict with "layer" and "V_W/V", or "V_W" and "V" to compute it from.
    model : shown in the title.
    fmt : "png" or "svg".
    """
    _check_fmt(fmt)
    rows, layers = _layer_rows(rows)
    ratio = _ratio(rows, "V_W", "V", "V_W/V")
    fig = _new_figure("within_ratio")
    ax = fig.add_subplot()
    ax.set_title(_title(model, "V_W / V per layer"))
    if not np.isfinite(ratio).any():
        _no_data(ax)
        return _render(fig, fmt)
    ax.plot(layers, ratio, marker="o", color="C0")
    _integer_layers(ax)
    ax.set_ylabel("V_W / V, within-type share of the variance (unitless)")
    ax.grid(True, alpha=0.3)
    return _render(fig, fmt)


def frequency(n, Q, M, V, layer, model, fmt: str = "png") -> bytes:
    """Q, M and V of each token type against log10 n: the paper's Fig. 7.

    Parameters
    ----------
    n, Q, M, V : array-like of shape (k,), count and statistics of each token type.
    layer, model : shown in the title.
    fmt : "png" or "svg".

    Three panels share the x-axis; a point is skipped in a panel where its value (or n)
    is missing, not finite, or n <= 0.
    """
    _check_fmt(fmt)
    n, Q, M, V = _array(n), _array(Q), _array(M), _array(V)
    if not (n.shape == Q.shape == M.shape == V.shape):
        raise ValueError("n, Q, M and V must have the same length")
    ok_n = np.isfinite(n) & (n > 0)
    x = np.full(n.shape, np.nan)
    x[ok_n] = np.log10(n[ok_n])
    fig = _new_figure("frequency")
    axes = fig.subplots(1, 3, sharex=True)
    fig.suptitle(_title(model, "Q, M, V of token types against frequency", layer))
    panels = ((Q, f"Q = mean \u2016x\u2016{_SQ}", "C0"),
              (M, f"M = \u2016mean\u2016{_SQ}", "C1"),
              (V, f"V = mean \u2016x \u2212 mean\u2016{_SQ}", "C2"))
    for ax, (y, title, color) in zip(axes, panels):
        ax.set_title(title)
        keep = np.isfinite(x) & np.isfinite(y)
        if not keep.any():
            _no_data(ax)
            continue
        ax.scatter(x[keep], y[keep], s=8, alpha=0.6, color=color, linewidths=0,
                   rasterized=int(keep.sum()) > RASTERIZE_ABOVE)
        ax.set_xlabel("log10 n (occurrences of the type)")
        ax.set_ylabel("squared embedding units")
        ax.grid(True, alpha=0.3)
    return _render(fig, fmt)


def isotropy(rows, model, fmt: str = "png") -> bytes:
    """IsoScore, mean cosine similarity and effective rank across layers.

    Not a figure of the paper: the isotropy diagnostics of :mod:`embgeom.diagnostics`
    (IsoScore after Rudman et al. 2022). Two panels: IsoScore and mean cosine (both
    unitless, left), effective rank (in dimensions, right).

    Parameters
    ----------
    rows : list of dict with "layer", "isoscore", "mean_cosine", "effective_rank".
    model : shown in the title.
    fmt : "png" or "svg".
    """
    _check_fmt(fmt)
    layers, cols = _by_layer(_rows(rows), ("isoscore", "mean_cosine", "effective_rank"))
    fig = _new_figure("isotropy")
    left, right = fig.subplots(1, 2)
    fig.suptitle(_title(model, "isotropy across layers"))
    left.set_title("IsoScore and mean cosine similarity")
    if np.isfinite(cols["isoscore"]).any() or np.isfinite(cols["mean_cosine"]).any():
        left.plot(layers, cols["isoscore"], marker="o", color="C0", label="IsoScore")
        left.plot(layers, cols["mean_cosine"], marker="s", color="C3", label="mean cosine")
        _integer_layers(left)
        left.set_ylabel("unitless (IsoScore in [0, 1], cosine in [-1, 1])")
        left.grid(True, alpha=0.3)
        left.legend(loc="best", fontsize=9)
    else:
        _no_data(left)
    right.set_title("effective rank of the covariance")
    if np.isfinite(cols["effective_rank"]).any():
        right.plot(layers, cols["effective_rank"], marker="o", color="C2")
        _integer_layers(right)
        right.set_ylabel("effective rank (dimensions)")
        right.grid(True, alpha=0.3)
    else:
        _no_data(right)
    return _render(fig, fmt)


def outliers(rows, model, fmt: str = "png") -> bytes:
    """Outlier dimensions across layers, as a dot plot of dimension index against layer.

    Not a figure of the paper: dimensions whose variance is at least a threshold times
    the mean variance (Kovaleva et al. 2021; Rudman et al. 2023). Dots are sized and
    coloured by that variance ratio.

    Parameters
    ----------
    rows : list of {"layer": int, "dimensions": [{"dim": int, "ratio": float}, ...]}, or
        the ``.../models/{m}/outliers`` answer (its "layers" are used).
    model : shown in the title.
    fmt : "png" or "svg".
    """
    _check_fmt(fmt)
    xs, ys, rs = [], [], []
    for r in _rows(rows):
        layer = _num(r.get("layer"))
        dims = r.get("dimensions") or []
        if math.isnan(layer):
            continue
        for d in dims:
            if not isinstance(d, Mapping):
                continue
            dim, ratio = _num(d.get("dim")), _num(d.get("ratio"))
            if math.isnan(dim) or math.isnan(ratio) or ratio <= 0:
                continue
            xs.append(layer), ys.append(dim), rs.append(ratio)
    fig = _new_figure("outliers")
    ax = fig.add_subplot()
    ax.set_title(_title(model, "outlier dimensions across layers"))
    if not xs:
        _no_data(ax, "no outlier dimensions")
        return _render(fig, fmt)
    x, y, ratio = np.array(xs), np.array(ys), np.array(rs)
    lo, hi = float(ratio.min()), float(ratio.max())
    if hi <= lo:
        lo, hi = lo / 1.5, hi * 1.5
    scale = (np.log(ratio) - math.log(lo)) / (math.log(hi) - math.log(lo))
    sc = ax.scatter(x, y, s=20 + 120 * scale, c=ratio, cmap="plasma", norm=LogNorm(lo, hi),
                    edgecolors="0.2", linewidths=0.4)
    cbar = fig.colorbar(sc, ax=ax, label="variance / mean variance across dimensions")
    cbar.ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    cbar.ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    _integer_layers(ax)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("dimension index")
    ax.grid(True, alpha=0.3)
    return _render(fig, fmt)


def spectrum(eigenvalues, layer, model, fmt: str = "png") -> bytes:
    """Sorted eigenvalues of one layer's covariance and their cumulative explained variance.

    Not a figure of the paper: the spectrum behind IsoScore and the effective rank
    (``.../layers/{l}/isotropy?spectrum=true``). Eigenvalues are sorted in decreasing
    order on a log axis (non-positive ones cannot be shown there and count as 0 in the
    cumulative share, on the right axis).

    Parameters
    ----------
    eigenvalues : array-like of shape (d,).
    layer, model : shown in the title.
    fmt : "png" or "svg".
    """
    _check_fmt(fmt)
    lam = _array(eigenvalues)
    lam = np.sort(lam[np.isfinite(lam)])[::-1]
    fig = _new_figure("spectrum")
    ax = fig.add_subplot()
    ax.set_title(_title(model, "covariance spectrum", layer))
    positive = lam > 0
    if not positive.any():
        _no_data(ax)
        return _render(fig, fmt)
    index = np.arange(1, lam.size + 1)
    ax.plot(index[positive], lam[positive], color="C0", marker="." if lam.size <= 100 else None,
            label="eigenvalue")
    ax.set_yscale("log")
    ax.set_xlabel("eigenvalue rank (1 = largest)")
    ax.set_ylabel("eigenvalue (squared embedding units)")
    ax.grid(True, which="major", alpha=0.3)
    share = np.cumsum(np.clip(lam, 0.0, None)) / float(np.clip(lam, 0.0, None).sum())
    right = ax.twinx()
    right.plot(index, share, color="C1", label="cumulative explained variance")
    right.set_ylim(0.0, 1.02)
    right.set_ylabel("cumulative explained variance (fraction)")
    lines = ax.get_lines() + right.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], loc="center right", fontsize=9)
    return _render(fig, fmt)


def cka(result: Optional[Mapping], model, fmt: str = "png") -> bytes:
    """Heatmap of the layer-by-layer linear CKA (``.../similarity?metric=linear_cka``).

    Parameters
    ----------
    result : the endpoint's answer (``layers``, ``matrix`` with None for undefined, ``n``),
        or None for a collection that keeps no cross-layer moments ("no data" says why).
    model : shown in the title.
    fmt : "png" or "svg".
    """
    _check_fmt(fmt)
    fig = _new_figure("cka")
    ax = fig.add_subplot()
    ax.set_title(_title(model, "linear CKA between layers"))
    if result is None:
        _no_data(ax, "no cross-layer moments: create the collection with cross_layer")
        return _render(fig, fmt)
    layers = list(result.get("layers") or [])
    M = np.array([[np.nan if v is None else float(v) for v in row]
                  for row in (result.get("matrix") or [])], dtype=np.float64).reshape(len(layers), -1)
    if not layers or not result.get("n") or not np.isfinite(M).any():
        _no_data(ax)
        return _render(fig, fmt)
    image = ax.imshow(np.ma.masked_invalid(M), vmin=0.0, vmax=1.0, cmap="viridis", origin="lower")
    ticks = np.arange(len(layers))
    ax.set_xticks(ticks, [str(l) for l in layers])
    ax.set_yticks(ticks, [str(l) for l in layers])
    ax.set_xlabel("layer (hidden_states index)")
    ax.set_ylabel("layer (hidden_states index)")
    if len(layers) <= 16:
        for i in range(len(layers)):
            for j in range(len(layers)):
                if np.isfinite(M[i, j]):
                    ax.text(j, i, f"{M[i, j]:.2f}", ha="center", va="center", fontsize=7,
                            color="black" if M[i, j] > 0.6 else "white")
    fig.colorbar(image, ax=ax, label="linear CKA")
    fig.text(0.01, 0.01, f"n = {int(result['n']):,} occurrences", fontsize=8)
    return _render(fig, fmt)
