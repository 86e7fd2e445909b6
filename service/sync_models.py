"""The models of an API process's synchronous requests (the outlier probe, the isotropy
sample, input spaces and steering texts), loaded in the background.

A request whose model is loaded gets it. One whose model is not yet loaded starts its load
on a background thread (one per model at a time) and is answered at once with 503
``model_loading`` and ``Retry-After``, instead of holding the client for the seconds a
load takes; a retry after the load gets the model. A load that fails is told to the next
request for that model (503 ``model_unavailable``), and the one after tries again.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from embgeom.compute.models import LoadedModel, ModelPool
from embgeom.errors import ModelLoadError
from service.errors import ModelLoading

__all__ = ["SyncModels", "RETRY_AFTER_SECONDS"]

log = logging.getLogger(__name__)

# What a client is told to wait: a packaged model loads in about 1 to 10 s on a CPU.
RETRY_AFTER_SECONDS = 2


class SyncModels:
    """Loaded models now, or a background load and :class:`ModelLoading`.

    ``pool`` returns the process's :class:`ModelPool` (made on first use by the runtime);
    the pool's own lock serialises loads and its LRU bounds what stays loaded.
    """

    def __init__(self, pool: Callable[[], ModelPool], retry_after: int = RETRY_AFTER_SECONDS):
        self._pool = pool
        self.retry_after = retry_after
        self._lock = threading.Lock()  # guards _loading and _failed
        self._loading: dict[str, threading.Thread] = {}
        self._failed: dict[str, ModelLoadError] = {}

    def loading(self) -> list[str]:
        """Models being loaded now."""
        with self._lock:
            return list(self._loading)

    def get(self, name: str) -> LoadedModel:
        """The loaded model ``name``; else start its load (unless one runs) and raise
        :class:`ModelLoading`. Blocking only while the pool's lock is held by another
        model's load (a model already loaded never waits for its own)."""
        pool = self._pool()
        with self._lock:
            failed = self._failed.pop(name, None)
            if failed is not None:
                raise failed
            ready = name not in self._loading and name in pool.loaded()
            if not ready and name not in self._loading:
                thread = threading.Thread(target=self._load, args=(pool, name),
                                          name=f"load-{name}", daemon=True)
                self._loading[name] = thread
                thread.start()
        if ready:
            # Evicted since (another model's load, with max_loaded_models reached): the
            # pool loads it again here, in this request's thread (rare, and still bounded).
            return pool.get(name)
        raise ModelLoading(name, self.retry_after)

    def _load(self, pool: ModelPool, name: str) -> None:
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
