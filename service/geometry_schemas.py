"""Request and response bodies of the cross-model geometry endpoints (service/routes/geometry.py).

What each number means is in :mod:`embgeom.comparisons` and :mod:`embgeom.geometry`; the field
descriptions here are the short form.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

from embgeom.comparisons import Space
from embgeom.store import keys as K
from service.schemas import MAX_INT, AsOf, RequestBody

MinCount = Annotated[int, Field(ge=1, le=MAX_INT, description="Token types with n_t >= min_count in each space "
                                                  "(a mean of fewer occurrences is mostly one context)")]
Seed = Annotated[int, Field(ge=0, le=MAX_INT, description="Seeds the token sample, the baselines and splits")]
Sample = Annotated[Optional[int], Field(ge=3, le=MAX_INT, description="Use a seeded sample of this many shared "
                                                          "tokens (default: all, up to the service's cap)")]


def _json_integer(value):
    """A JSON integer (``6`` or ``6.0``, as JSON Schema's ``integer``), not a string or a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("layer must be an integer or \"input\"")
    return value


class SpaceIn(RequestBody):
    """A token embedding space: per-token means at a kept layer, or the input embeddings."""

    collection: str = Field(pattern=K.NAME_PATTERN)
    model: str = Field(pattern=K.NAME_PATTERN, description="Model alias")
    layer: Union[Annotated[int, BeforeValidator(_json_integer), Field(ge=0, le=MAX_INT),
                           WithJsonSchema({"type": "integer", "minimum": 0, "maximum": MAX_INT})],
                 Literal["input"]] = Field(
        description="hidden_states index (0 = embedding output), or \"input\": the model's input "
                    "embedding matrix restricted to the collection's tokens")

    def to_space(self) -> Space:
        return Space(self.collection, self.model, self.layer)


class SpaceOut(BaseModel):
    collection: str
    model: str
    layer: Union[int, str]


class PairAsOf(BaseModel):
    a: AsOf
    b: AsOf


class _Compared(BaseModel):
    a: SpaceOut
    b: SpaceOut
    matched_by: Literal["id", "string"] = Field(
        description="id: same vocabulary and key mode; string: canonical token string")
    shared_tokens: int = Field(description="Tokens present (n_t >= min_count) in both spaces")
    tokens_used: int = Field(description="Of those, the ones compared (after sampling)")
    sampled: bool
    min_count: int
    seed: int
    as_of: PairAsOf


# ---------------------------------------------------------------------- global


class GlobalRequest(RequestBody):
    a: SpaceIn
    b: SpaceIn
    min_count: MinCount = 5
    sample: Sample = None
    seed: Seed = 0
    k: int = Field(10, ge=1, le=MAX_INT, description="Neighbours per token (mutual_knn, cknna; "
                                                     "LLE)")


class GlobalScores(BaseModel):
    pearson_cosine: Optional[float] = Field(
        description="Pearson r of cos(a_i, a_j) against cos(b_i, b_j) over all pairs i < j")
    cka_linear: Optional[float] = Field(description="Linear CKA of the centred matrices")
    procrustes_residual: Optional[float] = Field(
        description="min over orthogonal R of ||A_n R - B_n||_F^2 (centred, unit Frobenius "
                    "norm, narrower space zero-padded): 0 = same shape, at most 2")
    unbiased_cka: Optional[float] = Field(
        description="Linear CKA with the debiased HSIC (Song et al. 2012): about 0 for unrelated "
                    "spaces even when tokens are few against dimensions")
    mutual_knn: Optional[float] = Field(
        description="Mean share of each token's k nearest tokens (cosine) common to both spaces "
                    "(Huh et al. 2024)")
    cknna: Optional[float] = Field(
        description="Debiased CKA of the cosine kernels restricted to mutual k-nearest "
                    "neighbours (Huh et al. 2024)")


class GlobalSimilarity(_Compared, GlobalScores):
    pairs: int = Field(description="Cosine pairs compared, m (m - 1) / 2")
    k: int = Field(description="Neighbours per token of mutual_knn and cknna")
    chance_mutual_knn: float = Field(description="k / (m - 1), mutual_knn of unrelated spaces")
    baseline: GlobalScores = Field(description="The same with b's rows shuffled (seeded)")


# ------------------------------------------------------------------------- LLE


class LLERequest(GlobalRequest):
    k: int = Field(10, ge=1, description="Neighbours per token")
    reg: float = Field(1e-3, ge=0, description="LLE regularisation, relative to the local scale")


class LLEResult(_Compared):
    k: int
    reg: float
    transfer_error: Optional[float] = Field(
        description="b's variance left unexplained when each token is rebuilt from its "
                    "k nearest neighbours in a, with a's LLE weights, in b")
    own_error: Optional[float] = Field(description="The same with b's optimal weights (the floor)")
    own_neighbors_error: Optional[float] = Field(description="Plain LLE in b (b's own neighbours)")
    random_error: Optional[float] = Field(description="a's neighbours, random weights (baseline)")
    transfer_over_own: Optional[float]
    transfer_over_random: Optional[float]
    neighbor_overlap: Optional[float] = Field(
        description="Mean share of a token's k nearest neighbours common to both spaces")
    chance_overlap: float = Field(description="k / (m - 1): the overlap of random neighbours")


# --------------------------------------------------------- intrinsic dimension


class NeighborOut(BaseModel):
    token_id: int
    token: str
    n: Optional[int] = None
    cosine: float


class DimensionToken(BaseModel):
    token_id: int
    token: str
    n: int
    estimate: float = Field(description="The token's intrinsic dimension estimate")
    neighbors: Optional[list[NeighborOut]] = Field(
        None, description="Its nearest tokens by cosine (with ?neighbors=)")


class IntrinsicDimension(BaseModel):
    collection: str
    model: str
    layer: int
    method: Literal["local_pca", "twonn", "mle"]
    k: int
    threshold: Optional[float] = Field(description="Variance share (local_pca only)")
    min_count: int
    tokens: int = Field(description="Token types estimated (n_t >= min_count)")
    dimension: Optional[float] = Field(
        description="Global estimate: mean of the local PCA dimensions; TwoNN over all "
                    "tokens; the MacKay-Ghahramani average of the MLE")
    mean: Optional[float] = Field(description="Mean of the per-token estimates")
    median: Optional[float]
    undefined: int = Field(description="Tokens whose estimate is undefined (left out)")
    lowest: list[DimensionToken]
    highest: list[DimensionToken]
    as_of: AsOf


class Neighbors(BaseModel):
    collection: str
    model: str
    layer: int
    token_id: int
    token: str
    n: int
    k: int
    min_count: int
    candidates: int = Field(description="Token types searched (n_t >= min_count, itself excluded)")
    neighbors: list[NeighborOut] = Field(description="By cosine of the means, descending")
    as_of: AsOf


# --------------------------------------------------------------------- Emb2Emb


class SteeringRequest(RequestBody):
    # What the route checks, stated: a vector, or both text sets (non-empty), not both.
    # (null is as good as absent).
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["vector"],
         "properties": {"vector": {"type": "array"}, "positive_texts": {"type": "null"},
                        "negative_texts": {"type": "null"}}},
        {"required": ["positive_texts", "negative_texts"],
         "properties": {"vector": {"type": "null"},
                        "positive_texts": {"type": "array", "minItems": 1},
                        "negative_texts": {"type": "array", "minItems": 1}}},
    ]})

    a: SpaceIn
    b: SpaceIn
    vector: Optional[list[float]] = Field(None, description="A steering vector of a (length d_a)")
    positive_texts: Optional[list[str]] = Field(None, description="Texts of the + side")
    negative_texts: Optional[list[str]] = Field(None, description="Texts of the - side")
    ridge: float = Field(1.0, ge=0, description="Ridge penalty on ||W||_F^2, relative: in units of "
                                                "||A_c||_F^2 / d_a (the mean eigenvalue of a's "
                                                "centred Gram matrix over the tokens used)")
    held_out: float = Field(0.2, gt=0, lt=1, description="Share of shared tokens held out")
    seed: Seed = 0
    min_count: MinCount = 5
    sample: Sample = None
    return_vector: bool = Field(True, description="Include the transferred vector")


class MapFit(BaseModel):
    r2: Optional[float] = Field(description="Held-out share of b's variance explained by a W + c")
    mean_cosine: Optional[float] = Field(description="Held-out mean cosine of prediction and truth")
    mean_baseline_cosine: Optional[float] = Field(
        description="Held-out mean cosine of b's training mean and truth (anisotropy alone)")
    train_tokens: int
    held_out_tokens: int
    ridge: float = Field(description="As requested (relative)")
    ridge_absolute: float = Field(description="The penalty applied: ridge * ||A_c||_F^2 / d_a")
    held_out: float


class RandomMapBaseline(BaseModel):
    cosine: Optional[float] = Field(description="First draw")
    mean: Optional[float]
    std: Optional[float]
    max_abs: Optional[float]
    draws: int


class ShuffledMapBaseline(BaseModel):
    cosine: Optional[float] = Field(description="A map fit on shuffled token pairs")
    r2: Optional[float]


class SteeringBaseline(BaseModel):
    random_map: RandomMapBaseline
    shuffled_map: ShuffledMapBaseline


class SteeringResult(_Compared):
    map: MapFit
    source: Literal["vector", "texts"]
    source_norm: float
    vector_norm: float
    vector: Optional[list[float]] = Field(description="v_a W, the transferred vector (length d_b)")
    cosine: Optional[float] = Field(
        description="Cosine of v_a W with b's own difference of means for the same texts")
    own_norm: Optional[float]
    baseline: Optional[SteeringBaseline] = Field(description="With texts only")
