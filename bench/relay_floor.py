"""The least a Python reverse proxy can do per request: a reference row for ``bench.servers``.

    python -m bench.relay_floor --upstream-port 8765 [--port 0] [--read-body]

An ``asyncio.Protocol`` on uvloop: each client connection gets its own kept-alive connection
to the upstream; requests are framed with ``httptools`` (C) and written upstream as the
client sent them, answers are passed back byte for byte without being parsed. No routing,
no headers rewritten, no validation, no error handling beyond closing both sides: it is not
a proxy anyone should run, only the floor under every Python one. With ``--read-body`` it
also parses each request body with ``orjson`` (C), the one step no proxy that reads the
conversation can skip. Nothing else in the project imports it. It prints ``ready <port>``
once it listens; only ever bind it to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import httptools
import orjson


class _Back(asyncio.Protocol):
    """The upstream side of one client connection: every byte goes back to the client."""

    def __init__(self, front: _Front) -> None:
        self.front = front

    def data_received(self, data: bytes) -> None:
        if self.front.transport is not None:
            self.front.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.front.transport is not None:
            self.front.transport.close()


class _Front(asyncio.Protocol):
    upstream_port = 0  # set once by ``main``
    read_body = False

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.raw: list[bytes] = []
        self.body: list[bytes] = []
        self.back: asyncio.Transport | None = None
        self.pending: list[bytes] = []  # requests framed before the upstream connection is up

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            back, _ = await loop.create_connection(
                lambda: _Back(self), "127.0.0.1", self.upstream_port
            )
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        self.back = back  # type: ignore[assignment]
        for request in self.pending:
            back.write(request)  # type: ignore[attr-defined]
        self.pending = []

    def data_received(self, data: bytes) -> None:
        self.raw.append(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.connection_lost(None)

    def connection_lost(self, exc: Exception | None) -> None:
        for side in (self.transport, self.back):
            if side is not None:
                side.close()

    # httptools callbacks
    def on_body(self, body: bytes) -> None:
        if self.read_body:
            self.body.append(body)

    def on_message_complete(self) -> None:
        if self.read_body:
            orjson.loads(b"".join(self.body))
            self.body = []
        request, self.raw = b"".join(self.raw), []
        if self.back is None:
            self.pending.append(request)
        else:
            self.back.write(request)


async def serve(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(_Front, "127.0.0.1", port, backlog=1024)
    print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.relay_floor", description=__doc__)
    parser.add_argument("--upstream-port", type=int, required=True)
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    parser.add_argument("--read-body", action="store_true", help="orjson-parse every body")
    args = parser.parse_args(argv)
    _Front.upstream_port, _Front.read_body = args.upstream_port, args.read_body
    try:
        from uvloop import run
    except ImportError:  # plain asyncio works, a little slower
        from asyncio import run  # type: ignore[assignment]
    try:
        run(serve(args.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
