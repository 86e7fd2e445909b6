"""Request and response bodies (pydantic), the API contract of DESIGN.md section 2."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Optional

from fastapi import Query
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from embgeom.store import keys as K


# The 503 of an operation that may run a model in the API process.
MODEL_503 = ("store_unavailable; model_loading: the model was still loading in this process "
             "after model_load_wait_seconds, retry after Retry-After seconds; "
             "model_unavailable: it could not be loaded")


class ErrorBody(BaseModel):
    type: str = Field(description="Stable, machine-readable error type")
    message: str
    detail: dict = Field(default_factory=dict)


# ------------------------------------------------------------------------ input checks
# JSON as Python reads it admits what no statistic can use: NaN, Infinity and 1e999 (inf),
# and "\ud800", a lone UTF-16 surrogate that decodes into a str no tokenizer, Redis or
# UTF-8 encoder accepts. Both are 422 wherever they can enter: every request body derives
# from RequestBody, which refuses them anywhere inside it (nested models, lists, dict keys
# included); query floats use FiniteQuery. (Query strings and paths cannot carry a lone
# surrogate: they are percent-decoded as UTF-8 with replacement.)


def _at(path: list) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p.encode('utf-8', 'backslashreplace').decode()}"
                   for p in path).lstrip(".") or "value"


def _problem(item: Any) -> Optional[str]:
    """``lone_surrogate`` or ``finite_number`` when ``item`` itself (not what it holds) is one."""
    if isinstance(item, str):
        if not item.isascii():
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return "lone_surrogate"
    elif isinstance(item, float) and not math.isfinite(item):
        return "finite_number"
    return None


def _walk(value: Any, with_paths: bool):
    """Every value inside decoded JSON ``value`` (dict keys included), with its path when
    asked (the paths are built only to report a problem: the usual walk is path-free)."""
    stack = [(value, [])]
    while stack:
        item, path = stack.pop()
        yield item, path
        if isinstance(item, dict):
            for k, v in item.items():
                stack.append((k, path + [k] if with_paths else path))
                stack.append((v, path + [k] if with_paths else path))
        elif isinstance(item, (list, tuple)):
            stack.extend((v, path + [i] if with_paths else path) for i, v in enumerate(item))


MESSAGES = {"lone_surrogate": "{where}: text is not valid Unicode (a lone surrogate)",
            "finite_number": "{where}: the number must be finite"}


def refuse_unusable(value: Any) -> None:
    """Raise a pydantic error (``finite_number`` or ``lone_surrogate``) at a non-finite
    number or a lone surrogate anywhere in decoded JSON ``value``."""
    for item, _ in _walk(value, False):
        if _problem(item) is not None:
            break
    else:
        return
    for item, path in _walk(value, True):
        kind = _problem(item)
        if kind is not None:
            raise PydanticCustomError(kind, MESSAGES[kind], {"where": _at(path)})


def _valid_text(text: str) -> str:
    refuse_unusable(text)
    return text


# A text field: valid Unicode (for a str a model builds outside a request body).
Text = Annotated[str, AfterValidator(_valid_text)]
# A number field: finite (NaN, inf and 1e999 are 422).
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
# The largest integer a count or an id may take: exact as a JSON number in every client
# (2^53 - 1), and within the 64 bits the response encoder writes. Beyond, 422.
MAX_INT = 2**53 - 1


# Constraints the document states for checks a route makes itself, with its own error type
# (invalid_collection_name, invalid_format, unknown_figure, ...): a generator reading the
# document then sends what the route accepts, and the error types stay what they were.
NAME_SCHEMA = {"pattern": K.NAME_PATTERN}
TRANSFORM_PATTERN = r"^\s*(?i:none|standardize|abtt:[0-9]+)\s*$"
# A text with something in it: what str.strip() does not remove (Python's whitespace).
NON_BLANK = r"[^\s\x1c-\x1f]"


def documented(**schema: Any) -> dict:
    """``json_schema_extra`` for a parameter whose route checks ``schema`` itself."""
    return {"json_schema_extra": schema}


def FiniteQuery(**kwargs: Any):
    """``Query(...)`` for a float (in ``Annotated``): NaN, inf and 1e999 are 422."""
    return Query(allow_inf_nan=False, **kwargs)


class RequestBody(BaseModel):
    """Base of every request body: unknown fields, non-finite numbers and lone surrogates
    are 422, at any depth."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _usable(cls, data: Any) -> Any:
        refuse_unusable(data)
        return data


class AsOf(BaseModel):
    version: int = Field(description="Checkpoints completed when the data were read")
    updated_at: Optional[float] = Field(description="Unix time of the last one")
    applying: int = Field(0, description="Checkpoints being applied while the data were read: "
                                         "parts read may or may not hold them yet")


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    status: str
    redis: bool
    workers: int
    embedded: bool


class ModelOut(BaseModel):
    name: str
    source: str
    architecture: Optional[str]
    num_layers: Optional[int]
    hidden_size: Optional[int]
    vocab_size: Optional[int]
    max_length: Optional[int] = None
    loaded: bool
    available: bool = True
    error: Optional[str] = None


class JobCreate(RequestBody):
    collection: str = Field("default", pattern=K.NAME_PATTERN)
    model: str = Field("minilm", pattern=K.NAME_PATTERN)
    texts: list[Annotated[str, Field(pattern=NON_BLANK)]] = Field(min_length=1)
    include_special: Optional[bool] = Field(
        None, description="Also count the special tokens the tokenizer adds ([CLS], [SEP], BOS, ...). "
                          "A collection's setting: it creates a new collection with it, and must "
                          "agree with an existing one's (409 collection_settings_conflict)")

    @field_validator("texts")
    @classmethod
    def _non_empty(cls, texts: list[str]) -> list[str]:
        for i, t in enumerate(texts):
            if not t.strip():
                raise ValueError(f"text {i} is empty")
        return texts


class JobCreated(BaseModel):
    job_id: str
    status: str
    created: bool = Field(True, description="False when an Idempotency-Key named an existing job")


class JobStatus(BaseModel):
    job_id: str
    status: Literal["queued", "running", "done", "failed"]
    collection: str
    model: str
    texts: int
    tokens: int
    progress: float
    error: Optional[str]
    attempts: int
    worker: Optional[str]
    created_at: float
    started_at: Optional[float]
    finished_at: Optional[float]


class CollectionOut(BaseModel):
    name: str
    models: list[str]


class CollectionSettingsIn(RequestBody):
    """Either a preset, or explicit settings (unset fields take the defaults)."""

    preset: Optional[Literal["paper"]] = Field(
        None, description="paper: key by token string with subword markers stripped, special "
                          "tokens counted (Yamagiwa & Shimodaira's released code)")
    key: Literal["id", "string"] = "id"
    unit: Literal["token", "word"] = "token"
    include_special: bool = False
    layers: Optional[list[Annotated[int, Field(ge=0, le=MAX_INT)]]] = Field(
        None, min_length=1, description="hidden_states indices to keep (0 = embedding output); null keeps all")
    self_similarity: bool = Field(
        True, description="Keep per-token unit-vector sums (half of the per-token bytes)")
    cross_layer: bool = Field(
        False, description="Keep the co-moment of all kept layers concatenated: the exact "
                           "layer-by-layer CKA (.../similarity); L d x L d floats per pair")


class CollectionSettingsOut(BaseModel):
    key: str
    unit: str
    include_special: bool
    layers: Optional[list[int]]
    self_similarity: bool
    preset: Optional[str]
    cross_layer: bool = False


class CollectionInfo(BaseModel):
    name: str
    settings: Optional[CollectionSettingsOut]
    models: list[str]
    created: Optional[bool] = None


class Deleted(BaseModel):
    deleted: str
    models: list[str]


class DecompositionFields(BaseModel):
    layer: int
    n: int
    num_types: int
    Q: Optional[float]
    M: Optional[float]
    V: Optional[float]
    V_W: Optional[float]
    V_B: Optional[float]
    V_B_error: Optional[float] = Field(
        None, description="Bound on the rounding error of V_B (absolute): V_B is a difference "
                          "that cancels when the token types' means nearly coincide; it is "
                          "not clamped, so a |V_B| under V_B_error is 0 within rounding")
    min_count: int = 1
    max_count: Optional[int] = None


class Decomposition(DecompositionFields):
    as_of: AsOf


class LayerRow(DecompositionFields):
    model_config = ConfigDict(populate_by_name=True)

    cv_Q: Optional[float]
    slope: Optional[float]
    intercept: Optional[float]
    r2: Optional[float]
    slope_Q_log10n: Optional[float]
    slope_M_log10n: Optional[float]
    slope_V_log10n: Optional[float]
    M_over_Q: Optional[float] = Field(alias="M/Q")
    V_W_over_Q: Optional[float] = Field(alias="V_W/Q")
    V_B_over_Q: Optional[float] = Field(alias="V_B/Q")
    V_W_over_V: Optional[float] = Field(alias="V_W/V")


class LayersOut(BaseModel):
    collection: str
    model: str
    min_count: int
    max_count: Optional[int]
    layers: list[LayerRow]
    as_of: AsOf


class TokenStats(BaseModel):
    token_id: int
    token: str
    n: int
    Q: float
    M: float
    V: float
    self_similarity: Optional[float] = Field(
        None, description="Mean cosine between distinct occurrences (Ethayarajh 2019); null if n < 2")


class TokenDetail(TokenStats):
    layer: int
    as_of: AsOf


class TokenPage(BaseModel):
    layer: int
    tokens: list[TokenStats]
    next_cursor: Optional[str]
    total: int
    as_of: AsOf


class Isotropy(BaseModel):
    layer: int
    transform: str
    n: int
    isoscore: Optional[float] = Field(description="IsoScore (Rudman et al. 2022) over all embeddings")
    mean_cosine: Optional[float] = Field(description="Exact mean cosine over all distinct pairs")
    effective_rank: Optional[float] = Field(description="Roy & Vetterli 2007")
    participation_ratio: Optional[float]
    top_eigenvalue_ratio: Optional[float]
    partition_isotropy: Optional[float] = Field(description="I(W) of Mu & Viswanath on per-token means")
    partition_isotropy_log10: Optional[float] = Field(
        None, description="log10 I(W); finite where I(W) underflows to 0")
    partition_types: Optional[int] = None
    eigenvalues: Optional[list[float]] = None
    unavailable: dict[str, str] = Field(default_factory=dict,
                                        description="Measures not determined under this transform")
    as_of: AsOf


class OutlierDimension(BaseModel):
    dim: int
    variance: float
    ratio: float
    mean: float


class RogueDimension(BaseModel):
    dim: int
    contribution: float = Field(description="CC_i, this dimension's share of the mean cosine")
    share: Optional[float]


class Outliers(BaseModel):
    layer: int
    threshold: float
    transform: str
    n: int
    dimensions: list[OutlierDimension]
    rogue: Optional[list[RogueDimension]]
    mean_cosine: Optional[float]
    unavailable: dict[str, str] = Field(default_factory=dict)
    as_of: AsOf


class LayerOutliers(BaseModel):
    layer: int
    n: int
    dimensions: list[OutlierDimension]


class PersistentDimension(BaseModel):
    dim: int
    layers: list[int]
    num_layers: int


class ModelOutliers(BaseModel):
    threshold: float
    transform: str
    layers: list[LayerOutliers]
    persistent: list[PersistentDimension]
    as_of: Optional[AsOf]


class LayerSimilarity(BaseModel):
    metric: Literal["linear_cka", "rv"]
    layers: list[int] = Field(description="hidden_states indices, the rows and columns of matrix")
    matrix: list[list[Optional[float]]] = Field(
        description="matrix[i][j] = ||C_ij||_F^2 / (||C_ii||_F ||C_jj||_F), C_ij the centred "
                    "cross-moment of layers i and j over every occurrence (rv: the same number)")
    n: int = Field(description="Occurrences counted (embeddings per layer)")
    as_of: Optional[AsOf]


class SampleRequest(RequestBody):
    texts: list[str] = Field(min_length=1)
    zeta: float = Field(0.2, ge=0.0, le=1.0, description="Shrinkage weight of the reference")
    reference: Literal["collection", "identity"] = "collection"
    include_special: bool = False


class SampleIsotropy(BaseModel):
    layer: int
    n_points: int
    zeta: float
    reference: str
    isoscore: float
    isoscore_star: float


class ProbeRequest(RequestBody):
    model: str = Field("minilm", pattern=K.NAME_PATTERN)
    layer: int = Field(ge=0)
    texts: list[str] = Field(min_length=4)
    labels: list[str | int] = Field(min_length=4, description="Two distinct values")
    pooling: Literal["cls", "mean", "last"] = "mean"
    test_fraction: float = Field(0.3, gt=0.0, lt=1.0)
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed of the train/test split")
    top_k: int = Field(10, ge=1, le=4096)
    include_special: bool = False


class ProbeDimension(BaseModel):
    dim: int
    variance: float
    variance_ratio: Optional[float]
    threshold: float
    direction: int
    train_accuracy: float
    test_accuracy: float


class Accuracy(BaseModel):
    train_accuracy: Optional[float] = None
    test_accuracy: float


class ProbeResult(BaseModel):
    model: str
    layer: int
    pooling: str
    labels: list[str]
    n_train: int
    n_test: int
    top_k: int
    dimensions: list[ProbeDimension]
    best_dimension: ProbeDimension
    logistic_regression: Accuracy
    majority_baseline: Accuracy
