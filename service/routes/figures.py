"""Figures (PNG, SVG), the report page (HTML) and per-token exports (Parquet, CSV).

Rendering and encoding are CPU work: these routes are plain ``def`` routes, run on the
thread pool with the synchronous Redis client, never on the event loop. Figures and
pages come from :mod:`embgeom.renders` (one snapshot each, drawn in the runtime's render
processes, once for concurrent identical requests, cached per API process until the
collection changes); exports from :mod:`embgeom.exports`, streamed.

Responses carry ``X-Embgeom-Version`` (the ``as_of`` version they show) and figures and
pages ``X-Embgeom-Cache: hit|miss``.
"""

from __future__ import annotations

from typing import Annotated, Optional

from fastapi import APIRouter, Path, Query
from fastapi.responses import Response, StreamingResponse
from pydantic import WithJsonSchema

from embgeom import exports, reports
from embgeom.renders import MEDIA_TYPES, check_format, figure_params, render_figure, render_report
from service.deps import LayerTargetDep, ModelDep, PairDep, RuntimeDep, _check_layer
from embgeom import figure_names as figure_kinds
from service.schemas import MAX_INT, ErrorBody, documented

router = APIRouter(prefix="/v1/collections/{collection}/models/{model}", tags=["figures"],
                   responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody}})

MinCount = Annotated[int, Query(ge=1, le=MAX_INT, description="Keep token types with n_t >= min_count")]
MaxCount = Annotated[Optional[int], Query(ge=1, le=MAX_INT, description="Keep token types with n_t <= max_count")]
# A layer index as the document states it (the route answers a negative one 404 layer_not_found).
LayerIndex = Optional[Annotated[int, WithJsonSchema({"type": "integer", "minimum": 0})]]
ImageFormat = Annotated[str, Query(description="png | svg", **documented(enum=list(figure_kinds.FORMATS)))]


# ?fresh=true: wait for the current snapshot's drawing rather than take the newest drawn.
Fresh = Annotated[bool, Query(description="Wait for a drawing of the collection as it is now "
                                          "instead of the newest drawn (X-Embgeom-Cache: stale)")]


def _headers(rendered) -> dict:
    headers = {"X-Embgeom-Cache": "stale" if rendered.stale else "hit" if rendered.hit else "miss",
               "X-Embgeom-Version": str(rendered.as_of.get("version", 0)),
               "Cache-Control": "no-cache"}
    if rendered.layer is not None:
        headers["X-Embgeom-Layer"] = str(rendered.layer)
    return headers


@router.get("/figures/{name}", response_class=Response,
            responses={200: {"content": {"image/png": {}, "image/svg+xml": {}},
                             "description": "The figure"},
                       409: {"model": ErrorBody, "description": "cross_layer_not_kept: cka of a "
                                                                "collection made without cross_layer"}})
def figure(pair: PairDep, model: ModelDep, rt: RuntimeDep,
           name: Annotated[str, Path(**documented(enum=list(figure_kinds.FIGURES)))],
           format: ImageFormat = "png",
           layer: Annotated[LayerIndex, Query(description="Required by vm_scatter, frequency, spectrum")] = None,
           min_count: MinCount = 1, max_count: MaxCount = None,
           models: Annotated[Optional[str], Query(
               description="layer_summary: comma-separated models of the collection to overlay "
                           "(default: this one)",
               **documented(pattern=r"^[A-Za-z0-9_.-]{1,64}(,[A-Za-z0-9_.-]{1,64})*$"))] = None,
           fresh: Fresh = False) -> Response:
    """One figure, drawn from one consistent read of the collection.

    ``name``: vm_scatter (V against M per token type, paper Fig. 2), layer_summary (cv_Q,
    slope, R^2 across layers, Fig. 4), decomposition (Fig. 5), within_ratio (Fig. 6),
    frequency (Q, M, V against log10 n, Fig. 7), isotropy, outliers, spectrum, cka (the
    layer-by-layer linear CKA of .../similarity; 409 cross_layer_not_kept without
    cross_layer). The count filter (default every token type, as the JSON endpoints)
    applies to the first five.
    Figures are cached until the collection changes; while it changes, the newest drawn
    (``X-Embgeom-Cache: stale``, its own ``X-Embgeom-Version``) is answered while the
    current one is drawn, unless ``fresh``."""
    params = figure_params(name, format, layer, min_count, max_count, models, pair.model)
    if params.layer is not None:
        _check_layer(model, params.layer)
    for other in params.models:
        if other != pair.model:
            rt.registry.source(other)  # unknown_model
    rendered = render_figure(rt.renderer, rt.read_sync, rt.reader, pair.collection, params, fresh)
    return Response(rendered.content, media_type=MEDIA_TYPES[params.fmt], headers=_headers(rendered))


@router.get("/report", response_class=Response,
            responses={200: {"content": {"text/html": {}}, "description": "The report page"}})
def report(pair: PairDep, model: ModelDep, rt: RuntimeDep,
           min_count: MinCount = 1, max_count: MaxCount = None,
           layer: Annotated[LayerIndex, Query(
               description="Layer of the per-layer figures (default: the middle kept layer)")] = None,
           format: Annotated[str, Query(description="Figures as png (default) or svg",
                                        **documented(enum=list(figure_kinds.FORMATS)))] = "png",
           fresh: Fresh = False) -> Response:
    """A self-contained HTML page: the per-layer table, the isotropy table, every figure
    and links to the JSON endpoints, from one consistent read; cached until the
    collection changes, and while it changes answered as the figures are (``fresh``)."""
    check_format(format)
    if layer is not None:
        _check_layer(model, layer)
    f = reports.CountFilter(min_count, max_count)
    rendered = render_report(rt.renderer, rt.read_sync, rt.reader, pair, f, layer, format, fresh)
    return Response(rendered.content, media_type="text/html; charset=utf-8", headers=_headers(rendered))


@router.get("/layers/{layer}/export", response_class=StreamingResponse,
            responses={200: {"content": {exports.MEDIA_TYPES["parquet"]: {}, "text/csv": {}},
                             "description": "One row per token type"}})
def export(t: LayerTargetDep,
           format: Annotated[str, Query(description="parquet | csv",
                                        **documented(enum=list(exports.FORMATS)))] = "parquet",
           min_count: MinCount = 1, max_count: MaxCount = None,
           means: Annotated[bool, Query(description="Add each token type's mean vector")] = False):
    """One row per token type: token_id, token, n, Q, M, V, self_similarity (and with
    ``means=true`` the mean vector, a JSON array in CSV), streamed, ordered by token_id;
    ``pandas.read_parquet(url)`` or ``pandas.read_csv(url, keep_default_na=False,
    na_values={"self_similarity": [""]})`` read it back exactly."""
    fmt = exports.check_format(format)
    f = reports.CountFilter(min_count, max_count)
    rt = t.rt
    ex = rt.read_sync(exports.prepare(rt.reader, t.pair, t.layer, f, means,
                                      rt.registry.vocabulary(t.pair.model)))
    filename = f"{t.pair.collection}-{t.pair.model}-layer{t.layer}.{fmt}"
    headers = {"Content-Disposition": f'attachment; filename="{filename}"',
               "X-Embgeom-Version": str(ex.state.version), "X-Embgeom-Rows": str(ex.rows)}
    return StreamingResponse(exports.stream(ex, rt.read_sync, fmt), media_type=exports.MEDIA_TYPES[fmt],
                             headers=headers)
