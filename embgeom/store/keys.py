"""The Redis key layout, in one place.

Control keys of one (collection, model) pair share the hash tag ``{c:m}``, so on Redis
Cluster they sit in one slot: a job's submission, delivery, retry, dead letter, the seal
and the completion of a checkpoint are each one atomic step (MULTI/EXEC or a Lua script)
on that slot::

    eg:{c:m}:meta          hash   version (completed checkpoints), updated_at
    eg:{c:m}:gen           string generation, bumped by DELETE; everything of an older one is void
    eg:{c:m}:conf:<g>      string JSON PairConf of generation g, fixed when its first job runs
    eg:{c:m}:inflight      zset   checkpoints sealed and not yet completed -> seal time (ms)
    eg:{c:m}:cp:<id>       hash   a sealed checkpoint: its jobs, stream entries, owner, lease
    eg:{c:m}:done          zset   completed checkpoints awaiting marker pruning -> completion (ms)
    eg:{c:m}:deadletter    zset   checkpoints given up (their cp hash kept, status "dead") -> time (ms)
    eg:{c:m}:job:<id>      hash   job status
    eg:{c:m}:payload:<id>  string the job's texts (JSON), deleted when its checkpoint completes
    eg:{c:m}:jobs          stream job ids waiting for a worker (consumer group ``workers``)
    eg:{c:m}:idem:<key>    string job id for an Idempotency-Key used with this pair

The accumulators of generation g are *parts*, each with its own hash tag, so their slots
spread over a cluster and checkpoints of different workers write them in parallel:

- token shard s and layer group k, tag ``{c:m:g:s<s>}`` for k = 0 and ``{c:m:g:s<s>l<k>}``
  for k > 0 (a token's shard is a hash of its key; the groups are ``PairConf.groups``,
  contiguous runs of kept layers; below, L is the number of layers *of the group* and
  "per layer" means per layer of the group)::

    :rec      hash  key -> float64[1 + L + L d]   (n, m2 per layer, mean per layer)
    :unit     hash  key -> float64[L d]           unit-vector sums (only with self-similarity)
    :scal     hash  key -> float64[1 + 3 L]       (n, M, m2, ||U||^2 per layer): scans,
                                                     self-similarity (1 + 2 L without
                                                     ||U||^2: see PairConf.scal_unit_norms)
    :bkt      hash  bucket -> float64[2 + L d]    (types, sum n_t, sum n_t mean_t): filters;
                    "c<bucket>" -> float64[L d], "cw" -> float64[L]: what float64 cannot
                    hold of the compensated running sums (of the vectors, of agg's within)
    :agg      string float64[2 + L]               (types, sum n_t, sum m2_t per layer)
    :name     hash  key -> UTF-8 name                (group 0 only; hashed word keys >= 2**62
                                                     only, written with the key's first
                                                     record: their names are not in the
                                                     tokenizer)
    :applied  hash  checkpoint id -> its pieces applied here ("0,1,...")
    :lock     string fencing token of the worker applying to this shard (PX lease)
    :gate     string touched (PX 1 s) by a piece's guard that refused it, so the piece's
                    WATCHed EXEC writes nothing (embgeom.store.scripts.GUARD_PIECE)
    :dead     string set when the generation is deleted: later writes are refused

  Each (shard, group) part is applied and locked on its own: a checkpoint's piece p of
  shard s is the same tokens in every group, applied once per group. While a checkpoint
  is being applied, a token's groups may differ by it (the reader reports ``applying``).

  Layer groups and existing data: a generation's configuration stored before groups has
  no ``layer_groups`` and reads as one group of every layer, whose parts are exactly the
  keys above with k = 0 (``{c:m:g:s<s>}``, records of every layer): such a data folder is
  read and written as it is, with no migration. Only a generation created since (a new
  pair, or one after a DELETE) is cut into groups by ``Settings.record_bytes``.

- the layer head, tag ``{c:m:g:h}``, co-moment chunk j of layer l, tag
  ``{c:m:g:L<l>c<j>}``, and (``cross_layer`` only) chunk j of the co-moment of all kept
  layers concatenated, tag ``{c:m:g:Xc<j>}``::

    :seg      hash  "base" and one field per checkpoint not yet folded into it
    :folded   hash  checkpoint id -> fold time (a late rewrite of a folded segment is refused)
    :lock, :dead    as for shards

Global keys (small, one slot each; never in a transaction with a pair's keys)::

    eg:{c}:settings        hash   a collection's settings (fixed at its creation)
    eg:pairs               set    "c:m" of every collection/model with data or jobs
    eg:streams:<model>     set    "c:m" of every pair that has (had) a job stream for <model>
    eg:{notify}:<model>    stream "c:m" of a pair with a new (or requeued) job (capped): idle
                                  workers block on it instead of polling
    eg:jobref:<id>         string "c:m" of a job, to find its status key
    eg:idem:<key>          string "c:m" an Idempotency-Key was first used with
    eg:workers             zset   worker id -> last heartbeat (unix seconds)
    eg:worker:<id>         string worker's last heartbeat details (JSON, with a TTL)
    eg:stats:checkpoints   hash   fleet-wide counters: retries, abandoned, dead_lettered,
                                  adopted, retried_dead (/metrics)

The directory entries (``eg:pairs``, ``eg:streams:<model>``, ``eg:jobref:<id>``,
``eg:idem:<key>``) are written by separate idempotent commands *before* the pair-slot
MULTI that enqueues a job, so a job that exists is always findable; an orphan entry left
by a failed submission is harmless.
"""

from __future__ import annotations

import re

NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
_NAME = re.compile(NAME_PATTERN)

GROUP = "workers"  # the consumer group every worker joins


def valid_name(name: str) -> bool:
    return bool(_NAME.match(name))


class PairKeys:
    """Control keys of one (collection, model) pair."""

    def __init__(self, collection: str, model: str):
        self.collection = collection
        self.model = model
        self.tag = f"{{{collection}:{model}}}"
        self.pair = f"{collection}:{model}"

    def __repr__(self) -> str:
        return f"PairKeys({self.pair!r})"

    def _k(self, suffix: str) -> str:
        return f"eg:{self.tag}:{suffix}"

    @property
    def meta(self) -> str:
        return self._k("meta")

    @property
    def gen(self) -> str:
        return self._k("gen")

    def conf(self, gen: int) -> str:
        return self._k(f"conf:{gen}")

    @property
    def inflight(self) -> str:
        return self._k("inflight")

    def checkpoint(self, cp: str) -> str:
        return self._k(f"cp:{cp}")

    @property
    def done(self) -> str:
        return self._k("done")

    @property
    def deadletter(self) -> str:
        """Checkpoints given up: kept, with their jobs' payloads, until retried."""
        return self._k("deadletter")

    def job(self, job_id: str) -> str:
        return self._k(f"job:{job_id}")

    def payload(self, job_id: str) -> str:
        return self._k(f"payload:{job_id}")

    @property
    def jobs(self) -> str:
        """The pair's job stream (consumer group :data:`GROUP`)."""
        return self._k("jobs")

    def idem(self, key: str) -> str:
        return self._k(f"idem:{key}")

    def parts(self, gen: int) -> "PartKeys":
        return PartKeys(self, gen)


class PartTag:
    """The keys of one accumulator part (a shard or a layer part): one hash tag."""

    def __init__(self, tag: str):
        self.tag = tag

    def __getattr__(self, name: str) -> str:
        if name.startswith("_"):
            raise AttributeError(name)
        return f"eg:{self.tag}:{name}"

    def __repr__(self) -> str:
        return f"PartTag({self.tag!r})"


SHARD_KEYS = ("rec", "unit", "scal", "bkt", "agg", "name", "applied", "lock", "gate")
LAYER_PART_KEYS = ("seg", "folded", "lock")


class PartKeys:
    """The accumulator parts of one pair's generation."""

    def __init__(self, pair: PairKeys, gen: int):
        self.pair = pair
        self.gen = int(gen)
        self._prefix = f"{pair.collection}:{pair.model}:{self.gen}"

    def shard(self, s: int, group: int = 0) -> PartTag:
        """Token shard s's part of layer group ``group``: tag ``{c:m:g:s<s>}`` for group 0
        (the only group of a generation stored before groups, so its keys are unchanged),
        ``{c:m:g:s<s>l<group>}`` for the others."""
        return PartTag(f"{{{self._prefix}:s{s}}}" if group == 0
                       else f"{{{self._prefix}:s{s}l{group}}}")

    def shard_parts(self, conf) -> list[tuple[int, int, PartTag]]:
        """``(shard, group, keys)`` of every token-record part of the generation."""
        return [(s, g, self.shard(s, g)) for s in range(conf.shards)
                for g in range(len(conf.groups))]

    @property
    def head(self) -> PartTag:
        return PartTag(f"{{{self._prefix}:h}}")

    def chunk(self, layer: int, j: int) -> PartTag:
        return PartTag(f"{{{self._prefix}:L{layer}c{j}}}")

    def cross(self, j: int) -> PartTag:
        """Chunk j of the cross-layer co-moment (collections with ``cross_layer``)."""
        return PartTag(f"{{{self._prefix}:Xc{j}}}")


def collection_settings(collection: str) -> str:
    return f"eg:{{{collection}}}:settings"


PAIRS = "eg:pairs"
WORKERS = "eg:workers"
CHECKPOINT_STATS = "eg:stats:checkpoints"


def split_pair(pair: str) -> tuple[str, str]:
    collection, model = pair.split(":", 1)
    return collection, model


def jobref(job_id: str) -> str:
    return f"eg:jobref:{job_id}"


def idempotency(key: str) -> str:
    """Global: the pair an Idempotency-Key was first used with (the job id is per pair)."""
    return f"eg:idem:{key}"


def streams(model: str) -> str:
    """Global: the set of pairs ("c:m") whose job streams serve ``model``."""
    return f"eg:streams:{model}"


def notify(model: str) -> str:
    """Global: new-work notifications for ``model``'s workers. Every model's stream shares
    the ``{notify}`` tag, so one XREAD BLOCK can wait on several models on a cluster."""
    return f"eg:{{notify}}:{model}"


def worker(worker_id: str) -> str:
    return f"eg:worker:{worker_id}"
