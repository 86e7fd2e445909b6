"""Shared geometry across models (Lee, Weber, Viegas & Wattenberg 2025): global similarity,
LLE transfer, per-token intrinsic dimension, neighbours and Emb2Emb steering transfer.

The reads and the math are CPU work: every route runs them on the thread pool (a plain
``def``, or ``run_in_threadpool``), never on the event loop. The work itself is
:class:`embgeom.comparisons.Comparisons`, one per app (its result cache is keyed by pair names
and versions, which are only unique within one store).

Figures (PNG, SVG) of the analyses: ``.../layers/{l}/figures/{name}`` (one space) and
``/v1/compare/figures/{name}?a=collection:model:layer&b=...`` (two), drawn by
:mod:`embgeom.figures.geometry` from the same computations as the JSON answers and cached
with them until either space changes. They carry ``X-Embgeom-Cache: hit|miss``, the
version(s) shown (``X-Embgeom-Version``, or ``X-Embgeom-Version-A`` and ``-B``) and the
headline numbers they show (``X-Embgeom-Pearson``, ...).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, Optional

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from embgeom.comparisons import (FIGURE_PAIRS, INPUT, Comparisons, GeometryCache, Limits,
                                 RenderedFigure, Space)
from embgeom.figures import geometry as geometry_figures
from embgeom.errors import NotFound
from embgeom.renders import MEDIA_TYPES, check_format
from service.deps import LayerTargetDep, app_object
from service.encoding import FastJSON
from service.geometry_schemas import (
    GlobalRequest, GlobalSimilarity, IntrinsicDimension, LLERequest, LLEResult, Neighbors,
    SteeringRequest, SteeringResult,
)
from service.limits import check_sync_texts
from embgeom import figure_names as figure_kinds
from service.schemas import MAX_INT, MODEL_503, ErrorBody, FiniteQuery, documented

router = APIRouter(prefix="/v1", tags=["geometry"],
                   responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody},
                              429: {"model": ErrorBody}})

LAYER_PATH = "/collections/{collection}/models/{model}/layers/{layer}"
# An input space (layer "input") or steering texts run a model in this process.
MODEL_RESPONSES = {503: {"model": ErrorBody, "description": MODEL_503}}
# Token pairs a global-similarity figure may plot.
MAX_FIGURE_PAIRS = 200_000


def geometry_of(request: Request) -> Comparisons:
    """The app's :class:`Comparisons`, made on first use from its runtime and settings."""
    def make(rt) -> Comparisons:
        s = rt.settings
        return Comparisons(rt.reader, rt.read_sync, rt.registry,
                           rt.sync_models.get, Limits.from_settings(s),
                           GeometryCache(s.geometry_cache_entries, s.geometry_cache_mb << 20),
                           s.geometry_max_concurrent)
    return app_object(request, "geometry", make)


MinCount = Annotated[int, Query(ge=1, le=MAX_INT, description="Token types with n_t >= min_count")]


@router.post("/compare/global", response_model=GlobalSimilarity, responses=MODEL_RESPONSES)
def compare_global(body: GlobalRequest, request: Request):
    """Global similarity of two spaces over their shared tokens: Pearson correlation of
    the pairwise cosine similarities, linear CKA (biased and debiased), the orthogonal
    Procrustes residual, mutual k-NN and CKNNA, each beside a baseline with the token
    correspondence shuffled."""
    return FastJSON(geometry_of(request).pairs.compare_global(
        body.a.to_space(), body.b.to_space(), body.min_count, body.sample, body.seed, body.k))


@router.post("/compare/lle", response_model=LLEResult, responses=MODEL_RESPONSES)
def compare_lle(body: LLERequest, request: Request):
    """Local similarity: each shared token's LLE weights over its k nearest neighbours in
    a, reused to rebuild it in b, against b's own optimal weights and random weights."""
    return FastJSON(geometry_of(request).pairs.compare_lle(
        body.a.to_space(), body.b.to_space(), body.k, body.min_count, body.sample, body.seed,
        body.reg))


@router.get(LAYER_PATH + "/intrinsic-dimension", response_model=IntrinsicDimension)
def intrinsic_dimension(
    t: LayerTargetDep, request: Request,
    k: Annotated[int, Query(ge=2, le=MAX_INT, description="Neighbours per token")] = 20,
    method: Literal["local_pca", "twonn", "mle"] = "local_pca",
    threshold: Annotated[float, FiniteQuery(gt=0, lt=1, description="Variance share (local_pca)")] = 0.9,
    min_count: MinCount = 5,
    limit: Annotated[int, Query(ge=1, le=100, description="Tokens listed at each end")] = 10,
    neighbors: Annotated[int, Query(ge=0, le=20, description="Nearest tokens shown for each")] = 0,
):
    """Per-token intrinsic dimension of the layer's token means: the global estimate and
    the lowest- and highest-dimension tokens."""
    return FastJSON(geometry_of(request).layers.intrinsic_dimension(
        Space(t.pair.collection, t.pair.model, t.layer), k, method, threshold, min_count, limit,
        neighbors))


@router.get(LAYER_PATH + "/tokens/{token_id}/neighbors", response_model=Neighbors)
def neighbors(t: LayerTargetDep, request: Request,
              token_id: Annotated[int, Path(description="Token id (key)", **documented(minimum=0, maximum=MAX_INT))],
              k: Annotated[int, Query(ge=1, le=MAX_INT)] = 10, min_count: MinCount = 5):
    """The k tokens whose means are nearest by cosine to this token's mean."""
    return FastJSON(geometry_of(request).layers.neighbors(
        Space(t.pair.collection, t.pair.model, t.layer), token_id, k, min_count))


@router.post("/steering/transfer", response_model=SteeringResult,
             responses={413: {"model": ErrorBody}, **MODEL_RESPONSES})
async def steering_transfer(body: SteeringRequest, request: Request):
    """Emb2Emb: a ridge map from space a to space b fit on shared tokens (held-out fit
    reported), applied to a steering vector given directly or as a difference of means of
    two text sets in a; compared with b's own difference of means and with random maps.
    With texts, both models run them in the API process: a synchronous model run (413
    beyond the text limits, 429 beyond ``max_sync_runs`` at once)."""
    steering = geometry_of(request).steering
    rt = request.app.state.runtime

    def run():
        return steering.steering_transfer(
            body.a.to_space(), body.b.to_space(), body.vector, body.positive_texts,
            body.negative_texts, body.ridge, body.held_out, body.seed, body.min_count,
            body.sample, body.return_vector)

    texts = (body.positive_texts or []) + (body.negative_texts or [])
    if texts:
        check_sync_texts(rt.settings, texts)
        return FastJSON(await rt.sync_runs.run(run))
    return FastJSON(await run_in_threadpool(run))


# --------------------------------------------------------------------------- figures

IMAGE_RESPONSES = {200: {"content": {"image/png": {}, "image/svg+xml": {}}, "description": "The figure"}}
SPACE_PATTERN = r"^[A-Za-z0-9_.-]{1,64}:[A-Za-z0-9_.-]{1,64}:([0-9]{1,9}|input)$"
SpaceQuery = Annotated[str, Query(
    pattern=SPACE_PATTERN, description="A space as collection:model:layer (layer an integer or "
                                       "\"input\"), e.g. bbc:minilm:6")]
ImageFormat = Annotated[str, Query(description="png | svg", **documented(enum=list(figure_kinds.FORMATS)))]


def _space(text: str) -> Space:
    collection, model, layer = text.split(":")
    return Space(collection, model, layer if layer == INPUT else int(layer))


def _figure_name(name: str, names: dict) -> str:
    if name not in names:
        raise NotFound("unknown_figure", f"no figure {name!r}; figures: {', '.join(names)}",
                       figure=name, figures=list(names))
    return name


def _image(fig: RenderedFigure, fmt: str) -> Response:
    headers = {"X-Embgeom-Cache": "hit" if fig.hit else "miss", "Cache-Control": "no-cache"}
    if "a" in fig.as_of and "b" in fig.as_of:
        headers["X-Embgeom-Version-A"] = str(fig.as_of["a"].get("version", 0))
        headers["X-Embgeom-Version-B"] = str(fig.as_of["b"].get("version", 0))
    else:
        headers["X-Embgeom-Version"] = str(fig.as_of.get("version", 0))
    for name, value in fig.numbers.items():
        header = "X-Embgeom-" + "-".join(part.capitalize() for part in name.split("_"))
        headers[header] = json.dumps(value)  # a float exactly as the JSON answer gives it
    return Response(fig.content, media_type=MEDIA_TYPES[fmt], headers=headers)


@router.get(LAYER_PATH + "/figures/{name}", response_class=Response, responses=IMAGE_RESPONSES)
def layer_figure(
    t: LayerTargetDep, request: Request,
    name: Annotated[str, Path(description="intrinsic_dimension",
                              **documented(enum=list(geometry_figures.LAYER_FIGURES)))],
    format: ImageFormat = "png",
    k: Annotated[int, Query(ge=2, le=MAX_INT, description="Neighbours per token")] = 20,
    method: Literal["local_pca", "twonn", "mle"] = "local_pca",
    threshold: Annotated[float, FiniteQuery(gt=0, lt=1, description="Variance share (local_pca)")] = 0.9,
    min_count: Annotated[int, Query(ge=1, le=MAX_INT, description="Token types with n_t >= min_count")] = 5,
    limit: Annotated[int, Query(ge=1, le=geometry_figures.MAX_NAMED,
                                description="Tokens named at each end")] = 8,
) -> Response:
    """A figure of one layer's token space. ``intrinsic_dimension``: the histogram of the
    per-token estimates (``.../intrinsic-dimension`` with the same parameters) and each
    estimate against log10 n, the lowest and highest tokens named. Cached until the
    collection changes; ``X-Embgeom-Dimension`` is the global estimate shown."""
    _figure_name(name, geometry_figures.LAYER_FIGURES)
    check_format(format)
    fig = geometry_of(request).figures.intrinsic_dimension_figure(
        Space(t.pair.collection, t.pair.model, t.layer), k, method, threshold, min_count, limit, format)
    return _image(fig, format)


@router.get("/compare/figures/{name}", response_class=Response,
            responses={**IMAGE_RESPONSES, **MODEL_RESPONSES})
def compare_figure(
    request: Request,
    name: Annotated[str, Path(description="global | lle",
                              **documented(enum=list(geometry_figures.COMPARE_FIGURES)))],
    a: SpaceQuery, b: SpaceQuery,
    format: ImageFormat = "png",
    min_count: Annotated[int, Query(ge=1, le=MAX_INT, description="Token types with n_t >= "
                                                                  "min_count in each space")] = 5,
    sample: Annotated[Optional[int], Query(ge=3, le=MAX_INT, description="A seeded sample of "
                                                                         "this many shared tokens")] = None,
    seed: Annotated[int, Query(ge=0, le=MAX_INT, description="Seeds the samples and baselines")] = 0,
    pairs: Annotated[int, Query(ge=100, le=MAX_FIGURE_PAIRS,
                                description="global: token pairs plotted (a seeded sample)")] = FIGURE_PAIRS,
    k: Annotated[int, Query(ge=1, le=MAX_INT, description="lle: neighbours per token")] = 10,
    reg: Annotated[float, FiniteQuery(ge=0, description="lle: regularisation")] = 1e-3,
) -> Response:
    """A figure comparing two spaces, from the same computation as the JSON answer with the
    same parameters (``/v1/compare/global`` or ``/v1/compare/lle``). ``global``: cos(a_i,
    a_j) against cos(b_i, b_j) for a seeded sample of ``pairs`` token pairs (density),
    beside the same with b's tokens shuffled; the Pearson r shown (and in
    ``X-Embgeom-Pearson``, ``X-Embgeom-Baseline-Pearson``) is over all pairs. ``lle``: each
    token's transfer error against its own-weights error, and the transfer, own and random
    errors over all tokens (``X-Embgeom-Transfer-Error``, ...). Parameters a figure does
    not use are ignored. Cached until either space changes."""
    _figure_name(name, geometry_figures.COMPARE_FIGURES)
    check_format(format)
    figures = geometry_of(request).figures
    if name == "global":
        fig = figures.global_figure(_space(a), _space(b), min_count, sample, seed, pairs, format)
    else:
        fig = figures.lle_figure(_space(a), _space(b), k, min_count, sample, seed, reg, format)
    return _image(fig, format)
