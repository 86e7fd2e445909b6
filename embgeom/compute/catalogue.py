"""The model catalogue: aliases and their sources, and what is known of a model before its
weights load (its local folder, :class:`ModelInfo`, its tokenizer or what reads need of
it, a :class:`~embgeom.compute.positions.Vocabulary`). No torch here, and
transformers only where a model's files are read in this process: the API imports this
module and reads the files in a child.

Why a child. The API reads a model's files on its first request, on its thread pool, but
transformers holds the GIL there in long stretches of C code and garbage collection
(``json.load`` of ``tokenizer.json``, twice, then the conversion of its merges), so the
event loop, ``/healthz`` included, waits as long as the read: a large part of a second
for a tokenizer, longer the larger its vocabulary.

A child process reads them instead, once for every caller, and sends back the folder, the
:class:`ModelInfo` and the vocabulary (token strings and subword markers), pickled: the
API shows tokens, it never tokenizes text for a read, and a tokenizer's model is large
(Gemma 3's: hundreds of MB in the process that holds it, its vocabulary a few dozen). The
child costs its start (importing transformers), once per model for the life of the
process that asks. A model run in the API (a probe) reads the whole tokenizer in-process.

    python -m embgeom.compute.catalogue   (the request pickled on stdin, the answer on stdout)
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from embgeom.errors import ModelLoadError, UnknownModel
from embgeom.lifetime import spawn
from embgeom.settings import ModelSource, Settings

__all__ = ["ModelInfo", "ModelRegistry", "ModelFiles", "read", "read_in_child", "TIMEOUT_SECONDS"]

# A packaged model is converted into the cache folder on its first read on a machine
# (tens of seconds for SmolLM2's GGUF); a child still busy after this long is stopped.
TIMEOUT_SECONDS = 900.0

# A tokenizer that declares no limit reports a huge sentinel (int(1e30)).
_NO_LIMIT = 1_000_000


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

    ``helper_env``: read a model's folder, configuration and vocabulary in a child process
    with this environment (the API, whose event loop would otherwise wait while
    transformers holds the GIL), once per model, and keep all three. None reads them in
    this process (a worker, which tokenizes anyway).
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
        self._vocabularies: dict[str, object] = {}

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
        from transformers import AutoConfig  # here: the API reads in a child, never imports it

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

    def vocabulary(self, name: str):
        """What reads need of ``name``'s tokenizer (token strings, markers), kept for the
        registry's life (the API shows tokens of every model it reads). Read in a child
        (``helper_env``): a :class:`~embgeom.compute.positions.Vocabulary`, a list where the
        tokenizer holds its whole model (Gemma 3's: hundreds of MB); else the tokenizer."""
        cached = self._vocabularies.get(name)
        if cached is not None:
            return cached
        if self._helper_env is not None:
            return self._one_from_child(name).vocabulary
        return self._vocabularies.setdefault(name, self.tokenizer(name))

    def tokenizer(self, name: str, keep: bool = True):
        """``name``'s tokenizer, read in this process (a model run needs the whole of it;
        reads need only :meth:`vocabulary`). ``keep``: cached for the registry's life.
        Without it, the cached one if there is one, else a fresh one the caller owns: a
        worker's tokenizers belong to its loaded models and leave with them, not to a cache
        that would keep every model the worker ever touched."""
        cached = self._tokenizers.get(name)
        if cached is not None:
            return cached
        from transformers import AutoTokenizer  # here: the API reads in a child, never imports it

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

    def _one_from_child(self, name: str) -> ModelFiles:
        got = self._files_from_child([name])[name]
        if isinstance(got, ModelLoadError):
            raise got
        return got

    def _files_from_child(self, names: Sequence[str]) -> dict[str, ModelFiles | ModelLoadError]:
        """The files of ``names``: those not read yet read by one child process (callers
        that want them meanwhile wait for its answer) and kept; a failure is not kept."""
        sources = {name: self.source(name) for name in sorted(set(names))}  # UnknownModel first
        with self._lock:
            locks = [self._reading.setdefault(name, threading.Lock()) for name in sources]
        with contextlib.ExitStack() as held:
            for lock in locks:  # in name order, so two callers cannot deadlock
                held.enter_context(lock)
            unread = {name: source for name, source in sources.items()
                      if not (name in self._infos and name in self._vocabularies and name in self._paths)}
            answers = read_in_child(unread, self._cache_dir, self._max_window_tokens,
                                                self._helper_env) if unread else {}
            for name, got in answers.items():
                if isinstance(got, ModelFiles):
                    self._paths[name] = got.path
                    self._vocabularies[name] = got.vocabulary
                    self._infos[name] = got.info  # last: info_loaded() means all three are here
        return {name: answers[name] if name in answers else
                ModelFiles(self._paths[name], self._infos[name], self._vocabularies[name])
                for name in names}

    def vocabulary_loaded(self, name: str) -> bool:
        """Whether :meth:`vocabulary` has ``name``'s cached (then it answers at once)."""
        return name in self._vocabularies

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


@dataclass(frozen=True)
class ModelFiles:
    """What :class:`ModelRegistry` keeps of a model before loading its weights: its local
    folder, its :class:`ModelInfo`, its :class:`~embgeom.compute.positions.Vocabulary`."""

    path: str
    info: object
    vocabulary: object


def read(name: str, source: ModelSource, cache_dir: Path, max_window_tokens: Optional[int]) -> ModelFiles:
    """:class:`ModelFiles` of ``name``, read in this process (what the child runs)."""
    from embgeom.compute.positions import Vocabulary

    registry = ModelRegistry({name: source}, cache_dir, max_window_tokens)
    return ModelFiles(registry.path(name), registry.info(name), Vocabulary.of(registry.tokenizer(name)))


def read_in_child(sources: dict[str, ModelSource], cache_dir: Path, max_window_tokens: Optional[int],
                  env: dict[str, str], timeout: float = TIMEOUT_SECONDS) -> dict[str, ModelFiles | ModelLoadError]:
    """:func:`read` of each model of ``sources`` (alias -> source), all in one child process
    with environment ``env`` (killed with this process, or after ``timeout`` seconds): its
    :class:`ModelFiles`, or the :class:`ModelLoadError` that says why it could not be read."""
    request = pickle.dumps((sources, str(cache_dir), max_window_tokens))
    child = spawn([sys.executable, "-m", __name__], death_signal=signal.SIGKILL, env=env,
                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = child.communicate(request, timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        reason = f"reading its configuration and tokenizer took over {timeout:g} s"
        return {name: ModelLoadError(name, reason) for name in sources}
    if child.returncode != 0 or not out:
        tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit status {child.returncode}"]
        return {name: ModelLoadError(name, f"the process reading its files failed: {tail[0]}") for name in sources}
    return {name: value if kind == "files" else ModelLoadError(name, value)
            for name, (kind, value) in pickle.loads(out).items()}


def _main() -> int:
    answer_to = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything a library prints goes to stderr, not into the answer
    sources, cache_dir, max_window_tokens = pickle.load(sys.stdin.buffer)
    answers = {}
    for name, source in sources.items():
        try:
            files = read(name, source, Path(cache_dir), max_window_tokens)
            answers[name] = ("files", files)
        except ModelLoadError as exc:
            answers[name] = ("error", exc.reason)
        except Exception as exc:  # a broken model of many costs only its own answer
            answers[name] = ("error", f"{type(exc).__name__}: {exc}")
    pickle.dump(answers, answer_to, protocol=pickle.HIGHEST_PROTOCOL)
    answer_to.flush()
    return 0


if __name__ == "__main__":
    # The module's own copy, not __main__'s: the classes of an answer must unpickle in
    # the parent under their real name (embgeom.compute.catalogue.ModelInfo).
    from embgeom.compute.catalogue import _main as main

    sys.exit(main())
