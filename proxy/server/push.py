"""A streamed answer pushed to the client from the upstream connection's callbacks (#28).

Pulled, each read of a stream woke the relaying task: the connection's waiter, the reader's
and the relay's generators, an ASGI message through uvicorn's ``send`` and a write held to
the end of the loop's turn: ~25 us of CPU an event against the floor relay's ~10, and an
agent's answer is hundreds of events. Pushed, the upstream connection hands each read to a
sink (``H1Reply.push``) that reads it (``events.StreamReads``) and writes the events it
completed to the client's socket as one HTTP chunk, in the same callback; the relaying task
wakes only when the stream ends, breaks, times out, or the client's socket is full.

Only where both ends allow it: the upstream's answer on the ``h1`` transport, not encoded
(``H1Reply.pushable``), and the client's response on uvicorn's httptools protocol, chunked,
its head sent (``ChunkWriter.of``). Anywhere else the stream is pulled as before. The head
and the end of the response still go through ``send``, so uvicorn's cycle keeps its own
account of the response (started, complete, keep-alive).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.types import Send
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from proxy.adapters.h1conn import GO, HOLD, STOP

# What ``ChunkWriter.of`` reads of uvicorn's cycle, and must find as (True, False, False, True).
_STATE = ("response_started", "response_complete", "disconnected", "chunked_encoding")


def cycle_of(bound: Any) -> RequestResponseCycle | None:
    """The uvicorn httptools cycle whose bound method ``bound`` is (its ``send`` or
    ``receive``, or the ``send`` a ``front.Tracked`` wraps as ``raw``), else None: what this
    module, ``sendstream`` and ``incoming`` read of it they read only from the cycle of
    today's uvicorn."""
    cycle = getattr(getattr(bound, "raw", bound), "__self__", None)
    return cycle if type(cycle) is RequestResponseCycle else None


class ChunkWriter:
    """Writes HTTP chunks of a started, chunked response on uvicorn's httptools protocol,
    as its ``send`` would for ``http.response.body`` with ``more_body``."""

    __slots__ = ("_cycle", "_write", "_write_now")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        transport = cycle.transport
        self._write: Callable[[bytes], None] = transport.write
        # (``OneWriteTransport``: what it holds, the head, goes first, in the same write.)
        self._write_now: Callable[[bytes], None] = getattr(transport, "write_now", transport.write)

    @classmethod
    def of(cls, send: Send) -> ChunkWriter | None:
        """The writer for ``send``'s response, if it can be written straight (else None).
        The cycle's state is read as the uvicorn of today keeps it; one that keeps it
        otherwise gets its stream pulled, never a write on a state it does not have."""
        cycle = cycle_of(send)
        if cycle is None:
            return None
        state = tuple(getattr(cycle, name, None) for name in _STATE)
        if state != (True, False, False, True) or not hasattr(cycle, "transport"):
            return None  # (started, not complete, client there, chunked)
        flow = getattr(cycle, "flow", None)
        if not isinstance(getattr(flow, "write_paused", None), bool) or not hasattr(flow, "drain"):
            return None
        scope = getattr(cycle, "scope", None)
        if not isinstance(scope, dict) or scope.get("method") == "HEAD":
            return None
        return cls(cycle)

    def write(self, data: bytes, last: bool = False) -> int:
        """``data`` as one chunk: GO, STOP when the client is gone (nothing more to read
        for it), HOLD when its socket's buffer is full (read on once ``drain`` returned).
        ``last``: the stream's end is in it, and the response's end follows in this turn of
        the loop: held, so that both leave in one write (a short answer: one write, as
        pulled); any other read is written at once."""
        cycle = self._cycle
        if cycle.disconnected:
            return STOP
        (self._write if last else self._write_now)(b"%x\r\n%b\r\n" % (len(data), data))
        return HOLD if cycle.flow.write_paused else GO

    async def drain(self) -> None:
        await self._cycle.flow.drain()
