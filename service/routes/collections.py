from __future__ import annotations

from typing import Annotated, Literal, Optional

from fastapi import APIRouter, Query

from embgeom import keys as K
from embgeom import reports
from embgeom.errors import NotFound
from service.deps import CollectionDep, LayerDep, ModelDep, PairDep, RuntimeDep
from service.schemas import (
    Decomposition, Deleted, CollectionOut, ErrorBody, LayersOut, TokenDetail, TokenPage,
)

router = APIRouter(prefix="/v1/collections", tags=["collections"],
                   responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody}})

MinCount = Annotated[int, Query(ge=1, description="Keep token types with n_t >= min_count")]
MaxCount = Annotated[Optional[int], Query(ge=1, description="Keep token types with n_t <= max_count")]


def _pairs(rt) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for raw in rt.redis.smembers(K.PAIRS):
        c, m = K.split_pair(raw.decode())
        grouped.setdefault(c, []).append(m)
    return {c: sorted(ms) for c, ms in sorted(grouped.items())}


@router.get("", response_model=list[CollectionOut])
def list_collections(rt: RuntimeDep) -> list[dict]:
    return [{"name": c, "models": ms} for c, ms in _pairs(rt).items()]


@router.delete("/{collection}", response_model=Deleted)
def delete_collection(collection: CollectionDep, rt: RuntimeDep) -> dict:
    """Delete every statistic of a collection. Jobs still queued for it are voided."""
    models = _pairs(rt).get(collection)
    if not models:
        raise NotFound("collection_not_found", f"no collection {collection!r}", collection=collection)
    for model in models:
        rt.store.delete_pair(K.PairKeys(collection, model))
    return {"deleted": collection, "models": models}


@router.get("/{collection}/models/{model}/layers", response_model=LayersOut)
def layers(pair: PairDep, model: ModelDep, rt: RuntimeDep,
           min_count: MinCount = 1, max_count: MaxCount = None) -> dict:
    """Decomposition and summary (cv_Q, V-on-M regression) of every layer."""
    f = reports.CountFilter(min_count, max_count)
    rows, as_of = reports.layer_rows(rt.store, pair, range(model.num_layers + 1), f)
    for row in rows:
        row.update(f.to_dict())
    return {"collection": pair.collection, "model": pair.model, **f.to_dict(),
            "layers": rows, "as_of": as_of}


@router.get("/{collection}/models/{model}/layers/{layer}/decomposition", response_model=Decomposition)
def decomposition(pair: PairDep, layer: LayerDep, rt: RuntimeDep,
                  min_count: MinCount = 1, max_count: MaxCount = None) -> dict:
    """Q = M + V_W + V_B at one layer; O(d) without a count filter."""
    f = reports.CountFilter(min_count, max_count)
    rows, as_of = reports.layer_rows(rt.store, pair, [layer], f, with_summary=False)
    return {**rows[0], **f.to_dict(), "as_of": as_of}


@router.get("/{collection}/models/{model}/layers/{layer}/tokens", response_model=TokenPage)
def tokens(pair: PairDep, layer: LayerDep, rt: RuntimeDep,
           order_by: Literal["n", "Q", "M", "V"] = "n", desc: bool = True,
           limit: Annotated[int, Query(ge=1, le=10000)] = 100,
           cursor: Optional[str] = None, min_count: MinCount = 1, max_count: MaxCount = None,
           token: Annotated[Optional[str], Query(description="A vocabulary string, e.g. '##ing'")] = None) -> dict:
    tokenizer = rt.registry.tokenizer(pair.model)
    token_id = _lookup(tokenizer, token) if token is not None else None
    return reports.token_page(rt.store, pair, layer, tokenizer, order_by, desc, limit, cursor,
                              reports.CountFilter(min_count, max_count), token_id)


@router.get("/{collection}/models/{model}/layers/{layer}/tokens/{token_id}", response_model=TokenDetail)
def token(pair: PairDep, layer: LayerDep, token_id: int, rt: RuntimeDep) -> dict:
    return reports.token_detail(rt.store, pair, layer, token_id, rt.registry.tokenizer(pair.model))


def _lookup(tokenizer, token: str) -> int:
    """Vocabulary string -> id; an out-of-vocabulary string is a 404, never [UNK]'s id."""
    vocab = tokenizer.get_vocab()
    if token not in vocab:
        raise NotFound("token_not_in_vocabulary", f"{token!r} is not in the model's vocabulary",
                       token=token)
    return int(vocab[token])
