"""Which token positions count, and under which key: the one place that decides it.

A text is tokenised by the model's own tokenizer and cut into consecutive windows of at
most the model's maximum length, each window encoded on its own with the special
tokens the tokenizer adds around a text ([CLS]/[SEP], <s>/</s>, BOS/EOS). No token is
dropped: a long text becomes several windows.

A position counts when it is not padding and, unless the job asks
``include_special=True``, it is not one of those added special tokens (the tokenizer's
``special_tokens_mask``). Tokens that come from the text itself count, [UNK] and a
literal "[SEP]" typed in the text included. A counted position is keyed by its
vocabulary id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

__all__ = ["Window", "encode_windows", "batches_by_token_budget"]


@dataclass(frozen=True)
class Window:
    """One encoded window of one text.

    Attributes
    ----------
    text_index : index of the text it comes from, in the job.
    input_ids : the ids fed to the model, special tokens included.
    keys : the key each position is counted under (its vocabulary id).
    counted : whether each position counts.
    """

    text_index: int
    input_ids: tuple[int, ...]
    keys: tuple[int, ...]
    counted: tuple[bool, ...]

    def __len__(self) -> int:
        return len(self.input_ids)


def encode_windows(
    tokenizer, texts: Sequence[str], max_length: int, include_special: bool = False
) -> list[Window]:
    """Tokenise ``texts`` into windows of at most ``max_length`` tokens each.

    Uses the fast tokenizer's overflow (``return_overflowing_tokens`` with stride 0),
    which cuts the token sequence into consecutive, non-overlapping windows and adds
    the special tokens around each.
    """
    if not texts:
        return []
    enc = tokenizer(
        list(texts),
        truncation=True,
        max_length=max_length,
        stride=0,
        return_overflowing_tokens=True,
        return_special_tokens_mask=True,
        add_special_tokens=True,
    )
    mapping = enc.get("overflow_to_sample_mapping") or list(range(len(enc["input_ids"])))
    windows = []
    for ids, special, text_index in zip(enc["input_ids"], enc["special_tokens_mask"], mapping):
        counted = tuple(include_special or not s for s in special)
        windows.append(Window(int(text_index), tuple(ids), tuple(ids), counted))
    return windows


def batches_by_token_budget(windows: Iterable[Window], token_budget: int) -> Iterator[list[Window]]:
    """Group windows into batches whose padded size ``rows x longest`` fits the budget.

    Windows are sorted by length first so padding is small; a single window longer than
    the budget still forms a batch of its own (the budget is checked against the
    model's maximum length at start-up).
    """
    batch: list[Window] = []
    longest = 0
    for window in sorted(windows, key=len):
        size = max(longest, len(window))
        if batch and size * (len(batch) + 1) > token_budget:
            yield batch
            batch, size = [], len(window)
        batch.append(window)
        longest = size
    if batch:
        yield batch
