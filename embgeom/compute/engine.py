"""Texts -> windows -> padded batches -> forward -> per-batch reduction, for one model.

:class:`Engine` splits a job's work in two halves so a worker can overlap them:
:meth:`Engine.prepare` (tokenise, cut into windows, pad into token-budget batches, pin
the host memory: CPU work, run on the worker's prefetch thread while the device is busy)
and :meth:`Engine.run` (copy to the device without blocking, forward, reduce: device
work, on the worker's main thread).

What a collection counts (its key, its unit, its layers, special tokens, self-similarity)
comes from :class:`CountingRule`, decided once per (collection, model) and fixed. With the
word unit, each batch's hidden states are pooled into one row per word (the mean of its
pieces, :func:`pool_words`) before the reduction, which then sees words as it sees tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from embgeom.compute.models import LoadedModel
from embgeom.compute.positions import PaddedBatch, batches_by_token_budget, encode, pad_batch
from embgeom.compute.reduce import PRECISIONS, reduce_batch
from embgeom.stats import LayerMoments, TokenMoments

__all__ = ["CountingRule", "PreparedJob", "Engine", "padded_batches", "POOLINGS", "pool_words", "text_embeddings"]


@dataclass(frozen=True)
class CountingRule:
    """Which positions count, under which key, at which layers (a collection's settings,
    resolved against one model).

    ``window`` is the longest window in tokens (special tokens included) a text is cut
    into: it decides counts (each window adds its special tokens, and a word across a
    window boundary is two words), so it is the pair's pinned value, not the worker's;
    0 means the model's maximum as this worker's registry reports it."""

    layers: tuple[int, ...]
    key: str = "id"
    include_special: bool = False
    self_similarity: bool = True
    unit: str = "token"
    window: int = 0


@dataclass
class PreparedJob:
    """A job's texts, ready for the device: its batches, how many embeddings count (per
    layer: tokens, or words), and the names of its hashed word keys."""

    batches: list
    counted: int
    windows: int
    names: dict = field(default_factory=dict)


def padded_batches(tokenizer, texts: Sequence[str], rule: CountingRule, window: int,
                   token_budget: int, pad_id: int) -> tuple[object, list[PaddedBatch]]:
    """A job's texts as the service batches them: cut into windows of ``window`` tokens
    under ``rule``, grouped into right-padded batches of at most ``token_budget`` padded
    tokens (at least one window each). Returns ``(encoding, batches)``; host work, no
    model (the benchmarks record exactly this)."""
    enc = encode(tokenizer, texts, window, rule.include_special, rule.key, rule.unit)
    budget = max(token_budget, window)
    return enc, [pad_batch(enc, w, pad_id) for w in batches_by_token_budget(enc.lengths, budget)]


class Engine:
    """Forward + reduction of one loaded model under one counting rule."""

    def __init__(self, loaded: LoadedModel, rule: CountingRule, token_budget: int = 16384,
                 precision: str = "fp32"):
        self.loaded = loaded
        self.rule = rule
        self.window = rule.window or loaded.info.max_length
        self.token_budget = max(token_budget, self.window)  # a batch holds at least one window
        self.precision = precision
        self._pin = loaded.device.type == "cuda"

    def prepare(self, texts: Sequence[str]) -> PreparedJob:
        """Tokenise and batch (host work; thread-safe)."""
        enc, padded = padded_batches(self.loaded.tokenizer, texts, self.rule, self.window,
                                     self.token_budget, self.loaded.pad_id)
        return PreparedJob([self._to_tensors(b) for b in padded], enc.num_units,
                           enc.num_windows, enc.names)

    def _to_tensors(self, batch: PaddedBatch) -> dict:
        names = ("input_ids", "attention", "keys", "counted")
        if self.rule.unit == "word":
            names += ("unit_start",)
        out = {name: torch.from_numpy(getattr(batch, name)) for name in names}
        if self._pin:
            out = {k: v.pin_memory() for k, v in out.items()}
        return out

    @torch.inference_mode()
    def run(self, batch: dict, window=None) -> tuple[Optional[TokenMoments], LayerMoments]:
        """Forward one prepared batch and reduce it on the device. With ``window`` (a
        :class:`~embgeom.compute.window.WindowAccumulator`), the batch's per-type sums and
        its co-moment go straight into it, and the token moments returned are None: pass
        the pair to ``window.add``, which folds in the layer moments."""
        dev = self.loaded.device
        moved = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
        hidden = self.loaded.hidden_states(moved["input_ids"], moved["attention"])
        layers, keys, counted = self.rule.layers, moved["keys"], moved["counted"]
        if "unit_start" in moved:
            hidden, keys = pool_words(hidden, layers, keys, counted, moved["unit_start"],
                                      PRECISIONS[self.precision])
            layers, counted = range(len(layers)), torch.ones_like(keys, dtype=torch.bool)
        return reduce_batch(hidden, layers, keys, counted, self.rule.self_similarity,
                            self.precision, None if window is None else window.layers, window)


def pool_words(hidden_states: Sequence[torch.Tensor], layers: Sequence[int], keys: torch.Tensor,
               counted: torch.Tensor, unit_start: torch.Tensor,
               dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One row per word: the mean of its pieces' states (segment sums, no loop per word).

    Parameters
    ----------
    hidden_states : L+1 tensors (B, T, d), the forward's.
    layers : the indices of ``hidden_states`` to pool.
    keys, counted, unit_start : (B, T): each position's key (its word's), whether it
        counts, whether it starts a word; a word's pieces are the counted positions from
        its start to the next start, in row-major order (never across rows).
    dtype : the arithmetic of the sums (the reduction's work precision).

    Returns
    -------
    ``(pooled, word_keys)``: per kept layer a (1, Nw, d) tensor in ``dtype``, and the
    words' keys (1, Nw), for :func:`~embgeom.compute.reduce.reduce_batch` with layers
    ``0..len(layers)-1`` and every row counted.
    """
    starts = unit_start[counted]                                 # (N,) bool
    word = torch.cumsum(starts, 0) - 1                           # (N,) word of each piece
    num_words = int(starts.sum())
    size = torch.bincount(word, minlength=num_words).to(dtype)[:, None]
    pooled = []
    for layer in layers:
        x = hidden_states[layer][counted].to(dtype)
        sums = torch.zeros((num_words, x.shape[1]), dtype=dtype, device=x.device)
        pooled.append((sums.index_add_(0, word, x) / size)[None])
    return pooled, keys[counted][starts][None]


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
    enc = encode(loaded.tokenizer, texts, info.max_length, include_special)
    d = info.hidden_size
    P = enc.input_ids.shape[0]
    # Every position's hidden state, in flat (window, position) order.
    flat = {l: np.zeros((P, d), dtype=np.float32) for l in layers}
    for windows in batches_by_token_budget(enc.lengths, max(token_budget, info.max_length)):
        batch = pad_batch(enc, windows, loaded.pad_id)
        hidden = loaded.forward_padded(batch)
        real = batch.attention.astype(bool)
        dest = (enc.starts[windows][:, None] + np.arange(real.shape[1])[None, :])[real]
        for l in layers:
            flat[l][dest] = hidden[l][torch.from_numpy(real).to(hidden[l].device)].float().cpu().numpy()
    if pooling is None:
        return {l: flat[l][enc.counted] for l in layers}
    window_of = np.repeat(np.arange(enc.num_windows), enc.lengths)
    text_of = enc.text_index[window_of]
    counts = np.bincount(text_of[enc.counted], minlength=len(texts)).astype(np.float64)
    first = enc.starts[:-1][np.unique(enc.text_index, return_index=True)[1]]
    last_window = len(enc.text_index) - 1 - np.unique(enc.text_index[::-1], return_index=True)[1]
    last = enc.starts[1:][last_window] - 1
    out = {}
    for l in layers:
        if pooling == "mean":
            sums = np.zeros((len(texts), d))
            np.add.at(sums, text_of[enc.counted], flat[l][enc.counted].astype(np.float64))
            out[l] = sums / np.maximum(counts, 1)[:, None]
        else:
            out[l] = flat[l][first if pooling == "cls" else last].astype(np.float64)
    return out
