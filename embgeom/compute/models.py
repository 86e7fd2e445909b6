"""Loaded models: on-demand loading with an LRU bound, and forward passes (torch).

Models are addressed by alias; :mod:`embgeom.compute.catalogue` resolves an alias to a
local folder, its configuration and tokenizer. Loading happens on first use and a bounded
LRU keeps the most recently used models. Imported only where a model runs.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional, TypeVar

import torch
# Imported here, once, on the importing thread: transformers' lazy module loading is not
# thread-safe, and the API thread and a worker thread may both reach it first. AutoConfig
# and AutoTokenizer are for the catalogue's reads in this process (a worker's), which
# then find them loaded.
from transformers import AutoConfig, AutoModel, AutoTokenizer  # noqa: F401

from embgeom import heap
from embgeom.compute.catalogue import ModelInfo, ModelRegistry
from embgeom.errors import ModelLoadError
from embgeom.compute.positions import PaddedBatch
from embgeom.settings import Settings

log = logging.getLogger(__name__)

__all__ = ["DTYPES", "LoadedModel", "ModelPool", "default_device"]

E = TypeVar("E")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


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


@dataclass
class _Entry:
    """A loaded model and what is built on it: the pool owns both, so they leave together."""

    model: LoadedModel
    engines: OrderedDict = field(default_factory=OrderedDict)  # key -> engine, LRU


def _return_freed_memory(device: torch.device) -> None:
    """Hand memory freed by a released model back to the system: the CUDA caching
    allocator's blocks, and glibc's free heap pages (without ``malloc_trim`` the RSS of a
    process that loads and frees models in turn only grows)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    heap.trim()


class ModelPool:
    """Models loaded on demand, kept in an LRU bounded by count and parameter memory.

    The pool is the one owner of a loaded model and of the engines built on it
    (:meth:`engine`): evicting the model drops them too, so the bound on models is a bound
    on memory. Whoever holds an engine or a model beyond its use (an open window) delays
    the release until it lets go; :meth:`release_evicted` then returns the memory.
    """

    MAX_ENGINES = 8       # per model: one per counting rule in use (an engine is cheap)
    RELEASE_TRIES = 8     # collections tried before an evicted model is reported as leaked

    def __init__(self, registry: ModelRegistry, device: Optional[str] = None,
                 max_models: int = 2, max_memory_mb: Optional[int] = None, dtype: str = "fp32"):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}")
        self.registry = registry
        self.dtype = dtype
        self.device = torch.device(device or default_device())
        self.max_models = max_models
        self.max_memory_bytes = None if max_memory_mb is None else max_memory_mb * 2**20
        self._models: OrderedDict[str, _Entry] = OrderedDict()
        self._evicted: list[list] = []  # [name, weakref to the LoadedModel, tries left]
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, registry: ModelRegistry, settings: Settings) -> "ModelPool":
        return cls(registry, settings.device, settings.max_loaded_models, settings.max_model_memory_mb,
                   settings.dtype)

    def loaded(self) -> list[str]:
        return list(self._models)

    def get(self, name: str) -> LoadedModel:
        with self._lock:
            return self._entry(name).model

    def engine(self, name: str, key: Hashable, build: Callable[[LoadedModel], E]) -> E:
        """The engine ``build(model)`` of model ``name`` under ``key``, built once and kept
        with the model (the least recently used of more than :attr:`MAX_ENGINES` goes)."""
        with self._lock:
            entry = self._entry(name)
            if key in entry.engines:
                entry.engines.move_to_end(key)
                return entry.engines[key]
            engine = entry.engines[key] = build(entry.model)
            while len(entry.engines) > self.MAX_ENGINES:
                entry.engines.popitem(last=False)
            return engine

    def _entry(self, name: str) -> _Entry:
        """Under the lock: the entry of ``name``, loaded if need be, made most recent."""
        if name in self._models:
            self._models.move_to_end(name)
            return self._models[name]
        entry = self._models[name] = _Entry(self._load(name))
        self._evict()
        return entry

    def _evict(self) -> None:
        def total():
            return sum(e.model.param_bytes for e in self._models.values())

        evicted = False
        while len(self._models) > self.max_models or (
            self.max_memory_bytes is not None and len(self._models) > 1
            and total() > self.max_memory_bytes
        ):
            name, entry = self._models.popitem(last=False)
            self._evicted.append([name, weakref.ref(entry.model), self.RELEASE_TRIES])
            entry.engines.clear()
            del entry
            evicted = True
            log.info("evicted model %s", name)
        if evicted:
            self._release()

    def release_evicted(self) -> None:
        """Return the memory of evicted models nobody uses any more (call when a user of
        one may have let go of it, e.g. a window closed). Cheap when nothing was evicted."""
        with self._lock:
            if self._evicted:
                self._release()

    def _release(self) -> None:
        """Under the lock: hand back the memory of the evicted models now unreferenced.
        A model is freed by reference counting when its last user lets go; a garbage
        collection runs only while one is still referenced (a cycle would keep it), and one
        still referenced after :attr:`RELEASE_TRIES` calls is logged (something keeps it)
        and no longer waited for."""
        if any(ref() is not None for _, ref, _ in self._evicted):
            gc.collect()
        freed, waiting = [], []
        for name, ref, tries in self._evicted:
            if ref() is None:
                freed.append(name)
            elif tries > 1:
                waiting.append([name, ref, tries - 1])
            else:
                log.warning("evicted model %s is still referenced: its memory is not released", name)
        self._evicted = waiting
        if freed:
            _return_freed_memory(self.device)
            log.info("released the memory of %s", ", ".join(freed))

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
        return LoadedModel(info, self.registry.tokenizer(name, keep=False), model, self.device, param_bytes,
                           self.dtype)
