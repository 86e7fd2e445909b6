"""Dependencies, declared once and reused by every route.

They are ``async``: none of them blocks (names are checked in memory, model infos are
cached after their first load), and an async dependency costs no trip through the thread
pool on the hot read paths.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Annotated, Callable, TypeVar

from fastapi import Depends, Path, Request

from embgeom.compute.catalogue import ModelInfo
from embgeom.errors import InvalidInput, NotFound
from embgeom.store import keys as K
from embgeom.store.keys import PairKeys
from service.auth import required_scope
from service.errors import Forbidden, Unauthorized
from service.runtime import Runtime
from service.schemas import NAME_SCHEMA, documented

NAME_DOC = "Matches ^[A-Za-z0-9_.-]{1,64}$"
# Path parameters as the document states them; the checks below enforce them with their
# own error types (invalid_collection_name 422, unknown_model and layer_not_found 404).
CollectionPath = Annotated[str, Path(description=NAME_DOC, **documented(**NAME_SCHEMA))]
ModelPath = Annotated[str, Path(description="Model alias", **documented(**NAME_SCHEMA))]
LayerPath = Annotated[int, Path(description="0 = embedding output, 1..L blocks", **documented(minimum=0))]


async def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]

T = TypeVar("T")
_APP_STATE_LOCK = threading.Lock()


def app_object(request: Request, name: str, make: Callable[[Runtime], T]) -> T:
    """``request.app.state.<name>``, made once per app from its runtime on first use
    (a cache, a worker pool: created lazily, shared by every request of the process)."""
    state = request.app.state
    obj = getattr(state, name, None)
    if obj is None:
        with _APP_STATE_LOCK:
            obj = getattr(state, name, None)
            if obj is None:
                obj = make(state.runtime)
                setattr(state, name, obj)
    return obj


async def require_api_key(request: Request) -> None:
    """When API keys are configured, a /v1 request (and /metrics, when asked) needs
    ``Authorization: Bearer <key>`` with the scope its method calls for
    (:mod:`service.auth`). One dependency on the whole app, reading the header itself:
    it runs on every request, against keys parsed once at start-up."""
    auth = request.app.state.auth
    if not auth.enabled:
        return
    scope = required_scope(request.scope["method"], request.scope["path"], auth.metrics_protected)
    if scope is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("this route needs an API key: Authorization: Bearer <key>")
    scopes = auth.scopes_of(token.strip())
    if scopes is None:
        raise Unauthorized("the bearer token is not a configured API key", invalid_token=True)
    if scope not in scopes:
        raise Forbidden(scope)


async def valid_collection(collection: CollectionPath) -> str:
    if not K.valid_name(collection):
        raise InvalidInput(f"collection name {collection!r} does not match {K.NAME_PATTERN}",
                           type="invalid_collection_name")
    return collection


CollectionDep = Annotated[str, Depends(valid_collection)]


async def model_info(rt: RuntimeDep, model: ModelPath) -> ModelInfo:
    rt.registry.source(model)  # UnknownModel -> 404
    return await rt.model_info(model)


ModelDep = Annotated[ModelInfo, Depends(model_info)]


async def model_pair(collection: CollectionDep, model: ModelDep) -> PairKeys:
    """The (collection, model) pair named by the path; whether it holds data is checked
    by the read itself (one round trip)."""
    return PairKeys(collection, model.name)


PairDep = Annotated[PairKeys, Depends(model_pair)]


def _check_layer(model: ModelInfo, layer: int) -> int:
    if not 0 <= layer <= model.num_layers:
        raise NotFound("layer_not_found",
                       f"layer {layer} is out of range for {model.name}: 0..{model.num_layers}",
                       layer=layer, num_layers=model.num_layers)
    return layer


async def valid_layer(model: ModelDep, layer: LayerPath) -> int:
    return _check_layer(model, layer)


LayerDep = Annotated[int, Depends(valid_layer)]


@dataclass(frozen=True)
class LayerTarget:
    """What a per-layer read addresses: the runtime, the pair, its model and the layer."""

    rt: Runtime
    pair: PairKeys
    model: ModelInfo
    layer: int


async def layer_target(request: Request,
                       collection: CollectionPath, model: ModelPath, layer: LayerPath) -> LayerTarget:
    """The checks of :func:`valid_collection`, :func:`model_info` and :func:`valid_layer`
    in one dependency: the per-layer reads are the hot paths, and each dependency costs
    FastAPI a resolution step per request."""
    rt = request.app.state.runtime
    await valid_collection(collection)
    info = await model_info(rt, model)
    return LayerTarget(rt, PairKeys(collection, info.name), info, _check_layer(info, layer))


LayerTargetDep = Annotated[LayerTarget, Depends(layer_target)]
