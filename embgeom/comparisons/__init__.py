"""Comparisons of token embedding spaces held in the store: the measures of
:mod:`embgeom.geometry` (pure numpy) on spaces read here, matched across models
(:mod:`embgeom.geometry.matching`), gated and cached. A file per concern::

    spaces   what a space is and its reads: token types, strings, vectors, shared rows
    forward  the reads that run a model: an input space's rows, the vectors of texts
    cache    the LRU of answers, matrices and figures, with its owner and byte bound
    gate     how many computations run at once (``overloaded`` beyond)
    limits   caps on one request and the checks of its parameters
    measures what every family below shares: the space reader, the cache, the gate
    pairs    global similarity and LLE transfer of two spaces
    layer    intrinsic dimension and neighbours in one layer
    steering Emb2Emb steering transfer
    figures  the figures of those answers
    numbers  JSON floats and cosines

A *space* is ``{collection, model, layer}``:

- ``layer`` an integer (a ``hidden_states`` index the collection keeps): the matrix whose
  row t is ``mu_t``, the mean embedding of token type t over everything the collection
  ingested for that model, for every type with ``n_t >= min_count``;
- ``layer = "input"``: the model's input embedding matrix ``E``
  (``model.get_input_embeddings().weight``) restricted to those same token types, row t
  being ``E[t]``. The collection only chooses which tokens (the ones its text contains);
  a word-unit collection's multi-piece words (hashed keys) have no row of ``E`` and are
  left out of its input space.

Under a collection keyed by ``"string"`` a token key is the smallest vocabulary id of its
canonical string (see :mod:`embgeom.compute.positions`), and an input row is that id's.

Two spaces are compared on their *shared tokens*:

- by key, when both pairs count tokens under the same key mode and the two tokenizers have
  the same vocabulary (every string with the same id): a space against another layer or
  another collection of the same model, for example;
- otherwise by canonical string, the paper preset's normalisation
  (:func:`~embgeom.compute.positions.canonical_token`: the tokenizer's ``##``, ``Ġ`` or
  ``▁`` stripped, case kept; a word by its name). When several tokens of one space share
  a canonical string (``s`` and ``##s`` under id keys), the one with the largest count
  ``n_t`` represents it, ties to the smallest key: deterministic, and the most frequent
  form is usually the word-initial one whatever the tokenizer's marker convention.

Every answer says how they were matched (``matched_by``), how many tokens matched
(``shared_tokens``) and how many were used (``tokens_used``, after a seeded sample and
after dropping rows with a zero vector).

Bounded work: a comparison reads the per-token scalars (one small record per token, cached
by the reader per version), matches and samples on them, and only then reads the means of
the tokens it uses (:meth:`~embgeom.store.reader.Reader.means_of`). Caps
(:class:`~embgeom.comparisons.limits.Limits`, from the settings) bound the tokens and
neighbours of every request; beyond them a comparison samples with its seed, and a read
that cannot sample (the neighbours and intrinsic dimension of a layer's token set) answers
``too_many_tokens`` with the ``min_count`` that would fit. Results are cached until either
space changes.
"""

from __future__ import annotations

from typing import Callable, Optional

from embgeom.comparisons.cache import GeometryCache
from embgeom.comparisons.figures import FIGURE_PAIRS, Figures, RenderedFigure
from embgeom.comparisons.gate import Gate
from embgeom.comparisons.layer import LayerMeasures
from embgeom.comparisons.limits import Limits
from embgeom.comparisons.pairs import PairMeasures
from embgeom.comparisons.spaces import INPUT, Space, Spaces, SpaceTokens
from embgeom.comparisons.steering import Steering
from embgeom.store.reader import Reader

__all__ = ["Comparisons", "FIGURE_PAIRS", "GeometryCache", "INPUT", "Limits", "RenderedFigure",
           "Space", "SpaceTokens"]


class Comparisons:
    """The comparisons of one service process (``app.state.geometry``): its parts share
    one space reader, one cache (owned here) and one gate.

    Parameters
    ----------
    reader, run, registry, models : what :class:`~embgeom.comparisons.spaces.Spaces` reads
        with (the store's reader, a synchronous plan runner, the model registry, alias ->
        loaded model).
    limits, cache, max_concurrent : caps, the cache (a new one by default), and how many
        computations may run at once (beyond: ``overloaded``, 429).
    """

    def __init__(self, reader: Reader, run: Callable, registry, models: Callable,
                 limits: Limits = Limits(), cache: Optional[GeometryCache] = None,
                 max_concurrent: int = 2):
        self.limits = limits
        self.cache = cache if cache is not None else GeometryCache()
        self.gate = Gate(max_concurrent)
        self.spaces = Spaces(reader, run, registry, models, limits, self.cache)
        self.pairs = PairMeasures(self.spaces, self.cache, self.gate)
        self.layers = LayerMeasures(self.spaces, self.cache, self.gate)
        self.steering = Steering(self.spaces, self.cache, self.gate)
        self.figures = Figures(self.spaces, self.pairs, self.layers, self.cache, self.gate)
