"""The measures of one layer's token space: per-token intrinsic dimension
(:mod:`embgeom.geometry.intrinsic`) and a token's nearest neighbours, read, gated and
cached. Neither can sample: beyond ``geometry_max_tokens`` types they answer
``too_many_tokens`` with the ``min_count`` that would fit."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from embgeom.comparisons.limits import check_id_method
from embgeom.comparisons.measures import Measures
from embgeom.comparisons.numbers import json_float, unit_rows
from embgeom.comparisons.spaces import Space, SpaceTokens
from embgeom.errors import InvalidInput, NotFound
from embgeom.geometry import intrinsic
from embgeom.keyspace import is_key

__all__ = ["LayerMeasures"]


class LayerMeasures(Measures):
    """``.../layers/{l}/intrinsic-dimension`` and ``.../tokens/{id}/neighbors``."""

    def _candidates(self, t: SpaceTokens) -> None:
        cap = self.limits.max_tokens
        if t.keys.shape[0] > cap:
            fit = t.min_count_to_fit(cap)
            raise InvalidInput(
                f"{t.keys.shape[0]} token types have n >= {t.min_count}, more than the "
                f"{cap} one request may scan; min_count={fit} keeps few enough",
                type="too_many_tokens", tokens=int(t.keys.shape[0]), limit=cap,
                min_count_to_fit=fit)

    def _neighbour_lists(self, t: SpaceTokens, X: np.ndarray, rows: Sequence[int],
                         count: int) -> list[list[dict]]:
        """The ``count`` nearest tokens by cosine of each of ``rows`` (itself excluded)."""
        if count == 0 or not len(rows):
            return [[] for _ in rows]
        U = unit_rows(X)
        out = []
        for i in rows:
            cos = U @ U[i]
            cos[i] = -np.inf
            top = np.lexsort((t.keys, -cos))[:count]
            strings = self.spaces.display(t, t.keys[top])
            out.append([{"token_id": int(t.keys[j]), "token": s, "cosine": float(cos[j])}
                        for j, s in zip(top, strings)])
        return out

    # ------------------------------------------------------- intrinsic dimension
    def intrinsic_dimension(self, space: Space, k: int = 20, method: str = "local_pca",
                            threshold: float = 0.9, min_count: int = 5, limit: int = 10,
                            neighbors: int = 0) -> dict:
        """Per-token intrinsic dimension of a layer's token means, on the k nearest
        neighbours (Euclidean) of each token among the types with ``n_t >= min_count``.

        ``method``: ``local_pca`` (how many principal components of the token's
        k-neighbourhood reach ``threshold`` of its variance: an integer; the global value
        is their mean), ``twonn`` (TwoNN on the ratios r2/r1 pooled over the token and its
        k neighbours; global: TwoNN over all tokens) or ``mle`` (Levina-Bickel on the k
        neighbour distances; global: the MacKay-Ghahramani average). ``lowest`` and
        ``highest``: the ``limit`` tokens with the smallest and largest estimates (ties:
        the more frequent first, then the smaller id), each with its ``neighbors``
        nearest tokens by cosine when asked.
        """
        check_id_method(method, threshold)
        return self.intrinsic_answer(self.spaces.tokens(space, min_count), k, method, threshold,
                                     limit, neighbors)

    def id_estimates(self, t: SpaceTokens, k: int, method: str, threshold: float):
        """Every token's estimate (t.keys order) and the global one, cached (the caller
        holds a computation slot)."""
        key = ("id_estimates", t.ident, k, method, threshold if method == "local_pca" else None)

        def compute():
            self._candidates(t)
            self.limits.check_k(k, t.keys.shape[0], low=3 if method == "twonn" else 2)
            X = self.spaces.matrix(t)
            try:
                est = intrinsic.intrinsic_dimension(X, method, k, threshold)
            except ValueError as exc:
                raise InvalidInput(str(exc), type="invalid_geometry_input") from None
            return np.asarray(est.per_point, dtype=np.float64), float(est.dimension)

        out, _ = self.cache.through(key, t.settled, compute, lambda out: out[0].nbytes)
        return out

    def intrinsic_answer(self, t: SpaceTokens, k: int, method: str, threshold: float, limit: int,
                         neighbors: int) -> dict:
        """:meth:`intrinsic_dimension`'s answer on a space already read."""
        space, min_count = t.space, t.min_count
        key = ("id", t.ident, k, method, threshold if method == "local_pca" else None, limit, neighbors)

        def compute():
            per, dimension = self.id_estimates(t, k, method, threshold)
            X = self.spaces.matrix(t) if neighbors else None
            finite = np.flatnonzero(np.isfinite(per))
            low = finite[np.lexsort((t.keys[finite], -t.n[finite], per[finite]))][:limit]
            high = finite[np.lexsort((t.keys[finite], -t.n[finite], -per[finite]))][:limit]

            def listing(rows):
                strings = self.spaces.display(t, t.keys[rows])
                near = self._neighbour_lists(t, X, rows, neighbors)
                out = []
                for j, i in enumerate(rows):
                    row = {"token_id": int(t.keys[i]), "token": strings[j], "n": int(t.n[i]),
                           "estimate": float(per[i])}
                    if neighbors:
                        row["neighbors"] = near[j]
                    out.append(row)
                return out

            return {
                "collection": space.collection, "model": space.model, "layer": space.layer,
                "method": method, "k": k, "threshold": threshold if method == "local_pca" else None,
                "min_count": min_count, "tokens": int(t.keys.shape[0]),
                "dimension": json_float(dimension),
                "mean": json_float(per[finite].mean()) if finite.size else None,
                "median": json_float(np.median(per[finite])) if finite.size else None,
                "undefined": int(per.shape[0] - finite.size),
                "lowest": listing(low), "highest": listing(high), "as_of": t.state.as_of(),
            }

        return self.gated(key, (t,), compute)[0]

    # -------------------------------------------------------------- neighbours
    def neighbors(self, space: Space, token_id: int, k: int = 10, min_count: int = 5) -> dict:
        """The k tokens whose mean is nearest by cosine to token ``token_id``'s mean, among
        the layer's types with ``n_t >= min_count`` (the token itself excluded; it need
        not pass the filter itself). Ordered by cosine, descending, ties by id."""
        t = self.spaces.tokens(space, min_count)
        key = ("neighbors", t.ident, int(token_id), k)

        def compute():
            self.limits.check_k(k, self.limits.max_k + 1)
            self._candidates(t)
            where = np.searchsorted(t.keys, token_id)
            inside = where < t.keys.shape[0] and t.keys[where] == token_id
            if t.state.empty or not is_key(token_id):
                n_q = 0.0
            elif inside:
                n_q = float(t.n[where])
            else:
                n_q, q = self.spaces.mean_of(t, token_id)
            if n_q == 0:
                raise NotFound("token_not_found", f"token {token_id} was never seen at layer "
                               f"{space.layer} of this collection", token_id=int(token_id))
            X = self.spaces.matrix(t)
            if inside:
                q = X[where]
            norms = np.linalg.norm(X, axis=1)
            qn = np.linalg.norm(q)
            with np.errstate(invalid="ignore", divide="ignore"):
                cos = (X @ q) / (norms * qn)
            cos = np.where(np.isfinite(cos), np.clip(cos, -1.0, 1.0), -np.inf)
            if inside:
                cos[where] = -np.inf
            top = np.lexsort((t.keys, -cos))[:k]
            top = top[np.isfinite(cos[top])]
            strings = self.spaces.display(t, t.keys[top])
            (q_string,) = self.spaces.display(t, np.array([token_id]))
            return {
                "collection": space.collection, "model": space.model, "layer": space.layer,
                "token_id": int(token_id), "token": q_string, "n": int(n_q), "k": k,
                "min_count": min_count, "candidates": int(t.keys.shape[0] - (1 if inside else 0)),
                "neighbors": [{"token_id": int(t.keys[j]), "token": s, "n": int(t.n[j]),
                               "cosine": float(cos[j])} for j, s in zip(top, strings)],
                "as_of": t.state.as_of(),
            }

        return self.gated(key, (t,), compute)[0]
