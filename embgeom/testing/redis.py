"""A private ``redis-server`` for one test or one benchmark.

:class:`embgeom.store.server.RedisServer` as the service runs it (AOF, ``appendfsync
always``, ``noeviction``), on a free port of 127.0.0.1, with its data in a folder of its
own: never the shared Redis on port 6379. It is SIGKILLed at the end (nothing to keep),
and a temporary folder it made is removed.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional

from embgeom.store.server import RedisServer

__all__ = ["private_redis"]


@contextlib.contextmanager
def private_redis(folder: Optional[Path] = None, timeout: float = 20.0,
                  prefix: str = "embgeom-redis-") -> Iterator[RedisServer]:
    """A started server with its data in ``folder``/redis (a temporary folder named
    ``prefix``..., removed at the end, without one); ``timeout``: seconds to answer."""
    tmp = None if folder is not None else Path(tempfile.mkdtemp(prefix=prefix))
    server = RedisServer(Path(folder or tmp) / "redis").start(timeout=timeout)
    try:
        yield server
    finally:
        server.kill()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
