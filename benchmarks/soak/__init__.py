"""``make soak``: the service run as a lab runs it, for minutes, with faults; then checked.

``python -m benchmarks.soak [--minutes 20] [--plan full|quick] [--json soak.json]``

What runs (all real processes, nothing mocked):

- a ``redis-server`` the harness starts (AOF on, ``appendfsync always``, a tmp folder, a
  free port: :class:`embgeom.store.server.RedisServer`);
- ``embgeom serve --redis-url`` (the API) and three ``embgeom worker`` processes, the third
  with ``EMBGEOM_MAX_WINDOW_TOKENS=64`` (:data:`SMALL_WINDOW`) so long texts are windowed
  differently from the others; leases of :data:`LEASE_S` seconds; the API's bounded
  caches small (:data:`API_CACHES`) so they are full before the RSS window;
- the packaged models and ``wide``: a random-weight GPT-2 of 17 hidden states x 2048
  (:func:`build_wide_model`, a 512-entry BPE vocabulary trained on BBC), built in the run's
  tmp folder and registered through ``EMBGEOM_MODELS``;
- collections of different settings (:data:`PLANS`: the paper preset, word unit, a layer
  subset, self-similarity off), jobs of random sizes from BBC (short sentences or
  paragraphs), and a DELETE of a collection right after a burst of jobs to it, while they
  are queued (the collection is PUT again after it);
- readers of every GET endpoint of the live OpenAPI document, filled from what the run
  made (token pages at ``limit=10000``, CSV exports, every figure, the report page,
  ``POST /v1/compare/global``); an endpoint the harness cannot fill is listed as not read;
- faults in the first third of the load (:data:`FAULTS`): a worker SIGKILLed (and
  restarted), Redis SIGKILLed and restarted from its AOF, ``serve`` SIGKILLed and
  restarted, another worker; then small jobs of every model until each worker holds its
  models again (as before the load: the RSS window starts from loaded workers).

What it measures (sampled every :data:`SAMPLE_S` seconds): memory of the API and of each
worker (:func:`process_memory`: RSS, its anonymous and file-backed parts, the resident
pages of mapped weight files), Redis ``used_memory`` and, once a minute and at the end,
``MEMORY USAGE`` over each pair's keys by family (per (type, kept layer) at the end); the
sealed checkpoints (``eg:{c:m}:inflight``, their owner); every response of 500 or more
(endpoint, body); the latency of every read by endpoint (p50, p99); and the machine
(:func:`benchmarks.run.machine`: cores, CPU, memory, GPU, Redis's persistence, versions).

At the end the load stops, every job is waited for, and the store is checked:

- counts: for every pair, each kept layer's ``n`` equals the count of the texts of its
  jobs that are ``done`` since the collection's last DELETE, computed here from the
  model's tokenizer under the collection's rules (:func:`expected_count`). The count of
  special tokens and of words depends on the window length (a window boundary adds
  special tokens and splits words): it must equal the count at *one* of the workers'
  window lengths, the same for the whole pair. Id-keyed token collections also compare
  each token type's ``n`` (the CSV export of the first kept layer).
- values: MiniLM pairs of id-keyed token collections whose texts fit every window:
  Q, M, V, V_W, V_B of up to three kept layers, and five tokens' n, Q, M, V per layer,
  against the float64 one-text-at-a-time reference (:mod:`embgeom.testing.reference`)
  within its tolerance, the one ``tests/test_e2e_minilm.py`` pins.

Acceptance, one PASS/FAIL line each: memory flat over the last two thirds of the load,
from when the restarted processes hold their models again (:func:`rss_growth`: growth <=
5% + 50 MB), compared at rest (:func:`at_rest`; every :data:`REST_EVERY_S` the load pauses
for at most :data:`REST_MAX_S` until the workers are done, then the readers too, for
longer than the processes' heap-trim period :data:`HEAP_TRIM_S`): the API's RSS; a
worker's anonymous RSS (no job, no window, nothing applying, no work between its
neighbouring samples) per set of models it held, and the resident pages of the weight
files it maps within the pool's bound (:func:`weights_check`); a worker's RSS at rest and
every process's samples while busy are kept as ``vmrss_at_rest`` and
``busy_included``), no checkpoint sealed longer than two leases
without progress (an adoption, or more pieces applied), no 5xx but 503 while Redis
was down (with requests sent then: a fault never falls inside a rest pause), every job
ended, no process died unless killed here, every count exact, values within tolerance.
The exit status is 1 when a line fails.

Timings and sizes depend on the machine and whatever else runs on it: a 2-core machine
shared with other work gives noisy latencies; the checks above do not depend on speed.
"""

from benchmarks.soak.checks import at_rest, expected_count, rss_growth, weights_check
from benchmarks.soak.harness import Soak, run
from benchmarks.soak.plan import FAULTS, PLANS, collection_rules
from benchmarks.soak.report import table
from benchmarks.soak.sampler import key_family, memory_by_family, process_memory

__all__ = ["FAULTS", "PLANS", "Soak", "at_rest", "collection_rules", "expected_count", "key_family",
           "memory_by_family", "process_memory", "rss_growth", "run", "table", "weights_check"]
