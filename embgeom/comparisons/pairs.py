"""The measures of two spaces over their shared tokens: global similarity and LLE
transfer (:mod:`embgeom.geometry.similarity`, :mod:`embgeom.geometry.local`), read,
gated and cached."""

from __future__ import annotations

from typing import Optional

from embgeom.comparisons.limits import check_reg, check_seed
from embgeom.comparisons.measures import Measures
from embgeom.comparisons.numbers import json_float
from embgeom.comparisons.spaces import Space, SpaceTokens, as_of
from embgeom.geometry import local, similarity

__all__ = ["GLOBAL_SCORES", "PairMeasures"]

# What /v1/compare/global answers, each beside its baseline.
GLOBAL_SCORES = ("pearson_cosine", "cka_linear", "procrustes_residual", "unbiased_cka",
                 "mutual_knn", "cknna")


class PairMeasures(Measures):
    """``/v1/compare/global`` and ``/v1/compare/lle``."""

    # ---------------------------------------------------------- global similarity
    def compare_global(self, a: Space, b: Space, min_count: int = 5,
                       sample: Optional[int] = None, seed: int = 0, k: int = 10) -> dict:
        """Every global measure of two spaces over their shared tokens (or a seeded sample
        of them), each beside a shuffled baseline (:func:`embgeom.geometry.similarity.
        global_similarity`).

        ``pearson_cosine``: Pearson r between ``cos(a_i, a_j)`` and ``cos(b_i, b_j)`` over
        all pairs i < j of used tokens (1: the same relative orientations; about 0 for
        unrelated spaces). ``cka_linear``: linear CKA of the column-centred matrices (1 for
        a rotation and scaling; about ``sqrt(d_a d_b) / m`` for unrelated ones, near 1 when
        m is not much larger than d). ``unbiased_cka``: the same with the debiased HSIC
        (about 0 for unrelated spaces whatever m and d). ``procrustes_residual``:
        ``min_R ||A_n R - B_n||_F^2`` over orthogonal R after centring, scaling to unit
        Frobenius norm and zero-padding the narrower space (0: the same shape; up to 2).
        ``mutual_knn``: mean share of a token's ``k`` nearest tokens by cosine common to
        both spaces (chance ``k / (m - 1)``). ``cknna``: debiased CKA of the cosine kernels
        restricted to mutual neighbours. ``baseline``: each with b's rows shuffled
        (seeded): what these marginal geometries give without a correspondence.
        """
        check_seed(seed)
        return self.global_answer(self.spaces.tokens(a, min_count),
                                  self.spaces.tokens(b, min_count), sample, seed, k)

    def global_answer(self, ta: SpaceTokens, tb: SpaceTokens, sample: Optional[int], seed: int,
                      k: int = 10) -> dict:
        """:meth:`compare_global`'s answer on spaces already read."""
        key = ("global", ta.ident, tb.ident, sample, seed, k)

        def compute():
            self.limits.check_k(k, self.limits.max_tokens)
            s = self.spaces.shared(ta, tb, self.limits.max_tokens, sample, seed, 4)
            self.limits.check_k(k, s["Xa"].shape[0])
            g = similarity.global_similarity(s["Xa"], s["Xb"], None, seed, k)
            scores = {name: json_float(g[name]) for name in GLOBAL_SCORES}
            return {**s["header"], "pairs": g["pairs"], "k": g["k"], **scores,
                    "chance_mutual_knn": k / (s["Xa"].shape[0] - 1),
                    "baseline": {name: json_float(g["baseline"][name]) for name in GLOBAL_SCORES},
                    "as_of": as_of(ta, tb)}

        return self.gated(key, (ta, tb), compute)[0]

    # ---------------------------------------------------------------------- LLE
    def compare_lle(self, a: Space, b: Space, k: int = 10, min_count: int = 5,
                    sample: Optional[int] = None, seed: int = 0, reg: float = 1e-3) -> dict:
        """LLE weights of each token from its k nearest neighbours in a, reused in b.

        Errors are fractions of b's total variance left unexplained by the reconstructions
        (:func:`embgeom.geometry.local.lle_transfer`): ``transfer_error`` (a's neighbours and
        weights), ``own_error`` (a's neighbours, b's optimal weights: the floor),
        ``own_neighbors_error`` (plain LLE in b), ``random_error`` (a's neighbours, random
        weights on the simplex: the baseline), their ratios, ``neighbor_overlap`` (mean
        share of a token's k neighbours that are the same in both spaces) beside
        ``chance_overlap = k / (m - 1)``.
        """
        check_seed(seed)
        check_reg(reg)
        return self.lle_answer(self.spaces.tokens(a, min_count), self.spaces.tokens(b, min_count),
                               k, sample, seed, reg)

    def lle_answer(self, ta: SpaceTokens, tb: SpaceTokens, k: int, sample: Optional[int],
                   seed: int, reg: float) -> dict:
        """:meth:`compare_lle`'s answer on spaces already read."""
        key = ("lle", ta.ident, tb.ident, k, sample, seed, reg)

        def compute():
            self.limits.check_k(k, self.limits.max_lle_tokens)
            s = self.spaces.shared(ta, tb, self.limits.max_lle_tokens, sample, seed, 3)
            self.limits.check_k(k, s["Xa"].shape[0])
            r = local.lle_transfer(s["Xa"], s["Xb"], k, reg, seed)
            m = s["Xa"].shape[0]
            out = {**s["header"],
                   **{name: json_float(v) for name, v in r.items() if name not in ("k", "reg")}}
            out.update({"k": k, "reg": reg, "chance_overlap": k / (m - 1),
                        "as_of": as_of(ta, tb)})
            return out

        return self.gated(key, (ta, tb), compute)[0]
