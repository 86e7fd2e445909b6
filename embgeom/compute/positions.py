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
- ``"string"``: its token string with the subword markers stripped (WordPiece ``##``,
  byte-level BPE ``Ġ``, SentencePiece ``▁``), the convention of Yamagiwa & Shimodaira's
  released code, so ``##s`` and ``s`` are one key. The key is then the smallest vocabulary
  id whose token has that canonical string, so keys stay integers and a key's string is
  the tokenizer's.

Everything is array arithmetic over the whole job: no Python loop per position.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np

__all__ = [
    "KEY_MODES", "MARKERS", "canonical_token", "Encoded", "encode", "key_map", "lookup_key",
    "batches_by_token_budget", "PaddedBatch", "pad_batch",
]

KEY_MODES = ("id", "string")
# Subword markers stripped by the "string" key: WordPiece continuation, byte-level BPE
# space, SentencePiece space.
MARKERS = ("##", "\u0120", "\u2581")


def canonical_token(token: str) -> str:
    """A token string without its subword marker (``##ing`` -> ``ing``, ``Ġthe`` -> ``the``).

    A token that is nothing but a marker (a lone ``Ġ`` or ``▁``: a space) is kept as it
    is, so it does not merge with the empty string.
    """
    for marker in MARKERS:
        if token.startswith(marker) and len(token) > len(marker):
            return token[len(marker):]
    return token


_KEY_MAPS: dict[tuple[int, str], np.ndarray] = {}
_KEY_MAPS_LOCK = threading.Lock()


def key_map(tokenizer, key: str) -> np.ndarray:
    """Vocabulary id -> key, an int64 array of the tokenizer's full length (cached).

    ``"id"``: the identity. ``"string"``: the smallest id with the same canonical string.
    """
    if key not in KEY_MODES:
        raise ValueError(f"key must be one of {', '.join(KEY_MODES)}")
    cache_key = (id(tokenizer), key)
    with _KEY_MAPS_LOCK:
        if cache_key in _KEY_MAPS:
            return _KEY_MAPS[cache_key]
    size = len(tokenizer)
    mapping = np.arange(size, dtype=np.int64)
    if key == "string":
        tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
        first: dict[str, int] = {}
        for i, token in enumerate(tokens):  # once per tokenizer, not per position
            mapping[i] = first.setdefault(canonical_token(token or ""), i)
    with _KEY_MAPS_LOCK:
        _KEY_MAPS[cache_key] = mapping
    return mapping


_LOOKUPS: dict[tuple[int, str], dict[str, int]] = {}


def lookup_key(tokenizer, token: str, key: str) -> Optional[int]:
    """The key a vocabulary string is counted under, or None when it is not in the
    vocabulary. With ``"string"`` keys, ``##ing``, ``ing`` and ``Ġing`` name one key."""
    cache_key = (id(tokenizer), key)
    table = _LOOKUPS.get(cache_key)
    if table is None:
        vocab = tokenizer.get_vocab()
        if key == "string":
            mapping = key_map(tokenizer, "string")
            table = {}
            for string, i in vocab.items():  # once per tokenizer
                table.setdefault(canonical_token(string), int(mapping[i]))
        else:
            table = {string: int(i) for string, i in vocab.items()}
        with _KEY_MAPS_LOCK:
            _LOOKUPS[cache_key] = table
    return table.get(canonical_token(token) if key == "string" else token)


@dataclass(frozen=True)
class Encoded:
    """Texts cut into windows, every position of every window in one flat array.

    Attributes
    ----------
    input_ids : ndarray (P,) int64, the ids fed to the model, special tokens included.
    keys : ndarray (P,) int64, the key each position is counted under.
    counted : ndarray (P,) bool, whether each position counts.
    starts : ndarray (W + 1,) int64, window ``w`` is ``[starts[w], starts[w + 1])``.
    text_index : ndarray (W,) int64, the text each window comes from.
    """

    input_ids: np.ndarray
    keys: np.ndarray
    counted: np.ndarray
    starts: np.ndarray
    text_index: np.ndarray

    @property
    def num_windows(self) -> int:
        return int(self.text_index.shape[0])

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    @property
    def num_counted(self) -> int:
        return int(self.counted.sum())

    def window(self, w: int) -> slice:
        return slice(int(self.starts[w]), int(self.starts[w + 1]))


def _flat(lists) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate per-window lists (one C-level conversion per window, none per position)."""
    parts = [np.asarray(x, dtype=np.int64) for x in lists]
    starts = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([p.shape[0] for p in parts], out=starts[1:])
    return np.concatenate(parts), starts


def encode(tokenizer, texts: Sequence[str], max_length: int, include_special: bool = False,
           key: str = "id") -> Encoded:
    """Tokenise ``texts`` into windows of at most ``max_length`` tokens each.

    Uses the fast tokenizer's overflow (``return_overflowing_tokens`` with stride 0),
    which cuts the token sequence into consecutive, non-overlapping windows and adds the
    special tokens around each.
    """
    if not texts:
        empty = np.zeros(0, dtype=np.int64)
        return Encoded(empty, empty, np.zeros(0, dtype=bool), np.zeros(1, dtype=np.int64), empty)
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
    return Encoded(input_ids, keys, counted, starts, text_index)


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
    positions that do not count.
    """

    input_ids: np.ndarray
    attention: np.ndarray
    keys: np.ndarray
    counted: np.ndarray
    windows: np.ndarray

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
    return PaddedBatch(input_ids, real.astype(np.int64), keys, counted, windows)
