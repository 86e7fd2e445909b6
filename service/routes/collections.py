from __future__ import annotations

from typing import Annotated, Literal, Optional

from fastapi import APIRouter, Query, Request
from service.encoding import FastJSON

from embgeom import reports
from embgeom.errors import NotFound
from embgeom.store.conf import CollectionSettings
from service.deps import CollectionDep, LayerTargetDep, PairDep, RuntimeDep, layer_target
from service.schemas import (
    MAX_INT, CollectionInfo, CollectionOut, CollectionSettingsIn, Decomposition, Deleted, ErrorBody,
    LayersOut, TokenDetail, TokenPage,
)

router = APIRouter(prefix="/v1/collections", tags=["collections"],
                   responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody}})

MinCount = Annotated[int, Query(ge=1, le=MAX_INT, description="Keep token types with n_t >= min_count")]
MaxCount = Annotated[Optional[int], Query(ge=1, le=MAX_INT, description="Keep token types with n_t <= max_count")]


@router.get("", response_model=list[CollectionOut])
def list_collections(rt: RuntimeDep) -> list[dict]:
    return [{"name": c, "models": ms} for c, ms in rt.collections.pairs().items()]


@router.put("/{collection}", response_model=CollectionInfo, status_code=201,
            responses={200: {"model": CollectionInfo, "description": "Already there, same settings"},
                       409: {"model": ErrorBody, "description": "Already there, other settings"}})
def put_collection(collection: CollectionDep, body: CollectionSettingsIn, rt: RuntimeDep):
    """Create a collection with fixed settings: a preset, or explicit settings."""
    if body.preset is not None:
        settings = CollectionSettings.from_preset(body.preset)
    else:
        settings = CollectionSettings(key=body.key, unit=body.unit,
                                      include_special=body.include_special,
                                      layers=tuple(body.layers) if body.layers is not None else None,
                                      self_similarity=body.self_similarity,
                                      cross_layer=body.cross_layer)
    settings, created = rt.collections.put(collection, settings)
    out = {"name": collection, "settings": settings.to_dict(), "created": created,
           "models": rt.collections.pairs().get(collection, [])}
    return FastJSON(out, status_code=201 if created else 200)


@router.get("/{collection}", response_model=CollectionInfo)
def get_collection(collection: CollectionDep, rt: RuntimeDep) -> dict:
    settings = rt.collections.settings(collection)
    models = rt.collections.pairs().get(collection, [])
    if settings is None and not models:
        raise NotFound("collection_not_found", f"no collection {collection!r}", collection=collection)
    return {"name": collection, "settings": settings.to_dict() if settings else None, "models": models}


@router.delete("/{collection}", response_model=Deleted)
def delete_collection(collection: CollectionDep, rt: RuntimeDep) -> dict:
    """Delete a collection: its settings and every statistic. Jobs still queued for it
    are voided (they fail without running)."""
    models = rt.collections.delete(collection)
    return {"deleted": collection, "models": models}


@router.get("/{collection}/models/{model}/layers", response_model=LayersOut)
async def layers(pair: PairDep, rt: RuntimeDep,
                 min_count: MinCount = 1, max_count: MaxCount = None):
    """Decomposition and summary (cv_Q, V-on-M regression) of every kept layer."""
    f = reports.CountFilter(min_count, max_count)
    rows, as_of = await rt.read(reports.layer_rows(rt.reader, pair, None, f))
    for row in rows:
        row.update(f.to_dict())
    return FastJSON({"collection": pair.collection, "model": pair.model, **f.to_dict(),
                           "layers": rows, "as_of": as_of})


@router.get("/{collection}/models/{model}/layers/{layer}/decomposition", response_model=Decomposition)
async def decomposition(t: LayerTargetDep, min_count: MinCount = 1, max_count: MaxCount = None):
    """Q = M + V_W + V_B at one layer; O(d) without a count filter."""
    f = reports.CountFilter(min_count, max_count)
    rows, as_of = await t.rt.read(reports.layer_rows(t.rt.reader, t.pair, [t.layer], f,
                                                      with_summary=False))
    return FastJSON({**rows[0], **f.to_dict(), "as_of": as_of})


@router.get("/{collection}/models/{model}/layers/{layer}/tokens", response_model=TokenPage)
async def tokens(t: LayerTargetDep,
                 order_by: Literal["n", "Q", "M", "V"] = "n", desc: bool = True,
                 limit: Annotated[int, Query(ge=1, le=10000)] = 100,
                 cursor: Optional[str] = None, min_count: MinCount = 1, max_count: MaxCount = None,
                 token: Annotated[Optional[str], Query(description=(
                     "A token as the collection keys it: a vocabulary string ('##ing'; with "
                     "string keys 'ing' names the same key), or a word of a word-unit "
                     "collection"))] = None):
    page = await t.rt.read(reports.token_page(
        t.rt.reader, t.pair, t.layer, await t.rt.vocabulary(t.pair.model), order_by, desc, limit,
        cursor, reports.CountFilter(min_count, max_count), token))
    return FastJSON(page)


@router.get("/{collection}/models/{model}/layers/{layer}/tokens/{token_id}", response_model=TokenDetail)
async def token(t: LayerTargetDep, token_id: int):
    detail = await t.rt.read(reports.token_detail(
        t.rt.reader, t.pair, t.layer, token_id, await t.rt.vocabulary(t.pair.model)))
    return FastJSON(detail)


async def token_lane(request: Request, params: dict) -> Optional[FastJSON]:
    """:func:`token` for :class:`service.fast_lane.FastLane`: its dependency and its
    body called directly; None (the app answers) unless layer and token id are numbers."""
    layer, token_id = params["layer"], params["token_id"]
    if not (layer.isascii() and layer.isdigit() and token_id.isascii() and token_id.isdigit()):
        return None
    t = await layer_target(request, params["collection"], params["model"], int(layer))
    return await token(t, int(token_id))


# The routes service.fast_lane.FastLane serves, with their handlers.
FAST_LANES = [(route, token_lane) for route in router.routes if route.endpoint is token]
