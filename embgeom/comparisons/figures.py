"""The comparisons' figures (:mod:`embgeom.figures.geometry`): drawn from the same
computations as the JSON answers with the same parameters, gated and cached with them
until either space changes."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import numpy as np

from embgeom.comparisons.cache import GeometryCache
from embgeom.comparisons.gate import Gate
from embgeom.comparisons.layer import LayerMeasures
from embgeom.comparisons.limits import check_id_method, check_reg, check_seed
from embgeom.comparisons.measures import Measures
from embgeom.comparisons.numbers import unit_rows
from embgeom.comparisons.pairs import PairMeasures
from embgeom.comparisons.spaces import Space, Spaces, SpaceTokens
from embgeom.errors import InvalidInput
from embgeom.figures import geometry as gf
from embgeom.geometry import local
from embgeom.geometry.matching import sample_pairs

__all__ = ["FIGURE_PAIRS", "Figures", "RenderedFigure"]

# Token pairs a global-similarity figure plots by default (a seeded sample).
FIGURE_PAIRS = 20_000


@dataclass(frozen=True)
class RenderedFigure:
    """A geometry figure's bytes, the ``as_of`` of what it shows (one space's, or
    ``{"a", "b"}``), the headline numbers it shows (for response headers) and whether it
    came from the cache."""

    content: bytes
    as_of: dict
    numbers: dict
    hit: bool = False


class Figures(Measures):
    """``.../layers/{l}/figures/intrinsic_dimension`` and ``/v1/compare/figures/{global,lle}``."""

    def __init__(self, spaces: Spaces, pairs: PairMeasures, layers: LayerMeasures,
                 cache: GeometryCache, gate: Gate):
        super().__init__(spaces, cache, gate)
        self.pairs = pairs
        self.layers = layers

    def _figure(self, key, spaces: Sequence[SpaceTokens],
                draw: Callable[[], RenderedFigure]) -> RenderedFigure:
        fig, hit = self.gated(key, spaces, draw, lambda fig: len(fig.content))
        return replace(fig, hit=True) if hit else fig

    def intrinsic_dimension_figure(self, space: Space, k: int = 20, method: str = "local_pca",
                                   threshold: float = 0.9, min_count: int = 5, limit: int = 8,
                                   fmt: str = "png") -> RenderedFigure:
        """:func:`embgeom.figures.geometry.intrinsic_dimension` of a layer: the
        :meth:`~embgeom.comparisons.layer.LayerMeasures.intrinsic_dimension` answer
        (``limit`` tokens named at each end) and every token's estimate, from one read of
        the space; cached until it changes."""
        check_id_method(method, threshold)
        limit = min(limit, gf.MAX_NAMED)
        t = self.spaces.tokens(space, min_count)
        thr = threshold if method == "local_pca" else None
        result = self.layers.intrinsic_answer(t, k, method, threshold, limit, 0)
        key = ("figure", "intrinsic_dimension", fmt, t.ident, k, method, thr, limit)

        def draw():
            per, _ = self.layers.id_estimates(t, k, method, threshold)
            content = gf.render(gf.intrinsic_dimension(result, per, t.n), fmt)
            return RenderedFigure(content, result["as_of"], {"dimension": result["dimension"]})

        return self._figure(key, (t,), draw)

    def global_figure(self, a: Space, b: Space, min_count: int = 5, sample: Optional[int] = None,
                      seed: int = 0, pairs: int = FIGURE_PAIRS, fmt: str = "png") -> RenderedFigure:
        """:func:`embgeom.figures.geometry.global_similarity`: the
        :meth:`~embgeom.comparisons.pairs.PairMeasures.compare_global` answer and the
        cosines of a seeded sample of ``pairs`` of its token pairs (all of them when there
        are fewer), matched and under the answer's shuffled baseline."""
        check_seed(seed)
        if pairs < 1:
            raise InvalidInput("pairs must be >= 1", type="invalid_pairs")
        ta, tb = self.spaces.tokens(a, min_count), self.spaces.tokens(b, min_count)
        result = self.pairs.global_answer(ta, tb, sample, seed)
        key = ("figure", "global", fmt, ta.ident, tb.ident, sample, seed, pairs)

        def draw():
            s = self.spaces.shared(ta, tb, self.limits.max_tokens, sample, seed, 3)
            Ua, Ub = unit_rows(s["Xa"]), unit_rows(s["Xb"])
            i, j = sample_pairs(Ua.shape[0], pairs, seed)
            # The baseline's permutation (similarity.global_similarity): b's rows shuffled.
            perm = np.random.default_rng([seed, 1]).permutation(Ua.shape[0])
            cos_a = np.einsum("ij,ij->i", Ua[i], Ua[j])
            cos_b = np.einsum("ij,ij->i", Ub[i], Ub[j])
            cos_s = np.einsum("ij,ij->i", Ub[perm[i]], Ub[perm[j]])
            content = gf.render(gf.global_similarity(result, cos_a, cos_b, cos_s), fmt)
            return RenderedFigure(content, result["as_of"], {
                "pearson": result["pearson_cosine"],
                "baseline_pearson": result["baseline"]["pearson_cosine"],
                "pairs_plotted": int(i.shape[0])})

        return self._figure(key, (ta, tb), draw)

    def lle_figure(self, a: Space, b: Space, k: int = 10, min_count: int = 5,
                   sample: Optional[int] = None, seed: int = 0, reg: float = 1e-3,
                   fmt: str = "png") -> RenderedFigure:
        """:func:`embgeom.figures.geometry.lle`: the
        :meth:`~embgeom.comparisons.pairs.PairMeasures.compare_lle` answer and the same
        errors token by token (:func:`embgeom.geometry.local.lle_transfer_rows` on the same
        tokens, neighbours and seed)."""
        check_seed(seed)
        check_reg(reg)
        ta, tb = self.spaces.tokens(a, min_count), self.spaces.tokens(b, min_count)
        result = self.pairs.lle_answer(ta, tb, k, sample, seed, reg)
        key = ("figure", "lle", fmt, ta.ident, tb.ident, k, sample, seed, reg)

        def draw():
            s = self.spaces.shared(ta, tb, self.limits.max_lle_tokens, sample, seed, 3)
            rows = local.lle_transfer_rows(s["Xa"], s["Xb"], k, reg, seed)
            tokens = self.spaces.display(ta, ta.keys[s["rows_a"]])
            content = gf.render(gf.lle(result, rows, tokens), fmt)
            return RenderedFigure(content, result["as_of"], {
                "transfer_error": result["transfer_error"], "own_error": result["own_error"],
                "random_error": result["random_error"]})

        return self._figure(key, (ta, tb), draw)
