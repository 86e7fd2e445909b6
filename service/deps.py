"""Dependencies, declared once and reused by every route.

They are ``async``: none of them blocks (names are checked in memory, model infos are
cached after their first load), and an async dependency costs no trip through the thread
pool on the hot read paths.
"""

from __future__ import annotations

import hmac
from typing import Annotated, Optional

from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from embgeom.compute.models import ModelInfo
from embgeom.errors import EmbgeomError, InvalidInput, NotFound
from embgeom.store import keys as K
from embgeom.store.keys import PairKeys
from service.runtime import Runtime

NAME_DOC = "Matches ^[A-Za-z0-9_.-]{1,64}$"


async def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]

_bearer = HTTPBearer(auto_error=False)


class Unauthorized(EmbgeomError):
    type = "unauthorized"


async def require_api_key(rt: RuntimeDep,
                          credentials: Annotated[Optional[HTTPAuthorizationCredentials], Depends(_bearer)]) -> None:
    """When ``EMBGEOM_API_KEY`` is set, every /v1 route needs ``Authorization: Bearer <key>``."""
    expected = rt.settings.api_key
    if expected and (credentials is None
                     or not hmac.compare_digest(credentials.credentials.encode(), expected.encode())):
        raise Unauthorized("missing or wrong bearer token")


async def valid_collection(collection: Annotated[str, Path(description=NAME_DOC)]) -> str:
    if not K.valid_name(collection):
        raise InvalidInput(f"collection name {collection!r} does not match {K.NAME_PATTERN}",
                           type="invalid_collection_name")
    return collection


CollectionDep = Annotated[str, Depends(valid_collection)]


async def model_info(rt: RuntimeDep, model: Annotated[str, Path(description="Model alias")]) -> ModelInfo:
    rt.registry.source(model)  # UnknownModel -> 404
    return rt.registry.info(model)


ModelDep = Annotated[ModelInfo, Depends(model_info)]


async def model_pair(collection: CollectionDep, model: ModelDep) -> PairKeys:
    """The (collection, model) pair named by the path; whether it holds data is checked
    by the read itself (one round trip)."""
    return PairKeys(collection, model.name)


PairDep = Annotated[PairKeys, Depends(model_pair)]


async def valid_layer(model: ModelDep, layer: Annotated[int, Path(description="0 = embedding output, 1..L blocks")]) -> int:
    if not 0 <= layer <= model.num_layers:
        raise NotFound("layer_not_found",
                       f"layer {layer} is out of range for {model.name}: 0..{model.num_layers}",
                       layer=layer, num_layers=model.num_layers)
    return layer


LayerDep = Annotated[int, Depends(valid_layer)]
