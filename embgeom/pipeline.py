"""Texts -> windows -> forward batches -> per-batch reduction -> job-local moments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from embgeom.models import LoadedModel
from embgeom.positions import batches_by_token_budget, encode_windows
from embgeom.reduce import reduce_batch
from embgeom.stats import LayerMoments, TokenAccumulator

__all__ = ["JobMoments", "accumulate_texts"]


@dataclass
class JobMoments:
    """What one job adds: per-token moments, per-layer moments, and counts."""

    tokens: TokenAccumulator
    layers: LayerMoments
    texts: int
    windows: int

    @property
    def counted(self) -> int:
        return int(self.layers.n)


def accumulate_texts(
    loaded: LoadedModel,
    texts: Sequence[str],
    include_special: bool = False,
    token_budget: int = 16384,
    on_progress: Optional[Callable[[float, int], None]] = None,
) -> JobMoments:
    """Run the model over ``texts`` and fold every counted hidden state into moments.

    ``on_progress(fraction_done, tokens_counted)`` is called after each batch.
    """
    info = loaded.info
    windows = encode_windows(loaded.tokenizer, texts, info.max_length, include_special)
    num_layers = info.num_layers + 1
    tokens = TokenAccumulator(num_layers, info.hidden_size)
    layers = LayerMoments.empty(num_layers, info.hidden_size)
    done = 0
    for batch in batches_by_token_budget(windows, max(token_budget, info.max_length)):
        hidden, keys, counted = loaded.hidden_states(batch)
        batch_tokens, batch_layers = reduce_batch(hidden, keys, counted)
        del hidden
        if len(batch_tokens):
            within_increase = tokens.add(batch_tokens)
            # ``within`` of the job is sum_t m2_t over its tokens: the batch's own
            # within-sum plus the cross terms of merging into earlier batches.
            batch_layers.within = within_increase
            layers = layers.merged(batch_layers)
        done += len(batch)
        if on_progress is not None:
            on_progress(done / max(len(windows), 1), int(layers.n))
    return JobMoments(tokens=tokens, layers=layers, texts=len(texts), windows=len(windows))



POOLINGS = ("cls", "mean", "last")


def text_embeddings(
    loaded: LoadedModel,
    texts: Sequence[str],
    layers: Sequence[int],
    pooling: Optional[str] = None,
    include_special: bool = False,
    token_budget: int = 16384,
) -> dict[int, np.ndarray]:
    """Raw hidden states for small synchronous requests (isotropy samples, probes).

    With ``pooling=None``: per layer, every counted embedding, shape (N, d), float32, in
    text order. With a pooling, one vector per text, shape (len(texts), d), float64:
    ``cls`` = the first position of the text's first window (the [CLS] token of an
    encoder, the first token of a decoder), ``mean`` = the mean of the text's counted
    positions over all its windows, ``last`` = the last position of its last window
    (the final [SEP] of an encoder, the last token of a decoder).
    """
    if pooling is not None and pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}")
    info = loaded.info
    windows = encode_windows(loaded.tokenizer, texts, info.max_length, include_special)
    order = {id(w): i for i, w in enumerate(windows)}
    per_window: dict[int, list] = {l: [None] * len(windows) for l in layers}
    for batch in batches_by_token_budget(windows, max(token_budget, info.max_length)):
        hidden, _, counted = loaded.hidden_states(batch)
        for row, w in enumerate(batch):
            for l in layers:
                h = hidden[l][row, : len(w)].float().cpu().numpy()
                per_window[l][order[id(w)]] = (h, counted[row, : len(w)].numpy())
    out = {}
    for l in layers:
        if pooling is None:
            parts = [h[mask] for h, mask in per_window[l]]
            out[l] = np.concatenate(parts) if parts else np.zeros((0, info.hidden_size), np.float32)
            continue
        pooled = np.zeros((len(texts), info.hidden_size))
        sums = np.zeros((len(texts), info.hidden_size))
        counts = np.zeros(len(texts))
        first_seen = set()
        for w, (h, mask) in zip(windows, per_window[l]):
            t = w.text_index
            if pooling == "cls" and t not in first_seen:
                pooled[t] = h[0]
            elif pooling == "last":
                pooled[t] = h[-1]  # windows come in order, so the last one wins
            sums[t] += h[mask].astype(np.float64).sum(axis=0)
            counts[t] += mask.sum()
            first_seen.add(t)
        if pooling == "mean":
            pooled = sums / np.maximum(counts, 1)[:, None]
        out[l] = pooled
    return out
