"""What the read endpoints answer: plans that read the store, then the math.

Each function here is a *plan* (see :mod:`embgeom.store.reader`): run it with
``run_sync(client, plan)`` or ``await run_async(client, plan)``. It reads what it needs
(never a mean vector unless the quantity is defined on the means), computes with
:mod:`embgeom.stats` and :mod:`embgeom.diagnostics`, and returns plain dicts with an
``as_of`` telling how fresh the data it read were.

Token keys: with a collection keyed by ``"id"`` a key is a vocabulary id; keyed by
``"string"`` it is the smallest vocabulary id of its canonical string, and ``token`` shows
that string; a word-unit collection's multi-piece words have hashed keys (>= 2**62) whose
``token`` is the word's name, stored with its record (see :mod:`embgeom.compute.positions`
and :func:`token_strings`).
"""

from __future__ import annotations

import base64
import json
from typing import Optional, Sequence

import numpy as np

from embgeom import diagnostics
from embgeom.geometry.similarity import layer_cka
from embgeom.compute.positions import canonical_token, is_word_key, lookup_key, token_markers
from embgeom.errors import Conflict, InvalidInput, NotFound
from embgeom.stats import (aligned_buckets, decomposition, decomposition_from_sums,
                           decomposition_from_totals, layer_summary)
from embgeom.store.keys import PairKeys
from embgeom.store.reader import PairState, Plan, Reader

__all__ = [
    "CountFilter", "layer_rows", "token_page", "token_detail", "self_similarity",
    "isotropy", "outliers", "model_outliers", "token_strings", "EMPTY_AS_OF",
]

ORDER_FIELDS = ("n", "Q", "M", "V")
EMPTY_AS_OF = {"version": 0, "updated_at": None, "applying": 0}


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


def _none_if_nan(x) -> Optional[float]:
    if x is None:
        return None
    x = float(x)
    return None if not np.isfinite(x) else x


def _empty_decomposition(layer: int) -> dict:
    return {"layer": layer, "n": 0, "num_types": 0,
            "Q": None, "M": None, "V": None, "V_W": None, "V_B": None, "V_B_error": None}


def _positions(state: PairState, layers: Sequence[int]) -> list[int]:
    """Record positions of hidden-states layers; a layer the collection does not keep is
    ``layer_not_kept``."""
    out = []
    for layer in layers:
        pos = state.conf.layer_position(layer)
        if pos is None:
            raise NotFound("layer_not_kept",
                           f"layer {layer} is not among the layers this collection keeps: "
                           f"{list(state.conf.layers)}", layer=layer, kept=list(state.conf.layers))
        out.append(pos)
    return out


def token_strings(reader: Reader, state: PairState, tokenizer, keys: Sequence[int]) -> Plan:
    """The string each key is shown as (the ``token`` of every answer), list[str]: a
    vocabulary key's token (canonical under string keys), a hashed word key's stored name
    (read only when there are some; "" if the pair was deleted between the two reads)."""
    keys = np.asarray(keys, dtype=np.int64)
    if keys.shape[0] == 0:
        return []
    words = is_word_key(keys)
    names = {}
    if words.any():
        names = yield from reader.names(state, keys[words])
    vocab = [t or "" for t in tokenizer.convert_ids_to_tokens(keys[~words].tolist())]
    if state.conf.key == "string":
        markers = token_markers(tokenizer)
        vocab = [canonical_token(t, markers) for t in vocab]
    vocab = iter(vocab)
    return [names.get(k, "") if w else next(vocab) for k, w in zip(keys.tolist(), words.tolist())]


# ------------------------------------------------------------------- layers

def layer_rows(reader: Reader, pair: PairKeys, layers: Optional[Sequence[int]],
               count_filter: CountFilter, with_summary: bool = True) -> Plan:
    """Decomposition (and the per-layer summary) of each layer.

    Unfiltered: O(d) per layer from the layer heads and the shards' aggregates. A count
    filter on bucket edges (:data:`embgeom.stats.BUCKET_EDGES`: the usual thresholds)
    adds the buckets' vector sums and the per-token scalars (no mean vector is read);
    any other filter scans the means of the kept types. The summary (cv_Q, slope, r2,
    ...) is over the kept types' scalars.

    ``layers=None`` is every layer the collection keeps. Returns ``(rows, as_of)``.
    """
    state = yield from reader.pair_state(pair)
    if state.empty:
        return [_empty_decomposition(l) for l in (layers or [])], state.as_of()
    layers = list(state.conf.layers if layers is None else layers)
    positions = _positions(state, layers)
    rows: dict[int, dict] = {}
    scal = None
    if with_summary or not count_filter.is_everything:
        scal = yield from reader.scalars(state)
    if count_filter.is_everything:
        heads = yield from reader.heads(state)
        aggs = yield from reader.aggs(state)
        for layer, pos in zip(layers, positions):
            rows[layer] = _from_heads(layer, pos, heads, aggs, state.conf.shards)
    else:
        keep = count_filter.mask(scal.n)
        buckets = aligned_buckets(count_filter.min_count, count_filter.max_count)
        if buckets is not None:
            sums = yield from reader.buckets(state, buckets, positions)
            n_k = scal.n[keep]
            for i, (layer, pos) in enumerate(zip(layers, positions)):
                dec = decomposition_from_sums(
                    float(n_k.sum()), sums["vector"][i], float(scal.m2[keep, pos].sum()),
                    float(n_k @ scal.M[keep, pos]), int(keep.sum()),
                    parts=state.conf.shards * len(buckets))  # partial sums read and added
                rows[layer] = {"layer": layer, **dec}
        else:
            ids, n, m2, mean = yield from reader.means(state, positions, keep=count_filter.mask)
            for i, layer in enumerate(layers):
                rows[layer] = {"layer": layer, **decomposition(n, mean[:, i], m2[:, i])}
    if with_summary:
        keep = count_filter.mask(scal.n)
        for layer, pos in zip(layers, positions):
            M, V, Q = scal.at(pos)
            rows[layer].update(layer_summary(scal.n[keep], Q[keep], M[keep], V[keep]))
            q, v = rows[layer]["Q"], rows[layer]["V"]
            for name in ("M", "V_W", "V_B"):
                rows[layer][f"{name}/Q"] = (rows[layer][name] / q) if q else None
            rows[layer]["V_W/V"] = (rows[layer]["V_W"] / v) if v else None
    return [rows[l] for l in layers], state.as_of()


def _from_heads(layer: int, pos: int, heads: dict, aggs: dict, parts: int) -> dict:
    """O(d): Q = m2/n + ||mean||^2; V_W = sum_t m2_t / n; V_B = V - V_W."""
    n = heads["n"]
    if n == 0:
        return _empty_decomposition(layer)
    return {"layer": layer, **decomposition_from_totals(
        n, heads["mean"][pos], float(heads["m2"][pos]), float(aggs["within"][pos]),
        aggs["types"], parts=parts)}


# ------------------------------------------------------------------- tokens

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
    except (ValueError, TypeError, KeyError, OverflowError, UnicodeError):
        raise InvalidInput("cursor is not one this service issued", type="invalid_cursor") from None


def self_similarities(reader: Reader, state: PairState, keys: Sequence[int], n: np.ndarray,
                      position: int, unit_norms: Optional[np.ndarray] = None) -> Plan:
    """Self-similarity (:func:`embgeom.diagnostics.self_similarity`) of each of ``keys``
    (counts ``n``) at one kept layer: a list of float, None without self-similarity or
    below two occurrences.

    ``unit_norms``: the keys' ``||U||^2`` from the scalars (:meth:`Scalars.unit_norms_at`),
    so no unit record is read; None for a generation stored before scal records carried
    them, whose unit sums at that layer are read instead."""
    if not state.conf.self_similarity or len(keys) == 0:
        return [None] * len(keys)
    if unit_norms is None:
        units = yield from reader.units(state, keys, position)
        unit_norms = np.array([np.nan if u is None else float(u @ u) for u in units])
    return [_none_if_nan(s) for s in diagnostics.self_similarity_from_norm(unit_norms, n)]


def token_page(reader: Reader, pair: PairKeys, layer: int, tokenizer,
               order_by: str = "n", desc: bool = True, limit: int = 100,
               cursor: Optional[str] = None, count_filter: Optional[CountFilter] = None,
               token: Optional[str] = None) -> Plan:
    """One page of per-token stats, ordered by ``order_by`` then token id (keyset cursor).

    The cursor holds the last (value, id) served, so pages stay disjoint even while new
    checkpoints land between requests. ``token`` selects one vocabulary string (under the
    collection's key: with string keys ``##ing`` and ``ing`` are one token), or in a
    word-unit collection any word's name; a string no key can have (a token collection's
    non-vocabulary string) is ``token_not_in_vocabulary``.
    """
    if order_by not in ORDER_FIELDS:
        raise InvalidInput(f"order_by must be one of {', '.join(ORDER_FIELDS)}", type="invalid_order")
    count_filter = count_filter or CountFilter()
    state = yield from reader.pair_state(pair)
    if state.empty:
        return {"layer": layer, "tokens": [], "next_cursor": None, "total": 0, "as_of": state.as_of()}
    (pos,) = _positions(state, [layer])
    token_id = None
    if token is not None:
        token_id = lookup_key(tokenizer, token, state.conf.key, state.conf.unit)
        if token_id is None:
            raise NotFound("token_not_in_vocabulary", f"{token!r} is not in the model's vocabulary",
                           token=token)
    scal = yield from reader.scalars(state)
    M, V, Q = scal.at(pos)
    keep = count_filter.mask(scal.n)
    if token_id is not None:
        keep &= scal.ids == token_id
    ids = scal.ids[keep]
    values = {"n": scal.n[keep], "Q": Q[keep], "M": M[keep], "V": V[keep]}
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
    norms = scal.unit_norms_at(pos)
    similarity = yield from self_similarities(reader, state, page_ids.tolist(), values["n"][page],
                                              pos, None if norms is None else norms[keep][page])
    strings = yield from token_strings(reader, state, tokenizer, page_ids)
    tokens = []
    for j, i in enumerate(page):
        n = int(values["n"][i])
        tokens.append({
            "token_id": int(ids[i]), "token": strings[j], "n": n,
            "Q": float(values["Q"][i]), "M": float(values["M"][i]), "V": float(values["V"][i]),
            "self_similarity": similarity[j],
        })
    next_cursor = None
    if len(order) > limit and len(page):
        last = page[-1]
        next_cursor = _encode_cursor({"v": float(key[last]), "id": int(ids[last])})
    return {"layer": layer, "tokens": tokens, "next_cursor": next_cursor,
            "total": int(keep.sum()), "as_of": state.as_of()}


def token_detail(reader: Reader, pair: PairKeys, layer: int, token_id: int, tokenizer) -> Plan:
    state, rec = yield from reader.token(pair, token_id)
    if not state.empty:
        (pos,) = _positions(state, [layer])
    if rec is None:
        raise NotFound("token_not_found",
                       f"token {token_id} was never seen at layer {layer} of this collection",
                       token_id=token_id)
    n, M, m2, norms = rec
    V = float(m2[pos]) / n
    (string,) = yield from token_strings(reader, state, tokenizer, [token_id])
    return {"layer": layer, "token_id": int(token_id), "token": string,
            "n": n, "Q": float(M[pos]) + V, "M": float(M[pos]), "V": V,
            "self_similarity": None if norms is None else _none_if_nan(
                diagnostics.self_similarity_from_norm(norms[pos], n)),
            "as_of": state.as_of()}


# --------------------------------------------------------------- isotropy

def _transform(spec: Optional[str]):
    try:
        return diagnostics.parse_transform(spec)
    except ValueError as exc:
        raise InvalidInput(str(exc), type="invalid_transform") from None


def _layer_moments(reader: Reader, pair: PairKeys, layer: int, t) -> Plan:
    """``(state, moments)`` with moments = (cov dict, cov, transformed cov), or None when
    the layer is empty."""
    state = yield from reader.pair_state(pair)
    if state.empty:
        return state, None
    (pos,) = _positions(state, [layer])
    cov = yield from reader.covariance(state, pos)
    if cov["n"] == 0:
        return state, None
    C = cov["comoment"] / cov["n"]
    try:
        C_t = diagnostics.transform_covariance(C, t, mean=cov["mean"])
    except ValueError as exc:
        raise InvalidInput(str(exc), type="invalid_transform") from None
    return state, (cov, C, C_t, pos)


def covariance(reader: Reader, pair: PairKeys, layer: int) -> Plan:
    """The layer's population covariance (d, d) over everything ingested, or None."""
    state, moments = yield from _layer_moments(reader, pair, layer, _transform(None))
    return None if moments is None else moments[1]


SIMILARITY_METRICS = ("linear_cka", "rv")


def require_cross_layer(pair: PairKeys, state: PairState) -> None:
    """``cross_layer_not_kept`` (409) unless the pair keeps its cross-layer co-moment (an
    empty pair, with no settings yet, passes: it answers an empty matrix)."""
    if state.conf is not None and not state.conf.cross_layer:
        raise Conflict("cross_layer_not_kept",
                       f"collection {pair.collection!r} was created without cross_layer: it keeps "
                       "no cross-layer moments (create a collection with {\"cross_layer\": true})",
                       collection=pair.collection, model=pair.model)


def layer_similarity(reader: Reader, pair: PairKeys, metric: str = "linear_cka") -> Plan:
    """Layer-by-layer similarity over every occurrence ingested, from the streamed
    cross-layer co-moment (:func:`embgeom.geometry.similarity.layer_cka`): ``{"layers",
    "matrix" (L x L, nan as null), "n", "metric", "as_of"}``. ``rv`` (Escoufier's RV
    coefficient of the centred layers) is the same number as linear CKA. A collection
    made without ``cross_layer`` answers ``cross_layer_not_kept`` (409)."""
    if metric not in SIMILARITY_METRICS:
        raise InvalidInput(f"metric must be one of {', '.join(SIMILARITY_METRICS)}",
                           type="invalid_metric", metric=metric)
    state = yield from reader.pair_state(pair)
    out = {"metric": metric, "layers": [], "matrix": [], "n": 0, "as_of": state.as_of()}
    if state.empty:
        return out
    conf = state.conf
    require_cross_layer(pair, state)
    cross = yield from reader.cross_layer(state)
    out.update({"layers": list(conf.layers), "n": int(cross["n"])})
    if cross["n"] == 0:
        out["matrix"] = [[None] * conf.L for _ in range(conf.L)]
        return out
    M = layer_cka(cross["comoment"], conf.L)
    out["matrix"] = [[_none_if_nan(v) for v in row] for row in M]
    return out


UNAVAILABLE_UNDER_TRANSFORM = (
    "not a function of the streamed moments once a transform is applied; not approximated"
)


def isotropy(reader: Reader, pair: PairKeys, layer: int, transform: Optional[str] = None,
             spectrum: bool = False, partition: bool = True, min_count: int = 1) -> Plan:
    """Isotropy of all embeddings of a layer, exact from the streamed covariance.

    IsoScore, effective rank, participation ratio and top eigenvalue ratio come from the
    eigenvalues of the (transformed) covariance ``C / n``; ``mean_cosine`` from the unit
    vector sum, only without a transform; the partition isotropy I(W) (Mu & Viswanath)
    from the matrix of per-token means with ``n_t >= min_count``, transformed alike (a
    scan of the means).
    """
    t = _transform(transform)
    state, moments = yield from _layer_moments(reader, pair, layer, t)
    out = {"layer": layer, "transform": transform or "none", "n": 0, "isoscore": None,
           "mean_cosine": None, "effective_rank": None, "participation_ratio": None,
           "top_eigenvalue_ratio": None, "partition_isotropy": None, "eigenvalues": None,
           "unavailable": {}, "as_of": state.as_of()}
    if moments is None:
        return out
    cov, C, C_t, pos = moments
    lam = diagnostics.covariance_eigenvalues(C_t)
    out.update({
        "n": cov["n"],
        "isoscore": _none_if_nan(diagnostics.isoscore_from_eigenvalues(lam)),
        "effective_rank": _none_if_nan(diagnostics.effective_rank(lam)),
        "participation_ratio": _none_if_nan(diagnostics.participation_ratio(lam)),
        "top_eigenvalue_ratio": _none_if_nan(diagnostics.top_eigenvalue_ratio(lam)),
    })
    if spectrum:
        out["eigenvalues"] = lam.tolist()
    if t.kind == "none":
        out["mean_cosine"] = _none_if_nan(diagnostics.mean_cosine(cov["unit_sum"], cov["n"]))
    else:
        out["unavailable"]["mean_cosine"] = UNAVAILABLE_UNDER_TRANSFORM
    if partition:
        _, n_t, _, mean_t = yield from reader.means(state, [pos], keep=lambda n: n >= min_count)
        if n_t.shape[0] >= 1:
            W = diagnostics.transform_points(mean_t[:, 0], cov["mean"], C, t)
            log_iw = diagnostics.log_partition_isotropy(W)
            out["partition_isotropy"] = _none_if_nan(np.exp(log_iw))
            out["partition_isotropy_log10"] = _none_if_nan(log_iw / np.log(10))
            out["partition_types"] = int(n_t.shape[0])
    return out


def outliers(reader: Reader, pair: PairKeys, layer: int, threshold: float = 5.0,
             transform: Optional[str] = None, top: int = 10) -> Plan:
    """Outlier dimensions (variance >= threshold x mean variance) and rogue dimensions.

    ``rogue`` lists the ``top`` dimensions by their exact share ``CC_i`` of the mean
    cosine similarity (Timkey & van Schijndel 2021); it is only available without a
    transform (a transformed cosine is not a function of the moments).
    """
    t = _transform(transform)
    if not (threshold > 0 and np.isfinite(threshold)):
        raise InvalidInput("threshold must be a finite number > 0", type="invalid_threshold")
    state, moments = yield from _layer_moments(reader, pair, layer, t)
    out = {"layer": layer, "threshold": threshold, "transform": transform or "none", "n": 0,
           "dimensions": [], "rogue": None, "mean_cosine": None, "unavailable": {},
           "as_of": state.as_of()}
    if moments is None:
        return out
    cov, C, C_t, _ = moments
    mean_t = np.zeros_like(cov["mean"]) if t.kind != "none" else cov["mean"]
    out["n"] = cov["n"]
    out["dimensions"] = diagnostics.outlier_dimensions(np.diag(C_t), mean_t, threshold)
    if t.kind == "none":
        cc = diagnostics.rogue_contributions(cov["unit_sum"], cov["unit_sq_sum"], cov["n"])
        total = float(np.sum(cc))
        order = np.argsort(-cc, kind="stable")[:top]
        out["mean_cosine"] = _none_if_nan(total)
        out["rogue"] = [{"dim": int(i), "contribution": float(cc[i]),
                         "share": float(cc[i] / total) if total else None} for i in order]
    else:
        out["unavailable"]["rogue"] = UNAVAILABLE_UNDER_TRANSFORM
    return out


def model_outliers(reader: Reader, pair: PairKeys, threshold: float = 5.0,
                   transform: Optional[str] = None) -> Plan:
    """Outlier dimensions of every kept layer, and which dimensions persist across them."""
    state = yield from reader.pair_state(pair)
    layers = list(state.conf.layers) if not state.empty else []
    rows = []
    for layer in layers:
        rows.append((yield from outliers(reader, pair, layer, threshold, transform, top=5)))
    where: dict[int, list[int]] = {}
    for row in rows:
        for dim in row["dimensions"]:
            where.setdefault(dim["dim"], []).append(row["layer"])
    persistent = sorted(({"dim": d, "layers": ls, "num_layers": len(ls)} for d, ls in where.items()),
                        key=lambda x: (-x["num_layers"], x["dim"]))
    return {"threshold": threshold, "transform": transform or "none",
            "layers": [{"layer": r["layer"], "n": r["n"], "dimensions": r["dimensions"]} for r in rows],
            "persistent": persistent, "as_of": rows[-1]["as_of"] if rows else state.as_of()}
