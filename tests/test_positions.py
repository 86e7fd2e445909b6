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
    WORD_KEY_BASE, batches_by_token_budget, canonical_token, encode, is_word_key, key_map,
    Vocabulary, lookup_key, pad_batch, string_hashes, token_markers, word_key_of_hash,
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
    # a lone marker is emptied, as the paper's code does (so "ĠĠ" -> "Ġ" stays apart)
    assert canonical_token("\u2581the") == "the" and canonical_token("##") == ""
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


def paper_partition_check(tok):
    """String keys group the vocabulary exactly as the paper's key does (the token string
    with the tokenizer's marker stripped, tests/paper_reference.py), and a key's string is
    the paper's."""
    from tests.paper_reference import marker_scheme, paper_key

    scheme = marker_scheme(tok)
    tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
    mapping = key_map(tok, "string")
    by_paper = {}
    for i, t in enumerate(tokens):
        by_paper.setdefault(paper_key(t, scheme), i)
    assert [by_paper[paper_key(t, scheme)] for t in tokens] == mapping.tolist()
    markers = token_markers(tok)
    assert [canonical_token(t, markers) for t in tokens] == [paper_key(t, scheme) for t in tokens]
    return scheme


def test_string_keys_are_the_papers_keys(tokenizer, bytelevel_tokenizer):
    assert paper_partition_check(tokenizer) == "wordpiece"
    assert paper_partition_check(bytelevel_tokenizer) == "bytelevel"
    vocab = bytelevel_tokenizer.get_vocab()
    # a byte-level vocabulary's literal "###" is not "#" with a WordPiece marker
    assert lookup_key(bytelevel_tokenizer, "###", "string") != lookup_key(bytelevel_tokenizer, "#", "string")
    assert lookup_key(bytelevel_tokenizer, "\u0120the", "string") == key_map(bytelevel_tokenizer, "string")[vocab["the"]]


def test_string_keys_in_encoding(tokenizer):
    text = "walks walking"  # walk ##s, walk ##ing
    (by_id,) = encode_windows(tokenizer, [text], 64)
    (by_string,) = encode_windows(tokenizer, [text], 64, key="string")
    mapping = key_map(tokenizer, "string")
    assert by_string.keys == tuple(int(mapping[i]) for i in by_id.input_ids)
    assert by_string.counted == by_id.counted


# ----------------------------------------------------------------------------- words

WORD_TEXTS = ["Embeddings are unbelievably fun: e-mail covid19 walks!",
              "The embeddings of Transformers, embeddings again."]


def reference_words(tokenizer, text, include_special=False):
    """The words of one text from its own tokenizer call, independently of the module:
    ``(input_ids, [positions of each word])`` in order; a word is a run of positions with
    the same word id, an added special token (no word id) a word of its own."""
    enc = tokenizer(text, return_special_tokens_mask=True)
    groups, previous = [], None
    for p, (word, special) in enumerate(zip(enc.word_ids(), enc["special_tokens_mask"])):
        if special and not include_special:
            previous = None
            continue
        if word is not None and word == previous:
            groups[-1].append(p)
        else:
            groups.append([p])
        previous = word
    return enc, groups


def word_name(tokenizer, text, enc, group):
    """A multi-piece word's name for a WordPiece tokenizer, from the text, not from its
    pieces: the normalised (lowercased) characters the word covers."""
    start, end = enc["offset_mapping"][group[0]][0], enc["offset_mapping"][group[-1]][1]
    return tokenizer.backend_tokenizer.normalizer.normalize_str(text[start:end])


@pytest.mark.parametrize("key", ["id", "string"])
@pytest.mark.parametrize("include_special", [False, True])
def test_words_follow_the_tokenizers_word_ids(tokenizer, key, include_special):
    enc = encode(tokenizer, WORD_TEXTS, 512, include_special, key, unit="word")
    tokens = encode(tokenizer, WORD_TEXTS, 512, include_special, key)
    assert enc.counted.tolist() == tokens.counted.tolist()
    for w in range(enc.num_windows):
        text = WORD_TEXTS[enc.text_index[w]]
        ref, groups = reference_words(tokenizer, text, include_special)
        ref_offsets = tokenizer(text, return_offsets_mapping=True)
        sl = enc.window(w)
        starts, keys = enc.unit_start[sl], enc.keys[sl]
        assert np.flatnonzero(starts).tolist() == [g[0] for g in groups]
        for g in groups:
            assert len(set(keys[g].tolist())) == 1  # every piece carries its word's key
            word_key = int(keys[g[0]])
            if len(g) == 1:  # a one-piece word keeps its token's key
                assert word_key == int(tokens.keys[sl][g[0]])
                continue
            assert word_key >= WORD_KEY_BASE
            assert enc.names[word_key] == word_name(tokenizer, text, ref_offsets, g)
            assert lookup_key(tokenizer, enc.names[word_key], key, "word") == word_key
    assert enc.num_units == sum(len(reference_words(tokenizer, t, include_special)[1])
                                for t in WORD_TEXTS)
    # the same word in two texts is one key; "embeddings" = em ##bed ##ding ##s
    assert list(enc.names.values()).count("embeddings") == 1
    assert lookup_key(tokenizer, "embeddings", key, "word") in set(enc.keys.tolist())


def test_a_word_cut_by_a_window_boundary_is_two_words(tokenizer):
    text = "Embeddings are unbelievably fun"  # [CLS] em ##bed ##ding ##s are un ##bel ##ie ##va ##bly fun [SEP]
    enc = encode(tokenizer, [text], 8, unit="word", key="id")
    starts = [enc.unit_start[enc.window(w)] for w in range(enc.num_windows)]
    # window 0: em ##bed ##ding ##s | are | un; window 1: ##bel ##ie ##va ##bly | fun
    assert [np.flatnonzero(s).tolist() for s in starts] == [[1, 5, 6], [1, 5]]
    names = sorted(enc.names.values())
    assert names == ["##believably", "embeddings"]  # id keys keep a fragment's marker
    assert enc.num_units == 5
    assert encode(tokenizer, [text], 8, unit="word", key="string").names.get(
        lookup_key(tokenizer, "believably", "string", "word")) == "believably"


def test_word_hashes_compose_and_stay_above_the_vocabulary(tokenizer):
    from embgeom.compute.positions import _segment_hash

    parts = ["em", "bed", "", "dings", "été", "▁x"]
    h, lengths = string_hashes(parts)
    whole, _ = string_hashes(["".join(parts)])
    assert (_segment_hash(h, lengths, np.array([0])) == whole).all()
    halves, _ = string_hashes(["embed", "dingsété▁x"])
    assert (_segment_hash(h, lengths, np.array([0, 3])) == halves).all()
    keys = word_key_of_hash(string_hashes(["embed", "embedding", "a" * 5000])[0])
    assert keys.dtype == np.int64 and (keys >= WORD_KEY_BASE).all() and len(set(keys.tolist())) == 3
    assert is_word_key(keys).all() and not is_word_key(np.arange(len(tokenizer))).any()


def test_word_keys_unknown_to_token_collections(tokenizer):
    assert lookup_key(tokenizer, "embeddings", "string") is None  # token unit: not a token
    assert lookup_key(tokenizer, "the", "string", "word") == lookup_key(tokenizer, "the", "string")
    assert lookup_key(tokenizer, "##s", "string", "word") == lookup_key(tokenizer, "s", "string")


@pytest.fixture(scope="module")
def bytelevel_tokenizer():
    """SmolLM2's byte-level BPE tokenizer (the packaged model's, converted once)."""
    from transformers import AutoTokenizer

    from embgeom.sources import default_cache_dir, smollm2_path

    try:
        return AutoTokenizer.from_pretrained(str(smollm2_path(default_cache_dir())))
    except FileNotFoundError as exc:
        pytest.skip(f"SmolLM2 is not installed: {exc}")


def test_bytelevel_words_are_keyed_by_their_name(bytelevel_tokenizer):
    tok = bytelevel_tokenizer
    # Embed dings | Ġand | Ġembeddings | , | ĠEmbed dings | Ġ 7 | Ġ 2 0 2 4
    text = "Embeddings and embeddings, Embeddings 7 2024"
    by_string = encode(tok, [text], 512, key="string", unit="word")
    by_id = encode(tok, [text], 512, key="id", unit="word")
    ref, groups = reference_words(tok, text)
    assert np.flatnonzero(by_string.unit_start).tolist() == [g[0] for g in groups]
    first = lambda enc: [int(enc.keys[g[0]]) for g in groups]  # noqa: E731
    s, i = first(by_string), first(by_id)
    vocab = tok.get_vocab()
    # string keys: "Embed dings" at the start and "ĠEmbed dings" mid-text are one word
    # "Embeddings"; " 7" (Ġ 7) is the vocabulary token "7"; " 2024" is the word "2024"
    assert s[0] == s[4] and by_string.names[s[0]] == "Embeddings"
    assert s[5] == key_map(tok, "string")[vocab["7"]]
    assert by_string.names[s[6]] == "2024" and s[6] >= WORD_KEY_BASE
    assert s[2] == key_map(tok, "string")[vocab["Ġembeddings"]]  # a one-piece word
    # id keys keep the leading-space marker apart, as they keep Ġthe apart from the
    assert i[0] != i[4] and by_id.names[i[0]] == "Embeddings" and by_id.names[i[4]] == "ĠEmbeddings"
    assert by_id.names[i[5]] == "Ġ7" and by_id.names[i[6]] == "Ġ2024"
    for enc, key in ((by_string, "string"), (by_id, "id")):
        for k, name in enc.names.items():
            assert lookup_key(tok, name, key, "word") == k
    assert lookup_key(tok, "ĠEmbeddings", "string", "word") == s[0]


def test_padded_word_batch_keeps_word_starts(tokenizer):
    enc = encode(tokenizer, WORD_TEXTS, 512, unit="word", key="string")
    batch = pad_batch(enc, np.array([1, 0]), pad_id=tokenizer.pad_token_id)
    for row, w in enumerate([1, 0]):
        length = int(enc.lengths[w])
        assert batch.unit_start[row, :length].tolist() == enc.unit_start[enc.window(w)].tolist()
        assert not batch.unit_start[row, length:].any()
    assert int(batch.unit_start.sum()) == enc.num_units


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




# ----------------------------------------------------------------------------- vocabulary

@pytest.mark.parametrize("which", ["tokenizer", "bytelevel_tokenizer"])
def test_a_vocabulary_answers_every_read_as_its_tokenizer(which, request):
    """What the API keeps of a model (its token strings and markers) gives the same token
    strings, vocabulary, key maps, markers and string lookups (tokens and hashed words) as
    the whole tokenizer, for WordPiece (MiniLM) and byte-level BPE (SmolLM2)."""
    tok = request.getfixturevalue(which)
    vocab = Vocabulary.of(tok)
    ids = list(range(len(tok) + 2))  # and two ids past the end: None, as the tokenizer
    assert len(vocab) == len(tok)
    assert vocab.convert_ids_to_tokens(ids) == tok.convert_ids_to_tokens(ids)
    assert vocab.get_vocab() == tok.get_vocab()
    assert token_markers(vocab) == token_markers(tok)
    for key in ("id", "string"):
        assert np.array_equal(key_map(vocab, key), key_map(tok, key))
    names = tok.convert_ids_to_tokens(list(range(0, len(tok), 97))) + ["embeddings", "Ġand", "##ing", "zzqx"]
    for key in ("id", "string"):
        for unit in ("token", "word"):
            assert [lookup_key(vocab, n, key, unit) for n in names] == \
                [lookup_key(tok, n, key, unit) for n in names]
