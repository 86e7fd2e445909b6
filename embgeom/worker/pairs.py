"""A pair's fixed configuration, and the engine that runs its jobs."""

from __future__ import annotations

import time
from typing import Callable, Optional

from embgeom.compute.catalogue import ModelRegistry
from embgeom.compute.engine import CountingRule, Engine
from embgeom.compute.models import ModelPool
from embgeom.settings import Settings
from embgeom.store import keys as K
from embgeom.store.conf import PairConf
from embgeom.worker.stores import Stores


class Pairs:
    """Resolves a (collection, model) pair's configuration (the first job of a pair fixes
    it) and gives the engine for it."""

    def __init__(self, stores: Stores, settings: Settings, registry: ModelRegistry,
                 pool: ModelPool, engine_factory: Optional[Callable[[PairConf, str], object]]):
        self.stores = stores
        self.settings = settings
        self.registry = registry
        self.pool = pool
        # None: engines are built on the pool's models and owned by the pool (they leave
        # with their model). A given factory owns whatever its engines hold.
        self._engine_factory = engine_factory

    def conf(self, pair: K.PairKeys, gen: int) -> PairConf:
        collections = self.stores.collections
        conf = collections.conf(pair, gen)
        if conf is not None:
            return conf
        settings = collections.ensure(pair.collection)
        info = self.registry.info(pair.model)
        # The window length (this worker's registry: the model's maximum capped by its
        # max_window_tokens) is pinned here: it decides counts, for every later worker.
        return collections.ensure_conf(pair, PairConf.resolve(
            settings, gen, info.num_layers + 1, info.hidden_size, info.tokenizer_size,
            self.settings.shards, self.settings.chunk_bytes, info.architecture, time.time(),
            window_tokens=info.max_length, record_bytes=self.settings.record_bytes))

    def engine(self, conf: PairConf, model: str):
        """The engine of ``model`` under the pair's counting rule (cheap: built once per
        rule and kept by the model pool with the model it runs)."""
        if self._engine_factory is not None:
            return self._engine_factory(conf, model)
        rule = CountingRule(conf.layers, conf.key, conf.include_special, conf.self_similarity,
                            conf.unit, conf.window_tokens)
        budget, precision = self.settings.token_budget, self.settings.reduce_precision
        return self.pool.engine(model, (rule, budget, precision),
                                lambda loaded: Engine(loaded, rule, budget, precision))
