"""The accumulator store on Redis (one server or a Redis Cluster).

- :mod:`~embgeom.store.connection`, :mod:`~embgeom.store.server`: clients from URLs, and the
  embedded/test ``redis-server`` process;
- :mod:`~embgeom.store.keys`: the key layout; :mod:`~embgeom.store.conf`: collection
  settings and each pair's fixed configuration; :mod:`~embgeom.store.codec`: record layouts;
- :mod:`~embgeom.store.jobs`: the job queue (Redis Streams), submitted to by
  :mod:`~embgeom.store.submission` and delivered by :mod:`~embgeom.store.delivery`;
- :mod:`~embgeom.store.checkpoints`: the exactly-once checkpoint, over
  :mod:`~embgeom.store.shards` (per-token state, its pieces written by
  :mod:`~embgeom.store.piece_writes`) and :mod:`~embgeom.store.layers`
  (per-layer state), with :mod:`~embgeom.store.scripts` (its atomic steps);
- :mod:`~embgeom.store.collections`: settings, listing, deletion;
- :mod:`~embgeom.store.reader`: reads, as plans (:mod:`~embgeom.store.plans`) for a sync or
  an async client, from a pair's state (:mod:`~embgeom.store.pair_state`), its records
  decoded by :mod:`~embgeom.store.records`.
"""
