"""One HTTP/1.1 connection of the ``h1`` transport (``proxy.adapters.h1``) and the answer in
progress on it: the answer's head and body parsed by httptools (C) as they arrive, the body
kept as the chunks the relay reads, the socket's reading paused past ``HIGH_WATER`` unread."""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Callable

import httptools
import httpx

from proxy.adapters.upstreamcall import UpstreamRequest, httpx_of

# Past this much unread body the socket stops being read (the client is slower than the
# upstream); reading resumes once the relay has taken it.
HIGH_WATER = 1024 * 1024

# What an error names as its request: httpx's, or ours (its httpx request built then).
Requested = httpx.Request | UpstreamRequest

# What a sink (``Conn.sink``) answers for the body it was given: go on; stop (it wants no
# more: the connection's later bytes are kept as chunks); hold (its reader is slow: the
# socket stops being read until ``Conn.unhold``).
GO, STOP, HOLD = 0, 1, 2
Sink = Callable[[bytes], int]


class Gone(Exception):
    """The connection ended before any of the answer arrived (a kept one may be retried)."""


class Conn(asyncio.Protocol):
    """One connection and the answer in progress on it."""

    def __init__(self, key: tuple[str, str, int]) -> None:
        self.key = key
        self.idle_since = 0.0
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._parser = httptools.HttpResponseParser(self)
        self._timer: asyncio.TimerHandle | None = None  # the read timer, armed for ``_timer_at``
        self._timer_at = math.inf
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
        self._deadline = math.inf  # when the wait in progress times out
        self._timeout: float | None = None  # the wait in progress's read timeout
        # Given each read's body as it arrives, from ``data_received`` (``push``), instead of
        # the chunks waking a reader; ``said``: its last answer but GO, ``held``: reading paused.
        self.sink: Sink | None = None
        self.said = GO
        self.held = False
        self.sink_error: BaseException | None = None
        # ``when_ended``: called once the answer's end (or anything else) arrives, or in time.
        self._then: Callable[[], None] | None = None
        self._then_timer: asyncio.TimerHandle | None = None
        self._disarm()  # (a timer of the connection's previous answer)

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
            return
        if self.sink is not None and self.chunks:
            self.feed_sink(self.sink)

    def feed_sink(self, sink: Sink) -> None:
        """The body that arrived, to ``sink``; its reader woken only when it stops or holds."""
        try:
            said = sink(self.take())
        except Exception as exc:  # (a bug of the sink's: its reader raises it)
            self.sink_error, said = exc, STOP
        if said == GO:
            if self._timeout is not None and self._waiter is not None:
                # The wait spans the whole body: each read moves its deadline (``_check``).
                self._deadline = self._waiter.get_loop().time() + self._timeout
            return
        self.said = said
        if said == STOP:
            self.sink = None
        elif not self.held and self.transport is not None:
            self.held = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool | None:
        if self.head_done and not self.complete and self._delimited_by_close():
            self.complete = True  # a body without a length ends with the connection
            self._wake()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._disarm()  # (a wait in progress ends below: the connection's end wakes it)
        if not self.complete and exc is None and self.head_done and self._delimited_by_close():
            self.complete = True  # (over TLS the end may come without eof_received)
            self._wake()
        if self.complete:
            return
        if not self.got_bytes:
            self._fail(Gone(str(exc) if exc else "connection closed"))
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
        if self.sink is not None:
            return  # taken at the end of this read (``data_received``)
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
        if self._then is not None:
            self._settle()

    def when_ended(self, then: Callable[[], None], within: float) -> None:
        """``then()`` at the next thing that happens on this connection (the answer's end,
        more body, an error, the connection lost) or after ``within`` seconds, whichever
        comes first; ``then`` looks at the state it finds."""
        self._then = then
        self._then_timer = asyncio.get_running_loop().call_later(within, self._expire)

    def _expire(self) -> None:
        # The loop may have been held up past ``within`` with the awaited bytes already in
        # the socket. libuv before 1.45 (older uvloop releases) runs due timers before the
        # poll that would read them, and a callback a timer queues before it too: two hops
        # of ``call_soon`` let one poll go first, so a stalled loop does not close a
        # connection that ended in time. (asyncio and newer libuv poll first anyway.)
        self._then_timer = None
        loop = asyncio.get_running_loop()
        loop.call_soon(loop.call_soon, self._settle_for, self._then)

    def _settle_for(self, then: Callable[[], None] | None) -> None:
        if then is not None and self._then is then:  # (not settled meanwhile)
            self._settle()

    def _settle(self) -> None:
        then, self._then = self._then, None
        if self._then_timer is not None:
            self._then_timer.cancel()
            self._then_timer = None
        if then is not None:
            then()

    async def wait(self, timeout: float | None, request: Requested) -> None:
        """Until something more happened (bytes, the end, an error); ``httpx.ReadTimeout``
        after ``timeout``. (``asyncio.timeout`` costs several times more, and this runs for
        every read of an answer: a stream waits once per event.)

        One timer per answer rather than one set and cancelled around every wait (#28):
        each wait moves the deadline; the timer, when it fires before it, is set again
        for it (``_check``)."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        self._timeout = timeout
        deadline = self._deadline = loop.time() + timeout if timeout is not None else math.inf
        if deadline < self._timer_at:  # none armed, or armed for later than this wait allows
            self._arm(loop, deadline)
        try:
            await waiter
        except TimeoutError as exc:
            raise httpx.ReadTimeout("upstream read timed out", request=httpx_of(request)) from exc
        finally:
            self._waiter = None

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        self._disarm()
        self._timer, self._timer_at = loop.call_at(at, self._check), at

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, math.inf

    def _check(self) -> None:
        """The read timer fired: the wait in progress times out if its deadline passed;
        otherwise the timer is set again for it (none when nothing waits)."""
        self._timer, self._timer_at = None, math.inf
        waiter = self._waiter
        if waiter is None or waiter.done() or self._deadline == math.inf:
            return
        loop = waiter.get_loop()
        if loop.time() >= self._deadline:
            waiter.set_exception(TimeoutError())
        else:
            self._arm(loop, self._deadline)

    def take(self) -> bytes:
        """Every body chunk that arrived so far, as one (``chunks`` must not be empty).

        One read of a stream often holds many HTTP chunks (a provider writes an event a
        chunk, and events queue while the loop is busy): taken one by one, each went through
        the relay's generators, its event split and its write on its own, ~8 us of Python a
        chunk (#28). Joined, what the relay does per chunk it does once per read."""
        chunks = self.chunks
        if len(chunks) == 1:
            data = chunks.popleft()
        else:
            data = b"".join(chunks)
            chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def unhold(self) -> None:
        """A held sink's reader caught up: the socket is read again."""
        self.said = GO
        if self.held:
            self.held = False
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()

    def start(self, head_only: bool) -> None:
        self._reset()
        self.head_only = head_only

    def close(self) -> None:
        self.closed = True
        self._disarm()
        if self.transport is not None:
            self.transport.close()


def mapped(exc: Exception, request: Requested) -> httpx.HTTPError:
    """A connection's error as the httpx error its request's reader raises."""
    if isinstance(exc, httpx.HTTPError):
        exc.request = httpx_of(request)
        return exc
    return httpx.RemoteProtocolError(
        f"upstream closed the connection without answering ({exc})", request=httpx_of(request)
    )
