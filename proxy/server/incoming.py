"""Reading a client's request: its headers once, its body within the limit and the time
allowed, parsed and validated (the engine describes it: ``proxy.engine.chat``)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive, Scope

from proxy.config import Limits
from proxy.core.errors import BadRequest, BodyTimeout, PayloadTooLarge
from proxy.core.reparse import Reparser
from proxy.core.reprint import Reuse
from proxy.core.surfaces import Surface
from proxy.core.validation import parse_json_object
from proxy.server.push import cycle_of


def header_map(scope: Scope) -> dict[str, str]:
    """The request's headers by lower-case name, the first of a repeated one (what
    Starlette's ``Headers.get`` answers), read once from the ASGI scope: the chat routes
    build no ``Request`` (#28)."""
    out: dict[str, str] = {}
    for name, value in scope["headers"]:
        key = name.decode("latin-1").lower()
        if key not in out:
            out[key] = value.decode("latin-1")
    return out


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """``receive_body`` for a Starlette request (None: the app's ``limits.body_timeout_s``)."""
    if timeout_s is None:
        timeout_s = _body_timeout(request)
    return await receive_body(request.headers, request.receive, limit, timeout_s)


async def receive_body(
    headers: Mapping[str, str], receive: Receive, limit: int, timeout_s: float
) -> bytes:
    """The body, refusing more than ``limit`` bytes without reading them all, and a body
    not complete within ``timeout_s``: a client that stops sending half-way never holds a
    connection and its memory for good."""
    declared = headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is over the limit of {limit} bytes")
    try:
        if _arrived(receive):
            return await _collect(receive, limit)  # (answered at once: nothing to time)
        async with asyncio.timeout(timeout_s):
            return await _collect(receive, limit)
    except ClientDisconnect as exc:
        raise BadRequest("client disconnected while sending the body") from exc
    except TimeoutError as exc:
        raise BodyTimeout(f"the request body did not arrive within {timeout_s:g} s") from exc


async def _collect(receive: Receive, limit: int) -> bytes:
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        if message["type"] != "http.request":
            continue
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _arrived(receive: Receive) -> bool:
    """Whether ``receive`` is uvicorn's httptools cycle's and the whole body is already in
    (nearly every request: it came with its head): its first message then carries all of
    it at once, and the body needs no timer (an ``asyncio.timeout`` is ~5 us, #28). Read as
    ``proxy.server.push`` reads the cycle: a cycle kept otherwise is timed as before."""
    cycle = cycle_of(receive)
    if cycle is None:
        return False
    event = getattr(cycle, "message_event", None)
    return (
        getattr(cycle, "more_body", True) is False
        and getattr(cycle, "waiting_for_100_continue", True) is False
        and isinstance(event, asyncio.Event)
        and event.is_set()
    )


def _body_timeout(request: Request) -> float:
    service = getattr(request.app.state, "res", None)
    config = getattr(service, "config", None)
    return config.limits.body_timeout_s if config is not None else Limits.body_timeout_s


def parse_and_validate(
    raw: bytes, surface: Surface, reparser: Reparser | None = None
) -> tuple[dict[str, Any], Reuse | None]:
    """The body as a JSON object the surface accepts, or ``BadRequest``. With a
    ``reparser``, a body that resends a recent one's history is parsed only past what the
    two share (``proxy.core.reparse``), and an accepted body is remembered for the next; then
    also what the engine may take from the earlier one and leave for the next (``Reuse``)."""
    if reparser is not None:
        extended = parse_extension(raw, surface, reparser)
        if extended is not None:
            return extended
    body = parse_json_object(raw)
    surface.validate(body, 0)
    reuse = reparser.remember(raw, body, surface.history_key) if reparser is not None else None
    return body, reuse


def parse_extension(
    raw: bytes, surface: Surface, reparser: Reparser, max_fresh: int | None = None
) -> tuple[dict[str, Any], Reuse | None] | None:
    """``parse_and_validate`` of a body that extends one ``reparser`` remembers, with at most
    ``max_fresh`` bytes to parse past what the two share; None otherwise (parse it whole)."""
    found = reparser.parse(raw, surface.history_key, max_fresh)
    if found is None:
        return None
    surface.validate(found.body, found.shared)  # the shared ones were, as they are
    reparser.accept(found)
    return found.body, found.reuse
