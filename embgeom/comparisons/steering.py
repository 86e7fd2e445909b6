"""Emb2Emb steering transfer between two spaces (:mod:`embgeom.geometry.steering`): a
ridge map fit on the shared tokens, a steering vector given or made from texts (a model
forward, :mod:`embgeom.comparisons.forward`), read, gated and cached."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from embgeom.comparisons.cache import digest
from embgeom.comparisons.forward import text_vectors
from embgeom.comparisons.limits import check_seed
from embgeom.comparisons.measures import Measures
from embgeom.comparisons.numbers import cosine, json_float
from embgeom.comparisons.spaces import Space, SpaceTokens, as_of
from embgeom.errors import InvalidInput
from embgeom.geometry.steering import fit_linear_map, random_map_like, transfer_vector

__all__ = ["RANDOM_MAP_DRAWS", "Steering"]

# Draws of the random-map baseline of a steering transfer.
RANDOM_MAP_DRAWS = 32


def _check_request(vector, positive_texts, negative_texts, ridge: float, held_out: float,
                   seed: int) -> None:
    check_seed(seed)
    texts = positive_texts is not None or negative_texts is not None
    if (vector is None) == (not texts):
        raise InvalidInput("give either vector or positive_texts and negative_texts",
                           type="invalid_steering")
    if texts:
        if not positive_texts or not negative_texts:
            raise InvalidInput("positive_texts and negative_texts must both be non-empty",
                               type="invalid_steering")
    if not (ridge >= 0 and np.isfinite(ridge)):
        raise InvalidInput("ridge must be a finite number >= 0", type="invalid_ridge")
    if not 0 < held_out < 1:
        raise InvalidInput("held_out must be in (0, 1)", type="invalid_held_out")


class Steering(Measures):
    """``/v1/steering/transfer``."""

    def steering_vector(self, t: SpaceTokens, positive: Sequence[str],
                        negative: Sequence[str]) -> np.ndarray:
        """Difference of means: ``mean_p v(p) - mean_q v(q)`` over the texts' vectors
        (cached: it depends on the model, the layer, the counting rule and the texts only)."""
        include_special = bool(t.state.conf.include_special)
        key = ("steering_vector", t.space.model, t.space.layer, include_special,
               digest([list(positive), list(negative)]))

        def compute():
            vectors = text_vectors(self.spaces.models(t.space.model), t.space.layer,
                                   list(positive) + list(negative), include_special,
                                   self.limits.token_budget)
            return vectors[:len(positive)].mean(axis=0) - vectors[len(positive):].mean(axis=0)

        v, _ = self.cache.through(key, True, compute, lambda v: v.nbytes)
        return v

    def steering_transfer(self, a: Space, b: Space, vector: Optional[Sequence[float]] = None,
                          positive_texts: Optional[Sequence[str]] = None,
                          negative_texts: Optional[Sequence[str]] = None, ridge: float = 1.0,
                          held_out: float = 0.2, seed: int = 0, min_count: int = 5,
                          sample: Optional[int] = None, return_vector: bool = True) -> dict:
        """Emb2Emb: fit ``b ~ a W + c`` (ridge) on the shared tokens' vectors, map a
        steering vector of a into b, and compare it with b's own.

        ``ridge`` is relative: the penalty on ``||W||_F^2`` is
        ``ridge * ||A_c||_F^2 / d_a``, the mean eigenvalue of a's centred Gram matrix over
        the tokens used (``map.ridge_absolute``), so one value means the same for any
        model, layer and number of tokens.

        ``map``: the fit on ``round(held_out * m)`` held-out tokens: ``r2`` (share of b's
        held-out variance explained; 0 is predicting b's mean), ``mean_cosine`` (mean
        cosine of prediction and truth) beside ``mean_baseline_cosine`` (the same for the
        training mean of b: what anisotropy alone gives). The steering vector is
        ``vector`` (length d_a) or the difference of the mean vectors of
        ``positive_texts`` and ``negative_texts`` in a (each text pooled over its counted
        positions, as the collection counts them). ``vector`` in the answer is
        ``v_a W`` (length d_b); with texts, ``cosine`` is its cosine with b's own
        difference of means for the same texts, and ``baseline`` gives the same cosine
        for random Gaussian maps of W's norm (``random_map``: the first draw, and the mean,
        std and largest absolute value over 32 draws) and for a map fit on shuffled
        token pairs (``shuffled_map``).
        """
        _check_request(vector, positive_texts, negative_texts, ridge, held_out, seed)
        ta, tb = self.spaces.tokens(a, min_count), self.spaces.tokens(b, min_count)
        d_a = self.spaces.registry.info(a.model).hidden_size
        if vector is not None:
            v = np.asarray(vector, dtype=np.float64)
            if v.ndim != 1 or v.shape[0] != d_a or not np.all(np.isfinite(v)):
                raise InvalidInput(f"vector must be {d_a} finite numbers (the width of "
                                   f"{a.model})", type="invalid_vector", expected=d_a,
                                   got=int(v.size))
            payload = v.tobytes().hex()
        else:
            payload = [list(positive_texts), list(negative_texts)]
        key = ("steer", ta.ident, tb.ident, digest(payload), ridge, held_out, seed, sample,
               return_vector)

        def compute():
            s = self.spaces.shared(ta, tb, self.limits.max_tokens, sample, seed, 10)
            Xa, Xb = s["Xa"], s["Xb"]
            centred = Xa - Xa.mean(axis=0)
            # The penalty in units of the mean eigenvalue of a's Gram matrix: one value
            # means the same whatever the model's scale and the number of tokens.
            ridge_absolute = ridge * float(np.einsum("ij,ij->", centred, centred)) / Xa.shape[1]
            try:
                fit = fit_linear_map(Xa, Xb, ridge_absolute, held_out, seed)
            except ValueError as exc:
                raise InvalidInput(str(exc), type="invalid_map") from None
            test = fit.held_out_rows
            train = np.setdiff1d(np.arange(Xa.shape[0]), test)
            centre = Xb[train].mean(axis=0)
            base_cos = np.array([cosine(centre, row) or np.nan for row in Xb[test]])
            v_a = v if vector is not None else self.steering_vector(ta, positive_texts, negative_texts)
            moved = transfer_vector(fit.weight, v_a)
            out = {**s["header"],
                   "map": {"r2": json_float(fit.r2), "mean_cosine": json_float(fit.mean_cosine),
                           "mean_baseline_cosine": json_float(np.nanmean(base_cos)) if test.size else None,
                           "train_tokens": int(fit.n_train), "held_out_tokens": int(test.size),
                           "ridge": ridge, "ridge_absolute": ridge_absolute, "held_out": held_out},
                   "source": "vector" if vector is not None else "texts",
                   "source_norm": float(np.linalg.norm(v_a)),
                   "vector_norm": float(np.linalg.norm(moved)),
                   "vector": moved.tolist() if return_vector else None,
                   "cosine": None, "own_norm": None, "baseline": None,
                   "as_of": as_of(ta, tb)}
            if vector is None:
                own = self.steering_vector(tb, positive_texts, negative_texts)
                out.update(self._text_baselines(Xa, Xb, v_a, moved, own, fit.weight,
                                                ridge_absolute, held_out, seed))
            return out

        return self.gated(key, (ta, tb), compute)[0]

    @staticmethod
    def _text_baselines(Xa, Xb, v_a, moved, own, weight, ridge_absolute: float,
                        held_out: float, seed: int) -> dict:
        """With texts: the moved vector's cosine with b's own, beside random maps of W's
        norm and a map fit on shuffled token pairs."""
        draws = [cosine(v_a @ random_map_like(weight, seed + i), own)
                 for i in range(RANDOM_MAP_DRAWS)]
        draws = np.array([np.nan if c is None else c for c in draws])
        perm = np.random.default_rng([seed, 4]).permutation(Xa.shape[0])
        shuffled = fit_linear_map(Xa, Xb[perm], ridge_absolute, held_out, seed)
        return {
            "cosine": cosine(moved, own), "own_norm": float(np.linalg.norm(own)),
            "baseline": {
                "random_map": {"cosine": json_float(draws[0]), "mean": json_float(np.nanmean(draws)),
                               "std": json_float(np.nanstd(draws)),
                               "max_abs": json_float(np.nanmax(np.abs(draws))),
                               "draws": RANDOM_MAP_DRAWS},
                "shuffled_map": {"cosine": cosine(v_a @ shuffled.weight, own),
                                 "r2": json_float(shuffled.r2)},
            },
        }
