"""Bounded requests: the body limit, the size of synchronous requests, and how many
synchronous model runs an API process does at once.

- :class:`BodyLimit` (pure ASGI middleware) refuses a body over ``max_body_bytes`` with 413
  ``payload_too_large`` before anything parses it: at once when its ``Content-Length`` says
  so, else (a chunked body) by counting the bytes as they arrive, without buffering more
  than the limit.
- :func:`check_sync_texts` caps the texts of a synchronous request by count
  (``max_sync_texts``) and UTF-8 bytes (``max_sync_bytes``): 413 beyond.
- :class:`SyncRuns` runs a model off the event loop, at most ``max_sync_runs`` at once; one
  more is 429 ``overloaded`` with ``Retry-After`` at once, never queued.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence, TypeVar

from starlette.concurrency import run_in_threadpool

from embgeom.errors import InvalidInput, Overloaded
from embgeom.settings import Settings
from service.errors import error_response

__all__ = ["body_limit", "BodyLimit", "check_sync_texts", "SyncRuns"]

T = TypeVar("T")

# Methods whose requests carry no body unless they say so with a header.
_BODILESS = frozenset({"GET", "HEAD", "OPTIONS"})


def body_limit(settings: Settings) -> int:
    """``max_body_bytes``, or by default room for one maximal job: its texts plus the JSON
    around them (quotes, separators, escapes)."""
    if settings.max_body_bytes is not None:
        return settings.max_body_bytes
    return settings.max_job_bytes * 5 // 4 + (1 << 20)


class BodyLimit:
    """413 for a request body over ``limit`` bytes, before the app reads any of it."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = None
        chunked = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"transfer-encoding":
                chunked = True
        if length is not None and not chunked:
            # The server reads no more than Content-Length announces: checking it suffices.
            if length.isdigit() and int(length) > self.limit:
                return await self._refuse(scope, receive, send)
            return await self.app(scope, receive, send)
        if not chunked and scope["method"] in _BODILESS:
            return await self.app(scope, receive, send)
        # No length announced: read the body here, counting, and hand it on only whole.
        chunks = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return await self._refuse(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send):
        response = error_response(
            "payload_too_large", f"the request body exceeds the limit of {self.limit} bytes", 413,
            {"limit": self.limit}, headers={"Connection": "close"})
        await response(scope, receive, send)


def check_sync_texts(settings: Settings, texts: Sequence[str]) -> None:
    """413 ``payload_too_large`` when a synchronous request carries more texts, or more
    UTF-8 bytes of text, than the settings allow."""
    if len(texts) > settings.max_sync_texts:
        raise InvalidInput(f"{len(texts)} texts exceed the limit of {settings.max_sync_texts} "
                           "for a synchronous request", type="payload_too_large",
                           limit=settings.max_sync_texts)
    size = 0
    for text in texts:
        size += len(text.encode("utf-8"))
        if size > settings.max_sync_bytes:
            raise InvalidInput(f"the texts exceed the limit of {settings.max_sync_bytes} UTF-8 "
                               "bytes for a synchronous request", type="payload_too_large",
                               limit=settings.max_sync_bytes)


class SyncRuns:
    """At most ``limit`` model runs at once, each on the thread pool."""

    def __init__(self, limit: int):
        self.limit = limit
        self._free = threading.BoundedSemaphore(limit)

    async def run(self, fn: Callable[[], T]) -> T:
        if not self._free.acquire(blocking=False):
            raise Overloaded(f"{self.limit} synchronous model runs are in progress; retry later",
                             limit=self.limit)
        try:
            # Not abandoned on cancellation: the slot is freed when the thread is done.
            return await run_in_threadpool(fn)
        finally:
            self._free.release()
