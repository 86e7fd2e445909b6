"""Request and response bodies (pydantic), the API contract of DESIGN.md section 2."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from embgeom import keys as K


class ErrorBody(BaseModel):
    type: str = Field(description="Stable, machine-readable error type")
    message: str
    detail: dict = Field(default_factory=dict)


class AsOf(BaseModel):
    version: int = Field(description="Commit sequence number of the snapshot read")
    updated_at: Optional[float] = Field(description="Unix time of that commit")


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


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    collection: str = Field("default", pattern=K.NAME_PATTERN)
    model: str = Field("minilm", pattern=K.NAME_PATTERN)
    texts: list[str] = Field(min_length=1)
    include_special: bool = Field(
        False, description="Also count the special tokens the tokenizer adds ([CLS], [SEP], BOS, ...)")

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
    include_special: bool
    created_at: float
    started_at: Optional[float]
    finished_at: Optional[float]


class CollectionOut(BaseModel):
    name: str
    models: list[str]


class Deleted(BaseModel):
    deleted: str
    models: list[str]


class Decomposition(BaseModel):
    layer: int
    n: int
    num_types: int
    Q: Optional[float]
    M: Optional[float]
    V: Optional[float]
    V_W: Optional[float]
    V_B: Optional[float]
    min_count: int = 1
    max_count: Optional[int] = None
    as_of: Optional[AsOf] = None


class LayerRow(Decomposition):
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
