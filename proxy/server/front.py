"""The chat routes reached straight, ahead of Starlette's router and middleware.

Why: a chat request is the proxy's hot path, and Starlette's per-request routing (a regular
expression per route until one matches) and its two exception middlewares cost ~20 us of
the ~0.8 ms the proxy adds (docs/benchmarks.md, #16). ``ChatFront`` sends a ``POST`` to one
of the three chat paths to its ``ChatRoute`` directly and handles what it raises as the
middlewares would: a failure before the answer started becomes the answer the app's
exception handlers give (``proxy.server.errors.HANDLERS``, the route's own error shape); a
broken upstream body after it started drops the connection (``abort.AbortOnBrokenBody``,
as for every other route). Every other request, and the app's lifespan, goes to the
Starlette app unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import State
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.server.abort import AbortOnBrokenBody
from proxy.server.errors import HANDLERS, unexpected


class Tracked:
    """The server's ``send`` (``raw``: what ``proxy.server.push`` writes a stream through),
    noting whether the response started."""

    __slots__ = ("raw", "started")

    def __init__(self, send: Send) -> None:
        self.raw = send
        self.started = False

    async def __call__(self, message: Message) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self.raw(message)


class ChatFront:
    """The ASGI app ``create_app`` returns: ``routes`` (path -> ASGI app) for ``POST``,
    ``app`` for everything else. ``state`` and ``router`` are the Starlette app's."""

    def __init__(self, app: Starlette, routes: Mapping[str, ASGIApp]) -> None:
        self.app = app
        # A broken upstream body after the answer started: the server drops the connection.
        self.routes = {path: AbortOnBrokenBody(route) for path, route in routes.items()}

    @property
    def state(self) -> State:
        return self.app.state

    @property
    def router(self) -> Any:
        return self.app.router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            route = self.routes.get(scope["path"])
            if route is not None:
                scope["app"] = self.app  # what Starlette sets: request.app.state
                await self._chat(route, scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _chat(self, route: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        tracked = Tracked(send)
        try:
            await route(scope, receive, tracked)
        except Exception as exc:
            if tracked.started:
                raise  # too late for an error answer: the server drops the connection
            handler = next(
                (HANDLERS[kind] for kind in type(exc).__mro__ if kind in HANDLERS), unexpected
            )
            response = await handler(Request(scope, receive), exc)
            await response(scope, receive, send)
            if handler is unexpected:
                raise  # as Starlette's ServerErrorMiddleware does: the server logs it too
