"""Texts -> windows -> forward batches -> per-batch reduction -> job-local moments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

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

