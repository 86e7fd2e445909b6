"""What a read of one pair starts from: its generation, configuration and freshness.

A read reports ``as_of``: the number of completed checkpoints (``version``), the time of
the last one, and ``applying``, the checkpoints sealed and still being applied when it
read. Parts are applied one after another, so while ``applying`` > 0 a read that spans
several parts may see a checkpoint in some of them and not yet in others (a token's layer
groups too: each layer's moments are whole, at that layer's count); every count of one
token at one layer is always whole.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

from embgeom.errors import NotFound
from embgeom.store import keys as K
from embgeom.store.conf import PairConf
from embgeom.store.keys import PairKeys
from embgeom.store.plans import Plan

__all__ = ["PairState", "PairStates", "BoundedCache"]


@dataclass(frozen=True)
class PairState:
    """What a read of one pair starts from: its generation, configuration and freshness."""

    pair: PairKeys
    gen: int
    conf: Optional[PairConf]
    version: int
    updated_at: Optional[float]
    applying: int

    def as_of(self) -> dict:
        return {"version": self.version, "updated_at": self.updated_at, "applying": self.applying}

    @property
    def empty(self) -> bool:
        return self.conf is None


class BoundedCache:
    """A map of at most ``entries`` items, the least recently used dropped first.

    One lock around every operation (and nothing else: no read or decoding holds it), so
    the event loop and the thread pool can share it; a miss is a default, never a
    ``KeyError``."""

    _MISSING = object()

    def __init__(self, entries: int):
        if entries < 1:
            raise ValueError("a cache holds at least one entry")
        self.entries = entries
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def get(self, key, default=None):
        with self._lock:
            value = self._items.get(key, self._MISSING)
            if value is self._MISSING:
                return default
            self._items.move_to_end(key)
            return value

    def put(self, key, value) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.entries:
                self._items.popitem(last=False)

    def discard(self, key) -> None:
        with self._lock:
            self._items.pop(key, None)


class PairStates:
    """Plans that read a pair's state, with its generations' configurations cached (they
    never change)."""

    def __init__(self, conf_cache_entries: int = 1024,
                 on_new_generation: Callable[[str], None] = lambda pair: None):
        # pair -> (generation, its configuration): the last generation read, so a DELETE
        # replaces its pair's entry instead of adding one; LRU over pairs.
        self._confs = BoundedCache(conf_cache_entries)
        # Told the pair when a read finds a newer generation than the one cached.
        self._on_new_generation = on_new_generation

    _HEAD = 4  # commands of the state read

    def _head(self, pair: PairKeys) -> list:
        return [("get", pair.gen), ("hgetall", pair.meta), ("zcard", pair.inflight),
                ("sismember", K.PAIRS, pair.pair)]

    def pair_state(self, pair: PairKeys) -> Plan:
        """The pair's generation, configuration and freshness; ``collection_not_found`` or
        ``model_not_in_collection`` when nothing was ever sent to it."""
        replies = yield self._head(pair)
        return (yield from self._state(pair, replies))

    def pair_state_with(self, pair: PairKeys, then) -> Plan:
        """:meth:`pair_state` and, in the same round trip, the commands ``then(gen, conf)``
        for the generation last seen: ``(state, their replies)``, or ``(state, None)``
        when that guess was wrong (a first read, a deletion since)."""
        guess = self._confs.get(pair.pair)
        extra = then(*guess) if guess else []
        replies = yield self._head(pair) + extra
        state = yield from self._state(pair, replies[:self._HEAD])
        if guess and not state.empty and state.gen == guess[0]:
            return state, replies[self._HEAD:]
        return state, None

    def _state(self, pair: PairKeys, replies: list) -> Plan:
        gen_raw, meta, applying, listed = replies
        if not listed:
            yield from self._not_found(pair)
        gen = int(gen_raw or 0)
        cached = self._confs.get(pair.pair)
        conf = cached[1] if cached is not None and cached[0] == gen else None
        if conf is None:
            if cached is not None and cached[0] < gen:
                self._on_new_generation(pair.pair)  # what was cached of a deleted one
            (raw,) = yield [("get", pair.conf(gen))]
            if raw is not None:
                conf = PairConf.from_json(raw)
        if conf is not None:
            self._confs.put(pair.pair, (gen, conf))
        updated = meta.get(b"updated_at")
        return PairState(pair, gen, conf, int(meta.get(b"version", 0)),
                         float(updated) if updated else None, int(applying))

    def _not_found(self, pair: PairKeys) -> Plan:
        members, settings = yield [("smembers", K.PAIRS),
                                   ("exists", K.collection_settings(pair.collection))]
        collections = {K.split_pair(m.decode())[0] for m in members}
        if pair.collection not in collections and not settings:
            raise NotFound("collection_not_found", f"no collection {pair.collection!r}",
                           collection=pair.collection)
        raise NotFound("model_not_in_collection",
                       f"no text was ever sent to collection {pair.collection!r} for model "
                       f"{pair.model!r}", collection=pair.collection, model=pair.model)
