"""What traces cost in the hot path: the proxy's added latency with tracing off and on, side by
side (issue #27).

    python -m bench.tracing [--smoke] [--rounds N] [--json PATH]

Rows, measured in alternation for ``--rounds`` rounds (so a machine that gets busier during
the run weighs on every row alike), each with the same request body sent back to back by
``bench.loadgen`` to the fast fixed-reply upstream (``bench.upstream_fast``):

- ``direct``: straight to the upstream, the baseline of "added";
- ``proxy, tracing off``: no ``OTEL_*`` variable (no OpenTelemetry module is loaded);
- ``proxy, tracing on``: ``OTEL_EXPORTER_OTLP_ENDPOINT`` set to ``bench.otlp_sink`` (an OTLP
  receiver that answers at once), default batching (``BatchSpanProcessor``, 5 s delay);
- ``proxy, before``: with ``--before DIR``, the proxy of another source tree (``git archive
  <commit> | tar -x -C DIR``: the code before tracing existed), for "off costs nothing".

Each cell is a fresh proxy process (one worker). Reported per row: the median over rounds of
the cell's p50 and p99 latency, and the added p50 (row minus direct, per round, median).
The acceptance bound of #27 is "tracing on adds at most 0.1 ms to the added p50".
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.overhead import (
    FULL,
    MEASURE_COMPACTION,
    PLAIN_KEY,
    SMOKE,
    FastUpstream,
    Profile,
    load,
    request_body,
    settle,
    start_ready,
)
from bench.overhead import _stop as stop_process
from tests.proxyproc import ProxyProcess

ROWS = ("direct", "proxy, tracing off", "proxy, tracing on")
BEFORE = "proxy, before"
EXTRA_ENV: dict[str, str] = {}  # --otel-env: more OTEL_* settings for the traced row


def cell(
    row: str,
    work: Path,
    upstream: FastUpstream,
    sink_port: int,
    body: Path,
    c: int,
    p: Profile,
    before: Path | None = None,
) -> dict[str, Any]:
    """One load run of ``row`` at concurrency ``c``."""
    if row == "direct":
        return load(upstream.port, body, PLAIN_KEY, c, p)
    tmp = Path(tempfile.mkdtemp(dir=work))
    env = {}
    if row == BEFORE and before is not None:
        env["PYTHONPATH"] = str(before)  # its ``proxy`` package instead of this one
    if row == "proxy, tracing on":
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{sink_port}"
        env.update(EXTRA_ENV)
    proxy = ProxyProcess(tmp, upstream.base_url, compaction=MEASURE_COMPACTION)
    proxy.start(env=env)
    try:
        assert proxy.proc is not None
        settle(proxy.proc.pid)
        result = load(proxy.port, body, PLAIN_KEY, c, p, watch=(proxy.proc.pid,))
        traced = "exporting traces" in proxy.logs()
        assert traced == (row == "proxy, tracing on"), proxy.logs()[-2000:]
        return result
    finally:
        proxy.stop()


def run(
    profile: Profile, rounds: int, concurrency: tuple[int, ...], before: Path | None = None
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-tracing-") as tmp_name:
        work = Path(tmp_name)
        upstream = FastUpstream(work / "upstream.log").start()
        sink, sink_port = start_ready(["bench.otlp_sink"], work / "sink.log", "otlp sink")
        body = work / "body.json"
        body.write_bytes(request_body(profile.small, stream=False))
        cells: dict[str, list[dict[str, Any]]] = {}
        try:
            for c in concurrency:
                for _ in range(rounds):
                    for row in (*ROWS, BEFORE) if before else ROWS:
                        result = cell(row, work, upstream, sink_port, body, c, profile, before)
                        cells.setdefault(f"{row}|{c}", []).append(result)
        finally:
            upstream.stop()
            stop_process(sink)
        sink_log = (work / "sink.log").read_text(errors="replace").strip()
    return {"profile": profile.name, "rounds": rounds, "cells": cells, "sink": sink_log}


def summary(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per row and concurrency: median p50/p99 over rounds and the median added p50."""
    out = []
    cells = results["cells"]
    for key in cells:
        row, c = key.split("|")
        direct = cells[f"direct|{c}"]
        runs = cells[key]
        added = [r["p50_ms"] - d["p50_ms"] for r, d in zip(runs, direct, strict=True)]
        out.append(
            {
                "row": row,
                "concurrency": int(c),
                "p50_ms": statistics.median(r["p50_ms"] for r in runs),
                "p99_ms": statistics.median(r["p99_ms"] for r in runs),
                "added_p50_ms": statistics.median(added),
                "requests": sum(r.get("requests", 0) for r in runs),
            }
        )
    return out


def paired(results: dict[str, Any], row: str, base: str, c: int) -> float | None:
    """Median over rounds of ``row``'s p50 minus ``base``'s p50 in the same round."""
    cells = results["cells"]
    rows, bases = cells.get(f"{row}|{c}"), cells.get(f"{base}|{c}")
    if not rows or not bases:
        return None
    return statistics.median(r["p50_ms"] - b["p50_ms"] for r, b in zip(rows, bases, strict=True))


def markdown(rows: list[dict[str, Any]], results: dict[str, Any]) -> str:
    lines = [
        "| row | concurrency | p50 ms | p99 ms | added p50 ms | requests |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['row']} | {r['concurrency']} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | "
            f"{r['added_p50_ms']:.3f} | {r['requests']} |"
        )
    lines.append("")
    for c in sorted({r["concurrency"] for r in rows}):
        on = paired(results, ROWS[2], ROWS[1], c)
        if on is not None:
            lines.append(f"- concurrency {c}: tracing on - off, same round: {on:+.3f} ms")
        old = paired(results, ROWS[1], BEFORE, c)
        if old is not None:
            lines.append(f"- concurrency {c}: tracing off - before, same round: {old:+.3f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="a few requests per cell")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--json", type=Path, help="write the raw cells here")
    parser.add_argument("--before", type=Path, help="a source tree to compare 'off' with")
    parser.add_argument("--otel-env", nargs="*", default=[], help="NAME=VALUE for the traced row")
    args = parser.parse_args(argv)
    profile = SMOKE if args.smoke else FULL
    EXTRA_ENV.update(item.split("=", 1) for item in args.otel_env)
    results = run(profile, args.rounds, tuple(args.concurrency), args.before)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(markdown(summary(results), results))
    print(results["sink"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
