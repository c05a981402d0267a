"""A lean HTTP/1.1 transport for httpx (``upstream.transport: h1``): asyncio + httptools.

Why: the proxy's own forwarding is one POST and one answer on a kept-alive connection, yet
aiohttp's client spends ~0.1 ms of Python a request around the socket calls (request and
header objects, timers rescheduled on every read, stream readers; docs/benchmarks.md, #16).
Here a request is one write of bytes httpx already built, and the answer is parsed by
httptools (C, installed with ``uvicorn[standard]``) straight into the chunks the relay reads.

What holds, as with the other transports (``tests/test_upstream_transport.py`` runs the same
checks on all three):

- the request goes out exactly as httpx built it: method, the URL's raw path and query,
  every header as bytes (``Host`` and ``Content-Length`` included), the body;
- timeouts come from the request's httpx timeout: ``pool`` for a free connection,
  ``connect``, ``read`` for each wait on the upstream (a whole-request deadline stays
  ``forward.mapped_errors``'s business);
- errors are httpx's: ``ConnectError`` with the OS error as its cause (what
  ``proxy.reach.classify`` reads), ``ConnectTimeout``, ``PoolTimeout``, ``ReadTimeout``,
  ``RemoteProtocolError`` for a broken or cut answer, ``ReadError`` for a reset;
- a connection is reused only after an answer read to its end that allows keep-alive;
  closing an answer early closes its connection, so a client gone away ends the upstream's
  work (a reader that had the whole answer, a stream's terminal event, says so: its
  connection waits ``END_WAIT_S`` for the body's last chunk and is kept if that is all);
  idle connections are dropped after ``keepalive_expiry``; an idempotent request on a
  kept connection the server closed meanwhile is retried once on a new one when nothing of
  the answer came back (RFC 9112 §9.3.1, as aiohttp does; a POST is never sent twice);
- the body is never decoded here (httpx decodes ``Content-Encoding``); no cookies, no
  redirects, no environment proxies (``trust_env`` is off for every transport).

The chat routes call ``exchange`` instead (``Forwarder.send``): the same request and the same
connection handling, without httpx's request, response and stream objects around them
(``upstreamcall``; ~50 us a request, #28); a stream's body is pushed to the relay from the
connection's callbacks (``H1Reply.push``). ``handle_async_request`` serves httpx's client
(the proxy's own detector and summarizer calls, the other routes).
"""

from __future__ import annotations

import asyncio
import ssl
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx

from proxy.adapters.h1conn import GO, HOLD, STOP, Conn, Gone, Requested, Sink, mapped
from proxy.adapters.upstreamcall import RawHeaders, UpstreamRequest, httpx_of, wire_head

# A request body up to this size is joined to its head and sent in one write.
ONE_WRITE = 64 * 1024
# How long a connection whose reader had the whole answer (a stream's terminal event) waits
# for the rest of the body's framing before it is closed rather than kept (``done_with``).
END_WAIT_S = 1.0
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS", "TRACE"})


async def _stream(conn: Conn, read: float | None, request: Requested) -> AsyncIterator[bytes]:
    """The answer's body as it arrives on ``conn`` (each wait bounded by ``read``)."""
    while True:
        while conn.chunks:
            yield conn.take()
        if conn.complete:
            return
        if conn.error is not None:
            raise mapped(conn.error, request)
        await conn.wait(read, request)


class _Body(httpx.AsyncByteStream):
    def __init__(self, conn: Conn, owner: H1Transport, request: httpx.Request) -> None:
        self._conn = conn
        self._owner = owner
        self._request = request
        self._released = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        read = self._request.extensions.get("timeout", {}).get("read")
        async for chunk in _stream(self._conn, read, self._request):
            yield chunk

    async def aclose(self) -> None:
        if not self._released:
            self._released = True
            self._owner.done_with(self._conn)


def _response(conn: Conn, owner: H1Transport, request: httpx.Request) -> httpx.Response:
    return httpx.Response(
        status_code=conn.status,
        headers=conn.headers,
        stream=_Body(conn, owner, request),
        request=request,
        extensions={"http_version": b"HTTP/1.1", "reason_phrase": conn.reason},
    )


class H1Reply:
    """``exchange``'s answer (an ``upstreamcall.Reply``). A body with a ``Content-Encoding``
    is read through httpx's response, which decodes it as ``aiter_bytes`` does."""

    __slots__ = ("status_code", "headers", "_conn", "_owner", "_request", "_done", "_decoded")

    def __init__(self, conn: Conn, owner: H1Transport, request: UpstreamRequest) -> None:
        self.status_code = conn.status
        self.headers = RawHeaders(conn.headers)
        self._conn, self._owner, self._request = conn, owner, request
        self._done = False
        self._decoded: httpx.Response | None = None

    def _encoded(self) -> httpx.Response | None:
        if self._decoded is None and not self.pushable:
            self._decoded = _response(self._conn, self._owner, self._request.httpx())
        return self._decoded

    def chunks(self) -> AsyncIterator[bytes]:
        decoded = self._encoded()
        if decoded is not None:
            return decoded.aiter_bytes()
        return _stream(self._conn, self._request.timeout.get("read"), self._request)

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    @property
    def pushable(self) -> bool:
        """Whether ``push`` can give this body (not one httpx must decode first)."""
        return "content-encoding" not in self.headers

    async def push(self, sink: Sink, drain: Callable[[], Awaitable[None]]) -> bool:
        """Give the body to ``sink`` read by read, straight from the connection's callbacks
        (``Conn.sink``): no task wakes for a read, so a stream's every event costs a few
        calls rather than a pass through the reader's generators (#28). Returns once the
        body ended (False) or ``sink`` said ``STOP`` (True); when it says ``HOLD``, the socket
        is not read until ``drain()`` returned. Each wait for the next read is bounded by the
        read timeout (``httpx.ReadTimeout``), as ``chunks``'s are."""
        conn, request = self._conn, self._request
        read = request.timeout.get("read")
        conn.sink, conn.said = sink, GO
        try:
            if conn.chunks:  # what arrived before (with the answer's head)
                conn.feed_sink(sink)
            while True:
                if conn.said == STOP:
                    if conn.sink_error is not None:
                        raise conn.sink_error
                    return True
                if conn.said == HOLD:
                    await drain()
                    conn.unhold()
                    continue
                if conn.complete:
                    return False
                if conn.error is not None:
                    raise mapped(conn.error, request)
                await conn.wait(read, request)
        finally:
            conn.sink = None
            conn.unhold()

    async def aclose(self, ended: bool = False) -> None:
        """Done with the answer. ``ended``: its reader had all of it (a stream's terminal
        event), so the body's last bytes still on the way do not cost the connection."""
        if self._decoded is not None:
            await self._decoded.aclose()  # its stream gives the connection back
        elif not self._done:
            self._done = True
            self._owner.done_with(self._conn, ended)


class H1Transport(httpx.AsyncBaseTransport):
    """Pooled HTTP/1.1 connections per (scheme, host, port), at most ``max_connections``."""

    def __init__(self, limits: httpx.Limits) -> None:
        self._max = limits.max_connections or 0
        keep = limits.max_keepalive_connections
        self._keep = keep if keep is not None else sys.maxsize
        self._expiry = limits.keepalive_expiry
        self._idle: dict[tuple[str, str, int], list[Conn]] = {}
        self._slots: asyncio.Semaphore | None = None
        self._ssl: ssl.SSLContext | None = None

    def _context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()  # the CA bundle httpx would use
        return self._ssl

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            body: bytes = request.content
        except httpx.RequestNotRead:
            body = await request.aread()
        head = wire_head(request.method, request.url, request.headers.raw)
        timeout = request.extensions.get("timeout", {})
        conn = await self._send(request.method, request.url, head, body, timeout, request)
        return _response(conn, self, request)

    async def exchange(self, request: UpstreamRequest) -> H1Reply:
        """``request`` sent as it is; its answer with the body still to read."""
        head = request.head()
        conn = await self._send(
            request.method, request.url, head, request.content, request.timeout, request
        )
        return H1Reply(conn, self, request)

    async def _send(
        self,
        method: str,
        url: httpx.URL,
        head: bytes,
        body: bytes,
        timeout: dict[str, float | None],
        request: Requested,
    ) -> Conn:
        """A connection with the answer's head read (its slot held until ``done_with``)."""
        key = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
        await self._take_slot(timeout.get("pool"), request)
        try:
            for attempt in (0, 1):
                conn, reused = await self._connection(key, timeout.get("connect"), request)
                conn.start(head_only=method == "HEAD")
                assert conn.transport is not None
                if len(body) < ONE_WRITE:
                    conn.transport.write(head + body)
                else:  # not copied into one buffer
                    conn.transport.writelines((head, body))
                try:
                    await self._head(conn, timeout.get("read"), request)
                except Gone:
                    conn.close()
                    if reused and attempt == 0 and method in IDEMPOTENT:
                        continue  # the server had closed this kept connection meanwhile
                    raise httpx.RemoteProtocolError(
                        "upstream closed the connection without answering",
                        request=httpx_of(request),
                    ) from None
                except BaseException:
                    conn.close()
                    raise
                return conn
        except BaseException:
            self._free_slot()
            raise
        raise AssertionError("unreachable")

    def done_with(self, conn: Conn, ended: bool = False) -> None:
        """An answer's reader is done: its connection kept if read to its end, else closed.

        ``ended``: the reader stopped at the answer's last event (a stream's ``[DONE]``),
        and the body's framing (the last HTTP chunk) may be a read behind it: the connection
        is kept if that is all that comes, within ``END_WAIT_S`` (else closed). Closing it
        at once cost the next request a new connection, with TLS a handshake (#28)."""
        if ended and not (conn.complete or conn.chunks or conn.closed or conn.error):
            conn.when_ended(lambda: self._ended(conn), END_WAIT_S)
            return
        done = conn.complete and not conn.chunks
        self.release(conn, reuse=done and conn.keep_alive)

    def _ended(self, conn: Conn) -> None:
        clean = conn.complete and not conn.chunks and conn.error is None
        self.release(conn, reuse=clean and conn.keep_alive)

    async def _head(self, conn: Conn, read: float | None, request: Requested) -> None:
        while not conn.head_done:
            if conn.error is not None:
                if isinstance(conn.error, Gone):
                    raise conn.error
                raise mapped(conn.error, request)
            await conn.wait(read, request)

    async def _take_slot(self, pool: float | None, request: Requested) -> None:
        if not self._max:
            return
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._max)
        if not self._slots.locked():
            # A slot is free: taken without waiting, so without a timer (an
            # ``asyncio.timeout`` is ~5 us, and this runs for every request).
            await self._slots.acquire()
            return
        try:
            async with asyncio.timeout(pool):
                await self._slots.acquire()
        except TimeoutError as exc:
            raise httpx.PoolTimeout(
                "no free upstream connection in time", request=httpx_of(request)
            ) from exc

    def _free_slot(self) -> None:
        if self._slots is not None:
            self._slots.release()

    async def _connection(
        self, key: tuple[str, str, int], connect: float | None, request: Requested
    ) -> tuple[Conn, bool]:
        loop = asyncio.get_running_loop()
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            fresh = self._expiry is None or loop.time() - conn.idle_since < self._expiry
            if fresh and not conn.closed and conn.transport and not conn.transport.is_closing():
                return conn, True
            conn.close()
        scheme, host, port = key
        tls = self._context() if scheme == "https" else None
        try:
            async with asyncio.timeout(connect):
                _, conn = await loop.create_connection(
                    lambda: Conn(key), host, port, ssl=tls, server_hostname=host if tls else None
                )
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(
                "upstream connect timed out", request=httpx_of(request)
            ) from exc
        except OSError as exc:
            # The OS error (refused, DNS, TLS) is what proxy.reach.classify reads.
            raise httpx.ConnectError(
                str(exc) or type(exc).__name__, request=httpx_of(request)
            ) from exc
        return conn, False

    def release(self, conn: Conn, reuse: bool) -> None:
        """An answer is done with: its connection back to the pool, or closed."""
        idle = self._idle.setdefault(conn.key, [])
        if reuse and not conn.closed and len(idle) < self._keep:
            conn.idle_since = asyncio.get_running_loop().time()
            idle.append(conn)
        else:
            conn.close()
        self._free_slot()

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
