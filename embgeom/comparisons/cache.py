"""The comparisons' cache: results, token matrices and figures of one API process.

One owner: the :class:`~embgeom.comparisons.Comparisons` of an app makes it (or is given
it) and hands it to its parts; nothing else keeps a reference to an entry, so evicting one
frees what it holds. Bounded by entries and by the bytes its callers declare (a matrix's
``nbytes``, a figure's length; a JSON answer counts 0: small, and bounded by the entries).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Callable, Optional

__all__ = ["GeometryCache", "digest"]


class GeometryCache:
    """A thread-safe LRU of results and token matrices, bounded by entries and bytes.

    Keys carry each space's (collection, model, generation, version): a checkpoint or a
    deletion makes new keys, and the old entries age out. Nothing is stored while a
    checkpoint is being applied (``applying > 0``: a read may be partial): callers say so
    with ``keep`` (:meth:`through`)."""

    def __init__(self, max_entries: int = 64, max_bytes: int = 256 << 20):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._items: OrderedDict = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key):
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                return self._items[key][0]
            self.misses += 1
            return None

    def put(self, key, value, nbytes: int = 0) -> None:
        if self.max_entries == 0 or nbytes > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                self._bytes -= self._items.pop(key)[1]
            self._items[key] = (value, nbytes)
            self._bytes += nbytes
            while len(self._items) > self.max_entries or self._bytes > self.max_bytes:
                _, (_, size) = self._items.popitem(last=False)
                self._bytes -= size

    def through(self, key, keep: bool, compute: Callable[[], object],
                nbytes: Optional[Callable[[object], int]] = None) -> tuple[object, bool]:
        """``(value, hit)``: the cached value of ``key``, or ``compute()``'s, stored under
        ``key`` (with ``nbytes(value)`` bytes). With ``keep`` false (a space that is being
        written) the cache is neither read nor written."""
        if keep:
            hit = self.get(key)
            if hit is not None:
                return hit, True
        value = compute()
        if keep:
            self.put(key, value, nbytes(value) if nbytes is not None else 0)
        return value, False

    def __len__(self) -> int:
        return len(self._items)


def digest(payload) -> str:
    """A cache key's short stand-in for a large JSON-able payload (texts, a vector)."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
