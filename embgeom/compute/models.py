"""Model registry (aliases), on-demand loading with an LRU bound, and forward passes.

Models are addressed by alias; an alias resolves to a local folder (packaged models are
unpacked or converted once into the cache folder by :mod:`embgeom.sources`). Loading
happens on first use and a bounded LRU keeps the most recently used models.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
# Imported here, once, on the importing thread: transformers' lazy module loading is not
# thread-safe, and the API thread and a worker thread may both reach it first.
from transformers import AutoConfig, AutoModel, AutoTokenizer

from embgeom.errors import ModelLoadError, UnknownModel
from embgeom.compute.positions import PaddedBatch
from embgeom.settings import ModelSource, Settings

log = logging.getLogger(__name__)

__all__ = ["DTYPES", "ModelInfo", "ModelRegistry", "LoadedModel", "ModelPool", "default_device"]

# A tokenizer that declares no limit reports a huge sentinel (int(1e30)).
_NO_LIMIT = 1_000_000


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class ModelInfo:
    name: str
    source: str
    architecture: str
    num_layers: int  # transformer blocks L; hidden_states has L + 1 entries
    hidden_size: int
    vocab_size: int
    max_length: int


class ModelRegistry:
    """Aliases -> sources, resolved lazily to local folders."""

    def __init__(self, sources: dict[str, ModelSource], cache_dir: Path,
                 max_window_tokens: Optional[int] = None):
        self._sources = dict(sources)
        self._cache_dir = Path(cache_dir)
        self._max_window_tokens = max_window_tokens
        self._lock = threading.Lock()
        self._paths: dict[str, str] = {}
        self._infos: dict[str, ModelInfo] = {}
        self._tokenizers: dict[str, object] = {}

    @classmethod
    def from_settings(cls, settings: Settings) -> "ModelRegistry":
        return cls(settings.model_sources(), settings.cache_dir, settings.max_window_tokens)

    def names(self) -> list[str]:
        return sorted(self._sources)

    def source(self, name: str) -> ModelSource:
        try:
            return self._sources[name]
        except KeyError:
            raise UnknownModel(name, self.names()) from None

    def available(self) -> list[str]:
        """Aliases whose files are present (a packaged model whose package is missing
        is configured but not available)."""
        out = []
        for name in self.names():
            try:
                self.path(name)
            except ModelLoadError:
                continue
            out.append(name)
        return out

    def path(self, name: str) -> str:
        """Local folder (or hub id) of an alias, unpacking a packaged model once."""
        spec = self.source(name)
        with self._lock:
            if name in self._paths:
                return self._paths[name]
            try:
                path = _resolve_source(spec.source, self._cache_dir)
            except (FileNotFoundError, ImportError, OSError) as exc:
                raise ModelLoadError(name, str(exc)) from exc
            self._paths[name] = path
            return path

    def info(self, name: str) -> ModelInfo:
        if name in self._infos:
            return self._infos[name]
        spec = self.source(name)
        path = self.path(name)
        try:
            config = AutoConfig.from_pretrained(path, gguf_file=spec.gguf_file) if spec.gguf_file \
                else AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(name, str(exc)) from exc
        tokenizer = self.tokenizer(name)
        info = ModelInfo(
            name=name,
            source=spec.source,
            architecture=(config.architectures or [type(config).__name__])[0],
            num_layers=int(config.num_hidden_layers),
            hidden_size=int(config.hidden_size),
            vocab_size=int(config.vocab_size),
            max_length=self._max_length(config, tokenizer),
        )
        self._infos[name] = info
        return info

    def tokenizer(self, name: str):
        if name not in self._tokenizers:
            spec = self.source(name)
            try:
                kwargs = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
                self._tokenizers[name] = AutoTokenizer.from_pretrained(self.path(name), **kwargs)
            except (OSError, ValueError) as exc:
                raise ModelLoadError(name, str(exc)) from exc
        return self._tokenizers[name]

    def _max_length(self, config, tokenizer) -> int:
        limits = []
        if 0 < getattr(tokenizer, "model_max_length", _NO_LIMIT) < _NO_LIMIT:
            limits.append(int(tokenizer.model_max_length))
        positions = getattr(config, "max_position_embeddings", None)
        if positions:
            # RoBERTa/MPNet reserve padding_idx + 1 positions before the first token.
            offset = (config.pad_token_id + 1) if config.model_type in ("roberta", "mpnet", "xlm-roberta") else 0
            limits.append(int(positions) - offset)
        if self._max_window_tokens:
            limits.append(self._max_window_tokens)
        return min(limits) if limits else 512


def _resolve_source(source: str, cache_dir: Path) -> str:
    if source.startswith("package:"):
        from embgeom import sources

        package = source.split(":", 1)[1]
        finders = {
            "minilm": lambda: sources.minilm_path(),
            "mpnet": lambda: sources.mpnet_path(cache_dir),
            "smollm2": lambda: sources.smollm2_path(cache_dir),
            "gemma3": lambda: sources.gemma3_path(cache_dir),
        }
        if package not in finders:
            raise FileNotFoundError(f"no packaged model named {package!r}")
        return str(finders[package]())
    path = Path(source).expanduser()
    if path.exists() or source.startswith(("/", ".", "~")):
        if not path.exists():
            raise FileNotFoundError(f"model folder {source} does not exist")
        return str(path)
    return source  # a hub id, served from the local Hugging Face cache


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    info: ModelInfo
    tokenizer: object
    model: torch.nn.Module
    device: torch.device
    param_bytes: int
    dtype: str = "fp32"

    @property
    def pad_id(self) -> int:
        return getattr(self.tokenizer, "pad_token_id", None) or 0

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, attention: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Forward one right-padded batch (B, T) already on the model's device.

        Returns L+1 tensors (B, T, d) in the model's dtype, as ``hidden_states`` of
        transformers (0 = embedding output).
        """
        out = self.model(input_ids=input_ids, attention_mask=attention,
                         output_hidden_states=True, return_dict=True)
        return tuple(out.hidden_states)

    def forward_padded(self, batch: PaddedBatch) -> tuple[torch.Tensor, ...]:
        """:meth:`hidden_states` of a :class:`PaddedBatch` given as numpy arrays."""
        return self.hidden_states(torch.from_numpy(batch.input_ids).to(self.device),
                                  torch.from_numpy(batch.attention).to(self.device))


class ModelPool:
    """Models loaded on demand, kept in an LRU bounded by count and parameter memory."""

    def __init__(self, registry: ModelRegistry, device: Optional[str] = None,
                 max_models: int = 2, max_memory_mb: Optional[int] = None, dtype: str = "fp32"):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}")
        self.registry = registry
        self.dtype = dtype
        self.device = torch.device(device or default_device())
        self.max_models = max_models
        self.max_memory_bytes = None if max_memory_mb is None else max_memory_mb * 2**20
        self._models: OrderedDict[str, LoadedModel] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, registry: ModelRegistry, settings: Settings) -> "ModelPool":
        return cls(registry, settings.device, settings.max_loaded_models, settings.max_model_memory_mb,
                   settings.dtype)

    def loaded(self) -> list[str]:
        return list(self._models)

    def get(self, name: str) -> LoadedModel:
        with self._lock:
            if name in self._models:
                self._models.move_to_end(name)
                return self._models[name]
            model = self._load(name)
            self._models[name] = model
            self._evict()
            return model

    def _evict(self) -> None:
        def total():
            return sum(m.param_bytes for m in self._models.values())

        while len(self._models) > self.max_models or (
            self.max_memory_bytes is not None and len(self._models) > 1
            and total() > self.max_memory_bytes
        ):
            name, _ = self._models.popitem(last=False)
            log.info("evicted model %s", name)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _load(self, name: str) -> LoadedModel:
        info = self.registry.info(name)
        spec = self.registry.source(name)
        path = self.registry.path(name)
        kwargs = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
        try:
            model = AutoModel.from_pretrained(path, dtype=DTYPES[self.dtype], **kwargs)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(name, str(exc)) from exc
        model.eval().to(self.device)
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        log.info("loaded model %s from %s on %s in %s (%.0f MB)", name, path, self.device,
                 self.dtype, param_bytes / 2**20)
        return LoadedModel(info, self.registry.tokenizer(name), model, self.device, param_bytes,
                           self.dtype)
