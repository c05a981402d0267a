"""``relay.send_stream`` relays in a task of its own (#28): what it sends, when the body is
closed, ``then`` run once, and who may stop it (the client going away: swallowed; the server
cancelling the request: raised) are as they were when it ran in the request's task."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from proxy.server.relay import send_stream


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
