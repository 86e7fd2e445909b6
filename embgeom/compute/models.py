"""Model registry (aliases), on-demand loading with an LRU bound, and forward passes.

Models are addressed by alias; an alias resolves to a local folder (packaged models are
unpacked or converted once into the cache folder by :mod:`embgeom.sources`). Loading
happens on first use and a bounded LRU keeps the most recently used models.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Hashable, Optional, Sequence, TypeVar

import torch
# Imported here, once, on the importing thread: transformers' lazy module loading is not
# thread-safe, and the API thread and a worker thread may both reach it first.
from transformers import AutoConfig, AutoModel, AutoTokenizer

from embgeom import heap
from embgeom.compute import model_files
from embgeom.errors import ModelLoadError, UnknownModel
from embgeom.compute.positions import PaddedBatch
from embgeom.settings import ModelSource, Settings

log = logging.getLogger(__name__)

__all__ = ["DTYPES", "ModelInfo", "ModelRegistry", "LoadedModel", "ModelPool", "default_device"]

E = TypeVar("E")

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
    tokenizer_size: int  # len(tokenizer): the vocabulary with added tokens, what ids range over


class ModelRegistry:
    """Aliases -> sources, resolved lazily to local folders.

    ``helper_env``: read a model's folder, configuration and tokenizer in a child process
    with this environment (:mod:`embgeom.compute.model_files`: the API, whose event loop
    would otherwise wait while transformers holds the GIL), once per model, and keep all
    three. None reads them in this process (a worker, which tokenizes anyway).
    """

    def __init__(self, sources: dict[str, ModelSource], cache_dir: Path,
                 max_window_tokens: Optional[int] = None, helper_env: Optional[dict[str, str]] = None):
        self._sources = dict(sources)
        self._cache_dir = Path(cache_dir)
        self._max_window_tokens = max_window_tokens
        self._helper_env = helper_env
        self._lock = threading.Lock()
        self._reading: dict[str, threading.Lock] = {}  # per model: one child reads its files
        self._paths: dict[str, str] = {}
        self._infos: dict[str, ModelInfo] = {}
        self._tokenizers: dict[str, object] = {}

    @classmethod
    def from_settings(cls, settings: Settings, files_in_child: bool = False) -> "ModelRegistry":
        return cls(settings.model_sources(), settings.cache_dir, settings.max_window_tokens,
                   settings.helper_environment() if files_in_child else None)

    def names(self) -> list[str]:
        return sorted(self._sources)

    def source(self, name: str) -> ModelSource:
        try:
            return self._sources[name]
        except KeyError:
            raise UnknownModel(name, self.names()) from None

    def path(self, name: str) -> str:
        """Local folder (or hub id) of an alias, unpacking a packaged model once."""
        spec = self.source(name)
        if self._helper_env is not None and name not in self._paths:
            return self._one_from_child(name).path
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
        if self._helper_env is not None:
            return self._one_from_child(name).info
        spec = self.source(name)
        path = self.path(name)
        try:
            config = AutoConfig.from_pretrained(path, gguf_file=spec.gguf_file) if spec.gguf_file \
                else AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(name, str(exc)) from exc
        tokenizer = self.tokenizer(name, keep=False)
        info = ModelInfo(
            name=name,
            source=spec.source,
            architecture=(config.architectures or [type(config).__name__])[0],
            num_layers=int(config.num_hidden_layers),
            hidden_size=int(config.hidden_size),
            vocab_size=int(config.vocab_size),
            max_length=self._max_length(config, tokenizer),
            tokenizer_size=len(tokenizer),
        )
        self._infos[name] = info
        return info

    def tokenizer(self, name: str, keep: bool = True):
        """``name``'s tokenizer. ``keep``: cached for the registry's life (the API decodes
        tokens of every model it reads; at most one per registered model). Without it, the
        cached one if there is one, else a fresh one the caller owns: a worker's
        tokenizers belong to its loaded models and leave with them (Gemma 3's holds about
        300 MB), not to a cache that would keep every model the worker ever touched.
        Read in a child (``helper_env``), it is always kept."""
        cached = self._tokenizers.get(name)
        if cached is not None:
            return cached
        if self._helper_env is not None:
            return self._one_from_child(name).tokenizer
        spec = self.source(name)
        try:
            kwargs = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
            tokenizer = AutoTokenizer.from_pretrained(self.path(name), **kwargs)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(name, str(exc)) from exc
        if keep:
            tokenizer = self._tokenizers.setdefault(name, tokenizer)
        return tokenizer

    def infos(self, names: Sequence[str]) -> dict[str, ModelInfo | ModelLoadError]:
        """:meth:`info` of each of ``names``, or the error that says why it could not be
        read; read in a child, the models not read yet are read by one child together."""
        if self._helper_env is not None:
            return {name: got if isinstance(got, ModelLoadError) else got.info
                    for name, got in self._files_from_child(names).items()}
        out: dict[str, ModelInfo | ModelLoadError] = {}
        for name in names:
            try:
                out[name] = self.info(name)
            except ModelLoadError as exc:
                out[name] = exc
        return out

    def _one_from_child(self, name: str) -> model_files.ModelFiles:
        got = self._files_from_child([name])[name]
        if isinstance(got, ModelLoadError):
            raise got
        return got

    def _files_from_child(self, names: Sequence[str]) -> dict[str, model_files.ModelFiles | ModelLoadError]:
        """The files of ``names``: those not read yet read by one child process (callers
        that want them meanwhile wait for its answer) and kept; a failure is not kept."""
        sources = {name: self.source(name) for name in sorted(set(names))}  # UnknownModel first
        with self._lock:
            locks = [self._reading.setdefault(name, threading.Lock()) for name in sources]
        with contextlib.ExitStack() as held:
            for lock in locks:  # in name order, so two callers cannot deadlock
                held.enter_context(lock)
            unread = {name: source for name, source in sources.items()
                      if not (name in self._infos and name in self._tokenizers and name in self._paths)}
            answers = model_files.read_in_child(unread, self._cache_dir, self._max_window_tokens,
                                                self._helper_env) if unread else {}
            for name, got in answers.items():
                if isinstance(got, model_files.ModelFiles):
                    self._paths[name] = got.path
                    self._tokenizers[name] = got.tokenizer
                    self._infos[name] = got.info  # last: info_loaded() means all three are here
        return {name: answers[name] if name in answers else
                model_files.ModelFiles(self._paths[name], self._infos[name], self._tokenizers[name])
                for name in names}

    def tokenizer_loaded(self, name: str) -> bool:
        """Whether :meth:`tokenizer` has ``name``'s cached (then it answers at once)."""
        return name in self._tokenizers

    def info_loaded(self, name: str) -> bool:
        """Whether :meth:`info` has ``name``'s cached (then it answers at once)."""
        return name in self._infos

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
