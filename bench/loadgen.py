"""A closed-loop HTTP/1.1 load generator, run in its own process.

    python -m bench.loadgen --port 4000 --body-file req.json --concurrency 16 \\
        [--path /v1/chat/completions] [--header 'authorization: Bearer sk-x'] \\
        [--warmup 1] [--duration 4] [--max-requests 5000] [--min-requests 1]

``--concurrency`` workers, each with its own keep-alive connection, send the same POST body
(with several ``--body-file``: each of them in turn) back to back (a new request as soon as
the previous response has been read to its last byte, streamed or not). Requests started
during ``--warmup`` seconds are not measured; measuring stops after ``--duration`` seconds
or ``--max-requests`` measured requests, whichever comes first, but never before
``--min-requests`` measured requests have started: on a busy machine a short window could
otherwise measure nothing and report no figure.
Prints one JSON object: request count, errors, status counts, latency percentiles (ms),
requests per second, and CPU seconds over the measured window (from the end of the warm-up
to the last response): the generator's own and, for each ``--watch-pid``, that process's
(from ``/proc``, Linux only), so a table can say which process was the limit.

It speaks raw HTTP/1.1 through ``httptools`` (uvloop when installed) rather than httpx: on a
2-core machine the generator shares the CPUs with the server under test, and an httpx client
costs several times more CPU per request, which would tax every row of the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httptools


class ResponseProtocol(asyncio.Protocol):
    """One keep-alive connection; ``request`` sends bytes and waits for a whole response."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[int, bool]] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(exc or ConnectionError("connection closed by the server"))

    def _fail(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            status = self.parser.get_status_code()
            self.waiter.set_result((status, self.parser.should_keep_alive()))

    async def request(self, data: bytes) -> tuple[int, bool]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self.waiter

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


@dataclass
class Run:
    measure_from: float
    measure_until: float
    max_requests: int
    min_requests: int = 1
    started: int = 0
    errors: int = 0
    last_end: float = 0.0
    latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)


def build_request(host: str, port: int, path: str, headers: list[str], body: bytes) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"host: {host}:{port}", "content-type: application/json"]
    lines += headers
    lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def worker(host: str, port: int, requests: list[bytes], first: int, run: Run) -> None:
    """Send ``requests`` in turn from the ``first`` one on (one body: always the same)."""
    loop = asyncio.get_running_loop()
    clock = time.perf_counter
    conn: ResponseProtocol | None = None
    turn = first
    try:
        while True:
            request = requests[turn % len(requests)]
            turn += 1
            t0 = clock()
            measured = t0 >= run.measure_from
            enough = run.started >= run.min_requests
            if (t0 >= run.measure_until and enough) or (
                measured and run.started >= run.max_requests
            ):
                return
            if measured:
                run.started += 1
            try:
                if conn is None or conn.closed:
                    _, conn = await loop.create_connection(ResponseProtocol, host, port)
                status, keep_alive = await conn.request(request)
            except (OSError, httptools.HttpParserError):
                if measured:
                    run.errors += 1
                conn = None
                await asyncio.sleep(0.01)
                continue
            t1 = clock()
            if measured:
                run.latencies.append(t1 - t0)
                run.statuses[status] = run.statuses.get(status, 0) + 1
                run.last_end = max(run.last_end, t1)
            if not keep_alive:
                conn.close()
                conn = None
    finally:
        if conn is not None:
            conn.close()


def process_cpu_s(pid: int) -> float | None:
    """User plus system CPU seconds ``pid`` has used so far (None when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds of this process and the watched ones between ``start`` and ``stop``."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.began = 0.0
        self.marks: dict[str, float | None] = {}

    def _now(self) -> dict[str, float | None]:
        now: dict[str, float | None] = {"self": time.process_time()}
        now.update({str(pid): process_cpu_s(pid) for pid in self.pids})
        return now

    def start(self) -> None:
        self.began, self.marks = time.perf_counter(), self._now()

    def stop(self) -> tuple[float, dict[str, float | None]]:
        window = time.perf_counter() - self.began
        end = self._now()
        used = {}
        for key, first in self.marks.items():
            last = end.get(key)
            used[key] = None if first is None or last is None else last - first
        return window, used


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(q / 100 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


async def drive(args: argparse.Namespace) -> dict[str, object]:
    requests = [
        build_request(args.host, args.port, args.path, args.header, Path(name).read_bytes())
        for name in args.body_file
    ]
    start = time.perf_counter()
    run = Run(
        measure_from=start + args.warmup,
        measure_until=start + args.warmup + args.duration,
        max_requests=args.max_requests,
        min_requests=max(0, min(args.min_requests, args.max_requests)),
    )
    meter = CpuMeter(args.watch_pid)
    loop = asyncio.get_running_loop()
    start_meter = loop.call_later(max(run.measure_from - time.perf_counter(), 0), meter.start)
    await asyncio.gather(
        *(
            worker(args.host, args.port, requests, n * len(requests) // args.concurrency, run)
            for n in range(args.concurrency)
        )
    )
    start_meter.cancel()
    if not meter.marks:  # every request ended before the warm-up did
        meter.start()
    cpu_window, used = meter.stop()
    lat = sorted(run.latencies)
    window = max(run.last_end - run.measure_from, 1e-9)
    ok = sum(n for status, n in run.statuses.items() if 200 <= status < 300)
    return {
        "concurrency": args.concurrency,
        "requests": len(lat),
        "ok": ok,
        "errors": run.errors + len(lat) - ok,
        "statuses": {str(k): v for k, v in sorted(run.statuses.items())},
        "p50_ms": percentile(lat, 50) * 1000,
        "p90_ms": percentile(lat, 90) * 1000,
        "p99_ms": percentile(lat, 99) * 1000,
        "mean_ms": (sum(lat) / len(lat) * 1000) if lat else float("nan"),
        "rps": len(lat) / window,
        "window_s": window,
        "cpu_window_s": cpu_window,
        "client_cpu_s": used.pop("self"),
        "watched_cpu_s": used,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.loadgen",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--path", default="/v1/chat/completions")
    parser.add_argument(
        "--body-file",
        required=True,
        action="append",
        help="the JSON body to POST; given several times, each worker sends them in turn",
    )
    parser.add_argument("--header", action="append", default=[], help="'name: value'")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds not measured")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds measured at most")
    parser.add_argument("--max-requests", type=int, default=10_000)
    parser.add_argument(
        "--min-requests", type=int, default=1, help="measured requests at least, however long"
    )
    parser.add_argument(
        "--watch-pid", type=int, action="append", default=[], help="report this PID's CPU too"
    )
    args = parser.parse_args(argv)
    try:
        from uvloop import run
    except ImportError:
        from asyncio import run  # type: ignore[assignment]
    print(json.dumps(run(drive(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
