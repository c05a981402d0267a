"""Dropping the client's connection when the upstream's body breaks after the response began.

Ending the body normally would tell the client it got everything (a clean 200 with a short
body). The relaying code raises ``BodyBroken`` instead; this middleware swallows it, so the
ASGI server sees a response that never completed and closes the connection (one line in its
log) rather than printing a traceback for a fault that was already logged.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class BodyBroken(Exception):
    """The upstream's body broke after the response started (already logged)."""


class AbortOnBrokenBody:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except BodyBroken:
            return  # the response stays incomplete: the server drops the connection
