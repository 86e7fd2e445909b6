"""The Redis key layout, in one place.

Everything about one (collection, model) pair lives under a hash tag ``{c:m}`` so that
on Redis Cluster it sits in one slot: a job's submission, delivery, retry, dead letter
and commit are each one MULTI/EXEC (or WATCH/MULTI/EXEC) on that slot::

    eg:{c:m}:meta          hash   version (commit sequence), updated_at, num_layers, hidden_size
    eg:{c:m}:gen           string generation, bumped by DELETE; jobs of an older one are void
    eg:{c:m}:committed     set    ids of the jobs whose contribution is in the accumulators
    eg:{c:m}:L<l>:tok      hash   token id -> float64[2 + d]  (n, m2, mean)
    eg:{c:m}:L<l>:unit     hash   token id -> float64[d]      sum of unit vectors
    eg:{c:m}:L<l>:scal     hash   token id -> float64[3]      (n, M, m2), for scans
    eg:{c:m}:L<l>:glob     string float64[3 + d]              (n, m2, within, mean) of the layer
    eg:{c:m}:L<l>:cov      string float64[d*d + 2d]           co-moment, sum u, sum u^2
    eg:{c:m}:job:<id>      hash   job status
    eg:{c:m}:payload:<id>  string the job's texts (JSON), deleted when committed
    eg:{c:m}:jobs          stream job ids of the pair waiting for a worker (group ``workers``)
    eg:{c:m}:idem:<key>    string job id for an Idempotency-Key used with this pair

Global keys (small, one slot each; never in a MULTI with a pair's keys)::

    eg:pairs               set    "c:m" of every collection/model with data or jobs
    eg:streams:<model>     set    "c:m" of every pair that has (had) a job stream for
                                  <model>: where workers serving <model> look for jobs
    eg:jobref:<id>         string "c:m" of a job, to find its status key
    eg:idem:<key>          string "c:m" an Idempotency-Key was first used with (a reuse of
                                  the key for another pair is refused while that job counts)
    eg:workers             zset   worker id -> last heartbeat (unix seconds)
    eg:worker:<id>         string worker's last heartbeat details (JSON, with a TTL)

The directory entries (``eg:pairs``, ``eg:streams:<model>``, ``eg:jobref:<id>``,
``eg:idem:<key>``) are written by separate idempotent commands *before* the pair-slot
MULTI that enqueues a job, so a job that exists is always findable. A submission that
fails or dies after them leaves an orphan entry, which is harmless: a jobref without a
job hash reads as "no such job", a stream in the directory with nothing in it is polled
and found empty, and a pair in ``eg:pairs`` without data answers like an empty pair
(``DELETE`` removes it). ``DELETE`` never removes a stream from ``eg:streams:<model>``:
a job enqueued concurrently must stay reachable.
"""

from __future__ import annotations

import re

NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
_NAME = re.compile(NAME_PATTERN)

GROUP = "workers"  # the consumer group every worker joins


def valid_name(name: str) -> bool:
    return bool(_NAME.match(name))


class PairKeys:
    """Keys of one (collection, model) pair."""

    def __init__(self, collection: str, model: str):
        self.collection = collection
        self.model = model
        self.tag = f"{{{collection}:{model}}}"
        self.pair = f"{collection}:{model}"

    def _k(self, suffix: str) -> str:
        return f"eg:{self.tag}:{suffix}"

    @property
    def meta(self) -> str:
        return self._k("meta")

    @property
    def gen(self) -> str:
        return self._k("gen")

    @property
    def committed(self) -> str:
        return self._k("committed")

    def tok(self, layer: int) -> str:
        return self._k(f"L{layer}:tok")

    def unit(self, layer: int) -> str:
        return self._k(f"L{layer}:unit")

    def scal(self, layer: int) -> str:
        return self._k(f"L{layer}:scal")

    def glob(self, layer: int) -> str:
        return self._k(f"L{layer}:glob")

    def cov(self, layer: int) -> str:
        return self._k(f"L{layer}:cov")

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

    def data_keys(self, num_layers: int) -> list[str]:
        """Every accumulator key (what DELETE removes)."""
        keys = [self.meta, self.committed]
        for layer in range(num_layers):
            keys += [self.tok(layer), self.unit(layer), self.scal(layer), self.glob(layer), self.cov(layer)]
        return keys


PAIRS = "eg:pairs"
WORKERS = "eg:workers"


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


def worker(worker_id: str) -> str:
    return f"eg:worker:{worker_id}"
