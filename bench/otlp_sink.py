"""A minimal OTLP/HTTP receiver for benchmarks: answers every ``POST /v1/traces`` with 200 at
once and keeps nothing, so a traced proxy's export costs what it costs the proxy, not a
collector's work on the same cores. Prints ``ready <port>`` once it listens; on SIGTERM
prints the batches and bytes it received to stderr.

    python -m bench.otlp_sink [--port 0]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

_OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n"


class Counts:
    batches = 0
    bytes = 0


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            body = await reader.readexactly(length)
            Counts.batches += 1
            Counts.bytes += len(body)
            writer.write(_OK)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _main(port: int) -> None:
    server = await asyncio.start_server(_serve, "127.0.0.1", port)
    print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with server:
        await stop.wait()
    print(f"otlp sink: {Counts.batches} batches, {Counts.bytes} bytes", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    asyncio.run(_main(parser.parse_args(argv).port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
