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
  work; idle connections are dropped after ``keepalive_expiry``; an idempotent request on a
  kept connection the server closed meanwhile is retried once on a new one when nothing of
  the answer came back (RFC 9112 §9.3.1, as aiohttp does; a POST is never sent twice);
- the body is never decoded here (httpx decodes ``Content-Encoding``); no cookies, no
  redirects, no environment proxies (``trust_env`` is off for every transport).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import sys
from collections.abc import AsyncIterator

import httptools
import httpx

# Past this much unread body the socket stops being read (the client is slower than the
# upstream); reading resumes once the relay has taken it.
HIGH_WATER = 1024 * 1024
# A request body up to this size is joined to its head and sent in one write.
ONE_WRITE = 64 * 1024
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS", "TRACE"})


class _Gone(Exception):
    """The connection ended before any of the answer arrived (a kept one may be retried)."""


class _Conn(asyncio.Protocol):
    """One connection and the answer in progress on it."""

    def __init__(self, key: tuple[str, str, int]) -> None:
        self.key = key
        self.idle_since = 0.0
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._parser = httptools.HttpResponseParser(self)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.error: Exception | None = None
        self.got_bytes = False
        self.head_only = False
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self._waiter: asyncio.Future[None] | None = None

    # ---- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is no subclass)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self.complete:
            return  # bytes after a HEAD answer's head: the connection is not reused
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed answer from the upstream: {exc}"))
            self.close()

    def eof_received(self) -> bool | None:
        if self.head_done and not self.complete and self._delimited_by_close():
            self.complete = True  # a body without a length ends with the connection
            self._wake()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and exc is None and self.head_done and self._delimited_by_close():
            self.complete = True  # (over TLS the end may come without eof_received)
            self._wake()
        if self.complete:
            return
        if not self.got_bytes:
            self._fail(_Gone(str(exc) if exc else "connection closed"))
        elif exc is not None:
            self._fail(httpx.ReadError(str(exc) or type(exc).__name__))
        else:
            self._fail(httpx.RemoteProtocolError("upstream closed the connection mid-answer"))

    def pause_writing(self) -> None:  # the request is one write; nothing to hold back
        pass

    def resume_writing(self) -> None:
        pass

    # ---- httptools callbacks -------------------------------------------------------------
    def on_status(self, reason: bytes) -> None:
        self.reason = reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        if 100 <= self.status < 200:
            return  # an interim answer (103 Early Hints): the real one follows
        self.head_done = True
        if self.head_only:
            self.complete = True  # a HEAD answer has no body whatever its length says
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if not self.head_done:
            self.headers = []  # the interim answer's headers are not the answer's
            return
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()
        self._wake()

    # ---- used by the transport and the body stream ---------------------------------------
    def _delimited_by_close(self) -> bool:
        names = {name.lower() for name, _ in self.headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    def _fail(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float | None, request: httpx.Request) -> None:
        """Until something more happened (bytes, the end, an error); ``httpx.ReadTimeout``
        after ``timeout``. (A timer on the future: ``asyncio.timeout`` costs several times
        more, and this runs for every answer.)"""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, _expire, waiter) if timeout is not None else None
        try:
            await waiter
        except TimeoutError as exc:
            raise httpx.ReadTimeout("upstream read timed out", request=request) from exc
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def take(self) -> bytes:
        chunk = self.chunks.popleft()
        self.buffered -= len(chunk)
        if self.paused and self.buffered <= HIGH_WATER // 2 and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return chunk

    def start(self, head_only: bool) -> None:
        self._reset()
        self.head_only = head_only

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _Body(httpx.AsyncByteStream):
    def __init__(self, conn: _Conn, owner: H1Transport, request: httpx.Request) -> None:
        self._conn = conn
        self._owner = owner
        self._request = request
        self._released = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        read = self._request.extensions.get("timeout", {}).get("read")
        while True:
            while conn.chunks:
                yield conn.take()
            if conn.complete:
                return
            if conn.error is not None:
                raise _mapped(conn.error, self._request)
            await conn.wait(read, self._request)

    async def aclose(self) -> None:
        if not self._released:
            self._released = True
            done = self._conn.complete and not self._conn.chunks
            self._owner.release(self._conn, reuse=done and self._conn.keep_alive)


def _mapped(exc: Exception, request: httpx.Request) -> httpx.HTTPError:
    if isinstance(exc, httpx.HTTPError):
        exc.request = request
        return exc
    return httpx.RemoteProtocolError(
        f"upstream closed the connection without answering ({exc})", request=request
    )


class H1Transport(httpx.AsyncBaseTransport):
    """Pooled HTTP/1.1 connections per (scheme, host, port), at most ``max_connections``."""

    def __init__(self, limits: httpx.Limits) -> None:
        self._max = limits.max_connections or 0
        keep = limits.max_keepalive_connections
        self._keep = keep if keep is not None else sys.maxsize
        self._expiry = limits.keepalive_expiry
        self._idle: dict[tuple[str, str, int], list[_Conn]] = {}
        self._slots: asyncio.Semaphore | None = None
        self._ssl: ssl.SSLContext | None = None

    def _context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()  # the CA bundle httpx would use
        return self._ssl

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions.get("timeout", {})
        try:
            body: bytes = request.content
        except httpx.RequestNotRead:
            body = await request.aread()
        url = request.url
        key = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
        head = bytearray(request.method.encode("ascii"))
        head += b" " + url.raw_path + b" HTTP/1.1\r\n"
        for name, value in request.headers.raw:
            head += name + b": " + value + b"\r\n"
        head += b"\r\n"
        await self._take_slot(timeout.get("pool"), request)
        try:
            for attempt in (0, 1):
                conn, reused = await self._connection(key, timeout.get("connect"), request)
                conn.start(head_only=request.method == "HEAD")
                assert conn.transport is not None
                if len(body) < ONE_WRITE:
                    conn.transport.write(bytes(head) + body)
                else:  # not copied into one buffer
                    conn.transport.writelines((bytes(head), body))
                try:
                    await self._head(conn, timeout.get("read"), request)
                except _Gone:
                    conn.close()
                    if reused and attempt == 0 and request.method in IDEMPOTENT:
                        continue  # the server had closed this kept connection meanwhile
                    raise httpx.RemoteProtocolError(
                        "upstream closed the connection without answering", request=request
                    ) from None
                except BaseException:
                    conn.close()
                    raise
                return httpx.Response(
                    status_code=conn.status,
                    headers=conn.headers,
                    stream=_Body(conn, self, request),
                    request=request,
                    extensions={"http_version": b"HTTP/1.1", "reason_phrase": conn.reason},
                )
        except BaseException:
            self._free_slot()
            raise
        raise AssertionError("unreachable")

    async def _head(self, conn: _Conn, read: float | None, request: httpx.Request) -> None:
        while not conn.head_done:
            if conn.error is not None:
                if isinstance(conn.error, _Gone):
                    raise conn.error
                raise _mapped(conn.error, request)
            await conn.wait(read, request)

    async def _take_slot(self, pool: float | None, request: httpx.Request) -> None:
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
            raise httpx.PoolTimeout("no free upstream connection in time", request=request) from exc

    def _free_slot(self) -> None:
        if self._slots is not None:
            self._slots.release()

    async def _connection(
        self, key: tuple[str, str, int], connect: float | None, request: httpx.Request
    ) -> tuple[_Conn, bool]:
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
                    lambda: _Conn(key), host, port, ssl=tls, server_hostname=host if tls else None
                )
        except TimeoutError as exc:
            raise httpx.ConnectTimeout("upstream connect timed out", request=request) from exc
        except OSError as exc:
            # The OS error (refused, DNS, TLS) is what proxy.reach.classify reads.
            raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from exc
        return conn, False

    def release(self, conn: _Conn, reuse: bool) -> None:
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
