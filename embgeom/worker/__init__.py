"""The worker: take jobs -> forward -> reduce into the window -> checkpoint + ack.

Any number of workers, in any number of processes or machines, share one Redis (or one
Redis Cluster). Each loads the models its jobs ask for on demand and keeps, per
(collection, model) pair it is working on, a *window*: the float64 moments of every job
since its last checkpoint, on the model's device (:mod:`embgeom.compute.window`). The
window is checkpointed in one exactly-once step (:mod:`embgeom.store.checkpoints`) when
its budget is reached (tokens, bytes or seconds), when nothing more is queued for its
pair (so a lone job is never held back), when a job of another pair comes, or when the
worker stops.

Threads: the main thread runs the device (forward, reduction into the window) and checkpoints; a
*feeder* thread takes the next job and prepares it (tokenise, batch, pin) meanwhile; an
*applier* thread applies a sealed checkpoint while the device fills the next window; a
heartbeat thread keeps the worker visible (``/readyz``), keeps the leases of every job it
holds, publishes progress and renews the lease of a checkpoint being applied.

SIGTERM finishes the current job and checkpoints the window (or, past the grace period,
hands every job not yet sealed back to the queue) and stops.

The package, one concern a module; :class:`Worker` wires the parts together:

- ``loop``: the :class:`Worker` and its main loop (run, step, finish, stop)
- ``feeder``: the feeder thread, preparing jobs, recovering this worker's own entries
- ``runner``: prepared jobs into the open window; the window closed or dropped
- ``windows``: the open window, when it is due, how large a new one starts
- ``checkpointing``: sealing a window, the applier thread, retries, giving up
- ``adoption``: taking over a checkpoint another worker sealed
- ``heartbeat``: the heartbeat thread and the details it publishes
- ``holdings``, ``returns``: what the worker holds; how a job leaves its hands
- ``pairs``, ``stores``, ``stop``, ``clock``: small shared parts
"""

from embgeom.store.connection import redis_client
from embgeom.worker.loop import Worker, new_worker_id

__all__ = ["Worker", "redis_client", "new_worker_id"]
