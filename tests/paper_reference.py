"""A float64 test reference that follows the paper's released code in its definitions.

Yamagiwa & Shimodaira, "Norm of Mean Contextualized Embeddings Determines their Variance"
(COLING 2025), code at https://github.com/ymgw55/Norm-and-Variance. Every definition below
was read from that repository (``src/*`` at commit 63e7b18c7a07564786d01470a48962c32275bfbc,
``requirements.txt`` at 039fd178aeda6195a4891e299d636fdb10f20a01) and is cited as
``file:line`` with these files under ``src/``: save_token_stats.py, utils.py,
Fig4...py = Fig4_make_QXtCV_MXtVXtSlope_MXtVXtR2_plot.py, Fig5...py =
Fig5_make_MXVwXVbX_per_QX_bargraph.py, Fig6...py = Fig6_make_VwX_per_VX_plot.py, Fig7...py =
Fig7_make_BERTbase_QXt_MXt_VXt_scatterplot.py, Appendix_Fig17...py =
Appendix_Fig17_make_Slope_of_QXt_MXt_VXt_plot.py, Appendix_J_save_word_stats.py,
Appendix_J_save_word2token_count.py. None of their code is used; this is our own float64
code, written to return what their scripts would return in exact arithmetic.

What we keep from them (the definitions)
    * token key: the token string with the WordPiece ``##`` or byte-level ``Ġ`` prefix
      stripped (save_token_stats.py:139-146), so ``play`` and ``##play`` are one key;
    * the model input: ``[bos] + tokenizer.tokenize(text) + [eos]`` with bos/eos =
      [CLS]/[SEP] for BERT and <s>/</s> or <|endoftext|> otherwise (save_token_stats.py:22-49),
      every position counted, the two added special tokens included, under their own
      strings ``"[CLS]"``, ``"[SEP]"`` (save_token_stats.py:132-161);
    * no truncation: texts are never cut; the paper only keeps sentences of fewer than 64
      space-separated words (utils.py:56), see :func:`paper_select_sentences`;
    * per key: ``Q = mean ||x||^2``, ``M = ||mean x||^2``, ``V = Q - M`` (save_token_stats.py:148-161);
    * the filter ``1 <= log10(n_t) <= 5``, i.e. 10 <= n_t <= 100000 inclusive (Fig4...py:63,71);
    * the per-layer summary: C.V. of Q with the population std (Fig4...py:77), OLS of V on M
      with intercept and R^2 = 1 - SS_res/SS_tot (sklearn ``LinearRegression`` + ``score``,
      Fig4...py:81-89), the weighted decomposition with ``V = Q - M`` and ``V_B = V - V_W``
      (Fig5...py:61-90, Fig6...py:84), the slopes on ``log10 n_t`` (Fig7...py:59-87) and of
      ``log10(1 + .)`` on ``log10 n_t`` (Appendix_Fig17...py:64-88);
    * the "word" unit of Appendix J: words from ``gensim.utils.simple_preprocess(text,
      min_len=2)``, each word tokenized on its own, the model fed ``[CLS] + tokens of every
      word + [SEP]``, a word's embedding the mean of its subword states
      (Appendix_J_save_word_stats.py:28-51,137-139).

What we change (the numerics)
    * the model runs one text at a time (they batch with right padding, which changes
      float32 hidden states only in the last bits);
    * statistics are two-pass in float64 over the hidden states (cast from the float32
      forward, exactly); they accumulate a float32 running mean and take ``V = q - m``
      (save_token_stats.py:150-156), which :func:`paper_running_update` reproduces so a
      test can show how much precision it loses.

Keys may be the paper's strings (``key="paper"``) or vocabulary ids (``key="id"``), and the
added special tokens may be dropped (``include_special=False``): with both, the token unit
counts exactly what ``embgeom/testing/reference.py`` and the service count by default.
"""

from __future__ import annotations

import json
import math
import re
import weakref
from dataclasses import dataclass, field
from typing import Hashable, Literal, Sequence

import numpy as np
import torch

__all__ = [
    "PAPER_MIN_COUNT",
    "PAPER_MAX_COUNT",
    "PAPER_MAX_WORDS",
    "paper_key",
    "marker_scheme",
    "paper_select_sentences",
    "paper_words",
    "paper_inputs",
    "collect_states",
    "key_stats",
    "passes_filter",
    "ols",
    "layer_summary",
    "stats_from_states",
    "paper_stats",
    "paper_running_update",
    "LayerStats",
    "Collected",
    "PaperInput",
]

# Fig4_make_QXtCV_MXtVXtSlope_MXtVXtR2_plot.py:71 (and Fig2, Fig5:69, Fig6:67, Fig7:76,
# Appendix_Fig17:79): ``1 <= log10(n_t) <= 5``, both ends inclusive.
PAPER_MIN_COUNT = 10
PAPER_MAX_COUNT = 100_000
# save_token_stats.py:71 ``max_len = 64`` -> utils.py:56 keeps ``len(text.split(' ')) < 64``.
PAPER_MAX_WORDS = 64

Unit = Literal["token", "word"]
KeyKind = Literal["paper", "id"]
Scheme = Literal["auto", "wordpiece", "bytelevel", "sentencepiece", "none"]


# --------------------------------------------------------------------------- keys


def paper_key(token: str, scheme: Scheme = "auto") -> str:
    """The key the paper counts a token string under: its subword marker stripped.

    save_token_stats.py:139-146 strips a leading ``##`` for BERT (``model_type == 'bert'``)
    and a leading ``Ġ`` for every other model (RoBERTa, GPT-2). So ``"##ing"`` and
    ``"ing"`` are one key, ``"Ġthe"`` and ``"the"`` are one key, and special tokens keep
    their string (``"[CLS]"``, ``"</s>"``).

    ``scheme`` says which marker the tokenizer uses (see :func:`marker_scheme`):
    ``"wordpiece"`` strips ``##`` only, ``"bytelevel"`` strips ``Ġ`` only,
    ``"sentencepiece"`` strips ``▁`` only (not in the paper, which has no SentencePiece
    model: the same rule by analogy), ``"none"`` strips nothing. ``"auto"`` strips
    whichever of the three the string starts with; it can differ from the paper on a
    byte-level vocabulary that holds a literal ``##...`` token, so pass the tokenizer's
    scheme when you have it.
    """
    if scheme == "wordpiece":
        return token[2:] if token.startswith("##") else token
    if scheme == "bytelevel":
        return token[1:] if token.startswith("Ġ") else token
    if scheme == "sentencepiece":
        return token[1:] if token.startswith("▁") else token
    if scheme == "none":
        return token
    if scheme == "auto":
        if token.startswith("##"):
            return token[2:]
        if token.startswith(("Ġ", "▁")):
            return token[1:]
        return token
    raise ValueError(f"unknown scheme {scheme!r}")


_SCHEMES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def marker_scheme(tokenizer) -> Scheme:
    """Which subword marker a fast tokenizer writes: ``wordpiece`` (``##``), ``bytelevel``
    (``Ġ``), ``sentencepiece`` (``▁``) or ``none``, read from its ``tokenizers`` JSON
    (cached per tokenizer object: the JSON holds the whole vocabulary, ~50 ms to write).

    The paper decides by model name (save_token_stats.py:84-91, ``'bert'`` -> ``##``, else
    ``Ġ``); reading the tokenizer gives the same answer for its six models and also covers
    MiniLM and MPNet (WordPiece), whose names the paper's scripts would reject
    (save_token_stats.py:27-28).
    """
    if tokenizer in _SCHEMES:
        return _SCHEMES[tokenizer]
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec.get("model") or {}
    text = json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])
    if model.get("type") == "WordPiece":
        scheme = "wordpiece"
    elif '"ByteLevel"' in text:
        scheme = "bytelevel"
    elif '"Metaspace"' in text:
        scheme = "sentencepiece"
    else:
        scheme = "none"
    _SCHEMES[tokenizer] = scheme
    return scheme


def _bos_eos(tokenizer) -> tuple[str, str]:
    """save_token_stats.py:22-36: [CLS]/[SEP] for BERT, bos/eos for RoBERTa and GPT-2
    (both ``<|endoftext|>`` for GPT-2). Generalised: cls/sep when the tokenizer has them,
    else bos/eos (this gives the paper's choice for all six of its models)."""
    bos = tokenizer.cls_token or tokenizer.bos_token
    eos = tokenizer.sep_token or tokenizer.eos_token
    if bos is None or eos is None:
        raise ValueError("the tokenizer has neither cls/sep nor bos/eos tokens")
    return bos, eos


# --------------------------------------------------------------------------- texts and words


def paper_select_sentences(texts: Sequence[str], max_words: int = PAPER_MAX_WORDS) -> list[str]:
    """The paper's length filter and order (utils.py:56-61): keep texts with fewer than
    ``max_words`` space-separated words (``len(text.split(' ')) < max_words``, strict) and
    sort them by that count (stable). save_token_stats.py:102 then reverses the order; the
    order only matters to the float32 running update, not to a two-pass statistic.

    (Their sentences are a 1% random sample of bookcorpus, utils.py:46-47, seed 0.)
    """
    kept = [t for t in texts if len(t.split(" ")) < max_words]
    return sorted(kept, key=lambda t: len(t.split(" ")))


# gensim.utils.PAT_ALPHABETIC: maximal runs of word characters that are not digits
# ("\w" minus "\d"), matched after lowercasing the whole text.
_ALPHABETIC_RUN = re.compile(r"[^\W\d]+")


def paper_words(text: str, min_len: int = 2, max_len: int = 15) -> list[str]:
    """Appendix J's words: ``gensim.utils.simple_preprocess(text, min_len=2)``
    (Appendix_J_save_word_stats.py:34-35, Appendix_J_save_word2token_count.py:36-37).

    gensim's definition (``gensim.utils.simple_preprocess`` -> ``tokenize(lower=True,
    deacc=False)`` -> ``simple_tokenize``): lowercase the text, take maximal runs of
    non-digit word characters, keep those with ``min_len <= len <= max_len`` (default
    ``max_len`` 15) that do not start with ``_``. Digits and punctuation split words and are
    dropped ("e-mail" -> "mail"; "covid19" -> "covid"; "x" -> nothing).
    """
    return [w for w in _ALPHABETIC_RUN.findall(text.lower())
            if min_len <= len(w) <= max_len and not w.startswith("_")]


@dataclass(frozen=True)
class PaperInput:
    """What the paper feeds the model for one text and which positions it counts.

    ``input_ids`` is the whole sequence; ``groups`` lists, per counted unit, the positions
    whose hidden states are averaged into it (one position for a token, all of a word's
    subwords for a word), with ``keys`` the key each unit is counted under.
    """

    input_ids: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    keys: tuple[Hashable, ...]


def paper_inputs(tokenizer, text: str, unit: Unit = "token", key: KeyKind = "paper",
                 include_special: bool = True) -> PaperInput:
    """Build the paper's model input for ``text`` and the units it counts.

    token unit (save_token_stats.py:45-49,132-161): ``tokens = [bos] + tokenize(text) +
    [eos]``; every position is a unit keyed by :func:`paper_key` of its token string
    (``key="paper"``) or by its vocabulary id (``key="id"``); ``include_special=False``
    drops the two added positions (the paper keeps them).

    word unit (Appendix_J_save_word_stats.py:28-53): ``tokens = [bos] + tokenize(w_1) +
    ... + tokenize(w_k) + [eos]`` over :func:`paper_words` (each word tokenized alone, so
    the model never sees the text's punctuation or digits); a unit per word, its positions
    the word's subwords, keyed by the word string. bos/eos are never counted
    (``include_special`` and ``key`` do not apply; ``key="id"`` is refused).
    """
    if key not in ("paper", "id"):
        raise ValueError(f"key must be 'paper' or 'id', not {key!r}")
    bos, eos = _bos_eos(tokenizer)
    if unit == "token":
        tokens = [bos, *tokenizer.tokenize(text), eos]
        ids = tokenizer.convert_tokens_to_ids(tokens)
        scheme = marker_scheme(tokenizer)
        positions = range(len(tokens)) if include_special else range(1, len(tokens) - 1)
        keys = tuple(paper_key(tokens[p], scheme) if key == "paper" else int(ids[p]) for p in positions)
        return PaperInput(tuple(int(i) for i in ids), tuple((p,) for p in positions), keys)
    if unit == "word":
        if key != "paper":
            raise ValueError("the word unit is keyed by the word string (key='paper')")
        tokens, groups, words = [bos], [], paper_words(text)
        for word in words:
            pieces = tokenizer.tokenize(word)
            if not pieces:  # the paper would divide by zero (Appendix_J...py:137-139)
                raise ValueError(f"word {word!r} has no tokens")
            groups.append(tuple(range(len(tokens), len(tokens) + len(pieces))))
            tokens.extend(pieces)
        tokens.append(eos)
        ids = tokenizer.convert_tokens_to_ids(tokens)
        return PaperInput(tuple(int(i) for i in ids), tuple(groups), tuple(words))
    raise ValueError(f"unit must be 'token' or 'word', not {unit!r}")


# --------------------------------------------------------------------------- forward


@dataclass
class Collected:
    """Every counted unit's key and, per layer, its embedding (rows in text order).

    ``states[layer]`` is (N, d): float32 exactly as the model gave it for tokens, float64
    (the float64 mean of the cast subword states) for words.
    """

    keys: list
    states: list[np.ndarray]


def _max_positions(model, tokenizer) -> int:
    config = getattr(model, "config", None)
    limits = [getattr(config, "max_position_embeddings", None), getattr(tokenizer, "model_max_length", None)]
    limits = [int(x) for x in limits if isinstance(x, int) and 0 < x < 10**9]
    return min(limits) if limits else 10**9


def collect_states(model, tokenizer, texts: Sequence[str], unit: Unit = "token",
                   key: KeyKind = "paper", include_special: bool = True) -> Collected:
    """Run the model on each text alone (float32 forward, no padding) and keep the counted
    units' hidden states of every layer (``hidden_states`` numbering, 0 = embeddings).

    Like the paper (which never truncates; its sentences are short), a text whose input
    does not fit the model raises ``ValueError`` rather than being cut.
    """
    limit = _max_positions(model, tokenizer)
    keys: list = []
    per_layer: list[list[np.ndarray]] | None = None
    with torch.inference_mode():
        for text in texts:
            inp = paper_inputs(tokenizer, text, unit=unit, key=key, include_special=include_special)
            if len(inp.input_ids) > limit:
                raise ValueError(f"a text of {len(inp.input_ids)} tokens does not fit the model ({limit})")
            ids = torch.tensor([inp.input_ids])
            # save_token_stats.py:119-122: input_ids and an all-ones mask for the real tokens
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
            if per_layer is None:
                per_layer = [[] for _ in out.hidden_states]
            for layer, h in enumerate(out.hidden_states):
                h = h[0].float().numpy()
                if unit == "token":
                    rows = h[[g[0] for g in inp.groups]] if inp.groups else h[:0]
                else:
                    rows = np.stack([h[list(g)].astype(np.float64).mean(0) for g in inp.groups]) \
                        if inp.groups else h[:0].astype(np.float64)
                per_layer[layer].append(rows)
            keys.extend(inp.keys)
    if per_layer is None:
        raise ValueError("no texts")
    return Collected(keys, [np.concatenate(rows) for rows in per_layer])


# --------------------------------------------------------------------------- statistics


def key_stats(keys: Sequence[Hashable], X: np.ndarray) -> dict:
    """Per key, two-pass float64 over the rows of ``X`` (N, d) with ``keys`` (length N).

    Returns ``{"keys": list (first-seen order), "n": int64 (K,), "mean": (K, d),
    "Q": (K,), "M": (K,), "V": (K,)}`` with ``Q = mean ||x||^2``, ``M = ||mean x||^2``,
    ``V = mean ||x - mean x||^2`` (the paper's save_token_stats.py:148-156 in exact
    arithmetic, where ``V = Q - M``).
    """
    X = np.asarray(X, dtype=np.float64)
    index: dict = {}
    codes = np.fromiter((index.setdefault(k, len(index)) for k in keys), dtype=np.int64, count=len(keys))
    K = len(index)
    n = np.bincount(codes, minlength=K)
    order = np.argsort(codes, kind="stable")
    starts = np.concatenate([[0], np.cumsum(n)[:-1]]) if K else np.zeros(0, dtype=np.int64)
    sums = np.add.reduceat(X[order], starts, axis=0) if K else np.zeros((0, X.shape[1]))
    mean = sums / n[:, None]
    dev = X - mean[codes]
    V = np.bincount(codes, weights=np.einsum("ij,ij->i", dev, dev), minlength=K) / n
    Q = np.bincount(codes, weights=np.einsum("ij,ij->i", X, X), minlength=K) / n
    M = np.einsum("ij,ij->i", mean, mean)
    return {"keys": list(index), "n": n, "mean": mean, "Q": Q, "M": M, "V": V}


def passes_filter(n, min_count: int = PAPER_MIN_COUNT, max_count: int = PAPER_MAX_COUNT):
    """The paper's count filter, written as they write it: ``log10(min) <= log10(n) <=
    log10(max)`` (Fig4...py:63,71 with 10 and 1e5: ``1 <= log10(n_t) <= 5``). For powers of
    ten this is the integer test ``min <= n <= max`` (both inclusive); a test checks it."""
    lg = np.log10(np.asarray(n, dtype=np.float64))
    return (np.log10(min_count) <= lg) & (lg <= np.log10(max_count))


def ols(x: np.ndarray, y: np.ndarray) -> dict:
    """Least squares of ``y`` on ``x`` with an intercept and its coefficient of determination,
    as sklearn ``LinearRegression().fit(x.reshape(-1, 1), y)`` then ``.score`` (Fig4...py:81-89).

    ``slope = sum (x - x̄)(y - ȳ) / sum (x - x̄)^2``, ``intercept = ȳ - slope x̄``,
    ``r2 = 1 - SS_res / SS_tot`` (sklearn ``r2_score``: 1.0 if ``SS_tot = 0`` and the fit is
    exact, else 0.0 then). Fewer than two points: all NaN (sklearn fails or warns).
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if len(x) < 2:
        return {"slope": math.nan, "intercept": math.nan, "r2": math.nan}
    dx, dy = x - x.mean(), y - y.mean()
    sxx = float(dx @ dx)
    # a constant x: sklearn's lstsq gives the minimum-norm coefficient 0
    slope = float(dx @ dy) / sxx if sxx > 0 else 0.0
    intercept = float(y.mean() - slope * x.mean())
    res = y - (slope * x + intercept)
    ss_res, ss_tot = float(res @ res), float(dy @ dy)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return {"slope": slope, "intercept": intercept, "r2": r2}


def layer_summary(n: np.ndarray, mean: np.ndarray, Q: np.ndarray, M: np.ndarray, V: np.ndarray,
                  min_count: int = PAPER_MIN_COUNT, max_count: int = PAPER_MAX_COUNT) -> dict:
    """The paper's per-layer numbers over the keys passing :func:`passes_filter`.

    Per key arrays (K,) and means (K, d) in; out (NaN where undefined):

    * ``num_types``, ``n`` = sum n_t (Fig5...py:70);
    * ``cv_Q`` = ``np.std(Q_t) / np.mean(Q_t)``, population std, unweighted over keys
      (Fig4...py:77);
    * ``slope``, ``intercept``, ``r2``: :func:`ols` of V_t on M_t (Fig4...py:81-89,
      intercept as Fig2 and Fig7...py:86);
    * ``Q`` = sum n_t Q_t / n, ``mu`` = sum n_t mu_t / n, ``V_W`` = sum n_t V_t / n,
      ``M`` = ||mu||^2, ``V`` = Q - M, ``V_B`` = V - V_W (Fig5...py:61-85: V_B is the
      residual, not sum n_t ||mu_t - mu||^2 / n, which we report as ``V_B_direct``);
    * ratios ``M/Q``, ``V_W/Q``, ``V_B/Q`` (Fig5...py:88-90), ``V/Q`` (Appendix_Fig18),
      ``V_W/V`` (Fig6...py:84), ``V_B/V`` (Appendix_Fig20);
    * Fig. 7 (Fig7...py:59-87): OLS of Q_t, M_t, V_t on log10 n_t: ``freq_slope_Q``,
      ``freq_intercept_Q``, ``freq_r2_Q`` (and M, V). The paper plots it for the middle
      layer ``layer_idxs[len(layer_idxs) // 2]`` (Fig7...py:45); here it is given per layer;
    * Appendix Fig. 17 (Appendix_Fig17...py:64-88): slope of ``log10(1 + Q_t)`` (M, V) on
      log10 n_t: ``freq_slope_log1p_Q`` (M, V).
    """
    n = np.asarray(n)
    keep = passes_filter(n, min_count, max_count)
    nk = n[keep].astype(np.float64)
    Qk, Mk, Vk, muk = Q[keep], M[keep], V[keep], mean[keep]
    out: dict = {"num_types": int(keep.sum()), "n": int(n[keep].sum())}
    nan = math.nan
    out["cv_Q"] = float(Qk.std() / Qk.mean()) if len(Qk) else nan
    out.update(ols(Mk, Vk))
    if out["n"]:
        total = nk.sum()
        mu = (nk[:, None] * muk).sum(0) / total
        Qx = float(nk @ Qk / total)
        Vw = float(nk @ Vk / total)
        Mx = float(mu @ mu)
        Vx = Qx - Mx
        Vb = Vx - Vw
        d = muk - mu
        Vb_direct = float(nk @ np.einsum("ij,ij->i", d, d) / total)
    else:
        Qx = Mx = Vx = Vw = Vb = Vb_direct = nan
    out.update({"Q": Qx, "M": Mx, "V": Vx, "V_W": Vw, "V_B": Vb, "V_B_direct": Vb_direct})
    ratio = (lambda a, b: a / b if b else nan)
    out.update({"M/Q": ratio(Mx, Qx), "V/Q": ratio(Vx, Qx), "V_W/Q": ratio(Vw, Qx),
                "V_B/Q": ratio(Vb, Qx), "V_W/V": ratio(Vw, Vx), "V_B/V": ratio(Vb, Vx)})
    lg = np.log10(nk)
    for name, y in (("Q", Qk), ("M", Mk), ("V", Vk)):
        fit = ols(lg, y)
        out[f"freq_slope_{name}"] = fit["slope"]
        out[f"freq_intercept_{name}"] = fit["intercept"]
        out[f"freq_r2_{name}"] = fit["r2"]
        out[f"freq_slope_log1p_{name}"] = ols(lg, np.log10(y + 1.0))["slope"]
    return out


@dataclass
class LayerStats:
    """One layer: per key ``n``, ``Q``, ``M``, ``V`` (dicts keyed by the key) and ``mean``
    (key -> (d,) float64), and the filtered ``summary`` (:func:`layer_summary`)."""

    layer: int
    n: dict = field(repr=False)
    Q: dict = field(repr=False)
    M: dict = field(repr=False)
    V: dict = field(repr=False)
    mean: dict = field(repr=False)
    summary: dict


def stats_from_states(collected: Collected, min_count: int = PAPER_MIN_COUNT,
                      max_count: int = PAPER_MAX_COUNT) -> list[LayerStats]:
    """Per layer: :func:`key_stats` then :func:`layer_summary`."""
    layers = []
    for layer, X in enumerate(collected.states):
        t = key_stats(collected.keys, X)
        ks = t["keys"]
        layers.append(LayerStats(
            layer=layer,
            n={k: int(v) for k, v in zip(ks, t["n"])},
            Q=dict(zip(ks, t["Q"].tolist())),
            M=dict(zip(ks, t["M"].tolist())),
            V=dict(zip(ks, t["V"].tolist())),
            mean=dict(zip(ks, t["mean"])),
            summary=layer_summary(t["n"], t["mean"], t["Q"], t["M"], t["V"], min_count, max_count),
        ))
    return layers


def paper_stats(model, tokenizer, texts: Sequence[str], unit: Unit = "token", key: KeyKind = "paper",
                include_special: bool = True, min_count: int = PAPER_MIN_COUNT,
                max_count: int = PAPER_MAX_COUNT) -> list[LayerStats]:
    """The paper's per-key and per-layer statistics, computed exactly (float64, two-pass).

    ``model``: a loaded Hugging Face model (float32, eval mode) returning ``hidden_states``;
    ``tokenizer``: its fast tokenizer. Defaults are the paper's: keys are marker-stripped
    token strings, the added [CLS]/[SEP] (or <s>/</s>) are counted, the filter is
    10 <= n_t <= 100000. One :class:`LayerStats` per entry of ``hidden_states``.
    The texts are used as given (apply :func:`paper_select_sentences` for the paper's
    sentence filter).
    """
    collected = collect_states(model, tokenizer, texts, unit=unit, key=key, include_special=include_special)
    return stats_from_states(collected, min_count, max_count)


# --------------------------------------------------------------------------- their numerics


def paper_running_update(X: np.ndarray, numpy_semantics: Literal["1.x", "2.x"] = "1.x") -> dict:
    """Q, M, V of one key as the paper's code accumulates them (save_token_stats.py:148-161;
    the same update in Appendix_J_save_word_stats.py:142-150), one embedding at a time.

    For each float32 row ``x`` in order (k = count so far):
    ``sq = np.linalg.norm(x)**2``; first row: ``(u, q, m, v) = (x, sq, sq, 0)``; then
    ``u = k*u/(k+1) + x/(k+1)`` (a float32 running mean), ``q = k*q/(k+1) + sq/(k+1)``,
    ``m = np.linalg.norm(u)**2``, ``v = q - m``.

    The float32 arithmetic is reproduced operation by operation. Scalars depend on NumPy's
    promotion rules: their pinned environment (``scipy==1.10.1`` in requirements.txt:9
    needs NumPy < 1.27) is ``"1.x"``, where ``float32_scalar ** 2`` and ``int * float32_scalar``
    promote to float64, so the norms are float32 but ``sq``, ``q``, ``m``, ``v`` are float64;
    under ``"2.x"`` (NEP 50) they all stay float32. ``u`` is float32 either way, and
    ``v = q - m`` subtracts two nearly equal numbers when M >> V, which is where the
    precision goes.

    Returns ``{"n", "Q", "M", "V", "mean"}`` (``mean`` the float32 running mean).
    """
    X = np.asarray(X, dtype=np.float32)
    if X.ndim != 2 or len(X) == 0:
        raise ValueError("X must be a non-empty (n, d) array")
    if numpy_semantics not in ("1.x", "2.x"):
        raise ValueError("numpy_semantics must be '1.x' or '2.x'")
    wide = np.float64 if numpy_semantics == "1.x" else np.float32
    one = np.float32

    def squared_norm(a):
        # np.linalg.norm of a float32 vector is a float32 sqrt(dot); then ``** 2`` in ``wide``
        r = wide(np.float32(np.linalg.norm(a)))
        return r * r

    u = X[0].copy()
    q = m = squared_norm(X[0])
    v = wide(0.0)
    for k in range(1, len(X)):
        x = X[k]
        sq = squared_norm(x)
        u = (one(k) * u) / one(k + 1) + x / one(k + 1)
        q = (wide(k) * q) / wide(k + 1) + sq / wide(k + 1)
        m = squared_norm(u)
        v = q - m
    return {"n": len(X), "Q": float(q), "M": float(m), "V": float(v), "mean": u}
