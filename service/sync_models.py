"""The models of an API process's synchronous requests (the outlier probe, the isotropy
sample, input spaces and steering texts), loaded on first use.

A request whose model is loaded gets it. One whose model is not loaded yet starts its load
on a background thread (one per model at a time; later requests join it) and waits for it,
on the thread pool where the route runs it (never on the event loop), for at most
``model_load_wait_seconds``: a first call answers once the model is there. Only a load
still running past that bound is answered 503 ``model_loading`` with ``Retry-After``; a
retry then joins the same load. A load that fails is told to the requests waiting for it
(503 ``model_unavailable``), or, when none was waiting any more, to the next request for
that model; the one after tries again.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Callable

from embgeom.errors import ModelLoadError
from service.errors import ModelLoading

if TYPE_CHECKING:  # the pool is torch's: imported where a model is loaded, not here
    from embgeom.compute.models import LoadedModel, ModelPool

__all__ = ["SyncModels", "RETRY_AFTER_SECONDS", "LOAD_WAIT_SECONDS"]

log = logging.getLogger(__name__)

# What a client is told to wait past the bound: a packaged model loads in about 1 to 10 s
# on a CPU.
RETRY_AFTER_SECONDS = 2
# How long a request waits for its model's load (Settings.model_load_wait_seconds).
LOAD_WAIT_SECONDS = 30.0


class SyncModels:
    """Loaded models, waiting up to ``wait_seconds`` for a load; past it :class:`ModelLoading`.

    ``pool`` returns the process's :class:`ModelPool` (made on first use by the runtime);
    the pool's own lock serialises loads and its LRU bounds what stays loaded.
    """

    def __init__(self, pool: Callable[[], "ModelPool"], wait_seconds: float = LOAD_WAIT_SECONDS,
                 retry_after: int = RETRY_AFTER_SECONDS):
        self._pool = pool
        self.wait_seconds = wait_seconds
        self.retry_after = retry_after
        self._lock = threading.Lock()  # guards _loading and _failed
        self._loading: dict[str, Future] = {}
        self._failed: dict[str, ModelLoadError] = {}

    def loading(self) -> list[str]:
        """Models being loaded now."""
        with self._lock:
            return list(self._loading)

    def get(self, name: str) -> "LoadedModel":
        """The loaded model ``name``; else its load (started unless one runs), waited for
        up to :attr:`wait_seconds`, then :class:`ModelLoading`. Blocks the calling thread
        (the thread pool's, never the event loop's)."""
        pool = self._pool()
        with self._lock:
            failed = self._failed.pop(name, None)
            if failed is not None:
                raise failed
            load = self._loading.get(name)
            if load is None and name not in pool.loaded():
                load = self._loading[name] = Future()
                threading.Thread(target=self._load, args=(pool, name, load),
                                 name=f"load-{name}", daemon=True).start()
        if load is not None:
            try:
                load.result(timeout=self.wait_seconds)
            except FutureTimeout:
                raise ModelLoading(name, self.retry_after) from None
            except ModelLoadError as exc:
                with self._lock:  # told here: not again to the next request
                    if self._failed.get(name) is exc:
                        del self._failed[name]
                raise
        # Loaded. Evicted since (another model's load, with max_loaded_models reached): the
        # pool loads it again here, in this request's thread (rare, and still bounded).
        return pool.get(name)

    def _load(self, pool: "ModelPool", name: str, load: Future) -> None:
        failure = None
        try:
            pool.get(name)
        except ModelLoadError as exc:
            failure = exc
        except Exception as exc:  # noqa: BLE001 - a thread's error must reach a request, not vanish
            log.exception("loading model %s failed", name)
            failure = ModelLoadError(name, f"{type(exc).__name__}: {exc}")
        with self._lock:
            if failure is not None:
                self._failed[name] = failure
            del self._loading[name]
        if failure is None:
            load.set_result(None)
        else:
            load.set_exception(failure)
