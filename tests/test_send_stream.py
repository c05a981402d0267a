"""``sendstream.send_stream`` relays in a task of its own (#28): what it sends, when the body is
closed, ``then`` run once, and who may stop it (the client going away: swallowed; the server
cancelling the request: raised) are as they were when it ran in the request's task."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from proxy.server.sendstream import send_stream


class Client:
    """An ASGI client side: records what is sent; ``receive`` answers a disconnect once
    ``leave`` is set."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.leave = asyncio.Event()
        self.got_first = asyncio.Event()

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if message.get("more_body"):
            self.got_first.set()

    async def receive(self) -> dict[str, Any]:
        await self.leave.wait()
        return {"type": "http.disconnect"}


class Body:
    """A body of ``chunks``; with ``hold``, it waits after the first until released."""

    def __init__(self, chunks: list[bytes], hold: bool = False) -> None:
        self.chunks, self.hold = chunks, hold
        self.release = asyncio.Event()
        self.closed = False

    async def run(self) -> AsyncGenerator[bytes, None]:
        try:
            for i, chunk in enumerate(self.chunks):
                if i == 1 and self.hold:
                    await self.release.wait()
                yield chunk
        finally:
            self.closed = True


def bodies(client: Client) -> list[bytes]:
    return [m["body"] for m in client.sent if m["type"] == "http.response.body"]


def test_a_whole_stream_is_sent_then_closed_then_finished() -> None:
    async def main() -> None:
        client, body, done = Client(), Body([b"a", b"b", b"c"]), []
        await send_stream(
            client.send,
            client.receive,
            200,
            {"x": "1"},
            body.run(),
            lambda: done.append(body.closed),
        )
        assert client.sent[0] == {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"x", b"1")],
        }
        assert bodies(client) == [b"a", b"b", b"c", b""]
        assert client.sent[-1] == {"type": "http.response.body", "body": b""}
        assert done == [True]  # once, after the body was closed

    asyncio.run(main())


async def held_stream() -> tuple[Client, Body, list[bool], asyncio.Future[None]]:
    """A stream whose body holds after its first chunk, once the client has that chunk:
    the client, the body, what ``then`` saw (whether the body was closed), the request."""
    client, body, done = Client(), Body([b"a", b"b"], hold=True), []
    task = asyncio.ensure_future(
        send_stream(
            client.send, client.receive, 200, {}, body.run(), lambda: done.append(body.closed)
        )
    )
    await client.got_first.wait()
    return client, body, done, task


def test_a_client_gone_stops_the_stream_quietly_and_closes_the_body() -> None:
    async def main() -> None:
        client, body, done, task = await held_stream()
        client.leave.set()  # the server reports the client gone
        # No error: the client leaving is not one (30 s: a guard against a hang, not a measure).
        await asyncio.wait_for(task, 30)
        assert bodies(client) == [b"a"]
        assert done == [True]
        assert not task.cancelled()

    asyncio.run(main())


def test_the_request_cancelled_cancels_the_stream_and_is_raised() -> None:
    async def main() -> None:
        client, body, done, task = await held_stream()
        task.cancel()  # the server shutting down
        with pytest.raises(asyncio.CancelledError):
            await task
        assert body.closed and done == [True]
        assert bodies(client) == [b"a"]

    asyncio.run(main())


def test_an_error_of_the_body_reaches_the_caller() -> None:
    async def broken() -> AsyncGenerator[bytes, None]:
        yield b"a"
        raise RuntimeError("upstream broke")

    async def main() -> None:
        client, done = Client(), []
        with pytest.raises(RuntimeError, match="upstream broke"):
            await send_stream(
                client.send, client.receive, 200, {}, broken(), lambda: done.append(1)
            )
        assert done == [1]

    asyncio.run(main())


# ---- a pushed stream relayed in the request's task (``here``) ---------------------------


class Wire:
    """The client's socket under uvicorn's cycle: what was written, and the connection."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def own_cycle() -> Any:
    """uvicorn's httptools cycle over this proxy's own transport (``OneWriteTransport``)."""
    import logging

    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    from proxy.server.onewrite import OneWriteTransport

    transport = OneWriteTransport(Wire(), asyncio.get_running_loop())  # type: ignore[arg-type]
    return RequestResponseCycle(
        scope={"type": "http", "method": "POST", "path": "/v1/chat/completions"},  # type: ignore[typeddict-item]
        transport=transport, flow=FlowControl(transport), logger=logging.getLogger("t"),  # type: ignore[arg-type]
        access_logger=logging.getLogger("t"), access_log=False, default_headers=[],
        message_event=asyncio.Event(), expect_100_continue=False, keep_alive=True,
        on_response=lambda: None,
    )  # fmt: skip


class Pushed:
    """A body that sends its chunks itself (``relay.PushedEvents``'s shape); with ``hold``
    it waits after the first until released."""

    def __init__(self, hold: bool = False) -> None:
        self.hold = hold
        self.release = asyncio.Event()
        self.sent_first = asyncio.Event()
        self.closed = False

    async def __call__(self, send: Any) -> None:
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        self.sent_first.set()
        if self.hold:
            await self.release.wait()
        await send({"type": "http.response.body", "body": b"b", "more_body": True})

    async def aclose(self) -> None:
        self.closed = True


def start_pushed(send: Any, receive: Any) -> tuple[Pushed, list[bool], asyncio.Future[None]]:
    """A pushed stream that holds after its first chunk, relayed ``here``: its body, what
    ``then`` saw (whether the body was closed), the request."""
    body, done = Pushed(hold=True), []
    task = asyncio.ensure_future(
        send_stream(send, receive, 200, {}, body, lambda: done.append(body.closed), here=True)
    )
    return body, done, task


def test_a_pushed_stream_runs_in_the_request_task_and_ends_whole() -> None:
    async def main() -> None:
        cycle, body, done = own_cycle(), Pushed(), []
        tasks = len(asyncio.all_tasks())
        seen: list[int] = []

        async def watch(message: Any) -> None:
            seen.append(len(asyncio.all_tasks()))
            await cycle.send(message)

        watch.raw = cycle.send  # type: ignore[attr-defined]  # (as ``front.Tracked`` is)
        await send_stream(
            watch, cycle.receive, 200, {}, body, lambda: done.append(body.closed), here=True
        )
        assert seen and max(seen) == tasks  # no task of its own (nor a watcher)
        cycle.transport.flush()
        sent = b"".join(cycle.transport._real.written)
        assert sent.startswith(b"HTTP/1.1 200 OK") and sent.endswith(b"1\r\nb\r\n0\r\n\r\n")
        assert cycle.response_complete and done == [True]
        assert cycle.transport.on_lost is None

    asyncio.run(main())


def test_a_client_leaving_a_pushed_stream_stops_it_quietly() -> None:
    async def main() -> None:
        cycle = own_cycle()
        body, done, task = start_pushed(cycle.send, cycle.receive)
        await body.sent_first.wait()
        cycle.disconnected = True  # what uvicorn's ``connection_lost`` does, then ours:
        cycle.transport.on_lost()
        await asyncio.wait_for(task, 30)  # (a guard against a hang, not a measure)
        assert not task.cancelled() and done == [True]
        assert cycle.transport.on_lost is None

    asyncio.run(main())


def test_a_client_gone_before_a_pushed_stream_starts_stops_it_at_its_first_wait() -> None:
    async def main() -> None:
        cycle = own_cycle()
        cycle.disconnected = True
        body, done, task = start_pushed(cycle.send, cycle.receive)
        await asyncio.wait_for(task, 30)
        assert done == [True] and not body.release.is_set()

    asyncio.run(main())


def test_the_request_cancelled_during_a_pushed_stream_is_raised() -> None:
    async def once(leaves_too: bool) -> None:
        cycle = own_cycle()
        body, done, task = start_pushed(cycle.send, cycle.receive)
        await body.sent_first.wait()
        task.cancel()  # the server shutting down
        if leaves_too:  # and the client's connection lost with it: still raised
            cycle.transport.on_lost()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert body.closed and done == [True], leaves_too

    async def main() -> None:
        await once(False)
        await once(True)

    asyncio.run(main())


def test_a_pushed_stream_on_another_server_is_relayed_with_its_watcher() -> None:
    async def main() -> None:
        client = Client()
        body, done, task = start_pushed(client.send, client.receive)
        await body.sent_first.wait()
        client.leave.set()  # told on ``receive``, as any ASGI server tells it
        await asyncio.wait_for(task, 30)
        assert not task.cancelled() and done == [True] and bodies(client) == [b"a"]

    asyncio.run(main())
