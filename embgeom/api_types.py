"""The JSON answers of the v1 API as TypedDicts (generated from openapi/openapi.json by
``make openapi``; do not edit: tests/test_client_notebook.py checks it is in sync).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, TypedDict, Union


__all__ = [
    "Accuracy",
    "AsOf",
    "CollectionInfo",
    "CollectionOut",
    "CollectionSettingsOut",
    "Decomposition",
    "Deleted",
    "DimensionToken",
    "GlobalScores",
    "GlobalSimilarity",
    "Health",
    "IntrinsicDimension",
    "Isotropy",
    "JobCreated",
    "JobStatus",
    "LLEResult",
    "LayerOutliers",
    "LayerRow",
    "LayerSimilarity",
    "LayersOut",
    "MapFit",
    "ModelOut",
    "ModelOutliers",
    "NeighborOut",
    "Neighbors",
    "OutlierDimension",
    "Outliers",
    "PairAsOf",
    "PersistentDimension",
    "ProbeDimension",
    "ProbeResult",
    "RandomMapBaseline",
    "Readiness",
    "RogueDimension",
    "SampleIsotropy",
    "ShuffledMapBaseline",
    "SpaceOut",
    "SteeringBaseline",
    "SteeringResult",
    "TokenDetail",
    "TokenPage",
    "TokenStats",
]


class Health(TypedDict):
    status: str


class Readiness(TypedDict):
    embedded: bool
    redis: bool
    status: str
    workers: int


class CollectionOut(TypedDict):
    models: list[str]
    name: str


class Deleted(TypedDict):
    deleted: str
    models: list[str]


class CollectionSettingsOut(TypedDict):
    cross_layer: bool
    include_special: bool
    key: str
    layers: Optional[list[int]]
    preset: Optional[str]
    self_similarity: bool
    unit: str


class CollectionInfo(TypedDict):
    created: Optional[bool]
    models: list[str]
    name: str
    settings: Optional[CollectionSettingsOut]


class AsOf(TypedDict):
    applying: int
    updated_at: Optional[float]
    version: int


LayerRow = TypedDict("LayerRow", {
    "M": Optional[float],
    "M/Q": Optional[float],
    "Q": Optional[float],
    "V": Optional[float],
    "V_B": Optional[float],
    "V_B/Q": Optional[float],
    "V_B_error": Optional[float],
    "V_W": Optional[float],
    "V_W/Q": Optional[float],
    "V_W/V": Optional[float],
    "cv_Q": Optional[float],
    "intercept": Optional[float],
    "layer": int,
    "max_count": Optional[int],
    "min_count": int,
    "n": int,
    "num_types": int,
    "r2": Optional[float],
    "slope": Optional[float],
    "slope_M_log10n": Optional[float],
    "slope_Q_log10n": Optional[float],
    "slope_V_log10n": Optional[float],
})


class LayersOut(TypedDict):
    as_of: AsOf
    collection: str
    layers: list[LayerRow]
    max_count: Optional[int]
    min_count: int
    model: str


class Decomposition(TypedDict):
    M: Optional[float]
    Q: Optional[float]
    V: Optional[float]
    V_B: Optional[float]
    V_B_error: Optional[float]
    V_W: Optional[float]
    as_of: AsOf
    layer: int
    max_count: Optional[int]
    min_count: int
    n: int
    num_types: int


class NeighborOut(TypedDict):
    cosine: float
    n: Optional[int]
    token: str
    token_id: int


class DimensionToken(TypedDict):
    estimate: float
    n: int
    neighbors: Optional[list[NeighborOut]]
    token: str
    token_id: int


class IntrinsicDimension(TypedDict):
    as_of: AsOf
    collection: str
    dimension: Optional[float]
    highest: list[DimensionToken]
    k: int
    layer: int
    lowest: list[DimensionToken]
    mean: Optional[float]
    median: Optional[float]
    method: Literal['local_pca', 'twonn', 'mle']
    min_count: int
    model: str
    threshold: Optional[float]
    tokens: int
    undefined: int


class Isotropy(TypedDict):
    as_of: AsOf
    effective_rank: Optional[float]
    eigenvalues: Optional[list[float]]
    isoscore: Optional[float]
    layer: int
    mean_cosine: Optional[float]
    n: int
    participation_ratio: Optional[float]
    partition_isotropy: Optional[float]
    partition_isotropy_log10: Optional[float]
    partition_types: Optional[int]
    top_eigenvalue_ratio: Optional[float]
    transform: str
    unavailable: dict[str, str]


class SampleIsotropy(TypedDict):
    isoscore: float
    isoscore_star: float
    layer: int
    n_points: int
    reference: str
    zeta: float


class OutlierDimension(TypedDict):
    dim: int
    mean: float
    ratio: float
    variance: float


class RogueDimension(TypedDict):
    contribution: float
    dim: int
    share: Optional[float]


class Outliers(TypedDict):
    as_of: AsOf
    dimensions: list[OutlierDimension]
    layer: int
    mean_cosine: Optional[float]
    n: int
    rogue: Optional[list[RogueDimension]]
    threshold: float
    transform: str
    unavailable: dict[str, str]


class TokenStats(TypedDict):
    M: float
    Q: float
    V: float
    n: int
    self_similarity: Optional[float]
    token: str
    token_id: int


class TokenPage(TypedDict):
    as_of: AsOf
    layer: int
    next_cursor: Optional[str]
    tokens: list[TokenStats]
    total: int


class TokenDetail(TypedDict):
    M: float
    Q: float
    V: float
    as_of: AsOf
    layer: int
    n: int
    self_similarity: Optional[float]
    token: str
    token_id: int


class Neighbors(TypedDict):
    as_of: AsOf
    candidates: int
    collection: str
    k: int
    layer: int
    min_count: int
    model: str
    n: int
    neighbors: list[NeighborOut]
    token: str
    token_id: int


class LayerOutliers(TypedDict):
    dimensions: list[OutlierDimension]
    layer: int
    n: int


class PersistentDimension(TypedDict):
    dim: int
    layers: list[int]
    num_layers: int


class ModelOutliers(TypedDict):
    as_of: Optional[AsOf]
    layers: list[LayerOutliers]
    persistent: list[PersistentDimension]
    threshold: float
    transform: str


class LayerSimilarity(TypedDict):
    as_of: Optional[AsOf]
    layers: list[int]
    matrix: list[list[Optional[float]]]
    metric: Literal['linear_cka', 'rv']
    n: int


class SpaceOut(TypedDict):
    collection: str
    layer: Union[int, str]
    model: str


class PairAsOf(TypedDict):
    a: AsOf
    b: AsOf


class GlobalScores(TypedDict):
    cka_linear: Optional[float]
    cknna: Optional[float]
    mutual_knn: Optional[float]
    pearson_cosine: Optional[float]
    procrustes_residual: Optional[float]
    unbiased_cka: Optional[float]


class GlobalSimilarity(TypedDict):
    a: SpaceOut
    as_of: PairAsOf
    b: SpaceOut
    baseline: GlobalScores
    chance_mutual_knn: float
    cka_linear: Optional[float]
    cknna: Optional[float]
    k: int
    matched_by: Literal['id', 'string']
    min_count: int
    mutual_knn: Optional[float]
    pairs: int
    pearson_cosine: Optional[float]
    procrustes_residual: Optional[float]
    sampled: bool
    seed: int
    shared_tokens: int
    tokens_used: int
    unbiased_cka: Optional[float]


class LLEResult(TypedDict):
    a: SpaceOut
    as_of: PairAsOf
    b: SpaceOut
    chance_overlap: float
    k: int
    matched_by: Literal['id', 'string']
    min_count: int
    neighbor_overlap: Optional[float]
    own_error: Optional[float]
    own_neighbors_error: Optional[float]
    random_error: Optional[float]
    reg: float
    sampled: bool
    seed: int
    shared_tokens: int
    tokens_used: int
    transfer_error: Optional[float]
    transfer_over_own: Optional[float]
    transfer_over_random: Optional[float]


class JobStatus(TypedDict):
    attempts: int
    collection: str
    created_at: float
    error: Optional[str]
    finished_at: Optional[float]
    job_id: str
    model: str
    progress: float
    started_at: Optional[float]
    status: Literal['queued', 'running', 'done', 'failed']
    texts: int
    tokens: int
    worker: Optional[str]


class JobCreated(TypedDict):
    created: bool
    job_id: str
    status: str


class ModelOut(TypedDict):
    architecture: Optional[str]
    available: bool
    error: Optional[str]
    hidden_size: Optional[int]
    loaded: bool
    max_length: Optional[int]
    name: str
    num_layers: Optional[int]
    source: str
    vocab_size: Optional[int]


class ProbeDimension(TypedDict):
    dim: int
    direction: int
    test_accuracy: float
    threshold: float
    train_accuracy: float
    variance: float
    variance_ratio: Optional[float]


class Accuracy(TypedDict):
    test_accuracy: float
    train_accuracy: Optional[float]


class ProbeResult(TypedDict):
    best_dimension: ProbeDimension
    dimensions: list[ProbeDimension]
    labels: list[str]
    layer: int
    logistic_regression: Accuracy
    majority_baseline: Accuracy
    model: str
    n_test: int
    n_train: int
    pooling: str
    top_k: int


class RandomMapBaseline(TypedDict):
    cosine: Optional[float]
    draws: int
    max_abs: Optional[float]
    mean: Optional[float]
    std: Optional[float]


class ShuffledMapBaseline(TypedDict):
    cosine: Optional[float]
    r2: Optional[float]


class SteeringBaseline(TypedDict):
    random_map: RandomMapBaseline
    shuffled_map: ShuffledMapBaseline


class MapFit(TypedDict):
    held_out: float
    held_out_tokens: int
    mean_baseline_cosine: Optional[float]
    mean_cosine: Optional[float]
    r2: Optional[float]
    ridge: float
    ridge_absolute: float
    train_tokens: int


class SteeringResult(TypedDict):
    a: SpaceOut
    as_of: PairAsOf
    b: SpaceOut
    baseline: Optional[SteeringBaseline]
    cosine: Optional[float]
    map: MapFit
    matched_by: Literal['id', 'string']
    min_count: int
    own_norm: Optional[float]
    sampled: bool
    seed: int
    shared_tokens: int
    source: Literal['vector', 'texts']
    source_norm: float
    tokens_used: int
    vector: Optional[list[float]]
    vector_norm: float
