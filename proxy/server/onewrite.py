"""One write for what a response sends within one turn of the event loop (#28).

uvicorn writes a response's status line and headers as soon as the app sends
``http.response.start``, the body on ``http.response.body``, and a stream's every chunk and
its closing ``0\\r\\n\\r\\n`` as they come: a ``send`` system call for each, each waking the
client. On this machine a socket write is the largest single cost of a small request
(docs/benchmarks.md, #28). ``OneWriteHttpToolsProtocol`` hands uvicorn's protocol a transport
that holds what is written and sends it in one write:

- when the response is complete (uvicorn's ``on_response_complete``): a whole answer leaves
  at once, before the work that follows it (log line, metrics, ledger queue);
- at the end of the event loop's turn otherwise: a stream's head and events go out as soon
  as the relay waits on the upstream, so no byte waits on the network;
- before a big write (``DIRECT_BYTES``), which goes as it is, not copied into the held bytes.

Order is kept: whatever is held goes before any later write, and ``close`` sends it first;
``abort`` drops it with the connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# A write this big is not joined to what is held (a copy of it would cost more than a call).
DIRECT_BYTES = 64 * 1024


class OneWriteTransport:
    """A transport that holds writes until ``flush`` or the loop's turn end. Everything else
    is the real transport's."""

    __slots__ = ("_real", "_held", "_loop", "on_lost")

    def __init__(self, real: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._real = real
        self._held: list[bytes] = []
        self._loop = loop
        # Called once when the connection is lost (``proxy.server.sendstream``: a stream
        # relayed in the request's task is stopped so, without a task to watch ``receive``).
        self.on_lost: Callable[[], None] | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if len(data) >= DIRECT_BYTES:
            self.flush()
            self._real.write(data)
            return
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(bytes(data))

    def write_now(self, data: bytes) -> None:
        """``data`` sent at once, after what is held, in one write (a stream's read pushed
        from the upstream's callback, ``proxy.server.push``: holding it to the end of the
        turn cost a callback and gained nothing, as no more of this response comes in it)."""
        self._held.append(data)
        self.flush()

    def flush(self) -> None:
        """Send what is held, in one write."""
        held = self._held
        if held:
            self._held = []
            if not self._real.is_closing():
                self._real.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self.flush()
        self._real.close()

    def abort(self) -> None:
        self._held = []
        self._real.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class OneWriteHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a ``OneWriteTransport`` (``uvicorn.run(http=...)``)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        loop = asyncio.get_running_loop()
        super().connection_made(OneWriteTransport(transport, loop))  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)  # (the cycle marked disconnected first)
        transport = self.transport
        lost = transport.on_lost if isinstance(transport, OneWriteTransport) else None
        if lost is not None:
            transport.on_lost = None  # type: ignore[union-attr]
            lost()

    def on_response_complete(self) -> None:
        # The answer is whole: it goes now, not after what the app does next in this turn.
        self.transport.flush()  # type: ignore[attr-defined]
        super().on_response_complete()
