"""The hottest reads served without FastAPI's routing and dependency resolution.

A per-token read is one Redis round trip and a few hundred bytes of JSON; through the
full stack (a linear match over every route, the dependency solver, the exception and
exit-stack layers, FastAPI's own middlewares) the framework cost several times the read
itself (py-spy under wrk: the lookup was about a sixth of the API's samples), and one API
process saturated its core well before Redis did.
:class:`FastLane` is a pure ASGI middleware that answers a GET of a route given to it by
calling that route's own dependency and endpoint functions directly. Nothing is written
twice: the route stays the documented one (the OpenAPI document is unchanged), its path
is matched by the route's own compiled pattern, and the request passes the app-wide API
key check first. What the lane does not answer goes on to the full app unchanged:

- a handler returns None for parameters it does not take as given (a layer that is not
  a number): the app answers it, with its validation errors;
- an exception is answered by the app's own handler for its class (``service.errors``,
  the one place errors are mapped); one that only the catch-all handler covers is
  raised on, to the outermost middleware, as for any route.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Optional, Sequence

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.responses import Response

from service.deps import require_api_key

__all__ = ["FastLane", "LaneHandler"]

# (request, the path's parameters as matched) -> the response, or None: the app answers.
LaneHandler = Callable[[Request, dict], Awaitable[Optional[Response]]]


class FastLane:
    """Pure ASGI middleware: serves ``GET`` of each route of ``lanes`` (``(route,
    handler)`` pairs, :data:`LaneHandler`) with its handler; every other request, and a
    handler's None, goes to ``app``. Sets ``scope["route"]`` as the router would, so the
    metrics count the request under its route."""

    def __init__(self, app, lanes: Sequence[tuple[APIRoute, LaneHandler]]):
        self.app = app
        self.lanes = [(route, handler) for route, handler in lanes if "GET" in route.methods]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "GET":
            return await self.app(scope, receive, send)
        path = scope["path"]
        for route, handler in self.lanes:
            match = route.path_regex.match(path)
            if match is None:
                continue
            request = Request(scope, receive)
            try:
                await require_api_key(request)
                response = await handler(request, match.groupdict())
            except Exception as exc:
                response = await _mapped(request, exc)
            if response is None:
                break
            scope["route"] = route
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


async def _mapped(request: Request, exc: Exception) -> Response:
    """The app's answer to ``exc``: its handler for the nearest class of ``exc`` that
    has one, or ``exc`` raised on when only the catch-all (``Exception``) covers it."""
    handlers = request.app.exception_handlers
    for cls in type(exc).__mro__:
        if cls is Exception:
            break
        if cls in handlers:
            return await handlers[cls](request, exc)
    raise exc
