"""Collections: their settings, each pair's fixed configuration, listing and deletion.

Deleting a collection bumps each pair's generation (one atomic INCR in the pair's slot):
from that instant every read and every new job uses the new generation's (empty) parts,
a job of the old one is void at delivery and at completion, and a checkpoint still
applying writes only into the old parts, which are then marked dead (later writes
refused) and freed with UNLINK. No key count has to be known before the deletion, so it
cannot race the first commit of a pair.
"""

from __future__ import annotations

import json
import time
from typing import Optional

import redis

from embgeom.errors import Conflict, NotFound
from embgeom.store import keys as K
from embgeom.store.conf import CollectionSettings, PairConf
from embgeom.store.keys import PairKeys
from embgeom.store.layers import layer_parts
from embgeom.store.scripts import KILL_PART

__all__ = ["Collections"]


class Collections:
    def __init__(self, client: redis.Redis, dead_ttl_seconds: int = 7 * 24 * 3600):
        self.r = client
        self.dead_ttl = dead_ttl_seconds

    # ---------------------------------------------------------------- settings
    def settings(self, collection: str) -> Optional[CollectionSettings]:
        raw = self.r.hget(K.collection_settings(collection), "settings")
        return None if raw is None else CollectionSettings.from_dict(json.loads(raw))

    def put(self, collection: str, settings: CollectionSettings) -> tuple[CollectionSettings, bool]:
        """Create a collection with ``settings``; returns ``(settings, created)``.

        Creating it again with the same counting rule is not an error (``created`` False);
        with another rule it is ``collection_settings_conflict``."""
        key = K.collection_settings(collection)
        created = self.r.hsetnx(key, "settings", settings.to_json())
        if created:
            self.r.hset(key, "created_at", repr(time.time()))
            return settings, True
        existing = self.settings(collection)
        if existing is None:  # deleted in between: try again
            return self.put(collection, settings)
        if not existing.same_rule(settings):
            raise Conflict("collection_settings_conflict",
                           f"collection {collection!r} exists with other settings",
                           existing=existing.to_dict(), requested=settings.to_dict())
        return existing, False

    def ensure(self, collection: str, include_special: Optional[bool] = None) -> CollectionSettings:
        """The collection's settings, creating it with the defaults (and the job's
        ``include_special`` when it says) on its first job."""
        existing = self.settings(collection)
        if existing is not None:
            if include_special is not None and include_special != existing.include_special:
                raise Conflict("collection_settings_conflict",
                               f"collection {collection!r} counts special tokens: "
                               f"include_special={existing.include_special}",
                               existing=existing.to_dict())
            return existing
        return self.put(collection, CollectionSettings(include_special=bool(include_special)))[0]

    # ------------------------------------------------------------- pair config
    def gen(self, pair: PairKeys) -> int:
        return int(self.r.get(pair.gen) or b"0")

    def conf(self, pair: PairKeys, gen: Optional[int] = None) -> Optional[PairConf]:
        gen = self.gen(pair) if gen is None else gen
        raw = self.r.get(pair.conf(gen))
        return None if raw is None else PairConf.from_json(raw)

    def ensure_conf(self, pair: PairKeys, conf: PairConf) -> PairConf:
        """Fix ``conf`` for its generation unless one is fixed already (which wins)."""
        self.r.set(pair.conf(conf.gen), conf.to_json(), nx=True)
        return PairConf.from_json(self.r.get(pair.conf(conf.gen)))

    # ---------------------------------------------------------------- listing
    def pairs(self) -> dict[str, list[str]]:
        grouped: dict[str, list[str]] = {}
        for raw in self.r.smembers(K.PAIRS):
            c, m = K.split_pair(raw.decode())
            grouped.setdefault(c, []).append(m)
        return {c: sorted(ms) for c, ms in sorted(grouped.items())}

    def exists(self, collection: str) -> bool:
        return collection in self.pairs() or self.settings(collection) is not None

    # --------------------------------------------------------------- deletion
    def delete(self, collection: str) -> list[str]:
        """Delete a collection: its settings, and every pair's data (generation bump)."""
        models = self.pairs().get(collection, [])
        had_settings = self.r.delete(K.collection_settings(collection))
        if not models and not had_settings:
            raise NotFound("collection_not_found", f"no collection {collection!r}",
                           collection=collection)
        for model in models:
            self.delete_pair(PairKeys(collection, model))
        return models

    def delete_pair(self, pair: PairKeys) -> None:
        old = int(self.r.incr(pair.gen)) - 1
        # Checkpoints in flight stay listed: their completion voids their jobs.
        self.r.delete(pair.meta)
        self.free_generation(pair, old)
        # The directory lives in another slot: a second command. If a job of the new
        # generation was enqueued meanwhile, put the pair back so it stays listed.
        self.r.srem(K.PAIRS, pair.pair)
        if self.r.exists(pair.conf(old + 1)):
            self.r.sadd(K.PAIRS, pair.pair)

    def free_generation(self, pair: PairKeys, gen: int) -> None:
        """Mark every part of generation ``gen`` dead and free it."""
        conf = self.conf(pair, gen)
        if conf is None:
            return
        parts = pair.parts(gen)
        with self.r.pipeline(transaction=False) as p:
            for *_, keys in parts.shard_parts(conf):
                KILL_PART.queue(p, [keys.dead] + [getattr(keys, k) for k in K.SHARD_KEYS],
                                [self.dead_ttl])
            for *_, keys in layer_parts(parts, conf):
                KILL_PART.queue(p, [keys.dead] + [getattr(keys, k) for k in K.LAYER_PART_KEYS],
                                [self.dead_ttl])
            p.execute()
        self.r.delete(pair.conf(gen))
