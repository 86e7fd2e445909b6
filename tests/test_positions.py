"""Unit tests for :mod:`embgeom.compute.positions`: windows, counted positions, keys,
token-budget batches and padding.

The tokenizer is the real packaged all-MiniLM-L6-v2 one (BERT WordPiece, [CLS]/[SEP]);
every expectation is derived from the tokenizer called directly on each text, never from
the module under test.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import pytest

from embgeom.compute.positions import (
    batches_by_token_budget, canonical_token, encode, key_map, lookup_key, pad_batch,
)

class Window(namedtuple("Window", "text_index input_ids keys counted")):
    def __len__(self):
        return len(self.input_ids)


def encode_windows(tokenizer, texts, max_length, include_special=False, key="id"):
    """The flat encoding seen window by window, for readable assertions."""
    enc = encode(tokenizer, texts, max_length, include_special, key)
    return [Window(int(enc.text_index[w]), tuple(enc.input_ids[enc.window(w)].tolist()),
                   tuple(enc.keys[enc.window(w)].tolist()),
                   tuple(bool(c) for c in enc.counted[enc.window(w)]))
            for w in range(enc.num_windows)]


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


# ----------------------------------------------------------------------------- keys


def test_string_keys_merge_subword_markers(tokenizer):
    assert canonical_token("##ing") == "ing" and canonical_token("\u0120the") == "the"
    assert canonical_token("\u2581the") == "the" and canonical_token("##") == "##"
    mapping = key_map(tokenizer, "string")
    vocab = tokenizer.get_vocab()
    # "##s" and "s" are one key, the smaller of the two ids
    assert mapping[vocab["##s"]] == mapping[vocab["s"]] == min(vocab["##s"], vocab["s"])
    assert lookup_key(tokenizer, "##s", "string") == lookup_key(tokenizer, "s", "string")
    assert lookup_key(tokenizer, "##s", "id") == vocab["##s"]
    assert lookup_key(tokenizer, "not-a-token-anywhere", "id") is None
    # every key is a vocabulary id whose canonical string is the token's own
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    for i in range(0, len(tokens), 97):
        assert canonical_token(tokens[mapping[i]]) == canonical_token(tokens[i])


def test_string_keys_in_encoding(tokenizer):
    text = "walks walking"  # walk ##s, walk ##ing
    (by_id,) = encode_windows(tokenizer, [text], 64)
    (by_string,) = encode_windows(tokenizer, [text], 64, key="string")
    mapping = key_map(tokenizer, "string")
    assert by_string.keys == tuple(int(mapping[i]) for i in by_id.input_ids)
    assert by_string.counted == by_id.counted


# ----------------------------------------------------------------------------- batching


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget", [16, 100, 512, 2048])
def test_batches_respect_the_token_budget(seed, budget):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 600, size=200)
    batches = list(batches_by_token_budget(lengths, budget))
    seen = np.concatenate(batches)
    assert sorted(seen.tolist()) == list(range(len(lengths)))  # every window exactly once
    for b in batches:
        padded = len(b) * lengths[b].max()
        if len(b) > 1:  # only a lone window may exceed the budget
            assert padded <= budget, (len(b), lengths[b], budget)
    # batches are greedy: a batch plus the next batch's first window would break the
    # budget, or pad a batch of at least budget/8 positions by more than 25%
    for a, b in zip(batches, batches[1:]):
        longest = max(lengths[a].max(), lengths[b[0]])
        padded = (len(a) + 1) * longest
        real = lengths[a].sum() + lengths[b[0]]
        assert padded > budget or (padded >= budget // 8 and padded > 1.25 * real)
    # and none pads more than that (unless small)
    for b in batches:
        padded = len(b) * lengths[b].max()
        assert padded < budget // 8 or padded <= 1.25 * lengths[b].sum() or len(b) == 1


def test_mixed_short_lengths_are_not_padded_to_the_longest():
    lengths = np.array([8] * 200 + [60] * 50)
    batches = list(batches_by_token_budget(lengths, 16384))
    padded = sum(len(b) * lengths[b].max() for b in batches)
    assert padded <= 1.25 * lengths.sum()  # one batch would have padded 250 x 60


def test_single_window_longer_than_budget_is_its_own_batch():
    lengths = np.array([5, 50, 6, 7])
    batches = list(batches_by_token_budget(lengths, 20))
    assert [b.tolist() for b in batches] == [[0, 2], [3], [1]]
    assert list(batches_by_token_budget(np.zeros(0, dtype=np.int64), 20)) == []


def test_padded_batch_holds_the_windows_and_nothing_else(tokenizer):
    texts = ["one two three four five six seven", "eight", "nine ten eleven"]
    enc = encode(tokenizer, texts, max_length=6)
    order = np.array([2, 0, 1])
    batch = pad_batch(enc, order, pad_id=tokenizer.pad_token_id)
    T = int(enc.lengths[order].max())
    assert batch.input_ids.shape == batch.counted.shape == (3, T)
    for row, w in enumerate(order):
        length = int(enc.lengths[w])
        assert batch.input_ids[row, :length].tolist() == enc.input_ids[enc.window(w)].tolist()
        assert (batch.input_ids[row, length:] == tokenizer.pad_token_id).all()
        assert batch.attention[row].tolist() == [1] * length + [0] * (T - length)
        assert batch.counted[row, :length].tolist() == enc.counted[enc.window(w)].tolist()
        assert not batch.counted[row, length:].any()
    assert batch.num_counted == int(enc.counted[np.isin(np.repeat(np.arange(enc.num_windows),
                                                                  enc.lengths), order)].sum())


