"""Which token positions count, and under which key: the one place that decides it.

A text is tokenised by the model's own tokenizer and cut into consecutive windows of at
most the model's maximum length, each window encoded on its own with the special tokens
the tokenizer adds around a text ([CLS]/[SEP], <s>/</s>, BOS/EOS). No token is dropped:
a long text becomes several windows.

A position counts when it is not padding and, unless the collection says
``include_special``, it is not one of those added special tokens (the tokenizer's
``special_tokens_mask``). Tokens that come from the text itself count, [UNK] and a
literal "[SEP]" typed in the text included.

A counted position is keyed by ``key``:

- ``"id"``: its vocabulary id (the default);
- ``"string"``: its token string with the tokenizer's subword marker stripped
  (:func:`token_markers`: WordPiece ``##``, byte-level BPE ``Ġ``, SentencePiece ``▁``),
  the convention of Yamagiwa & Shimodaira's released code, so ``##s`` and ``s`` are one
  key. Only the tokenizer's own marker goes, as in their code (``##`` for BERT, ``Ġ``
  otherwise): a byte-level vocabulary's literal ``###`` stays apart from ``#``. The key
  is then the smallest vocabulary id whose token has that canonical string, so keys stay
  integers and a key's string is the tokenizer's.

With ``unit="word"`` a counting unit is a word rather than a token (the paper's Appendix J
unit, but with the words of the model's own tokenizer): a word is a maximal run of counted
positions of one window with the same word id (the fast tokenizer's ``word_ids()``), its
embedding at each layer the mean of its pieces' states, and it counts once. An added special
token has no word id: with ``include_special`` it is a word of its own, keyed as its token
(as is any position without a word id).
A word split by a window boundary is two words (each window is encoded on its own). A
word's key:

- a one-piece word keeps its token's key, so single-token words and tokens coincide;
- a multi-piece word is keyed by its *name*: the first piece's string (its marker stripped
  under ``"string"`` keys) followed by the other pieces with WordPiece's ``##`` removed.
  ``em ##bed`` -> ``embed``; byte-level ``Ġem bed`` -> ``embed`` (``"string"``) or
  ``Ġembed`` (``"id"``, which keeps the leading-space marker as id keys keep ``Ġthe``
  apart from ``the``). A name that is a vocabulary string (under
  the collection's key) takes that token's key; any other name is hashed
  (:func:`word_key_of_hash`) into ``[2**62, 2**63)``, above every vocabulary id. So a key
  is a function of the name: ``?token=<name>`` finds it (:func:`lookup_key`), and the same
  word spelled by other pieces (``Ġem bed`` mid-text, ``em bed`` at the start of a text)
  is one key under ``"string"`` keys.

The names of hashed keys cannot be read from the tokenizer: :attr:`Encoded.names` carries
them to the store, which keeps them beside the records (:mod:`embgeom.store.keys`).

Everything is array arithmetic over the whole job: no Python loop per position or per
word (the names of a job's distinct hashed words are concatenated by ``np.add.reduceat``).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from embgeom.keyspace import WORD_KEY_BASE, is_word_key

__all__ = [
    "KEY_MODES", "UNITS", "MARKERS", "WORD_KEY_BASE", "canonical_token", "token_markers", "Vocabulary",
    "Encoded", "encode", "key_map", "lookup_key", "is_word_key", "word_key_of_hash",
    "string_hashes", "batches_by_token_budget", "PaddedBatch", "pad_batch",
]

KEY_MODES = ("id", "string")
UNITS = ("token", "word")
# Subword markers stripped by the "string" key: WordPiece continuation, byte-level BPE
# space, SentencePiece space.
MARKERS = ("##", "\u0120", "\u2581")


def canonical_token(token: str, markers: Sequence[str] = MARKERS) -> str:
    """A token string without its subword marker (``##ing`` -> ``ing``, ``Ġthe`` -> ``the``).

    ``markers``: the tokenizer's (:func:`token_markers`); by default any of the three.
    As in the paper's code, a token that is nothing but a marker (a lone ``Ġ``: a space)
    becomes the empty string, so it stays apart from ``ĠĠ`` (-> ``Ġ``).
    """
    for marker in markers:
        if token.startswith(marker):
            return token[len(marker):]
    return token


# Per-tokenizer tables, built once (a loop over the vocabulary, never per position) and
# dropped with their tokenizer: keyed by the object itself, not by an id() a later
# tokenizer could reuse.
_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()


def _cached(tokenizer, name: tuple, build: Callable[[], object]):
    """The tokenizer's table ``name``, built by ``build()`` on first use."""
    with _CACHE_LOCK:
        tables = _CACHE.setdefault(tokenizer, {})
        if name in tables:
            return tables[name]
    value = build()
    with _CACHE_LOCK:
        return tables.setdefault(name, value)


class Vocabulary:
    """What the reads need of a tokenizer (a token's string, a string's key, the subword
    markers): its token strings by id and its markers, a list where the tokenizer holds
    its whole model (Gemma 3's: hundreds of MB). Answers as the tokenizer it was made of
    for ``len``, ``convert_ids_to_tokens`` and ``get_vocab``, which is all the functions
    of this module read."""

    def __init__(self, tokens: Sequence[Optional[str]], markers: tuple[str, ...]):
        self.tokens = list(tokens)
        self.markers = tuple(markers)

    @classmethod
    def of(cls, tokenizer) -> "Vocabulary":
        return cls(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))), _markers(tokenizer))

    def __len__(self) -> int:
        return len(self.tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[Optional[str]]:
        """Each id's token string, None for an id past the vocabulary (as a fast tokenizer)."""
        n, tokens = len(self.tokens), self.tokens
        return [tokens[i] if 0 <= i < n else None for i in ids]

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id (equal to the tokenizer's for the packaged models: tests)."""
        return {t: i for i, t in enumerate(self.tokens) if t is not None}


def token_markers(tokenizer) -> tuple[str, ...]:
    """The subword marker a tokenizer writes, read from its fast backend (cached):
    ``("##",)`` for a WordPiece model, ``("Ġ",)`` for byte-level BPE, ``("▁",)`` for
    SentencePiece-style tokenizers (a Metaspace pre-tokenizer, or spaces replaced by ``▁``
    in the normalizer or decoder), ``()`` for none; all three without a fast backend."""
    return _cached(tokenizer, ("markers",), lambda: _markers(tokenizer))


def _markers(tokenizer) -> tuple[str, ...]:
    """:func:`token_markers`, uncached."""
    if isinstance(tokenizer, Vocabulary):
        return tokenizer.markers
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return MARKERS
    if type(backend.model).__name__ == "WordPiece":
        return ("##",)
    spec = " ".join(part.__getstate__().decode("utf-8", "replace")
                    for part in (backend.pre_tokenizer, backend.normalizer, backend.decoder)
                    if part is not None)
    if '"ByteLevel"' in spec:
        return ("\u0120",)
    if '"Metaspace"' in spec or "\u2581" in spec or "\\u2581" in spec:
        return ("\u2581",)
    return ()


def key_map(tokenizer, key: str) -> np.ndarray:
    """Vocabulary id -> key, an int64 array of the tokenizer's full length (cached).

    ``"id"``: the identity. ``"string"``: the smallest id with the same canonical string.
    """
    if key not in KEY_MODES:
        raise ValueError(f"key must be one of {', '.join(KEY_MODES)}")
    return _cached(tokenizer, ("key_map", key), lambda: _key_map(tokenizer, key))


def _key_map(tokenizer, key: str) -> np.ndarray:
    """:func:`key_map`, uncached."""
    size = len(tokenizer)
    mapping = np.arange(size, dtype=np.int64)
    if key == "string":
        tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
        markers = token_markers(tokenizer)
        first: dict[str, int] = {}
        for i, token in enumerate(tokens):  # once per tokenizer, not per position
            mapping[i] = first.setdefault(canonical_token(token or "", markers), i)
    return mapping


# ----------------------------------------------------------------------------- word names

# A polynomial hash of a name's UTF-8 bytes (digit = byte + 1, most significant first)
# modulo two primes below 2**31, so every product fits a uint64; the two residues make 62
# bits. Polynomial, so a word's hash composes from its pieces' hashes with array
# arithmetic: H(a + b) = H(a) * B**len(b) + H(b) (mod P).
_P = np.array([2147483647, 2147483629], dtype=np.uint64)
_B = np.array([911382323, 972663749], dtype=np.uint64)


def _pow_mod(exponents: np.ndarray) -> np.ndarray:
    """``B ** e mod P`` for both moduli: exponents (n,) int64 >= 0 -> (n, 2) uint64
    (square and multiply, one array step per bit of the largest exponent)."""
    e = exponents.astype(np.uint64)
    out = np.ones((e.shape[0], 2), dtype=np.uint64)
    base = np.broadcast_to(_B, out.shape).copy()
    while e.any():
        odd = (e & np.uint64(1)).astype(bool)
        out[odd] = out[odd] * base[odd] % _P
        e >>= np.uint64(1)
        base = base * base % _P
    return out


def _segment_hash(h: np.ndarray, length: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Hashes of concatenations: parts with hashes ``h`` (n, 2) uint64 and byte lengths
    ``length`` (n,) int64, cut into consecutive non-empty segments starting at ``starts``
    (S,) -> (S, 2) uint64, the hash of each segment's concatenated bytes."""
    n = h.shape[0]
    cum = np.cumsum(length)
    last = np.r_[starts[1:], n] - 1
    segment = np.repeat(np.arange(starts.shape[0]), np.diff(np.r_[starts, n]))
    after = cum[last][segment] - cum               # bytes after each part, in its segment
    terms = h * _pow_mod(after) % _P
    return np.add.reduceat(terms, starts, axis=0) % _P


def string_hashes(strings: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Polynomial hashes (n, 2) uint64 and UTF-8 byte lengths (n,) int64 of ``strings``
    (one ``encode`` per string: for a vocabulary once per tokenizer, or one query)."""
    encoded = [s.encode("utf-8", "surrogatepass") for s in strings]
    length = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    data = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(np.uint64) + np.uint64(1)
    out = np.zeros((len(encoded), 2), dtype=np.uint64)
    nonempty = length > 0                          # the empty string hashes to 0
    if nonempty.any():
        starts = (np.cumsum(length) - length)[nonempty]
        out[nonempty] = _segment_hash(np.repeat(data[:, None], 2, axis=1),
                                      np.ones(data.shape[0], dtype=np.int64), starts)
    return out, length


def word_key_of_hash(h: np.ndarray) -> np.ndarray:
    """The hashed key of names with hashes ``h`` (n, 2) uint64: (n,) int64 in
    ``[2**62, 2**63)``: the two 31-bit residues side by side, above :data:`WORD_KEY_BASE`.

    Two different names share a key with probability about 2**-62 (for names that are not
    built to collide); over N distinct multi-piece words some pair collides with
    probability about N**2 / 2**63: 1e-7 for a million words, 1e-3 for a hundred million.
    A collision merges the two words' statistics under one name."""
    packed = (h[:, 0] << np.uint64(31)) | h[:, 1]
    return (packed | np.uint64(WORD_KEY_BASE)).astype(np.int64)


@dataclass(frozen=True)
class _WordTable:
    """Per vocabulary id of one tokenizer and key mode, what the piece adds to the name of
    a multi-piece word, as its first piece and as a later one: strings (V,) object, their
    hashes (V, 2) uint64 and byte lengths (V,) int64; and the vocabulary's own names
    (their hashed keys sorted, (V',) int64, with the key each stands for)."""

    first: np.ndarray
    first_hash: np.ndarray
    first_len: np.ndarray
    rest: np.ndarray
    rest_hash: np.ndarray
    rest_len: np.ndarray
    vocab_hashed: np.ndarray
    vocab_key: np.ndarray

    def keys_of(self, h: np.ndarray) -> np.ndarray:
        """Keys of names with hashes ``h`` (n, 2): a vocabulary name's key, else hashed."""
        hashed = word_key_of_hash(h)
        where = np.minimum(np.searchsorted(self.vocab_hashed, hashed), len(self.vocab_hashed) - 1)
        return np.where(self.vocab_hashed[where] == hashed, self.vocab_key[where], hashed)


def _strip_continuation(token: str) -> str:
    """A piece after a word's first, without WordPiece's ``##`` (``##bed`` -> ``bed``)."""
    return token[2:] if token.startswith("##") and len(token) > 2 else token


def _word_table(tokenizer, key: str) -> _WordTable:
    """The tokenizer's :class:`_WordTable` under ``key`` (cached, like :func:`key_map`)."""
    return _cached(tokenizer, ("words", key), lambda: _build_word_table(tokenizer, key))


def _build_word_table(tokenizer, key: str) -> _WordTable:
    """:func:`_word_table`, uncached (loops over the vocabulary)."""
    tokens = [t or "" for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))]
    if key == "string":
        markers = token_markers(tokenizer)
        first = names = [canonical_token(t, markers) for t in tokens]
    else:
        first, names = tokens, tokens
    rest = [_strip_continuation(t) for t in tokens]
    vocab_hashed = word_key_of_hash(string_hashes(names)[0])
    order = np.argsort(vocab_hashed, kind="stable")
    return _WordTable(
        np.array(first, dtype=object), *string_hashes(first),
        np.array(rest, dtype=object), *string_hashes(rest),
        vocab_hashed[order], key_map(tokenizer, key)[order])


def lookup_key(tokenizer, token: str, key: str, unit: str = "token") -> Optional[int]:
    """The key a string is counted under, or None when no key can have that name.

    Tokens: a vocabulary string (with ``"string"`` keys, ``##ing``, ``ing`` and ``Ġing``
    name one key), else None. Words: also any other word name (see the module docstring),
    whose hashed key is returned whether or not that word was ever seen."""
    found = _vocab_key(tokenizer, token, key)
    if found is not None or unit == "token":
        return found
    name = canonical_token(token, token_markers(tokenizer)) if key == "string" else token
    return int(_word_table(tokenizer, key).keys_of(string_hashes([name])[0])[0])


def _vocab_key(tokenizer, token: str, key: str) -> Optional[int]:
    """The key of a vocabulary string under ``key``, or None."""
    table = _cached(tokenizer, ("lookup", key), lambda: _lookup_table(tokenizer, key))
    return table.get(canonical_token(token, token_markers(tokenizer)) if key == "string" else token)


def _lookup_table(tokenizer, key: str) -> dict[str, int]:
    """Vocabulary string (canonical under ``"string"``) -> its key."""
    vocab = tokenizer.get_vocab()
    if key == "id":
        return {string: int(i) for string, i in vocab.items()}
    mapping, markers = key_map(tokenizer, "string"), token_markers(tokenizer)
    table: dict[str, int] = {}
    for string, i in vocab.items():  # once per tokenizer
        table.setdefault(canonical_token(string, markers), int(mapping[i]))
    return table


@dataclass(frozen=True)
class Encoded:
    """Texts cut into windows, every position of every window in one flat array.

    Attributes
    ----------
    input_ids : ndarray (P,) int64, the ids fed to the model, special tokens included.
    keys : ndarray (P,) int64, the key each position is counted under (a word's key at
        each of its pieces).
    counted : ndarray (P,) bool, whether each position counts.
    starts : ndarray (W + 1,) int64, window ``w`` is ``[starts[w], starts[w + 1])``.
    text_index : ndarray (W,) int64, the text each window comes from.
    unit_start : ndarray (P,) bool, the first position of each counting unit (a token,
        or a word: its pieces are the counted positions up to the next unit start).
    names : hashed word key -> its name, for the hashed keys of these texts.
    """

    input_ids: np.ndarray
    keys: np.ndarray
    counted: np.ndarray
    starts: np.ndarray
    text_index: np.ndarray
    unit_start: np.ndarray
    names: dict = field(default_factory=dict)

    @property
    def num_windows(self) -> int:
        return int(self.text_index.shape[0])

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    @property
    def num_counted(self) -> int:
        """Counted positions (tokens)."""
        return int(self.counted.sum())

    @property
    def num_units(self) -> int:
        """Counted units: embeddings per layer (tokens, or words)."""
        return int(self.unit_start.sum())

    def window(self, w: int) -> slice:
        return slice(int(self.starts[w]), int(self.starts[w + 1]))


def _flat(lists, dtype=np.int64) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate per-window lists (one C-level conversion per window, none per position)."""
    parts = [np.asarray(x, dtype=dtype) for x in lists]
    starts = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([p.shape[0] for p in parts], out=starts[1:])
    return np.concatenate(parts), starts


def encode(tokenizer, texts: Sequence[str], max_length: int, include_special: bool = False,
           key: str = "id", unit: str = "token") -> Encoded:
    """Tokenise ``texts`` into windows of at most ``max_length`` tokens each.

    Uses the fast tokenizer's overflow (``return_overflowing_tokens`` with stride 0),
    which cuts the token sequence into consecutive, non-overlapping windows and adds the
    special tokens around each. With ``unit="word"``, positions are grouped into words
    by the same call's ``word_ids()`` (see the module docstring).
    """
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {', '.join(UNITS)}")
    if not texts:
        empty = np.zeros(0, dtype=np.int64)
        nothing = np.zeros(0, dtype=bool)
        return Encoded(empty, empty, nothing, np.zeros(1, dtype=np.int64), empty, nothing)
    enc = tokenizer(
        list(texts),
        truncation=True,
        max_length=max_length,
        stride=0,
        return_overflowing_tokens=True,
        return_special_tokens_mask=True,
        add_special_tokens=True,
    )
    input_ids, starts = _flat(enc["input_ids"])
    special, _ = _flat(enc["special_tokens_mask"])
    mapping = enc.get("overflow_to_sample_mapping")
    text_index = (np.asarray(mapping, dtype=np.int64) if mapping is not None
                  else np.arange(len(enc["input_ids"]), dtype=np.int64))
    counted = np.ones_like(special, dtype=bool) if include_special else special == 0
    keys = key_map(tokenizer, key)[input_ids]
    if unit == "token":
        return Encoded(input_ids, keys, counted, starts, text_index, counted)
    # word_ids() holds None for added special tokens: NaN in a float array, then -1.
    word_ids, _ = _flat((enc.word_ids(w) for w in range(len(starts) - 1)), dtype=np.float64)
    word_ids = np.nan_to_num(word_ids, nan=-1.0).astype(np.int64)
    window = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
    unit_start, keys, names = _words(_word_table(tokenizer, key), input_ids, keys, counted,
                                     word_ids, window)
    return Encoded(input_ids, keys, counted, starts, text_index, unit_start, names)


def _words(table: _WordTable, input_ids: np.ndarray, keys: np.ndarray, counted: np.ndarray,
           word_ids: np.ndarray, window: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
    """Group counted positions into words: ``(unit_start (P,) bool, keys (P,) int64 with
    each word's key at all its pieces, names of the hashed keys)``.

    ``keys`` (P,) are the token keys, ``word_ids`` (P,) int64 (-1: no word), ``window``
    (P,) the window of each position."""
    same = np.zeros_like(counted)
    same[1:] = (counted[:-1] & (window[1:] == window[:-1]) & (word_ids[1:] == word_ids[:-1])
                & (word_ids[1:] >= 0))
    unit_start = counted & ~same
    pos = np.flatnonzero(counted)
    unit = np.cumsum(unit_start)[pos] - 1                  # (N,) word of each counted position
    size = np.bincount(unit)
    word_keys = keys[unit_start]                           # one piece: its token's key
    multi = size[unit] > 1
    if not multi.any():
        return unit_start, keys, {}
    mpos = pos[multi]                                      # pieces of multi-piece words
    first = unit_start[mpos]
    ids = input_ids[mpos]
    seg = np.flatnonzero(first)                            # (S,) each word's first piece
    h = np.where(first[:, None], table.first_hash[ids], table.rest_hash[ids])
    lengths = np.where(first, table.first_len[ids], table.rest_len[ids])
    multi_keys = table.keys_of(_segment_hash(h, lengths, seg))
    word_keys[size > 1] = multi_keys
    keys = keys.copy()
    keys[pos] = word_keys[unit]
    return unit_start, keys, _names(table, ids, first, seg, multi_keys)


def _names(table: _WordTable, ids: np.ndarray, first: np.ndarray, seg: np.ndarray,
           multi_keys: np.ndarray) -> dict:
    """Names of the distinct hashed keys among multi-piece words: one occurrence of each
    (pieces ``ids`` (n,), ``first`` (n,) bool, words starting at ``seg`` (S,) with keys
    ``multi_keys`` (S,)), concatenated by ``np.add.reduceat`` over object arrays."""
    hashed = np.flatnonzero(is_word_key(multi_keys))
    if hashed.shape[0] == 0:
        return {}
    distinct, pick = np.unique(multi_keys[hashed], return_index=True)
    chosen = hashed[pick]                                  # one word per distinct key
    bounds = np.r_[seg, ids.shape[0]]
    lengths = bounds[chosen + 1] - bounds[chosen]
    offsets = np.r_[0, np.cumsum(lengths)[:-1]]
    rows = np.repeat(seg[chosen] - offsets, lengths) + np.arange(lengths.sum())
    strings = np.where(first[rows], table.first[ids[rows]], table.rest[ids[rows]])
    names = np.add.reduceat(strings, offsets)
    return dict(zip(distinct.tolist(), names.tolist()))


def batches_by_token_budget(lengths: np.ndarray, token_budget: int,
                            max_padding: float = 0.25) -> Iterator[np.ndarray]:
    """Group windows into batches whose padded size ``rows x longest`` fits the budget.

    Parameters
    ----------
    lengths : ndarray (W,), the length of each window.
    token_budget : the most padded positions a batch may hold.
    max_padding : a batch of at least an eighth of the budget also closes before its
        padding would exceed this share of its real positions (short texts of mixed
        lengths would otherwise be padded to the longest of them all).

    Yields
    ------
    ndarray of window indices per batch. Windows are sorted by length first; a single
    window longer than the budget still forms a batch of its own (the budget is checked
    against the model's maximum length at start-up). Every window is in exactly one batch.
    """
    lengths = np.asarray(lengths)
    order = np.argsort(lengths, kind="stable")
    sorted_lengths = lengths[order]
    real = np.concatenate([[0], np.cumsum(sorted_lengths)])
    start, W = 0, len(order)
    while start < W:
        # Sorted ascending, so the longest of [start, end) is its last window.
        ends = np.arange(start + 1, W + 1)
        padded = (ends - start) * sorted_lengths[start:]
        fits = padded <= token_budget
        tight = (padded <= (1 + max_padding) * (real[ends] - real[start])) | (padded < token_budget // 8)
        ok = fits & tight
        size = W - start if ok.all() else max(1, int(np.argmin(ok)))
        yield order[start:start + size]
        start += size


@dataclass(frozen=True)
class PaddedBatch:
    """Windows of one batch, right-padded to the longest: arrays of shape (B, T).

    ``attention`` is 1 on real positions; ``counted`` is False on padding and on the
    positions that do not count; ``unit_start`` marks the first position of each unit
    (see :class:`Encoded`; a word never spans two windows, so never two batches).
    """

    input_ids: np.ndarray
    attention: np.ndarray
    keys: np.ndarray
    counted: np.ndarray
    windows: np.ndarray
    unit_start: np.ndarray

    @property
    def num_counted(self) -> int:
        return int(self.counted.sum())


def pad_batch(encoded: Encoded, windows: np.ndarray, pad_id: int) -> PaddedBatch:
    """Gather the windows ``windows`` of ``encoded`` into right-padded (B, T) arrays."""
    lengths = encoded.lengths[windows]
    T = int(lengths.max())
    col = np.arange(T)
    real = col[None, :] < lengths[:, None]
    src = np.minimum(encoded.starts[windows][:, None] + col[None, :], len(encoded.input_ids) - 1)
    input_ids = np.where(real, encoded.input_ids[src], pad_id)
    keys = np.where(real, encoded.keys[src], 0)
    counted = real & encoded.counted[src]
    unit_start = real & encoded.unit_start[src]
    return PaddedBatch(input_ids, real.astype(np.int64), keys, counted, windows, unit_start)
