"""A model's folder, configuration and tokenizer read by a child process (the API's
registry, :mod:`embgeom.compute.catalogue`): the same answer as a read in this process,
one child for concurrent first callers and for a listing of every model, and failures, hangs
and unknown names as clear errors with no child left behind."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from embgeom.compute import catalogue
from embgeom.compute.catalogue import ModelRegistry
from embgeom.compute.positions import Vocabulary, token_markers
from embgeom.errors import ModelLoadError, UnknownModel
from embgeom.settings import ModelSource
from tests.conftest import test_settings

TEXT = "Embeddings of MiniLM, tokenised: an unusual-word and 1,234 numbers."


def in_child(**sources: ModelSource) -> ModelRegistry:
    settings = test_settings("redis://unused")
    return ModelRegistry(sources or settings.model_sources(), settings.cache_dir,
                         helper_env=settings.helper_environment())


def reader_children() -> list[int]:
    """Live processes running the child reader (any parent)."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"embgeom.compute.catalogue" in cmd and state != "Z":
            out.append(int(proc.name))
    return out


def test_a_child_reads_what_this_process_reads():
    settings = test_settings("redis://unused")
    here, child = ModelRegistry.from_settings(settings), in_child()
    assert child.info("minilm") == here.info("minilm")
    assert child.path("minilm") == here.path("minilm")
    mine, theirs = here.tokenizer("minilm"), child.vocabulary("minilm")
    assert isinstance(theirs, Vocabulary)  # the token strings, not the tokenizer's model
    ids = list(range(len(mine) + 2))
    assert theirs.convert_ids_to_tokens(ids) == mine.convert_ids_to_tokens(ids)
    assert theirs.get_vocab() == mine.get_vocab() and token_markers(theirs) == token_markers(mine)
    assert child.vocabulary_loaded("minilm") and child.info_loaded("minilm")
    # a model run in the API reads the whole tokenizer, in the API's process
    whole = child.tokenizer("minilm")
    assert whole(TEXT, return_special_tokens_mask=True) == mine(TEXT, return_special_tokens_mask=True)


def test_concurrent_first_reads_start_one_child(monkeypatch):
    calls = []
    real = catalogue.read_in_child

    def counted(sources, *args, **kwargs):
        calls.append(sorted(sources))
        return real(sources, *args, **kwargs)

    monkeypatch.setattr(catalogue, "read_in_child", counted)
    registry = in_child()
    calls_of = (registry.info, registry.vocabulary, registry.path, registry.info)
    got: dict = {}
    readers = [threading.Thread(target=lambda i=i, f=f: got.__setitem__(i, f("minilm")))
               for i, f in enumerate(calls_of)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    assert calls == [["minilm"]]
    assert len(got) == 4 and registry.vocabulary("minilm") is got[1] and got[0] is got[3]
    assert got[2] == registry.path("minilm")


def test_a_listing_reads_every_model_in_one_child(monkeypatch, tmp_path):
    calls = []
    real = catalogue.read_in_child
    monkeypatch.setattr(catalogue, "read_in_child",
                        lambda sources, *a, **k: calls.append(sorted(sources)) or real(sources, *a, **k))
    registry = in_child(minilm=ModelSource(source="package:minilm"),
                        gone=ModelSource(source=str(tmp_path / "missing")))
    infos = registry.infos(["minilm", "gone"])
    assert calls == [["gone", "minilm"]]
    assert infos["minilm"].num_layers == 6 and infos["minilm"].hidden_size == 384
    assert isinstance(infos["gone"], ModelLoadError) and "does not exist" in infos["gone"].message
    # What was read is kept; a failure is not (the folder may appear later).
    registry.infos(["minilm", "gone"])
    assert calls == [["gone", "minilm"], ["gone"]]


def test_a_broken_model_in_a_listing_spoils_only_its_own_answer(tmp_path):
    """A configuration transformers refuses with an error of its own (not an OSError): the
    child answers for the others instead of dying with the listing."""
    broken = tmp_path / "broken"
    broken.mkdir()
    minilm = Path(in_child().path("minilm"))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm / name, broken / name)
    config = json.loads((minilm / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "many"}))
    infos = in_child(minilm=ModelSource(source="package:minilm"),
                     broken=ModelSource(source=str(broken))).infos(["minilm", "broken"])
    assert infos["minilm"].num_layers == 6
    assert isinstance(infos["broken"], ModelLoadError) and "num_hidden_layers" in infos["broken"].message


def test_a_model_that_cannot_be_read_is_a_model_load_error(tmp_path):
    registry = in_child(gone=ModelSource(source=str(tmp_path / "missing")))
    with pytest.raises(ModelLoadError, match="does not exist") as err:
        registry.vocabulary("gone")
    assert err.value.type == "model_unavailable" and not registry.vocabulary_loaded("gone")
    with pytest.raises(UnknownModel):
        registry.info("never-registered")


def test_a_child_past_its_time_is_stopped():
    """The child needs seconds to import transformers: half a second is too little."""
    source = ModelSource(source="package:minilm")
    before = set(reader_children())
    t0 = time.monotonic()
    settings = test_settings("redis://unused")
    got = catalogue.read_in_child({"minilm": source}, settings.cache_dir, None,
                                    settings.helper_environment(), timeout=0.5)
    assert time.monotonic() - t0 < 10
    assert isinstance(got["minilm"], ModelLoadError) and "took over 0.5 s" in got["minilm"].message
    assert set(reader_children()) <= before  # killed and reaped, not left running
