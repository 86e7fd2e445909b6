"""Figures of the cross-model geometry answers (:mod:`embgeom.comparisons`), as matplotlib figures.

Each public function takes the answer of the matching JSON endpoint (a dict, as
``/v1/compare/global``, ``/v1/compare/lle`` or ``.../intrinsic-dimension`` answer it) and
the per-token or per-pair arrays behind it, and returns a :class:`matplotlib.figure.Figure`
(no ``pyplot``: thread-safe, nothing registered globally); :func:`render` encodes one as
PNG or SVG bytes with :mod:`embgeom.figures`' encoder (deterministic bytes, no dates)::

    intrinsic_dimension(result, estimates, n)           -> Figure
    global_similarity(result, cos_a, cos_b, cos_b_shuffled) -> Figure
    lle(result, rows)                                   -> Figure
    render(fig, "png" | "svg")                          -> bytes

:data:`LAYER_FIGURES` and :data:`COMPARE_FIGURES` name them as the service serves them
(``.../layers/{l}/figures/{name}`` and ``/v1/compare/figures/{name}``).

Robustness: NaN and inf values are skipped point by point; a panel with nothing left says
"no data". Token strings and names are shown literally (``$`` escaped, length bounded).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from embgeom.figures import DPI, FORMATS, RASTERIZE_ABOVE, _array, _fmt, _no_data, _render, _text

__all__ = ["LAYER_FIGURES", "COMPARE_FIGURES", "SIZES", "intrinsic_dimension",
           "global_similarity", "lle", "render", "space_label"]

LAYER_FIGURES: dict[str, str] = {
    "intrinsic_dimension": "histogram of the per-token intrinsic dimension estimates of a layer, "
                           "and each estimate against log10 n, the lowest and highest tokens named",
}
COMPARE_FIGURES: dict[str, str] = {
    "global": "cos(a_i, a_j) against cos(b_i, b_j) over a seeded sample of token pairs (density), "
              "beside the same with b's tokens shuffled; Pearson r of all pairs and its baseline",
    "lle": "per-token LLE errors in b (a's weights against b's own on a's neighbours), and the "
           "transfer, own and random errors over all tokens",
}
SIZES: dict[str, tuple[float, float]] = {
    "intrinsic_dimension": (13.0, 5.0),
    "global": (13.0, 5.5),
    "lle": (13.0, 5.0),
}
# Tokens named at each end of the intrinsic-dimension figure.
MAX_NAMED = 20


def render(fig: Figure, fmt: str = "png") -> bytes:
    """PNG or SVG bytes of a figure (as :mod:`embgeom.figures` encodes its own)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return _render(fig, fmt)


def space_label(space: Mapping) -> str:
    """``collection/model layer`` of a space dict (``{"collection", "model", "layer"}``)."""
    layer = space.get("layer")
    where = "input embeddings" if layer == "input" else f"layer {layer}"
    return f"{_text(space.get('collection'), 30)}/{_text(space.get('model'), 30)} {where}"


def _new(name: str) -> Figure:
    fig = Figure(figsize=SIZES[name], dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    fig.patch.set_facecolor("white")
    return fig


def _finite(*arrays: np.ndarray) -> np.ndarray:
    keep = np.ones(arrays[0].shape, dtype=bool)
    for a in arrays:
        keep &= np.isfinite(a)
    return keep


# ------------------------------------------------------------------ intrinsic dimension

def intrinsic_dimension(result: Mapping, estimates, n) -> Figure:
    """Per-token intrinsic dimension of one layer.

    Parameters
    ----------
    result : the ``.../layers/{l}/intrinsic-dimension`` answer: ``collection``, ``model``,
        ``layer``, ``method``, ``k``, ``threshold``, ``min_count``, ``tokens``,
        ``dimension`` (global), ``mean``, ``median``, ``undefined``, ``lowest`` and
        ``highest`` ([{``token``, ``n``, ``estimate``}], named on the right panel, at most
        :data:`MAX_NAMED` each).
    estimates, n : array-like of shape (k,): every token's estimate (NaN where undefined)
        and count ``n_t``, in one order.

    Left: histogram of the estimates (integer bins for ``local_pca``) with the mean, the
    median and the global estimate marked. Right: each estimate against log10 n, the
    lowest and highest tokens highlighted and listed.
    """
    est, n = _array(estimates), _array(n)
    if est.shape != n.shape:
        raise ValueError(f"estimates and n must have the same length, got {est.size} and {n.size}")
    keep = _finite(est, n) & (n > 0)
    est_k, n_k = est[keep], n[keep]
    method = str(result.get("method", ""))
    fig = _new("intrinsic_dimension")
    left, right = fig.subplots(1, 2)
    what = f"{method} k = {result.get('k')}"
    if method == "local_pca" and result.get("threshold") is not None:
        what += f", {100 * float(result['threshold']):.0f} % of the variance"
    fig.suptitle(f"{_text(result.get('collection'), 30)}/{_text(result.get('model'), 30)} "
                 f"layer {result.get('layer')}: intrinsic dimension per token ({what}; "
                 f"n_t >= {result.get('min_count')})")
    left.set_title(f"{est_k.size} tokens" + (f", {int(result['undefined'])} undefined"
                                             if result.get("undefined") else ""))
    right.set_title("estimate against frequency")
    if est_k.size == 0:
        _no_data(left)
        _no_data(right)
        return fig

    lo, hi = float(est_k.min()), float(est_k.max())
    if method == "local_pca":
        bins = np.arange(math.floor(lo) - 0.5, math.ceil(hi) + 1.5, 1.0)
    else:
        bins = np.linspace(lo, hi if hi > lo else lo + 1.0, 41)
    left.hist(est_k, bins=bins, color="C0", alpha=0.8, label="tokens")
    for key, style, colour, label in (("mean", "--", "0.2", "mean"), ("median", ":", "0.2", "median"),
                                      ("dimension", "-", "crimson", "global estimate")):
        v = _array([result.get(key)])[0]
        if np.isfinite(v):
            left.axvline(v, linestyle=style, color=colour, linewidth=1.5, label=f"{label} {_fmt(v, 3)}")
    left.set_xlabel("intrinsic dimension estimate")
    left.set_ylabel("tokens")
    left.grid(True, alpha=0.3)
    left.legend(loc="best", fontsize=9)

    logn = np.log10(n_k)
    right.scatter(logn, est_k, s=8, color="0.55", alpha=0.5, linewidths=0,
                  rasterized=est_k.size > RASTERIZE_ABOVE, label="tokens")
    lines = []
    for end, colour, marker in (("lowest", "C0", "v"), ("highest", "crimson", "^")):
        rows = [r for r in (result.get(end) or []) if isinstance(r, Mapping)][:MAX_NAMED]
        xs = _array([r.get("n") for r in rows])
        ys = _array([r.get("estimate") for r in rows])
        ok = _finite(xs, ys) & (xs > 0)
        if ok.any():
            right.scatter(np.log10(xs[ok]), ys[ok], s=36, color=colour, marker=marker,
                          edgecolors="black", linewidths=0.5, label=f"{end} {int(ok.sum())}")
        named = ", ".join(f"{_text(r.get('token'), 16)} ({_fmt(_array([r.get('estimate')])[0], 3)})"
                          for r in rows[:10])
        if named:
            lines.append(f"{end}: {named}")
    right.set_xlabel("log10 n (occurrences of the token)")
    right.set_ylabel("intrinsic dimension estimate")
    if method == "local_pca":
        right.yaxis.set_major_locator(MaxNLocator(integer=True))
    right.grid(True, alpha=0.3)
    right.legend(loc="best", fontsize=9)
    if lines:
        fig.text(0.01, 0.005, _wrap("\n".join(lines), 170), fontsize=8, va="bottom", ha="left",
                 color="0.15")
        fig.get_layout_engine().set(rect=(0, 0.09, 1, 0.91))
    return fig


def _wrap(text: str, width: int) -> str:
    out = []
    for line in text.split("\n"):
        while len(line) > width:
            cut = line.rfind(", ", 0, width)
            cut = width if cut <= 0 else cut + 1
            out.append(line[:cut])
            line = "    " + line[cut:].lstrip()
        out.append(line)
    return "\n".join(out[:4])


# ------------------------------------------------------------------ global similarity

def global_similarity(result: Mapping, cos_a, cos_b, cos_b_shuffled) -> Figure:
    """Pairwise cosines of two spaces against each other (the Pearson of cosines).

    Parameters
    ----------
    result : the ``/v1/compare/global`` answer: ``a``, ``b`` (space dicts), ``matched_by``,
        ``shared_tokens``, ``tokens_used``, ``pairs``, ``pearson_cosine``, ``cka_linear``,
        ``procrustes_residual`` and ``baseline`` (the same three with b shuffled). The r
        shown is this answer's, over all its pairs.
    cos_a, cos_b : array-like of shape (p,): ``cos(a_i, a_j)`` and ``cos(b_i, b_j)`` of the
        plotted pairs (a sample of the answer's pairs).
    cos_b_shuffled : array-like of shape (p,): ``cos(b_pi(i), b_pi(j))`` of the same pairs
        under the permutation pi of the answer's baseline.

    Two density panels (hexbin, log colour): the matched pairs, and the shuffled
    correspondence (what unrelated spaces with these marginal geometries give), each with
    its least-squares line through the plotted pairs.
    """
    x, y, ys = _array(cos_a), _array(cos_b), _array(cos_b_shuffled)
    if not (x.shape == y.shape == ys.shape):
        raise ValueError(f"cos_a, cos_b and cos_b_shuffled must have the same length, "
                         f"got {x.size}, {y.size}, {ys.size}")
    a, b = result.get("a") or {}, result.get("b") or {}
    base = result.get("baseline") or {}
    fig = _new("global")
    left, right = fig.subplots(1, 2, sharex=True, sharey=True)
    fig.suptitle(f"{space_label(a)}  vs  {space_label(b)}: cosine of each token pair "
                 f"({result.get('tokens_used')} of {result.get('shared_tokens')} shared tokens, "
                 f"matched by {_text(result.get('matched_by'), 10)})")
    pairs = result.get("pairs")
    shown = int(_finite(x, y).sum())
    fig.text(0.01, 0.005,
             f"Pearson r over all {pairs:,} pairs; plotted: a seeded sample of {shown:,} pairs.   "
             f"Linear CKA {_fmt(_array([result.get('cka_linear')])[0], 3)} "
             f"(shuffled {_fmt(_array([base.get('cka_linear')])[0], 3)}); Procrustes residual "
             f"{_fmt(_array([result.get('procrustes_residual')])[0], 3)} "
             f"(shuffled {_fmt(_array([base.get('procrustes_residual')])[0], 3)})"
             if isinstance(pairs, int) else f"plotted: {shown:,} pairs",
             fontsize=9, va="bottom", ha="left", color="0.15")
    fig.get_layout_engine().set(rect=(0, 0.04, 1, 0.96))
    panels = ((left, y, f"matched tokens: Pearson r = {_fmt(_array([result.get('pearson_cosine')])[0], 3)}"),
              (right, ys, f"b's tokens shuffled (baseline): r = "
                          f"{_fmt(_array([base.get('pearson_cosine')])[0], 3)}"))
    keep_all = _finite(x, y, ys)
    for ax, yy, title in panels:
        ax.set_title(title)
        keep = keep_all
        if not keep.any():
            _no_data(ax)
            continue
        hb = ax.hexbin(x[keep], yy[keep], gridsize=60, bins="log", cmap="viridis", mincnt=1,
                       linewidths=0.1, rasterized=True)
        if x[keep].max() > x[keep].min():
            slope, intercept = np.polyfit(x[keep], yy[keep], 1)
            xs = np.array([x[keep].min(), x[keep].max()])
            ax.plot(xs, intercept + slope * xs, color="crimson", linewidth=1.5,
                    label=f"least squares, slope {_fmt(slope, 3)}")
            ax.legend(loc="upper left", fontsize=9)
        ax.set_xlabel(f"cos(a_i, a_j)   a = {space_label(a)}")
        ax.grid(True, alpha=0.3)
        fig.colorbar(hb, ax=ax, label="pairs (log scale)")
    left.set_ylabel(f"cos(b_i, b_j)   b = {space_label(b)}")
    return fig


# ------------------------------------------------------------------------------- LLE

def lle(result: Mapping, rows: Mapping[str, Any], tokens: Optional[Sequence[str]] = None) -> Figure:
    """LLE weight transfer from space a to space b, token by token and over all tokens.

    Parameters
    ----------
    result : the ``/v1/compare/lle`` answer: ``a``, ``b``, ``k``, ``tokens_used``,
        ``transfer_error``, ``own_error``, ``own_neighbors_error``, ``random_error``,
        ``neighbor_overlap``, ``chance_overlap``. The bars show these numbers.
    rows : per-token arrays of shape (m,) as :func:`embgeom.geometry.lle_transfer_rows`
        gives them: ``transfer``, ``own`` (errors relative to b's mean squared deviation:
        their means are ``transfer_error`` and ``own_error``) and ``overlap``.
    tokens : optional strings of the m tokens: the 4 with the largest transfer / own
        ratio and the 4 with the smallest are named.

    Left: each token's transfer error against its own (floor) error, log-log, coloured by
    the share of its k neighbours common to both spaces, with the line transfer = own.
    Right: the four errors over all tokens, and the neighbour overlap against chance.
    """
    tr, own, ov = _array(rows.get("transfer")), _array(rows.get("own")), _array(rows.get("overlap"))
    if not (tr.shape == own.shape == ov.shape):
        raise ValueError("rows transfer, own and overlap must have the same length")
    a, b = result.get("a") or {}, result.get("b") or {}
    fig = _new("lle")
    left, right = fig.subplots(1, 2, width_ratios=(1.35, 1))
    fig.suptitle(f"LLE transfer, k = {result.get('k')}: weights of {space_label(a)} rebuilding "
                 f"{space_label(b)} ({result.get('tokens_used')} tokens)")
    keep = _finite(tr, own, ov) & (tr > 0) & (own > 0)
    left.set_title("per token: error in b (share of b's mean squared deviation)")
    if keep.any():
        sc = left.scatter(own[keep], tr[keep], c=ov[keep], cmap="viridis", norm=Normalize(0.0, 1.0),
                          s=10, alpha=0.8, linewidths=0, rasterized=int(keep.sum()) > RASTERIZE_ABOVE)
        fig.colorbar(sc, ax=left, label="share of the k neighbours common to a and b")
        lo = float(min(own[keep].min(), tr[keep].min()))
        hi = float(max(own[keep].max(), tr[keep].max()))
        left.plot([lo, hi], [lo, hi], color="crimson", linewidth=1.2, label="transfer = own")
        left.set_xscale("log")
        left.set_yscale("log")
        left.legend(loc="upper left", fontsize=9)
        if tokens is not None and len(tokens) == tr.size:
            idx = np.flatnonzero(keep)
            ratio = tr[idx] / own[idx]
            order = idx[np.argsort(ratio, kind="stable")]
            for i in list(order[:4]) + list(order[-4:]) if order.size > 8 else list(order):
                left.annotate(_text(tokens[i], 16), (own[i], tr[i]), fontsize=7, color="0.1",
                              xytext=(3, 3), textcoords="offset points")
    else:
        _no_data(left)
    left.set_xlabel("own error: a's neighbours, b's best weights (floor)")
    left.set_ylabel("transfer error: a's neighbours and weights")
    left.grid(True, which="major", alpha=0.3)

    names = (("own_error", "own\n(floor)", "C2"), ("own_neighbors_error", "plain LLE\nin b", "C1"),
             ("transfer_error", "transfer\n(a's weights)", "C0"), ("random_error", "random\nweights", "0.6"))
    values = _array([result.get(key) for key, _, _ in names])
    right.set_title("over all tokens: b's variance left unexplained")
    if np.isfinite(values).any():
        xs = np.arange(len(names))
        bars = right.bar(xs, np.nan_to_num(values), color=[c for _, _, c in names])
        for bar, v in zip(bars, values):
            right.annotate(_fmt(v, 3), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                           ha="center", va="bottom", fontsize=9, xytext=(0, 2),
                           textcoords="offset points")
        right.set_xticks(xs, [label for _, label, _ in names])
        right.set_ylim(0, max(1.0, float(np.nanmax(values))) * 1.12)
    else:
        _no_data(right)
    overlap = _array([result.get("neighbor_overlap")])[0]
    chance = _array([result.get("chance_overlap")])[0]
    right.text(0.02, 0.97, f"neighbour overlap {_fmt(overlap, 3)} (chance {_fmt(chance, 3)})",
               transform=right.transAxes, va="top", ha="left", fontsize=9)
    right.set_ylabel("error (fraction of b's total variance)")
    right.grid(True, axis="y", alpha=0.3)
    return fig
