from __future__ import annotations

from typing import Annotated, Literal, Optional

from fastapi import APIRouter, Query

from embgeom import reports
from embgeom.store.reader import run_sync
from embgeom.errors import NotFound
from service.deps import LayerDep, ModelDep, PairDep, RuntimeDep
from service.limits import check_sync_texts
from service.schemas import (
    MAX_INT, MODEL_503, ErrorBody, FiniteQuery, Isotropy, LayerSimilarity, ModelOutliers, Outliers, ProbeRequest, ProbeResult,
    SampleIsotropy, SampleRequest, TRANSFORM_PATTERN, documented,
)

router = APIRouter(prefix="/v1", tags=["diagnostics"],
                   responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody}})

LAYER_PATH = "/collections/{collection}/models/{model}/layers/{layer}"
Transform = Annotated[Optional[str], Query(description="none | standardize | abtt:D",
                                           **documented(pattern=TRANSFORM_PATTERN))]
Threshold = Annotated[float, FiniteQuery(gt=0, description="Outlier if variance >= threshold x mean variance")]
# A synchronous model run: 413 beyond the text limits, 429 beyond max_sync_runs at once,
# 503 model_loading when its model is still loading in this process past
# model_load_wait_seconds.
SYNC_RESPONSES = {413: {"model": ErrorBody}, 429: {"model": ErrorBody},
                  503: {"model": ErrorBody, "description": MODEL_503}}


# Eigendecompositions and scans are CPU work: these reads run on the thread pool with the
# synchronous client, never on the event loop.

@router.get(LAYER_PATH + "/isotropy", response_model=Isotropy)
def isotropy(pair: PairDep, layer: LayerDep, rt: RuntimeDep, transform: Transform = None,
             spectrum: bool = False, partition: bool = True,
             min_count: Annotated[int, Query(ge=1, le=MAX_INT, description="Token types used for I(W)")] = 1) -> dict:
    """IsoScore, mean cosine, effective rank, participation ratio, top eigenvalue ratio and
    partition isotropy, exact over every embedding ingested."""
    return run_sync(rt.redis, reports.isotropy(rt.reader, pair, layer, transform, spectrum,
                                               partition, min_count))


@router.get(LAYER_PATH + "/outliers", response_model=Outliers)
def outliers(pair: PairDep, layer: LayerDep, rt: RuntimeDep, threshold: Threshold = 5.0,
             transform: Transform = None, top: Annotated[int, Query(ge=1, le=4096)] = 10) -> dict:
    return run_sync(rt.redis, reports.outliers(rt.reader, pair, layer, threshold, transform, top))


@router.get("/collections/{collection}/models/{model}/outliers", response_model=ModelOutliers)
def model_outliers(pair: PairDep, model: ModelDep, rt: RuntimeDep, threshold: Threshold = 5.0,
                   transform: Transform = None) -> dict:
    """Outlier dimensions of every layer and the ones that persist across layers."""
    return run_sync(rt.redis, reports.model_outliers(rt.reader, pair, threshold, transform))


@router.get("/collections/{collection}/models/{model}/similarity", response_model=LayerSimilarity,
            responses={409: {"model": ErrorBody, "description": "cross_layer_not_kept: the "
                                                               "collection was made without cross_layer"}})
def layer_similarity(pair: PairDep, model: ModelDep, rt: RuntimeDep,
                     metric: Literal["linear_cka", "rv"] = "linear_cka") -> dict:
    """Layer-by-layer linear CKA over every occurrence ingested (exact, from the streamed
    cross-layer co-moment of a collection created with ``cross_layer``)."""
    return run_sync(rt.redis, reports.layer_similarity(rt.reader, pair, metric))


@router.post(LAYER_PATH + "/isotropy/sample", response_model=SampleIsotropy, responses=SYNC_RESPONSES)
async def isotropy_sample(pair: PairDep, layer: LayerDep, body: SampleRequest, rt: RuntimeDep) -> dict:
    """IsoScore and IsoScore* (Rudman & Eickhoff 2024) of a mini-batch, shrunk toward the
    collection's covariance or the identity. Runs the model in the API process, on the
    thread pool, at most ``max_sync_runs`` at once (429 beyond); a model not loaded yet is
    loaded first, the request waiting for it up to ``model_load_wait_seconds`` (503
    ``model_loading`` with ``Retry-After`` past it)."""
    check_sync_texts(rt.settings, body.texts)

    def run():
        from embgeom import probes  # torch: imported where the model runs, on the thread pool

        reference = None
        if body.reference == "collection":
            reference = run_sync(rt.redis, reports.covariance(rt.reader, pair, layer))
            if reference is None:
                raise NotFound("collection_empty", "the collection has no embeddings at this layer yet")
        loaded = rt.sync_models.get(pair.model)
        return probes.sample_isotropy(loaded, body.texts, layer, body.zeta, reference,
                                      body.include_special, rt.settings.token_budget)

    return await rt.sync_runs.run(run)


@router.post("/probes/outlier-dimension", response_model=ProbeResult, responses=SYNC_RESPONSES)
async def outlier_probe(body: ProbeRequest, rt: RuntimeDep) -> dict:
    """The 1-D outlier-dimension probe (Rudman et al. 2023) on labelled texts. Runs the
    model in the API process, on the thread pool, at most ``max_sync_runs`` at once (429
    beyond); a model not loaded yet is loaded first, the request waiting for it up to
    ``model_load_wait_seconds`` (503 ``model_loading`` with ``Retry-After`` past it)."""
    check_sync_texts(rt.settings, body.texts)
    rt.registry.source(body.model)  # unknown alias -> 404 unknown_model
    info = await rt.model_info(body.model)
    if body.layer > info.num_layers:
        raise NotFound("layer_not_found", f"layer {body.layer} is out of range 0..{info.num_layers}",
                       layer=body.layer, num_layers=info.num_layers)

    def run():
        from embgeom import probes  # torch: imported where the model runs, on the thread pool

        loaded = rt.sync_models.get(body.model)
        result = probes.outlier_dimension_probe(
            loaded, body.texts, body.labels, body.layer, body.pooling, body.test_fraction,
            body.seed, body.top_k, body.include_special, rt.settings.token_budget)
        return {"model": body.model, **result}

    return await rt.sync_runs.run(run)
