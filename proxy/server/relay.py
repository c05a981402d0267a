"""Forwarding a prepared request and relaying the answer, whole or streamed, straight on ASGI.

The chat routes are plain ASGI apps (``proxy.server.app.ChatRoute``), so these functions
write the answer themselves (``send``) instead of returning a Starlette response: a stream
then needs no anyio task group to notice a client going away (``proxy.server.sendstream``),
and a whole answer reaches the client before the after-answer work (log line, metrics, ledger
queue), which the client no longer waits for.

Each function ends the request's ``Call`` with ``Service.finish`` exactly once: when the
answer is known (its usage read from the body, the SSE events or the body's last bytes),
or with 499 when the client went away first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import httpx
import orjson
from starlette.types import Receive, Send

from proxy.adapters.forward import mapped_errors, response_headers
from proxy.adapters.h1 import H1Reply
from proxy.adapters.h1conn import GO, STOP
from proxy.adapters.upstreamcall import Reply
from proxy.core.errors import UpstreamError
from proxy.core.surfaces import Surface, model_of, usage_of
from proxy.engine.chat import Outgoing
from proxy.engine.service import Call, Service
from proxy.server.abort import BodyBroken
from proxy.server.bodies import TAIL_BYTES, WHOLE_BODY_BYTES, usage_in_tail
from proxy.server.events import StreamReads, broken_event
from proxy.server.push import ChunkWriter
from proxy.server.sendstream import raw_headers, send_stream

log = logging.getLogger("compaction_proxy.server")
# Set by the server answering (uvicorn): relaying the upstream's too would send two of each.
SERVER_SET = frozenset({"date", "server"})
# Not relayed on the routes the proxy reads: it relays the body decoded (``Reply.chunks``).
RELAY_DROPPED = frozenset({"content-encoding"}) | SERVER_SET


async def send_whole(send: Send, status: int, headers: dict[str, str], body: bytes) -> None:
    """A whole answer in two ASGI messages, with its length."""
    raw = raw_headers(headers)
    raw.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class Ending:
    """How a relayed body ended (499 until it is known complete), for ``Service.finish``
    once the client has the whole answer."""

    __slots__ = ("status", "usage", "model")

    def __init__(self) -> None:
        self.status = 499
        self.usage: dict[str, Any] | None = None
        self.model: str | None = None  # as the upstream named it (traces)

    def finish(self, service: Service, call: Call) -> Callable[[], None]:
        return lambda: service.finish(call, self.usage, self.status, response_model=self.model)

    # ---- a stream's, shared by the pulled (``_relay_events``) and pushed relay ------------
    def read(self, reads: StreamReads, chunk: bytes) -> bytes:
        """``reads.read(chunk)``; complete (200) before the write of the terminal event: the
        client may close once it has it."""
        out = reads.read(chunk)
        if reads.ended:
            self.status = 200
        return out

    def broke(self, exc: httpx.HTTPError, surface: Surface) -> bytes | None:
        """The stream broke: logged; the error event to send, unless it was complete."""
        log.warning("upstream stream broke", extra={"error": type(exc).__name__})
        return broken_event(surface) if self.status != 200 else None

    def took(self, reads: StreamReads) -> None:
        """What the stream's events said, once it is over."""
        self.usage, self.model = reads.usage or None, reads.model


async def relay(out: Outgoing, send: Send, receive: Receive) -> None:
    """Send ``out`` upstream and relay the answer, streamed or whole; ``Service.finish``
    records it once the client has it (or once the upstream failed: our 502/504 counts as
    any answer, #29)."""
    try:
        if out.stream:
            await forward_stream(out, send, receive)
        else:
            await forward_whole(out, send, receive)
    except UpstreamError as exc:
        out.service.finish(out.call, None, exc.status)
        raise


async def forward_whole(out: Outgoing, send: Send, receive: Receive) -> None:
    """A non-streamed request: ``upstream.timeout_s`` bounds the whole of it. An answer up
    to ``WHOLE_BODY_BYTES`` is read whole (its usage parsed); a bigger one is relayed as it
    arrives, its usage read from its last bytes. A 400 to a body the compaction changed is
    answered by the client's own body instead, when the service agrees (once)."""
    service, call, own = out.service, out.call, out.own
    timeout_s = service.config.upstream.timeout_s
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with mapped_errors(deadline_s=timeout_s):
        upstream = await _or_fallback(out)
        try:
            head, rest = await _read_up_to(upstream, WHOLE_BODY_BYTES)
        except BaseException:
            await upstream.aclose()
            raise
    out_headers = response_headers(upstream.headers, drop=RELAY_DROPPED) | own
    if rest is None:
        await upstream.aclose()
        usage, model = None, None
        if upstream.status_code == 200:
            try:
                answer = orjson.loads(head)
                usage, model = usage_of(answer), model_of(answer)
            except orjson.JSONDecodeError:
                usage = None
        try:
            await send_whole(send, upstream.status_code, out_headers, head)
        finally:
            # Once the client has its answer: it does not wait for the ledger and the log.
            service.finish(call, usage, upstream.status_code, response_model=model)
        return
    length = upstream.headers.get("content-length")
    if length and length.isdigit() and "content-encoding" not in upstream.headers:
        out_headers["content-length"] = length  # a short body is then seen as short
    ending = Ending()
    relay = _relay_whole(upstream, head, rest, deadline, ending)
    await send_stream(
        send, receive, upstream.status_code, out_headers, relay, ending.finish(service, call)
    )


async def _or_fallback(out: Outgoing) -> Reply:
    """The upstream's answer to ``out.request``, or to the client's own body when the
    upstream refused (400) what was sent and ``out.fallback`` gives it (the refused answer is
    discarded unread). The service hears how that second request was answered before the
    client does, so the client's next request finds the conversation as it should be."""
    upstream = await out.forwarder.send(out.request)
    if upstream.status_code != 400:
        return upstream
    instead = await out.fallback()
    if instead is None:
        return upstream
    await upstream.aclose()
    upstream = await out.forwarder.send(instead)
    await out.service.sent_as_sent(out.call, upstream.status_code)
    return upstream


async def _read_up_to(upstream: Reply, limit: int) -> tuple[bytes, AsyncIterator[bytes] | None]:
    """The body if it ends within ``limit`` bytes (and None); else what was read so far and
    the rest of the body still to come."""
    chunks: list[bytes] = []
    size = 0
    rest = upstream.chunks()
    async for chunk in rest:
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return b"".join(chunks), rest
    return b"".join(chunks), None


async def _relay_whole(
    upstream: Reply,
    head: bytes,
    rest: AsyncIterator[bytes],
    deadline: float,
    ending: Ending,
) -> AsyncGenerator[bytes, None]:
    loop = asyncio.get_running_loop()
    tail = head[-TAIL_BYTES:]
    try:
        yield head
        while True:
            # The deadline wraps each read only, never a yield (the client's pace is not the
            # upstream's, and a timeout must not cancel the write in progress).
            async with asyncio.timeout(max(deadline - loop.time(), 0)):
                try:
                    chunk = await anext(rest)
                except StopAsyncIteration:
                    break
            tail = (tail + chunk)[-TAIL_BYTES:]
            yield chunk
        ending.status = upstream.status_code  # the whole body relayed
        ending.usage = usage_in_tail(tail) if ending.status == 200 else None
    except (httpx.HTTPError, TimeoutError) as exc:
        log.warning("upstream body broke", extra={"error": type(exc).__name__})
        raise BodyBroken from exc
    finally:
        await upstream.aclose()


async def forward_stream(out: Outgoing, send: Send, receive: Receive) -> None:
    """A streamed request: an error answer is relayed whole, a 200 event by event. A 400 to
    a body the compaction changed is answered by the client's own body instead, when the
    service agrees (once)."""
    service, call = out.service, out.call
    async with mapped_errors():
        upstream = await _or_fallback(out)
    headers = response_headers(upstream.headers, drop=RELAY_DROPPED) | out.own
    if upstream.status_code != 200:
        try:
            async with mapped_errors():
                content = await upstream.aread()
        finally:
            await upstream.aclose()
        try:
            await send_whole(send, upstream.status_code, headers, content)
        finally:
            service.finish(call, None, upstream.status_code)
        return
    ending = Ending()
    events: AsyncGenerator[bytes, None] | PushedEvents
    if isinstance(upstream, H1Reply) and upstream.pushable:
        events = PushedEvents(out.surface, upstream, out.drop_usage, ending)
    else:
        events = _relay_events(out.surface, upstream, out.drop_usage, ending)
    here = isinstance(events, PushedEvents)  # (it wakes this task only at its end)
    await send_stream(send, receive, 200, headers, events, ending.finish(service, call), here=here)


async def _relay_events(
    surface: Surface, upstream: Reply, drop_usage: bool, ending: Ending
) -> AsyncGenerator[bytes, None]:
    """Relay SSE events as they complete; read usage from the events that carry it
    (``events.StreamReads``).

    The stream is complete once its terminal event (``[DONE]``, ``message_stop``,
    ``response.completed``...) has been relayed: the request counts as a success then and
    the rest of the upstream connection is not waited for (a client that closes right after
    the terminal event, as the openai SDK does, is not a disconnect).
    """
    reads = StreamReads(drop_usage)
    try:
        # Decoded: a provider may compress the stream (the client gets it plain, as the
        # relayed headers, without Content-Encoding, say).
        async for chunk in upstream.chunks():
            # Every event completed by this read goes out at once, in one write: nothing
            # waits for later bytes, and the client is not sent one syscall per event.
            out = ending.read(reads, chunk)
            if out:
                yield out
            if reads.ended:
                break
        else:
            rest = reads.rest()
            if rest:
                yield rest
            ending.status = 200
    except httpx.HTTPError as exc:
        broken = ending.broke(exc, surface)
        if broken:
            yield broken
    finally:
        ending.took(reads)
        # Also runs when the client goes away: closing cancels the upstream request.
        await upstream.aclose(ended=reads.ended)


class PushedEvents:
    """``_relay_events`` pushed (``proxy.server.push``): each read of the upstream's body
    written to the client from the connection's callback, when ``send`` allows it; pulled by
    ``_relay_events`` otherwise. ``aclose`` ends the upstream request, whether or not it ran."""

    def __init__(
        self, surface: Surface, upstream: H1Reply, drop_usage: bool, ending: Ending
    ) -> None:
        self.surface, self.upstream, self.drop_usage, self.ending = (
            surface, upstream, drop_usage, ending,
        )  # fmt: skip

    async def __call__(self, send: Send) -> None:
        surface, upstream, ending = self.surface, self.upstream, self.ending
        writer = ChunkWriter.of(send)
        if writer is None:
            events = _relay_events(surface, upstream, self.drop_usage, ending)
            async with contextlib.aclosing(events):
                async for chunk in events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            return
        reads = StreamReads(self.drop_usage)

        def sink(chunk: bytes) -> int:
            out = ending.read(reads, chunk)
            said = writer.write(out, reads.ended) if out else GO
            return STOP if reads.ended else said

        try:
            if not await upstream.push(sink, writer.drain):
                rest = reads.rest()
                if rest:
                    await send({"type": "http.response.body", "body": rest, "more_body": True})
                ending.status = 200
        except httpx.HTTPError as exc:
            broken = ending.broke(exc, surface)
            if broken:
                await send({"type": "http.response.body", "body": broken, "more_body": True})
        finally:
            ending.took(reads)
            await upstream.aclose(ended=reads.ended)

    async def aclose(self) -> None:
        await self.upstream.aclose()  # (once: a second close does nothing)
