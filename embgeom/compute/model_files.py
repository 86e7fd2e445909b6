"""A model's folder, configuration and tokenizer, read by a child process.

The API reads them on a model's first request, on its thread pool, but transformers holds
the GIL there in long stretches of C code and garbage collection (``json.load`` of
``tokenizer.json``, twice, then the conversion of its merges), so the event loop waits
too. Longest stall of a thread that ticks every millisecond, measured while another thread
read them: SmolLM2's configuration 170 ms, its tokenizer 230 ms, Gemma 3's tokenizer
1,130 ms; /healthz answered in 815 ms at worst while four token pages first read SmolLM2.

A child process reads them instead, once for every caller, and sends them back pickled.
Unpickling the tokenizer still holds the GIL, less long: about 100 ms for SmolLM2's
(/healthz at most 58 ms behind those four pages), but 1.2 to 1.4 s for Gemma 3's. The child
costs its start (importing transformers, about 3 s), once per model for the life of the
process that asks.

    python -m embgeom.compute.model_files   (the request pickled on stdin, the answer on stdout)
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from embgeom.errors import ModelLoadError
from embgeom.lifetime import spawn
from embgeom.settings import ModelSource

__all__ = ["ModelFiles", "read", "read_in_child", "TIMEOUT_SECONDS"]

# A packaged model is converted into the cache folder on its first read on a machine
# (SmolLM2: 20 s here); a child still busy after this long is stopped.
TIMEOUT_SECONDS = 900.0


@dataclass(frozen=True)
class ModelFiles:
    """What :class:`~embgeom.compute.models.ModelRegistry` keeps of a model before loading
    its weights: its local folder, its :class:`~embgeom.compute.models.ModelInfo`, its
    tokenizer."""

    path: str
    info: object
    tokenizer: object


def read(name: str, source: ModelSource, cache_dir: Path, max_window_tokens: Optional[int]) -> ModelFiles:
    """:class:`ModelFiles` of ``name``, read in this process (what the child runs)."""
    from embgeom.compute.models import ModelRegistry

    registry = ModelRegistry({name: source}, cache_dir, max_window_tokens)
    return ModelFiles(registry.path(name), registry.info(name), registry.tokenizer(name))


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
    return {name: ModelFiles(*value) if kind == "files" else ModelLoadError(name, value)
            for name, (kind, value) in pickle.loads(out).items()}


def _main() -> int:
    answer_to = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything a library prints goes to stderr, not into the answer
    sources, cache_dir, max_window_tokens = pickle.load(sys.stdin.buffer)
    answers = {}
    for name, source in sources.items():
        try:
            files = read(name, source, Path(cache_dir), max_window_tokens)
            # A tuple: this module runs as __main__ here, so its classes would not unpickle.
            answers[name] = ("files", (files.path, files.info, files.tokenizer))
        except ModelLoadError as exc:
            answers[name] = ("error", exc.reason)
        except Exception as exc:  # a broken model of many costs only its own answer
            answers[name] = ("error", f"{type(exc).__name__}: {exc}")
    pickle.dump(answers, answer_to, protocol=pickle.HIGHEST_PROTOCOL)
    answer_to.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
