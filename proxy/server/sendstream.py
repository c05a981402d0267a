"""A streamed answer written with ``send``, stopped when the client goes away (#28).

The ASGI server no longer fails a ``send`` once the client is gone; it says so on
``receive``. Two ways to hear it, one way to relay:

- Pulled (an async generator of chunks): the relaying runs in a task of its own (``pump``),
  so each chunk that arrives wakes only its few frames (the pump, the relay's generators,
  the upstream's wait), not the dozen of the request's whole chain above it (uvicorn's
  cycle, the middlewares, the route, ``relay``): a coroutine resumed goes back down every
  ``await`` it is in, and a stream resumes once per event. A watcher task waits on
  ``receive`` for the whole stream and cancels the pump when the client leaves.
- Pushed (``here``: a body that writes its chunks from the upstream connection's callbacks,
  ``proxy.server.push``), on this proxy's own server protocol (``OneWriteTransport``): the
  request's task wakes only at the stream's end, so it relays in that task, and the
  protocol's ``connection_lost`` cancels it when the client leaves. The two tasks and their
  scheduling cost ~8 us a stream; a slow upstream is stopped as promptly (at once).

Either way a client that leaves is no error (swallowed), the server cancelling the request
(shutting down) is raised, the body is closed (which ends its upstream request) and ``then``
runs last, once, whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any, Protocol

from starlette.types import Receive, Send

from proxy.server.onewrite import OneWriteTransport
from proxy.server.push import cycle_of


class Body(Protocol):
    """A body that sends its chunks itself (``relay.PushedEvents``) and can be closed."""

    async def __call__(self, send: Send) -> None: ...

    async def aclose(self) -> None: ...


def raw_headers(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """Response headers as ASGI wants them (what Starlette's ``Response`` would send)."""
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


async def send_stream(
    send: Send,
    receive: Receive,
    status: int,
    headers: dict[str, str],
    body: AsyncGenerator[bytes, None] | Body,
    then: Callable[[], None],
    *,
    here: bool = False,
) -> None:
    """Relay ``body`` (a generator of chunks, or a ``Body`` that sends them itself), its
    head first and its end last; ``here``: it wakes this task only at its end (it may then
    run in this task, see the module's doc)."""
    state = {"gone": False, "ended": False}
    cycle = _own_cycle(send) if here else None
    if cycle is not None:
        await _relay_here(cycle, _pump(send, status, headers, body, state), then, state)
        return

    pumping = asyncio.ensure_future(_pump(send, status, headers, body, state))

    def on_gone(watcher: asyncio.Future[None]) -> None:
        # Runs on the loop later: after the answer ended it must not cancel what follows.
        if state["ended"] or watcher.cancelled() or watcher.exception() is not None:
            return
        state["gone"] = True
        pumping.cancel()

    watcher = asyncio.ensure_future(_disconnected(receive))
    watcher.add_done_callback(on_gone)
    try:
        await pumping
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if not state["gone"] or (task is not None and task.cancelling()):
            raise  # not the client leaving (the server shutting down): not ours to swallow
    finally:
        state["ended"] = True
        watcher.cancel()
        then()


async def _pump(
    send: Send,
    status: int,
    headers: dict[str, str],
    body: AsyncGenerator[bytes, None] | Body,
    state: dict[str, bool],
) -> None:
    start = {"type": "http.response.start", "status": status, "headers": raw_headers(headers)}
    async with contextlib.aclosing(body):
        await send(start)
        if isinstance(body, AsyncGenerator):
            async for chunk in body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        else:
            await body(send)
    state["ended"] = True  # the server reports the end of the answer as a disconnect
    await send({"type": "http.response.body", "body": b""})


async def _relay_here(
    cycle: Any, pump: Coroutine[Any, Any, None], then: Callable[[], None], state: dict[str, bool]
) -> None:
    task = asyncio.current_task()
    assert task is not None

    def on_lost() -> None:
        # From the protocol's ``connection_lost``, while this task waits (never within it).
        if not state["ended"]:
            state["gone"] = True
            task.cancel()

    transport: OneWriteTransport = cycle.transport
    transport.on_lost = on_lost
    if cycle.disconnected:
        on_lost()  # gone already: stopped at the first wait (the upstream's)
    try:
        await pump
    except asyncio.CancelledError:
        # Only the client leaving, and nothing else cancelling the request, is swallowed.
        if not state["gone"] or task.uncancel() > 0:
            raise
    finally:
        state["ended"] = True
        transport.on_lost = None
        then()


def _own_cycle(send: Send) -> Any:
    """uvicorn's cycle of ``send``'s response when its transport is this proxy's own (which
    tells of the client leaving), else None."""
    cycle = cycle_of(send)
    if cycle is None or type(getattr(cycle, "transport", None)) is not OneWriteTransport:
        return None
    return cycle if isinstance(getattr(cycle, "disconnected", None), bool) else None


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
