"""Spaces and their reads: which token types a space has, their strings, their vectors,
and the rows two spaces share (see :mod:`embgeom.comparisons` for the rules).

The only module of the package that reads the store; an input space's vectors come from
the model (:mod:`embgeom.comparisons.forward`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np

from embgeom import reports
from embgeom.comparisons.cache import GeometryCache
from embgeom.comparisons.forward import INPUT, input_rows
from embgeom.comparisons.limits import Limits
from embgeom.compute.positions import canonical_token, is_word_key, token_markers
from embgeom.errors import InvalidInput, NotFound
from embgeom.geometry.matching import Match, match_tokens, select_rows
from embgeom.store import keys as K
from embgeom.store.keys import PairKeys
from embgeom.store.reader import PairState, Reader

__all__ = ["INPUT", "Space", "SpaceTokens", "Spaces", "as_of"]


@dataclass(frozen=True)
class Space:
    """``{collection, model, layer}``; ``layer`` an int or ``"input"``."""

    collection: str
    model: str
    layer: Union[int, str]

    def to_dict(self) -> dict:
        return {"collection": self.collection, "model": self.model, "layer": self.layer}


@dataclass
class SpaceTokens:
    """The token types a space's rows can be: the pair's types with ``n_t >= min_count``.

    ``keys`` (k,) int64 ascending, ``n`` (k,) their counts, ``all_n`` the counts of every
    type of the pair (for the ``min_count`` that would fit a cap), ``position`` the layer's
    place in the records (None for an input space)."""

    space: Space
    state: PairState
    position: Optional[int]
    keys: np.ndarray
    n: np.ndarray
    all_n: np.ndarray
    min_count: int

    @property
    def key_mode(self) -> str:
        return self.state.conf.key if self.state.conf is not None else "id"

    @property
    def ident(self) -> tuple:
        """What the space's contents depend on: it changes with every checkpoint."""
        return (self.space.collection, self.space.model, self.space.layer, self.state.gen,
                self.state.version, self.min_count)

    @property
    def settled(self) -> bool:
        return self.state.applying == 0

    def min_count_to_fit(self, cap: int) -> int:
        """The smallest ``min_count >= self.min_count`` keeping at most ``cap`` types."""
        above = np.sort(self.all_n[self.all_n >= self.min_count])[::-1]
        if above.shape[0] <= cap:
            return self.min_count
        return int(above[cap]) + 1


def as_of(ta: SpaceTokens, tb: SpaceTokens) -> dict:
    """The ``as_of`` of an answer on two spaces."""
    return {"a": ta.state.as_of(), "b": tb.state.as_of()}


class Spaces:
    """The reads of spaces for one service process.

    Parameters
    ----------
    reader : the store's :class:`~embgeom.store.reader.Reader`.
    run : runs a read plan synchronously (``Runtime.read_sync``): every method here is
        CPU-bound and meant for a worker thread, never the event loop.
    registry : the :class:`~embgeom.compute.models.ModelRegistry` (aliases, tokenizers).
    models : alias -> :class:`~embgeom.compute.models.LoadedModel`, for input spaces and
        steering texts (``ModelPool.get``; called only when needed).
    limits, cache : caps, and the cache the token matrices are kept in.
    """

    def __init__(self, reader: Reader, run: Callable, registry, models: Callable,
                 limits: Limits, cache: GeometryCache):
        self.reader = reader
        self.run = run
        self.registry = registry
        self.models = models
        self.limits = limits
        self.cache = cache
        self._vocab_same: dict[tuple[str, str], bool] = {}

    def check_space(self, space: Space) -> None:
        """Name, alias and layer range of a space (before any read)."""
        if not K.valid_name(space.collection):
            raise InvalidInput(f"collection name {space.collection!r} does not match "
                               f"{K.NAME_PATTERN}", type="invalid_collection_name")
        self.registry.source(space.model)  # unknown_model (404)
        info = self.registry.info(space.model)
        if isinstance(space.layer, str):
            if space.layer != INPUT:
                raise InvalidInput(f"layer must be an integer or {INPUT!r}, got {space.layer!r}",
                                   type="invalid_space")
        elif isinstance(space.layer, bool) or not 0 <= space.layer <= info.num_layers:
            raise NotFound("layer_not_found", f"layer {space.layer} is out of range for "
                           f"{space.model}: 0..{info.num_layers}", layer=space.layer,
                           num_layers=info.num_layers)

    def tokens(self, space: Space, min_count: int) -> SpaceTokens:
        """The pair's state and its token types with ``n_t >= min_count``:
        ``collection_not_found``, ``model_not_in_collection``, ``layer_not_kept``."""
        if min_count < 1:
            raise InvalidInput("min_count must be >= 1", type="invalid_filter")
        self.check_space(space)
        state = self.run(self.reader.pair_state(PairKeys(space.collection, space.model)))
        empty = np.zeros(0, dtype=np.int64)
        if state.empty:
            return SpaceTokens(space, state, None, empty, np.zeros(0), np.zeros(0), min_count)
        position = None
        if space.layer != INPUT:
            position = state.conf.layer_position(space.layer)
            if position is None:
                raise NotFound("layer_not_kept",
                               f"layer {space.layer} is not among the layers collection "
                               f"{space.collection!r} keeps: {list(state.conf.layers)}",
                               layer=space.layer, kept=list(state.conf.layers))
        scal = self.run(self.reader.scalars(state))
        keep = scal.n >= min_count
        if space.layer == INPUT:
            keep &= ~is_word_key(scal.ids)
        return SpaceTokens(space, state, position, scal.ids[keep], scal.n[keep], scal.n, min_count)

    def strings(self, t: SpaceTokens, keys: np.ndarray) -> list[str]:
        """Canonical strings of keys (the matching key across tokenizers): as shown under
        string keys, with the tokenizer's marker stripped under id keys."""
        shown = self.display(t, keys)
        if t.key_mode == "string":
            return shown
        markers = token_markers(self.registry.vocabulary(t.space.model))
        return [canonical_token(s, markers) for s in shown]

    def display(self, t: SpaceTokens, keys: np.ndarray) -> list[str]:
        """Token strings as the collection counts them, as ``/tokens`` shows them: the
        tokenizer's own string under id keys, the canonical one under string keys, a
        word's name (:func:`~embgeom.reports.token_strings`)."""
        return self.run(reports.token_strings(self.reader, t.state,
                                              self.registry.vocabulary(t.space.model), keys))

    def same_vocabulary(self, a: str, b: str) -> bool:
        if a == b:
            return True
        key = tuple(sorted((a, b)))
        if key not in self._vocab_same:
            va = self.registry.vocabulary(a).get_vocab()
            vb = self.registry.vocabulary(b).get_vocab()
            self._vocab_same[key] = va == vb
        return self._vocab_same[key]

    def match(self, a: SpaceTokens, b: SpaceTokens) -> Match:
        """Shared tokens of two spaces (see :mod:`embgeom.comparisons` for the rule)."""
        by_id = a.key_mode == b.key_mode and self.same_vocabulary(a.space.model, b.space.model)
        if by_id:
            return match_tokens(a.keys, a.n, None, b.keys, b.n, None, "id")
        return match_tokens(a.keys, a.n, self.strings(a, a.keys),
                            b.keys, b.n, self.strings(b, b.keys), "string")

    def rows(self, t: SpaceTokens, idx: np.ndarray) -> np.ndarray:
        """The space's vectors of ``t.keys[idx]``: (len(idx), d) float64."""
        keys = t.keys[idx]
        if t.space.layer == INPUT:
            return input_rows(self.models(t.space.model), keys)
        _, _, mean = self.run(self.reader.means_of(t.state, keys, [t.position]))
        return mean[:, 0]

    def mean_of(self, t: SpaceTokens, key: int) -> tuple[float, np.ndarray]:
        """One token's count and mean at the space's layer, whatever its count."""
        n, _, mean = self.run(self.reader.means_of(t.state, [key], [t.position]))
        return float(n[0]), mean[0, 0]

    def matrix(self, t: SpaceTokens) -> np.ndarray:
        """Every row of a space (its tokens with ``n_t >= min_count``), cached."""
        X, _ = self.cache.through(("matrix",) + t.ident, t.settled,
                                  lambda: self.rows(t, np.arange(t.keys.shape[0])),
                                  lambda X: X.nbytes)
        return X

    def shared(self, ta: SpaceTokens, tb: SpaceTokens, cap: int, sample: Optional[int],
               seed: int, need: int) -> dict:
        """The rows two spaces share, at most ``cap`` of them (or a seeded ``sample``),
        without zero vectors: ``Xa``, ``Xb``, their rows in each space, and the answer's
        header (how they were matched, how many were used). ``too_few_shared_tokens``
        below ``need`` (and the ``geometry_min_shared_tokens`` floor)."""
        m = self.match(ta, tb)
        need = max(need, self.limits.min_shared_tokens)
        if len(m) < need:
            raise InvalidInput(
                f"{len(m)} tokens with n >= {ta.min_count} are shared by the two spaces; at "
                f"least {need} are needed (ingest more text or lower min_count)",
                type="too_few_shared_tokens", shared_tokens=len(m), needed=need)
        if sample is not None and sample < need:
            raise InvalidInput(f"sample must be at least {need}", type="invalid_sample",
                               sample=sample, needed=need)
        idx, sampled = select_rows(len(m), cap, sample, seed)
        ra, rb = m.rows_a[idx], m.rows_b[idx]
        Xa, Xb = self.rows(ta, ra), self.rows(tb, rb)
        # A zero vector has no direction (cosines undefined): never a real mean, possibly
        # an input row (padding); left out and counted.
        ok = (np.linalg.norm(Xa, axis=1) > 0) & (np.linalg.norm(Xb, axis=1) > 0)
        if not ok.all():
            Xa, Xb, ra, rb = Xa[ok], Xb[ok], ra[ok], rb[ok]
        if Xa.shape[0] < need:
            raise InvalidInput(f"{Xa.shape[0]} usable shared tokens; at least {need} are needed",
                               type="too_few_shared_tokens", shared_tokens=int(Xa.shape[0]),
                               needed=need)
        return {"match": m, "Xa": Xa, "Xb": Xb, "rows_a": ra, "rows_b": rb, "sampled": sampled,
                "header": {"a": ta.space.to_dict(), "b": tb.space.to_dict(),
                           "matched_by": m.by, "shared_tokens": len(m),
                           "tokens_used": int(Xa.shape[0]), "sampled": sampled,
                           "min_count": ta.min_count, "seed": seed}}
