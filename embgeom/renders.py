"""Figures and the report page of a (collection, model) pair, each from one read.

    figure_params(name, fmt, layer, min_count, max_count, models, model) -> FigureParams
    render_figure(renderer, read, reader, collection, params)            -> Rendered
    render_report(renderer, read, reader, pair, count_filter, layer, ...) -> Rendered

A figure is drawn from one *snapshot*: one plan (:mod:`embgeom.store.reader`) that reads
the pair's state, then everything the figure needs (the per-layer rows, the per-token
scalars, the covariances, the outlier dimensions) with the same functions the JSON
endpoints use (:mod:`embgeom.reports`), so a figure shows exactly the numbers those
endpoints answer. Drawing is :mod:`embgeom.figures`; the page is
:func:`embgeom.report_page.build_report`.

Where the work runs: the snapshot, the drawing and the page are one *job*
(:func:`figure_job`, :func:`report_job`) that the :class:`Renderer`'s pool runs in a
child process (:mod:`embgeom.render_pool`): matplotlib never holds the API's GIL. The
calling thread (a thread-pool route, never the event loop) only reads the pair's state,
looks in the cache, waits, and stores; concurrent calls for the same entry share one
job (single flight).

Cache: rendered bytes are kept in a :class:`RenderCache` under
``(collection, ((model, generation, version), ...), what)``: ``what`` names the figure
and the parameters it uses (format, layer, count filter, overlaid models). The version
is bumped by every completed checkpoint and the generation by every DELETE, so a figure
is drawn again once its collection changes; an entry is only stored when the pair's state
read before the snapshot, inside it and after the drawing are the same with nothing
being applied (``applying == 0``), so a half-applied checkpoint is never cached.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import Any, Callable, Hashable, Optional, Sequence
from urllib.parse import quote, urlencode

from embgeom import figures, reports
from embgeom.errors import InvalidInput, NotFound, Overloaded
from embgeom.figure_names import FILTERED_FIGURES, LAYER_FIGURES
from embgeom.report_page import ISOTROPY_COLUMNS, build_report
from embgeom.stats import layer_summary
from embgeom.store.conf import PairConf
from embgeom.store.keys import PairKeys
from embgeom.render_pool import RenderPool, SingleFlight
from embgeom.store.reader import PairState, Plan, Reader

__all__ = [
    "LAYER_FIGURES", "FILTERED_FIGURES", "MAX_OVERLAID_MODELS", "REPORT_ISOTROPY_COLUMNS",
    "FigureParams", "Rendered", "RenderCache", "Renderer", "figure_job", "report_job", "check_format", "figure_params", "default_layer",
    "render_figure", "render_report", "report_figures", "report_links",
]

MAX_OVERLAID_MODELS = 8

MEDIA_TYPES = {"png": "image/png", "svg": "image/svg+xml"}

# The page's isotropy table: the partition isotropy I(W) needs a scan of every mean
# vector, which the page does not make (the JSON endpoint has it).
REPORT_ISOTROPY_COLUMNS = tuple(c for c in ISOTROPY_COLUMNS if c[0] != "partition_isotropy")

# What each figure reads.
_NEEDS = {
    "vm_scatter": {"tokens"},
    "frequency": {"tokens"},
    "layer_summary": {"rows"},
    "decomposition": {"rows"},
    "within_ratio": {"rows"},
    "isotropy": {"isotropy"},
    "outliers": {"outliers"},
    "spectrum": {"spectrum"},
    "cka": {"similarity"},
}


@dataclass(frozen=True)
class FigureParams:
    """A figure request, normalised: a parameter the figure does not use is dropped, so
    requests that draw the same image share one cache entry."""

    name: str
    fmt: str = "png"
    layer: Optional[int] = None
    min_count: int = 1
    max_count: Optional[int] = None
    models: tuple[str, ...] = ()

    @property
    def count_filter(self) -> reports.CountFilter:
        return reports.CountFilter(self.min_count, self.max_count)

    def what(self) -> tuple:
        return ("figure", self.name, self.fmt, self.layer, self.min_count, self.max_count)


@dataclass(frozen=True)
class Rendered:
    """Encoded bytes, the ``as_of`` of the (first) pair they show, the layer of the
    per-layer figures, and whether they came from the cache."""

    content: bytes
    as_of: dict
    layer: Optional[int]
    hit: bool = False
    stale: bool = False  # the newest drawn, of an earlier snapshot, while the current is drawn


def check_format(fmt: str) -> str:
    """``fmt`` if it is an image format of :mod:`embgeom.figures`, else ``invalid_format``."""
    if fmt not in figures.FORMATS:
        raise InvalidInput(f"format must be one of {', '.join(figures.FORMATS)}, not {fmt!r}",
                           type="invalid_format", format=fmt, formats=list(figures.FORMATS))
    return fmt


def figure_params(name: str, fmt: str, layer: Optional[int], min_count: int,
                  max_count: Optional[int], models: Optional[str], model: str) -> FigureParams:
    """Check a figure request: ``unknown_figure`` (404), ``invalid_format``,
    ``layer_required``, ``invalid_filter``, ``invalid_models`` (422).

    ``models`` (comma-separated aliases) only applies to ``layer_summary``, where it
    defaults to ``model``; ``layer`` only to the per-layer figures and the count filter
    only to the filtered ones: elsewhere they are ignored.
    """
    if name not in figures.FIGURES:
        raise NotFound("unknown_figure", f"no figure {name!r}; figures: {', '.join(figures.FIGURES)}",
                       figure=name, figures=list(figures.FIGURES))
    check_format(fmt)
    reports.CountFilter(min_count, max_count)  # invalid_filter
    if name in LAYER_FIGURES:
        if layer is None:
            raise InvalidInput(f"figure {name!r} shows one layer: give ?layer=", type="layer_required",
                               figure=name)
    else:
        layer = None
    if name not in FILTERED_FIGURES:
        min_count, max_count = 1, None
    overlaid: tuple[str, ...] = (model,)
    if name == "layer_summary" and models is not None:
        names = [m.strip() for m in models.split(",")]
        if any(not m for m in names):
            raise InvalidInput("models must be comma-separated model aliases, none empty",
                               type="invalid_models", models=models)
        overlaid = tuple(dict.fromkeys(names))
        if len(overlaid) > MAX_OVERLAID_MODELS:
            raise InvalidInput(f"at most {MAX_OVERLAID_MODELS} models can be overlaid",
                               type="invalid_models", models=list(overlaid),
                               limit=MAX_OVERLAID_MODELS)
    return FigureParams(name, fmt, layer, min_count, max_count, overlaid)


def default_layer(layers: Sequence[int]) -> Optional[int]:
    """The layer the report's per-layer figures show by default: the middle kept one
    (where the paper finds the clearest norm-variance trade-off)."""
    return layers[len(layers) // 2] if len(layers) else None


# ------------------------------------------------------------------ cache

class RenderCache:
    """A thread-safe LRU of rendered bytes, bounded in bytes (0 disables it).

    Keys are ``(scope, states, what)`` with ``scope = (collection, models)`` and
    ``states`` their ``(generation, version)``: storing an entry drops the entries of the
    same scope at other states, which no request can reach any more.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size(self) -> int:
        return self._size

    def get(self, key: Hashable) -> Any:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: Hashable, value: Any, nbytes: int) -> None:
        if nbytes > self.max_bytes:
            return
        scope, states = key[0], key[1]
        with self._lock:
            for other in [k for k in self._entries if k[0] == scope and k[1] != states]:
                self._size -= self._entries.pop(other)[1]
            old = self._entries.pop(key, None)
            if old is not None:
                self._size -= old[1]
            self._entries[key] = (value, nbytes)
            self._size += nbytes
            while self._size > self.max_bytes:
                self._size -= self._entries.popitem(last=False)[1][1]


# ------------------------------------------------------------------ reads

def _states(reader: Reader, pairs: Sequence[PairKeys]) -> Plan:
    """The state of each pair (``collection_not_found`` / ``model_not_in_collection`` when
    one holds nothing)."""
    out = []
    for pair in pairs:
        out.append((yield from reader.pair_state(pair)))
    return out


def _fingerprints(reader: Reader, pairs: Sequence[PairKeys]) -> Plan:
    """``((gen, version, applying), ...)`` of each pair."""
    return tuple(_fingerprint(s) for s in (yield from _states(reader, pairs)))


def _fingerprint(state: PairState) -> tuple[int, int, int]:
    return (state.gen, state.version, state.applying)


def _settled(prints: Sequence[tuple[int, int, int]]) -> bool:
    return all(p[2] == 0 for p in prints)


def _key(collection: str, models: Sequence[str], prints, what: tuple) -> tuple:
    return ((collection, tuple(models)), tuple(p[:2] for p in prints), what)


def _snapshot(reader: Reader, pair: PairKeys, needs: set, count_filter: reports.CountFilter,
              layer: Optional[int]) -> Plan:
    """Everything ``needs`` names, read for one pair after one state read.

    ``layer`` None with a per-layer need takes :func:`default_layer`; a layer the
    collection does not keep is ``layer_not_kept``.
    """
    state = yield from reader.pair_state(pair)
    snap: dict = {"state": state, "model": pair.model, "layer": layer}
    if state.empty:
        return snap
    per_layer = bool(needs & {"tokens", "spectrum"})
    if per_layer and layer is None:
        layer = snap["layer"] = default_layer(state.conf.layers)
    pos = reports._positions(state, [layer])[0] if per_layer else None
    if "rows" in needs:
        rows, _ = yield from reports.layer_rows(reader, pair, None, count_filter)
        snap["rows"] = rows
    if "tokens" in needs:
        scal = yield from reader.scalars(state)
        M, V, Q = scal.at(pos)
        keep = count_filter.mask(scal.n)
        n_k, Q_k, M_k, V_k = scal.n[keep], Q[keep], M[keep], V[keep]
        # The same regression as the ``.../layers`` row of this layer and filter.
        snap["tokens"] = {"n": n_k, "Q": Q_k, "M": M_k, "V": V_k,
                          "summary": layer_summary(n_k, Q_k, M_k, V_k)}
    if "isotropy" in needs:
        rows = []
        for kept in state.conf.layers:
            with_spectrum = "spectrum" in needs and kept == layer
            rows.append((yield from reports.isotropy(reader, pair, kept, spectrum=with_spectrum,
                                                     partition=False)))
        snap["isotropy"] = rows
        if "spectrum" in needs:
            snap["eigenvalues"] = rows[pos]["eigenvalues"]
    elif "spectrum" in needs:
        iso = yield from reports.isotropy(reader, pair, layer, spectrum=True, partition=False)
        snap["eigenvalues"] = iso["eigenvalues"]
    if "outliers" in needs:
        snap["outliers"] = yield from reports.model_outliers(reader, pair)
    if "similarity" in needs and state.conf.cross_layer:
        snap["similarity"] = yield from reports.layer_similarity(reader, pair)
    return snap


def _draw(name: str, fmt: str, snaps: Sequence[dict]) -> bytes:
    """One figure from its snapshot(s) (several only for an overlaid layer_summary)."""
    snap = snaps[0]
    model, layer = snap["model"], snap["layer"]
    if name == "layer_summary":
        return figures.layer_summary([{"model": s["model"], "layers": s.get("rows", [])} for s in snaps],
                                     fmt=fmt)
    if name in ("vm_scatter", "frequency"):
        tokens = snap.get("tokens") or {"n": [], "Q": [], "M": [], "V": [], "summary": {}}
        if name == "frequency":
            return figures.frequency(tokens["n"], tokens["Q"], tokens["M"], tokens["V"], layer, model,
                                     fmt=fmt)
        s = tokens["summary"]
        return figures.vm_scatter(tokens["M"], tokens["V"], tokens["n"], s.get("slope"),
                                  s.get("intercept"), s.get("r2"), layer, model, fmt=fmt)
    if name == "decomposition":
        return figures.decomposition(snap.get("rows", []), model, fmt=fmt)
    if name == "within_ratio":
        return figures.within_ratio(snap.get("rows", []), model, fmt=fmt)
    if name == "isotropy":
        return figures.isotropy(snap.get("isotropy", []), model, fmt=fmt)
    if name == "outliers":
        return figures.outliers(snap.get("outliers", {}), model, fmt=fmt)
    if name == "spectrum":
        return figures.spectrum(snap.get("eigenvalues"), layer, model, fmt=fmt)
    if name == "cka":
        return figures.cka(snap.get("similarity"), model, fmt=fmt)
    raise ValueError(f"no figure {name!r}")


def _store(cache: RenderCache, read, reader: Reader, pairs: Sequence[PairKeys], seen: tuple,
           entries: Sequence[tuple[tuple, tuple]]) -> None:
    """Cache ``entries`` (what, value) when the snapshot (its fingerprints ``seen``) was
    settled and still is; a value's first item is the bytes it is sized by."""
    if not entries or not _settled(seen) or cache.max_bytes <= 0:
        return
    if read(_fingerprints(reader, pairs)) != seen:
        return
    collection, models = pairs[0].collection, [p.model for p in pairs]
    for what, value in entries:
        cache.put(_key(collection, models, seen, what), value, len(value[0]))


class Renderer:
    """The owner of rendered bytes: the cache (bounded in bytes), the newest drawing of
    each figure and page (bounded likewise), the pool that draws
    (:class:`~embgeom.render_pool.RenderPool`) and the draws in flight, so concurrent
    requests for one (pair, version, query) draw it once. One per API process.

    A collection that changes every few seconds would keep every request waiting for a
    drawing of its own: where the same query was drawn before (same generation, at most
    ``max_stale_seconds`` ago), a request waits at most ``wait_seconds`` for the current
    drawing and is otherwise answered with that earlier one, marked stale; the current
    drawing goes on in the background (one per query at a time) and is kept for the next.
    """

    def __init__(self, cache: RenderCache, pool: RenderPool, max_stale_seconds: float = 0.0,
                 wait_seconds: float = 0.0, newest: Optional[RenderCache] = None):
        self.cache = cache
        self.newest = newest if newest is not None else RenderCache(cache.max_bytes)
        self.pool = pool
        self.max_stale_seconds = max_stale_seconds
        self.wait_seconds = wait_seconds
        self.flights = SingleFlight()
        self.drawn = 0  # draws run (pages and figures), hits and shared calls excluded
        self._background: dict[Hashable, tuple[tuple, Future]] = {}  # query -> (key, its drawing)
        self._lock = threading.Lock()

    def once(self, key: tuple, draw: Callable[[], Rendered]) -> Rendered:
        """``draw()``, run once for the concurrent calls with ``key``."""
        def counted():
            self.drawn += 1
            return draw()
        return self.flights.do(key, counted)

    def serve(self, key: tuple, fresh: bool, draw: Callable[[], tuple[Rendered, tuple]]) -> Rendered:
        """The entry ``key`` (``_key(...)`` of the request's snapshot, not in the cache),
        drawn by ``draw()`` (the rendered entry and the fingerprints of its snapshot), or,
        unless ``fresh``, the newest drawing of the query if the current one takes longer
        than ``wait_seconds``."""
        query = _query(key)

        def drawn() -> Rendered:
            started = time.monotonic()
            rendered, seen = draw()
            self._keep_newest(query, tuple(p[:2] for p in seen), rendered, started)
            return rendered

        kept = None if fresh or self.max_stale_seconds <= 0 else self.newest.get(query)
        if kept is None or time.monotonic() - kept[2] > self.max_stale_seconds:
            return self.once(key, drawn)
        states, rendered, _ = kept
        if states == key[1]:  # drawn at this version, not cached (a checkpoint was applying)
            return replace(rendered, hit=True)
        drawing, future = self._in_background(query, key, lambda: self.once(key, drawn))
        try:
            got = future.result(self.wait_seconds)
        except (FutureTimeout, Overloaded):  # not drawn in time, or no room to draw it
            return replace(rendered, hit=True, stale=True)
        # a drawing begun for an earlier request: newer than the kept one, older than asked
        return got if drawing == key else replace(got, stale=True)

    def _keep_newest(self, query: tuple, states: tuple, rendered: Rendered, started: float) -> None:
        """Keep ``rendered`` as the newest drawing of ``query`` unless a later snapshot's is
        kept (drawings end out of order); aged from when its drawing started."""
        with self._lock:
            kept = self.newest.get(query)
            if kept is None or kept[0] <= states:
                self.newest.put(query, (states, rendered, started), len(rendered.content))

    def _in_background(self, query: tuple, key: tuple, run: Callable[[], Rendered]) -> tuple[tuple, Future]:
        """``(key drawn, future)`` of the drawing of ``query`` running in the background,
        started with ``run`` (drawing ``key``) if none is; it outlives the request that
        started it."""
        with self._lock:
            running = self._background.get(query)
            if running is not None:
                return running
            future = Future()
            self._background[query] = (key, future)

        def target():
            try:
                future.set_result(run())
            except BaseException as exc:  # the waiters' to report; a later request draws again
                future.set_exception(exc)
            finally:
                with self._lock:
                    del self._background[query]
        threading.Thread(target=target, name="render-background", daemon=True).start()
        return key, future

    def close(self) -> None:
        self.pool.close()


def _query(key: tuple) -> tuple:
    """A cache key without its versions: (scope, generations, what)."""
    scope, states, what = key
    return scope, tuple(s[0] for s in states), what


def figure_job(read: Callable[[Plan], Any], reader: Reader, collection: str,
               params: FigureParams) -> tuple[bytes, dict, Optional[int], tuple]:
    """Draw the figure ``params`` names from one snapshot of each pair: (bytes, as_of,
    layer shown, fingerprints of the snapshot). Runs in a render process."""
    pairs = [PairKeys(collection, m) for m in params.models]

    def plan():
        snaps = []
        for p in pairs:
            snaps.append((yield from _snapshot(reader, p, _NEEDS[params.name], params.count_filter,
                                               params.layer)))
        return snaps

    snaps = read(plan())
    if params.name == "cka":
        reports.require_cross_layer(pairs[0], snaps[0]["state"])
    content = _draw(params.name, params.fmt, snaps)
    seen = tuple(_fingerprint(s["state"]) for s in snaps)
    return content, snaps[0]["state"].as_of(), snaps[0]["layer"], seen


def render_figure(renderer: Renderer, read: Callable[[Plan], Any], reader: Reader, collection: str,
                  params: FigureParams, fresh: bool = False) -> Rendered:
    """The figure ``params`` names: from the cache, or the newest drawn while the current
    snapshot's is drawn (:meth:`Renderer.serve`; not when ``fresh``), or drawn by the
    renderer's pool (once for concurrent identical requests) and cached."""
    models = params.models or ()
    if not models:
        raise ValueError("FigureParams.models must name the pair(s) (figure_params does)")
    pairs = [PairKeys(collection, m) for m in models]
    what = params.what() + ((models,) if params.name == "layer_summary" else ())
    before = read(_fingerprints(reader, pairs))
    key = _key(collection, models, before, what)
    if _settled(before):
        hit = renderer.cache.get(key)
        if hit is not None:
            return Rendered(hit[0], hit[1], params.layer, hit=True)

    def draw():
        content, as_of, layer, seen = renderer.pool.run(figure_job, collection, params)
        _store(renderer.cache, read, reader, pairs, seen, [(what, (content, as_of))])
        return Rendered(content, as_of, layer), seen

    return renderer.serve(key, fresh, draw)


# ------------------------------------------------------------------ report

def report_figures(conf: Optional[PairConf]) -> tuple[str, ...]:
    """The figures of a pair's page: ``cka`` only where the collection keeps cross_layer."""
    return tuple(n for n in figures.FIGURES if n != "cka" or (conf is not None and conf.cross_layer))


def report_links(pair: PairKeys, layer: Optional[int], count_filter: reports.CountFilter,
                 prefix: str = "", cross_layer: bool = False) -> list[tuple[str, str]]:
    """(label, href) of the JSON endpoints (and figures, exports) behind the page; the
    layer-by-layer CKA ones only for a ``cross_layer`` collection (elsewhere they are 409)."""
    base = f"{prefix}/v1/collections/{quote(pair.collection, safe='')}/models/{quote(pair.model, safe='')}"
    counts = urlencode({k: v for k, v in count_filter.to_dict().items() if v is not None})
    links = [("per-layer statistics (JSON)", f"{base}/layers?{counts}"),
             ("outlier dimensions of every layer (JSON)", f"{base}/outliers")]
    if cross_layer:
        links.append(("layer-by-layer linear CKA (JSON)", f"{base}/similarity?metric=linear_cka"))
    if layer is not None:
        lb = f"{base}/layers/{layer}"
        links += [
            (f"layer {layer}: decomposition (JSON)", f"{lb}/decomposition?{counts}"),
            (f"layer {layer}: token statistics (JSON)", f"{lb}/tokens?{counts}"),
            (f"layer {layer}: isotropy (JSON)", f"{lb}/isotropy"),
            (f"layer {layer}: outliers (JSON)", f"{lb}/outliers"),
            (f"layer {layer}: export (Parquet)", f"{lb}/export?format=parquet&{counts}"),
            (f"layer {layer}: export (CSV)", f"{lb}/export?format=csv&{counts}"),
        ]
    for name in figures.FIGURES:
        if name == "cka" and not cross_layer:
            continue
        query = {"format": "svg"}
        if name in LAYER_FIGURES:
            if layer is None:
                continue
            query["layer"] = layer
        if name in FILTERED_FIGURES:
            query.update({k: v for k, v in count_filter.to_dict().items() if v is not None})
        links.append((f"figure {name} (SVG)", f"{base}/figures/{name}?{urlencode(query)}"))
    return links


def _page_figures(state: PairState, fmt: str, shown: Optional[int],
                  f: reports.CountFilter) -> list[tuple[str, tuple]]:
    """(name, cache ``what``) of each figure of a pair's page, as the figure endpoint
    keys the same image."""
    out = []
    for name in report_figures(state.conf):
        params = FigureParams(name, fmt, shown if name in LAYER_FIGURES else None,
                              *((f.min_count, f.max_count) if name in FILTERED_FIGURES else (1, None)),
                              models=(state.pair.model,))
        out.append((name, params.what() + (((state.pair.model,),) if name == "layer_summary" else ())))
    return out


def _shown_layer(state: PairState, layer: Optional[int]) -> Optional[int]:
    """The layer of the page's per-layer figures (as :func:`_snapshot` picks it)."""
    if layer is not None or state.empty:
        return layer
    return default_layer(state.conf.layers)


def report_job(read: Callable[[Plan], Any], reader: Reader, pair: PairKeys,
               count_filter: reports.CountFilter, layer: Optional[int], fmt: str,
               known: tuple, cached: dict) -> tuple[bytes, dict, Optional[int], tuple, list]:
    """Build a pair's page from one snapshot: (HTML bytes, as_of, layer shown,
    fingerprints of the snapshot, cache entries of the page's figures drawn for it).

    ``cached`` holds figures already drawn (name -> bytes) at the fingerprints ``known``:
    used only when the snapshot is at those. Runs in a render process.
    """
    f = count_filter
    snap = read(_snapshot(reader, pair, set().union(*_NEEDS.values()), f, layer))
    state: PairState = snap["state"]
    shown = snap["layer"]
    seen = (_fingerprint(state),)
    if seen != known:
        cached = {}
    entries, drawn = [], {}
    for name, fig_what in _page_figures(state, fmt, shown, f):
        if name in cached:
            drawn[name] = cached[name]
        elif name in LAYER_FIGURES and shown is None:
            drawn[name] = None  # an empty pair: no layer to show
        else:
            drawn[name] = _draw(name, fmt, [snap])
            entries.append((fig_what, (drawn[name], state.as_of())))

    conf = state.conf
    summary = {"collection": pair.collection, "model": pair.model, "as_of": state.as_of()}
    if conf is not None:
        summary["settings"] = {"key": conf.key, "unit": conf.unit,
                               "include_special": conf.include_special,
                               "self_similarity": conf.self_similarity,
                               "cross_layer": conf.cross_layer}
    summary["count filter"] = f"{f.min_count} <= n_t" + (f" <= {f.max_count}" if f.max_count else "")
    if shown is not None:
        summary["layer of the per-layer figures"] = shown
    page = build_report(f"embgeom report: {pair.collection} / {pair.model}", summary,
                        snap.get("rows", []), snap.get("isotropy", []), drawn,
                        report_links(pair, shown, f, cross_layer=conf is not None and conf.cross_layer),
                        isotropy_columns=REPORT_ISOTROPY_COLUMNS, similarity=snap.get("similarity"))
    return page.encode("utf-8"), state.as_of(), shown, seen, entries


def render_report(renderer: Renderer, read: Callable[[Plan], Any], reader: Reader, pair: PairKeys,
                  count_filter: reports.CountFilter, layer: Optional[int] = None,
                  fmt: str = "png", fresh: bool = False) -> Rendered:
    """The report page (UTF-8 HTML) of a pair: the per-layer table, the isotropy table,
    every figure (``fmt``, as data URIs) and links to the JSON endpoints, all from one
    snapshot, built by the renderer's pool (once for concurrent identical requests).
    Figures the cache holds for the pair's version are reused; figures drawn for the
    page are cached as the figure endpoint's entries too. While the pair changes, the
    newest page drawn is answered (marked stale) as :func:`render_figure` does."""
    pairs = [pair]
    f = count_filter
    what = ("report", fmt, layer, f.min_count, f.max_count)
    (state,) = read(_states(reader, pairs))
    before = (_fingerprint(state),)
    key = _key(pair.collection, [pair.model], before, what)
    cache = renderer.cache
    cached = {}
    if _settled(before):
        hit = cache.get(key)
        if hit is not None:
            return Rendered(hit[0], hit[1], hit[2], hit=True)
        for name, fig_what in _page_figures(state, fmt, _shown_layer(state, layer), f):
            fig = cache.get(_key(pair.collection, [pair.model], before, fig_what))
            if fig is not None:
                cached[name] = fig[0]

    def draw():
        content, as_of, shown, seen, entries = renderer.pool.run(
            report_job, pair, f, layer, fmt, before, cached)
        entries.append((what, (content, as_of, shown)))
        _store(cache, read, reader, pairs, seen, entries)
        return Rendered(content, as_of, shown), seen

    return renderer.serve(key, fresh, draw)
