"""Caps on one comparison request (the ``geometry_*`` settings) and the checks of its
parameters, each refusal with its stable error type (422)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embgeom.errors import InvalidInput

__all__ = ["Limits", "ID_METHODS", "check_seed", "check_reg", "check_id_method"]

ID_METHODS = ("local_pca", "twonn", "mle")


@dataclass(frozen=True)
class Limits:
    """Caps on one geometry request (see the ``geometry_*`` settings)."""

    max_tokens: int = 5000
    max_lle_tokens: int = 3000
    max_k: int = 100
    min_shared_tokens: int = 20
    token_budget: int = 16384

    @classmethod
    def from_settings(cls, s) -> "Limits":
        return cls(s.geometry_max_tokens, s.geometry_max_lle_tokens, s.geometry_max_k,
                   s.geometry_min_shared_tokens, s.token_budget)

    def check_k(self, k: int, available: int, low: int = 1) -> None:
        """``k`` neighbours: at least ``low``, within ``max_k``, fewer than ``available``."""
        if k < low:
            raise InvalidInput(f"k must be >= {low}, got {k}", type="invalid_k", k=k)
        if k > self.max_k:
            raise InvalidInput(f"k={k} exceeds the limit of {self.max_k} neighbours",
                               type="k_too_large", k=k, limit=self.max_k)
        if k >= available:
            raise InvalidInput(f"k={k} needs more than {k} tokens; {available} are available",
                               type="k_too_large", k=k, tokens=available)


def check_seed(seed: int) -> None:
    if seed < 0:
        raise InvalidInput("seed must be >= 0", type="invalid_seed")


def check_reg(reg: float) -> None:
    if not (reg >= 0 and np.isfinite(reg)):
        raise InvalidInput("reg must be a finite number >= 0", type="invalid_reg")


def check_id_method(method: str, threshold: float) -> None:
    if method not in ID_METHODS:
        raise InvalidInput(f"method must be one of {', '.join(ID_METHODS)}", type="invalid_method")
    if not 0 < threshold < 1:
        raise InvalidInput("threshold must be in (0, 1)", type="invalid_threshold")
