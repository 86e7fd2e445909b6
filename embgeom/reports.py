"""What the read endpoints answer: a consistent snapshot from the store, then the math.

Each function reads once (one MULTI, see :mod:`embgeom.store`), computes with
:mod:`embgeom.stats`, and returns plain dicts with an ``as_of`` telling how fresh the
snapshot is.
"""

from __future__ import annotations

import base64
import json
from typing import Optional, Sequence

import numpy as np

from embgeom import diagnostics
from embgeom import keys as K
from embgeom.errors import InvalidInput, NotFound
from embgeom.stats import decomposition, layer_summary
from embgeom.store import AccumulatorStore, AsOf, LayerGlobal, LayerScalars

__all__ = [
    "CountFilter", "layer_rows", "token_page", "token_detail", "self_similarity",
    "isotropy", "outliers", "model_outliers",
]

ORDER_FIELDS = ("n", "Q", "M", "V")


class CountFilter:
    """Token types with ``min_count <= n_t <= max_count`` (None: no upper bound)."""

    def __init__(self, min_count: int = 1, max_count: Optional[int] = None):
        if min_count < 1:
            raise InvalidInput("min_count must be >= 1", type="invalid_filter")
        if max_count is not None and max_count < min_count:
            raise InvalidInput("max_count must be >= min_count", type="invalid_filter")
        self.min_count = min_count
        self.max_count = max_count

    @property
    def is_everything(self) -> bool:
        return self.min_count <= 1 and self.max_count is None

    def mask(self, n: np.ndarray) -> np.ndarray:
        keep = n >= self.min_count
        if self.max_count is not None:
            keep &= n <= self.max_count
        return keep

    def to_dict(self) -> dict:
        return {"min_count": self.min_count, "max_count": self.max_count}


def _as_of(meta: Optional[dict]) -> dict:
    return AsOf(meta["version"], meta["updated_at"]).to_dict() if meta else {"version": 0, "updated_at": None}


def _none_if_nan(x) -> Optional[float]:
    if x is None:
        return None
    x = float(x)
    return None if not np.isfinite(x) else x


def _empty_decomposition(layer: int) -> dict:
    return {"layer": layer, "n": 0, "num_types": 0,
            "Q": None, "M": None, "V": None, "V_W": None, "V_B": None}


def _from_global(layer: int, g: LayerGlobal, num_types: int) -> dict:
    """O(d): Q = m2/n + ||mean||^2, V_W = within/n, V_B = V - V_W."""
    if g.n == 0:
        return _empty_decomposition(layer)
    M = float(g.mean @ g.mean)
    V = g.m2 / g.n
    V_W = g.within / g.n
    return {"layer": layer, "n": g.n, "num_types": num_types,
            "Q": M + V, "M": M, "V": V, "V_W": V_W, "V_B": V - V_W}


def layer_rows(store: AccumulatorStore, pair: K.PairKeys, layers: Sequence[int],
               count_filter: CountFilter, with_summary: bool = True) -> tuple[list[dict], dict]:
    """Decomposition (and the per-layer summary) of each layer.

    Unfiltered decompositions cost O(d) per layer (maintained aggregates); a count
    filter scans the token types. The summary (cv_Q, slope, r2, ...) always scans the
    per-token scalars of the filtered types.
    """
    layers = list(layers)
    rows: dict[int, dict] = {}
    if count_filter.is_everything:
        # One snapshot for the decomposition and the summary.
        meta, globs, types, scalars = store.globals(pair, layers, with_scalars=with_summary)
        rows = {l: _from_global(l, globs[l], types[l]) for l in layers}
    else:
        meta, means = store.token_means(pair, layers)
        scalars = {}
        for l in layers:
            ids, n, m2, mean = means[l]
            scalars[l] = LayerScalars(ids=ids, n=n, M=np.einsum("ki,ki->k", mean, mean), m2=m2)
            keep = count_filter.mask(n)
            rows[l] = {"layer": l, **decomposition(n[keep], mean[keep], m2[keep])}
    if with_summary:
        for l in layers:
            s = scalars[l]
            keep = count_filter.mask(s.n)
            rows[l].update(layer_summary(s.n[keep], s.Q[keep], s.M[keep], s.V[keep]))
            q = rows[l]["Q"]
            for name in ("M", "V_W", "V_B"):
                rows[l][f"{name}/Q"] = (rows[l][name] / q) if q else None
            v = rows[l]["V"]
            rows[l]["V_W/V"] = (rows[l]["V_W"] / v) if v else None
    return [rows[l] for l in layers], _as_of(meta)


# ------------------------------------------------------------------ tokens

def _encode_cursor(payload: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(payload).encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[float, int]:
    """The (value, token id) a cursor resumes after; anything else is ``invalid_cursor``."""
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        payload = json.loads(base64.urlsafe_b64decode(padded.encode()))
        value, token_id = payload["v"], payload["id"]
        if isinstance(value, bool) or isinstance(token_id, bool) or not isinstance(token_id, int):
            raise TypeError
        value = float(value)
        if not np.isfinite(value):
            raise ValueError
        return value, token_id
    except (ValueError, TypeError, KeyError, OverflowError):
        raise InvalidInput("cursor is not one this service issued", type="invalid_cursor") from None


def self_similarity(unit_sum: Optional[np.ndarray], n: int) -> Optional[float]:
    """Self-similarity of one token (see :func:`embgeom.diagnostics.self_similarity`)."""
    if unit_sum is None:
        return None
    return _none_if_nan(diagnostics.self_similarity(unit_sum[None, :], np.array([n]))[0])


def token_page(store: AccumulatorStore, pair: K.PairKeys, layer: int, tokenizer,
               order_by: str = "n", desc: bool = True, limit: int = 100,
               cursor: Optional[str] = None, count_filter: Optional[CountFilter] = None,
               token_id: Optional[int] = None) -> dict:
    """One page of per-token stats, ordered by ``order_by`` then token id (keyset cursor).

    The cursor holds the last (value, id) served, so pages stay disjoint even while
    new commits land between requests.
    """
    if order_by not in ORDER_FIELDS:
        raise InvalidInput(f"order_by must be one of {', '.join(ORDER_FIELDS)}", type="invalid_order")
    count_filter = count_filter or CountFilter()
    meta, scalars = store.scalars(pair, [layer])
    s = scalars[layer]
    keep = count_filter.mask(s.n)
    if token_id is not None:
        keep &= s.ids == token_id
    ids = s.ids[keep]
    values = {"n": s.n[keep], "Q": s.Q[keep], "M": s.M[keep], "V": s.V[keep]}
    key = values[order_by]
    sign = -1.0 if desc else 1.0
    order = np.lexsort((ids, sign * key))
    if cursor is not None:
        last_v, last_id = _decode_cursor(cursor)
        last_v *= sign
        sk = sign * key[order]
        after = (sk > last_v) | ((sk == last_v) & (ids[order] > last_id))
        order = order[after]
    page = order[:limit]
    page_ids = ids[page]
    _, records = store.token_records(pair, layer, page_ids.tolist())
    strings = tokenizer.convert_ids_to_tokens(page_ids.tolist()) if len(page_ids) else []
    tokens = []
    for j, i in enumerate(page):
        rec = records[j]
        n = int(values["n"][i])
        tokens.append({
            "token_id": int(ids[i]), "token": strings[j], "n": n,
            "Q": float(values["Q"][i]), "M": float(values["M"][i]), "V": float(values["V"][i]),
            "self_similarity": self_similarity(rec[3] if rec else None, n),
        })
    next_cursor = None
    if len(order) > limit and len(page):
        last = page[-1]
        next_cursor = _encode_cursor({"v": float(key[last]), "id": int(ids[last])})
    return {"layer": layer, "tokens": tokens, "next_cursor": next_cursor,
            "total": int(keep.sum()), "as_of": _as_of(meta)}


def token_detail(store: AccumulatorStore, pair: K.PairKeys, layer: int, token_id: int, tokenizer) -> dict:
    meta, records = store.token_records(pair, layer, [token_id])
    rec = records[0] if records else None
    if rec is None:
        raise NotFound("token_not_found",
                       f"token {token_id} was never seen at layer {layer} of this collection",
                       token_id=token_id)
    n, m2, mean, unit = rec
    M = float(mean @ mean)
    V = m2 / n
    return {"layer": layer, "token_id": int(token_id),
            "token": tokenizer.convert_ids_to_tokens(int(token_id)),
            "n": n, "Q": M + V, "M": M, "V": V,
            "self_similarity": self_similarity(unit, n), "as_of": _as_of(meta)}


# --------------------------------------------------------------- isotropy

def _transform(spec: Optional[str]):
    try:
        return diagnostics.parse_transform(spec)
    except ValueError as exc:
        raise InvalidInput(str(exc), type="invalid_transform") from None


def _layer_moments(store: AccumulatorStore, pair: K.PairKeys, layer: int, t, with_means: bool = False):
    """``(meta, (global, cov, transformed cov, unit_sum, unit_sq_sum[, token means]))``
    from one snapshot; None when the layer is empty."""
    meta, state = store.covariance_state(pair, [layer], with_means=with_means)
    if meta is None or state[layer][0].n == 0:
        return meta, None
    g, comoment, unit_sum, unit_sq = state[layer][:4]
    cov = comoment / g.n
    try:
        cov_t = diagnostics.transform_covariance(cov, t, mean=g.mean)
    except ValueError as exc:
        raise InvalidInput(str(exc), type="invalid_transform") from None
    return meta, (g, cov, cov_t, unit_sum, unit_sq) + tuple(state[layer][4:])


UNAVAILABLE_UNDER_TRANSFORM = (
    "not a function of the streamed moments once a transform is applied; not approximated"
)


def isotropy(store: AccumulatorStore, pair: K.PairKeys, layer: int, transform: Optional[str] = None,
             spectrum: bool = False, partition: bool = True, min_count: int = 1) -> dict:
    """Isotropy of all embeddings of a layer, exact from the streamed covariance.

    IsoScore, effective rank, participation ratio and top eigenvalue ratio come from the
    eigenvalues of the (transformed) covariance ``C / n``; ``mean_cosine`` from the unit
    vector sum, only without a transform; the partition isotropy I(W) (Mu & Viswanath)
    from the matrix of per-token means with ``n_t >= min_count``, transformed alike.
    """
    t = _transform(transform)
    meta, moments = _layer_moments(store, pair, layer, t, with_means=partition)
    out = {"layer": layer, "transform": transform or "none", "n": 0, "isoscore": None,
           "mean_cosine": None, "effective_rank": None, "participation_ratio": None,
           "top_eigenvalue_ratio": None, "partition_isotropy": None, "eigenvalues": None,
           "unavailable": {}, "as_of": _as_of(meta)}
    if moments is None:
        return out
    g, cov, cov_t, unit_sum, unit_sq = moments[:5]
    lam = diagnostics.covariance_eigenvalues(cov_t)
    out.update({
        "n": g.n,
        "isoscore": _none_if_nan(diagnostics.isoscore_from_eigenvalues(lam)),
        "effective_rank": _none_if_nan(diagnostics.effective_rank(lam)),
        "participation_ratio": _none_if_nan(diagnostics.participation_ratio(lam)),
        "top_eigenvalue_ratio": _none_if_nan(diagnostics.top_eigenvalue_ratio(lam)),
    })
    if spectrum:
        out["eigenvalues"] = lam.tolist()
    if t.kind == "none":
        out["mean_cosine"] = _none_if_nan(diagnostics.mean_cosine(unit_sum, g.n))
    else:
        out["unavailable"]["mean_cosine"] = UNAVAILABLE_UNDER_TRANSFORM
    if partition:
        ids, n_t, _, mean_t = moments[5]
        keep = n_t >= min_count
        if keep.sum() >= 1:
            W = diagnostics.transform_points(mean_t[keep], g.mean, cov, t)
            log_iw = diagnostics.log_partition_isotropy(W)
            out["partition_isotropy"] = _none_if_nan(np.exp(log_iw))
            out["partition_isotropy_log10"] = _none_if_nan(log_iw / np.log(10))
            out["partition_types"] = int(keep.sum())
    return out


def outliers(store: AccumulatorStore, pair: K.PairKeys, layer: int, threshold: float = 5.0,
             transform: Optional[str] = None, top: int = 10) -> dict:
    """Outlier dimensions (variance >= threshold x mean variance) and rogue dimensions.

    ``rogue`` lists the ``top`` dimensions by their exact share ``CC_i`` of the mean
    cosine similarity (Timkey & van Schijndel 2021); it is only available without a
    transform (a transformed cosine is not a function of the moments).
    """
    t = _transform(transform)
    if not threshold > 0:
        raise InvalidInput("threshold must be > 0", type="invalid_threshold")
    meta, moments = _layer_moments(store, pair, layer, t)
    out = {"layer": layer, "threshold": threshold, "transform": transform or "none", "n": 0,
           "dimensions": [], "rogue": None, "mean_cosine": None, "unavailable": {},
           "as_of": _as_of(meta)}
    if moments is None:
        return out
    g, cov, cov_t, unit_sum, unit_sq = moments[:5]
    mean_t = np.zeros_like(g.mean) if t.kind != "none" else g.mean
    out["n"] = g.n
    out["dimensions"] = diagnostics.outlier_dimensions(np.diag(cov_t), mean_t, threshold)
    if t.kind == "none":
        cc = diagnostics.rogue_contributions(unit_sum, unit_sq, g.n)
        total = float(np.sum(cc))
        order = np.argsort(-cc, kind="stable")[:top]
        out["mean_cosine"] = _none_if_nan(total)
        out["rogue"] = [{"dim": int(i), "contribution": float(cc[i]),
                         "share": float(cc[i] / total) if total else None} for i in order]
    else:
        out["unavailable"]["rogue"] = UNAVAILABLE_UNDER_TRANSFORM
    return out


def model_outliers(store: AccumulatorStore, pair: K.PairKeys, num_layers: int,
                   threshold: float = 5.0, transform: Optional[str] = None) -> dict:
    """Outlier dimensions of every layer, and which dimensions persist across layers."""
    rows = [outliers(store, pair, l, threshold, transform, top=5) for l in range(num_layers)]
    where: dict[int, list[int]] = {}
    for row in rows:
        for dim in row["dimensions"]:
            where.setdefault(dim["dim"], []).append(row["layer"])
    persistent = sorted(({"dim": d, "layers": ls, "num_layers": len(ls)} for d, ls in where.items()),
                        key=lambda x: (-x["num_layers"], x["dim"]))
    return {"threshold": threshold, "transform": transform or "none",
            "layers": [{"layer": r["layer"], "n": r["n"], "dimensions": r["dimensions"]} for r in rows],
            "persistent": persistent, "as_of": rows[-1]["as_of"] if rows else None}
