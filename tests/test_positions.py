"""Unit tests for :mod:`embgeom.positions` (windows, counted positions, token-budget
batches) and :func:`embgeom.reduce.reduce_batch` (per-batch moments on the device).

The tokenizer is the real packaged all-MiniLM-L6-v2 one (BERT WordPiece, [CLS]/[SEP]).
``reduce_batch`` is checked against a plain numpy two-pass float64 computation over the
counted positions only.

Tolerances
----------
``reduce_batch`` works in float64 from float32 inputs, and the reference does the same
arithmetic in float64 with a different summation order. Each result is a sum of at most
a few hundred terms, so the rounding difference is ~1e-14 of the scale of the summed
quantities (||x||^2 for m2/comoment, ||x|| for means, 1 for unit vectors). We allow 1e-10
of that scale: six orders of magnitude of headroom, while any algebraic error (a padded
row counted, a wrong count, a missing term) is O(1) relative and fails loudly.
Counts and ids are integers and compared exactly.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from embgeom.positions import Window, batches_by_token_budget, encode_windows
from embgeom.reduce import reduce_batch
from embgeom.stats import LayerMoments, TokenAccumulator

REL = 1e-10  # see module docstring


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from embgeom.sources import minilm_path

    return AutoTokenizer.from_pretrained(str(minilm_path()))


def plain_ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------- windows


def test_short_text_is_one_window_with_specials_not_counted(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    (w,) = encode_windows(tokenizer, [text], max_length=512)
    ids = plain_ids(tokenizer, text)
    assert w.text_index == 0
    assert list(w.input_ids) == [tokenizer.cls_token_id, *ids, tokenizer.sep_token_id]
    assert w.keys == w.input_ids  # a counted position is keyed by its vocabulary id
    assert w.counted == (False,) + (True,) * len(ids) + (False,)


@pytest.mark.parametrize("max_length", [8, 13, 64])
def test_long_text_windows_are_consecutive_and_drop_nothing(tokenizer, max_length):
    texts = [
        "Quarterly profits at US media giant TimeWarner jumped 76% to $1.13bn (£600m) for the "
        "three months to December, from $639m year-earlier. " * 3,
        "short one",
        "",  # an empty text: one window of [CLS][SEP], nothing counted
        "Another paragraph, with a few more words than the second one has in it.",
    ]
    windows = encode_windows(tokenizer, texts, max_length=max_length)
    assert all(len(w) <= max_length for w in windows)
    assert [w.text_index for w in windows] == sorted(w.text_index for w in windows)
    for i, text in enumerate(texts):
        mine = [w for w in windows if w.text_index == i]
        assert mine, f"text {i} produced no window"
        for w in mine:
            # each window is encoded on its own: [CLS] ... [SEP]
            assert w.input_ids[0] == tokenizer.cls_token_id and w.input_ids[-1] == tokenizer.sep_token_id
            assert not w.counted[0] and not w.counted[-1]
        counted = [k for w in mine for k, c in zip(w.keys, w.counted) if c]
        # concatenating the counted keys of the windows gives back the text's tokens, in
        # order, each exactly once (no overlap, no gap)
        assert counted == plain_ids(tokenizer, text)
        if len(plain_ids(tokenizer, text)) > max_length - 2:
            assert len(mine) == -(-len(plain_ids(tokenizer, text)) // (max_length - 2))
            # every window but the last is full
            assert all(len(w) == max_length for w in mine[:-1])


def test_literal_special_strings_and_unk_count(tokenizer):
    # A "[SEP]" or "[CLS]" typed in the text is the text's own token: it counts. So does
    # [UNK] (both the literal string and an unknown character).
    text = "alpha [SEP] beta [CLS] gamma [UNK] delta \U0001F916"
    (w,) = encode_windows(tokenizer, [text], max_length=512)
    toks = tokenizer.convert_ids_to_tokens(list(w.input_ids))
    assert toks[0] == "[CLS]" and toks[-1] == "[SEP]"
    inner = list(zip(toks, w.counted))[1:-1]
    assert all(c for _, c in inner), inner
    assert [t for t, _ in inner].count("[SEP]") == 1
    assert [t for t, _ in inner].count("[CLS]") == 1
    assert [t for t, _ in inner].count("[UNK]") == 2  # the literal and the emoji
    assert sum(w.counted) == len(plain_ids(tokenizer, text))


def test_literal_sep_at_window_boundary_counts(tokenizer):
    # The literal [SEP] falls at the last content slot of a window; the added [SEP] after
    # it must still be the only position of that window not counted at its end.
    text = "a b c [SEP] d e f"
    windows = encode_windows(tokenizer, [text], max_length=6)  # 4 content tokens each
    assert [tokenizer.convert_ids_to_tokens(list(w.input_ids)) for w in windows] == [
        ["[CLS]", "a", "b", "c", "[SEP]", "[SEP]"], ["[CLS]", "d", "e", "f", "[SEP]"]]
    assert windows[0].counted == (False, True, True, True, True, False)
    assert windows[1].counted == (False, True, True, True, False)


def test_include_special_counts_everything(tokenizer):
    texts = ["one two three " * 10, "four"]
    windows = encode_windows(tokenizer, texts, max_length=10, include_special=True)
    assert all(all(w.counted) for w in windows)
    total = sum(len(w) for w in windows)
    content = sum(len(plain_ids(tokenizer, t)) for t in texts)
    assert total == content + 2 * len(windows)


def test_no_texts():
    assert encode_windows(None, [], max_length=16) == []


# ----------------------------------------------------------------------------- batching


def _w(i, length):
    return Window(i, tuple(range(length)), tuple(range(length)), (True,) * length)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget", [16, 100, 512, 2048])
def test_batches_respect_the_token_budget(seed, budget):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 600, size=200)
    windows = [_w(i, int(n)) for i, n in enumerate(lengths)]
    batches = list(batches_by_token_budget(windows, budget))
    seen = [w.text_index for b in batches for w in b]
    assert sorted(seen) == list(range(len(windows)))  # every window exactly once
    for b in batches:
        padded = len(b) * max(len(w) for w in b)
        if len(b) > 1:  # only a lone window may exceed the budget
            assert padded <= budget, (len(b), [len(w) for w in b], budget)
    # batches are greedy: a batch plus the next batch's first window would not fit
    for a, b in zip(batches, batches[1:]):
        longest = max(max(len(w) for w in a), len(b[0]))
        assert (len(a) + 1) * longest > budget


def test_single_window_longer_than_budget_is_its_own_batch():
    windows = [_w(0, 5), _w(1, 50), _w(2, 6), _w(3, 7)]
    batches = list(batches_by_token_budget(windows, 20))
    assert [[w.text_index for w in b] for b in batches] == [[0, 2], [3], [1]]
    assert list(batches_by_token_budget([], 20)) == []


# ----------------------------------------------------------------------------- reduce


def ref_reduce(hidden, keys, counted):
    """Numpy two-pass float64 moments over the counted positions only."""
    mask = counted.numpy()
    flat_keys = keys.numpy()[mask]
    ids = np.unique(flat_keys)
    out_tok = {"ids": ids, "n": np.array([(flat_keys == i).sum() for i in ids])}
    means, m2s, units = [], [], []
    lay = {"mean": [], "com": [], "unit": [], "unit_sq": [], "within": []}
    for h in hidden:
        x = h.numpy()[mask].astype(np.float64)
        u = x / np.linalg.norm(x, axis=1, keepdims=True)
        mean_l, m2_l, unit_l = [], [], []
        for i in ids:
            xi = x[flat_keys == i]
            mu = xi.mean(0)
            mean_l.append(mu)
            m2_l.append(((xi - mu) ** 2).sum())
            unit_l.append(u[flat_keys == i].sum(0))
        means.append(mean_l)
        m2s.append(m2_l)
        units.append(unit_l)
        mu = x.mean(0)
        lay["mean"].append(mu)
        lay["com"].append((x - mu).T @ (x - mu))
        lay["unit"].append(u.sum(0))
        lay["unit_sq"].append((u * u).sum(0))
        lay["within"].append(sum(m2_l))
    out_tok.update(mean=np.array(means), m2=np.array(m2s), unit_sum=np.array(units))
    return out_tok, {k: np.array(v) for k, v in lay.items()}, int(mask.sum())


def random_batch(rng, rows=5, T=11, d=8, L=3, vocab=7, pad_value=np.nan):
    """Hidden states with right padding; padded positions hold garbage (NaN by default)."""
    lengths = rng.integers(1, T + 1, size=rows)
    lengths[0] = T
    hidden = []
    base = rng.standard_normal((vocab, d)) * 3  # tokens have distinct means: M and V both matter
    keys = torch.from_numpy(rng.integers(0, vocab, size=(rows, T)))
    counted = torch.zeros((rows, T), dtype=torch.bool)
    for r, n in enumerate(lengths):
        counted[r, :n] = True
        counted[r, 0] = False  # a [CLS]-like position that does not count
    for _ in range(L):
        h = base[keys.numpy()] + rng.standard_normal((rows, T, d))
        h[~(np.arange(T)[None, :] < lengths[:, None])] = pad_value
        hidden.append(torch.from_numpy(h.astype(np.float32)))
    return hidden, keys, counted


def close(a, b, scale):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    err = np.max(np.abs(a - b)) if a.size else 0.0
    assert a.shape == b.shape
    assert err <= REL * scale, (err, scale)
    return err


@pytest.mark.parametrize("pad_value", [np.nan, 1e6, 0.0])
@pytest.mark.parametrize("seed", range(3))
def test_reduce_batch_matches_two_pass_and_ignores_padding(seed, pad_value):
    rng = np.random.default_rng(seed)
    hidden, keys, counted = random_batch(rng, pad_value=pad_value)
    tok, lay = reduce_batch(hidden, keys, counted)
    ref_tok, ref_lay, N = ref_reduce(hidden, keys, counted)
    q = max(float((h.numpy()[counted.numpy()].astype(np.float64) ** 2).sum(1).max()) for h in hidden)
    np.testing.assert_array_equal(tok.ids, ref_tok["ids"])
    np.testing.assert_array_equal(tok.n, ref_tok["n"])
    assert lay.n == N == int(tok.n.sum())
    close(tok.mean, ref_tok["mean"], np.sqrt(q))
    close(tok.m2, ref_tok["m2"], N * q)
    close(tok.unit_sum, ref_tok["unit_sum"], N)
    close(lay.mean, ref_lay["mean"], np.sqrt(q))
    close(lay.comoment, ref_lay["com"], N * q)
    close(lay.unit_sum, ref_lay["unit"], N)
    close(lay.unit_sq_sum, ref_lay["unit_sq"], N)
    close(lay.within, ref_lay["within"], N * q)
    for arr in (tok.mean, tok.m2, tok.unit_sum, lay.mean, lay.comoment):
        assert np.isfinite(arr).all()  # NaN padding never leaked


def test_uncounted_positions_with_a_counted_key_do_not_contribute():
    # The same key both counted and not counted ([CLS] typed in the text vs added [CLS]):
    # only the counted occurrences contribute.
    d = 4
    h = torch.tensor([[[1.0] * d, [2.0] * d, [100.0] * d]])  # (1, 3, d)
    keys = torch.tensor([[5, 5, 5]])
    counted = torch.tensor([[True, True, False]])
    tok, lay = reduce_batch([h], keys, counted)
    assert tok.ids.tolist() == [5] and tok.n.tolist() == [2]
    np.testing.assert_allclose(tok.mean[0, 0], [1.5] * d)
    np.testing.assert_allclose(tok.m2[0], [2 * d * 0.25])
    assert lay.n == 2


def test_nothing_counted_gives_empty_moments():
    h = torch.randn(2, 3, 4)
    tok, lay = reduce_batch([h, h], torch.zeros((2, 3), dtype=torch.long),
                            torch.zeros((2, 3), dtype=torch.bool))
    assert len(tok) == 0 and lay.n == 0
    assert tok.mean.shape == (2, 0, 4) and lay.mean.shape == (2, 4)


def _reduce_split(hidden, keys, counted, groups):
    """Reduce row groups separately (each trimmed to its own longest row), then merge."""
    L, d = len(hidden), hidden[0].shape[-1]
    acc = TokenAccumulator(L, d, capacity=2)  # tiny capacity: growth is exercised
    layers = LayerMoments.empty(L, d)
    for rows in groups:
        idx = torch.tensor(rows)
        width = int(counted[idx].sum(1).max()) + 1  # [CLS] + counted positions
        sub_h = [h[idx, :width] for h in hidden]
        t, l = reduce_batch(sub_h, keys[idx, :width], counted[idx, :width])
        l.within = acc.add(t)
        layers = layers.merged(l)
    return acc.snapshot(), layers


def test_results_do_not_depend_on_batch_composition():
    rng = np.random.default_rng(7)
    hidden, keys, counted = random_batch(rng, rows=12, T=9, d=6, L=2, vocab=5)
    whole_tok, whole_lay = reduce_batch(hidden, keys, counted)
    q = max(float((h.numpy()[counted.numpy()].astype(np.float64) ** 2).sum(1).max()) for h in hidden)
    N = whole_lay.n
    splits = [
        [list(range(12))],
        [[i] for i in range(12)],
        [[11, 3, 5], [0, 1], [2, 4, 6, 7, 8, 9, 10]],
        [list(range(0, 12, 2)), list(range(1, 12, 2))],
    ]
    for groups in splits:
        tok, lay = _reduce_split(hidden, keys, counted, groups)
        order = np.argsort(tok.ids)
        np.testing.assert_array_equal(tok.ids[order], whole_tok.ids)
        np.testing.assert_array_equal(tok.n[order], whole_tok.n)
        assert lay.n == N
        close(tok.mean[:, order], whole_tok.mean, np.sqrt(q))
        close(tok.m2[:, order], whole_tok.m2, N * q)
        close(tok.unit_sum[:, order], whole_tok.unit_sum, N)
        close(lay.mean, whole_lay.mean, np.sqrt(q))
        close(lay.comoment, whole_lay.comoment, N * q)
        close(lay.within, whole_tok.m2.sum(1), N * q)
        close(lay.unit_sum, whole_lay.unit_sum, N)


def test_every_split_of_a_small_batch_agrees():
    # All 2-way splits of 5 rows: exhaustive over batch composition.
    rng = np.random.default_rng(3)
    hidden, keys, counted = random_batch(rng, rows=5, T=6, d=3, L=1, vocab=3)
    whole_tok, whole_lay = reduce_batch(hidden, keys, counted)
    q = float((hidden[0].numpy()[counted.numpy()].astype(np.float64) ** 2).sum(1).max())
    for r in range(1, 5):
        for first in itertools.combinations(range(5), r):
            second = [i for i in range(5) if i not in first]
            tok, lay = _reduce_split(hidden, keys, counted, [list(first), second])
            order = np.argsort(tok.ids)
            np.testing.assert_array_equal(tok.n[order], whole_tok.n)
            close(tok.m2[:, order], whole_tok.m2, whole_lay.n * q)
            close(lay.comoment, whole_lay.comoment, whole_lay.n * q)
