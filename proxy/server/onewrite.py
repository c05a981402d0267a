"""One write for a response's head and the body that follows it (#28).

uvicorn writes a response's status line and headers as soon as the app sends
``http.response.start`` and the body on ``http.response.body``: two ``send`` system calls
for every answer, each waking the client. On this machine a socket write is the largest
single cost of a small request (docs/benchmarks.md, #28). ``OneWriteHttpToolsProtocol`` hands
uvicorn's protocol a transport that holds a response head back until the next write, which
it joins (the body, or a stream's first chunk); a head nothing follows within the event
loop's turn (a stream whose first event is not there yet) goes out at the end of that turn,
so no byte waits on the upstream. Order is kept: whatever is held goes before any later
write, and ``close`` sends it first.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# What uvicorn's heads begin with (its status lines).
_HEAD = b"HTTP/1."


class OneWriteTransport:
    """A transport that holds a response head until the next write or the loop's turn end.
    Everything else is the real transport's."""

    __slots__ = ("_real", "_held", "_loop")

    def __init__(self, real: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._real = real
        self._held: bytes | None = None
        self._loop = loop

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._real.write(held + bytes(data))
        elif isinstance(data, bytes) and data.startswith(_HEAD):
            self._held = data
            self._loop.call_soon(self.flush)
        else:
            self._real.write(data)

    def flush(self) -> None:
        """Send what is held (a head nothing followed in the same turn)."""
        held = self._held
        if held is not None:
            self._held = None
            if not self._real.is_closing():
                self._real.write(held)

    def close(self) -> None:
        self.flush()
        self._real.close()

    def abort(self) -> None:
        self._held = None
        self._real.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class OneWriteHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a ``OneWriteTransport`` (``uvicorn.run(http=...)``)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        loop = asyncio.get_running_loop()
        super().connection_made(OneWriteTransport(transport, loop))  # type: ignore[arg-type]
