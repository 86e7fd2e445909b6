"""What every measure's orchestration shares: one space reader, the cache and the gate."""

from __future__ import annotations

from typing import Callable, Optional, Sequence, TypeVar

from embgeom.comparisons.cache import GeometryCache
from embgeom.comparisons.gate import Gate
from embgeom.comparisons.spaces import Spaces, SpaceTokens

__all__ = ["Measures"]

T = TypeVar("T")


class Measures:
    """A family of answers computed on spaces read by ``spaces``, kept in ``cache`` and
    computed in a slot of ``gate``."""

    def __init__(self, spaces: Spaces, cache: GeometryCache, gate: Gate):
        self.spaces = spaces
        self.limits = spaces.limits
        self.cache = cache
        self.gate = gate

    def gated(self, key, spaces: Sequence[SpaceTokens], compute: Callable[[], T],
              nbytes: Optional[Callable[[T], int]] = None) -> tuple[T, bool]:
        """``(value, hit)``: a computation on ``spaces`` from the cache when every space is
        settled and it is there, else run in a slot of the gate (and kept when settled)."""
        settled = all(t.settled for t in spaces)
        return self.cache.through(key, settled, lambda: self.gate.run(compute), nbytes)
