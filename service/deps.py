"""Dependencies, declared once and reused by every route."""

from __future__ import annotations

from typing import Annotated, Optional

from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from embgeom import keys as K
from embgeom.errors import EmbgeomError, InvalidInput, NotFound
from embgeom.models import ModelInfo
from service.runtime import Runtime

NAME_DOC = "Matches ^[A-Za-z0-9_.-]{1,64}$"


def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]

_bearer = HTTPBearer(auto_error=False)


class Unauthorized(EmbgeomError):
    type = "unauthorized"


def require_api_key(rt: RuntimeDep,
                    credentials: Annotated[Optional[HTTPAuthorizationCredentials], Depends(_bearer)]) -> None:
    """When ``EMBGEOM_API_KEY`` is set, every /v1 route needs ``Authorization: Bearer <key>``."""
    expected = rt.settings.api_key
    if expected and (credentials is None or credentials.credentials != expected):
        raise Unauthorized("missing or wrong bearer token")


def valid_collection(collection: Annotated[str, Path(description=NAME_DOC)]) -> str:
    if not K.valid_name(collection):
        raise InvalidInput(f"collection name {collection!r} does not match {K.NAME_PATTERN}",
                           type="invalid_collection_name")
    return collection


CollectionDep = Annotated[str, Depends(valid_collection)]


def model_info(rt: RuntimeDep, model: Annotated[str, Path(description="Model alias")]) -> ModelInfo:
    rt.registry.source(model)  # UnknownModel -> 404
    return rt.registry.info(model)


ModelDep = Annotated[ModelInfo, Depends(model_info)]


def existing_pair(rt: RuntimeDep, collection: CollectionDep, model: ModelDep) -> K.PairKeys:
    """The (collection, model) pair; 404 when the collection was never created."""
    pairs = {p.decode() for p in rt.redis.smembers(K.PAIRS)}
    if not any(K.split_pair(p)[0] == collection for p in pairs):
        raise NotFound("collection_not_found", f"no collection {collection!r}", collection=collection)
    pair = K.PairKeys(collection, model.name)
    if pair.pair not in pairs:
        raise NotFound("model_not_in_collection",
                       f"no text was ever sent to collection {collection!r} for model {model.name!r}",
                       collection=collection, model=model.name)
    return pair


PairDep = Annotated[K.PairKeys, Depends(existing_pair)]


def valid_layer(model: ModelDep, layer: Annotated[int, Path(description="0 = embedding output, 1..L blocks")]) -> int:
    if not 0 <= layer <= model.num_layers:
        raise NotFound("layer_not_found",
                       f"layer {layer} is out of range for {model.name}: 0..{model.num_layers}",
                       layer=layer, num_layers=model.num_layers)
    return layer


LayerDep = Annotated[int, Depends(valid_layer)]
