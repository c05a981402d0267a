"""The proxy's CPU per request, layer by layer, over real sockets (#28).

    python -m bench.layers [--rounds 3] [--duration 3] [--concurrency 8] [--conversations 1]
        [--json PATH]

Five servers in front of one fast upstream (``bench.upstream_fast``), each fed by
``bench.loadgen --watch-pid`` with the same 2- and 50-message bodies (below the trigger, one
conversation seen before, streamed and not; with ``--conversations N``, N bodies of as many
conversations sent in turn, so the ledger's writer writes one row per conversation and
flush as in real traffic: ``bench.cpu_ab``'s), rounds interleaved in a rotating order:

- ``whole``: ``compaction-proxy serve`` as it is (one worker, diskcache, the default config);
- ``without the ledger``: the same, ``BatchWriter.record`` doing nothing: each request's
  ledger entry is built but not queued, so the writer's thread writes no request, its
  conversation, hour and totals rows, or its history (the stability tracker and other
  small values still go through it);
- ``without finish``: the same, ``Service.finish`` doing nothing: no log line, metrics,
  ledger entry or stability tracker, so the batched writer has nothing to write either;
- ``without the engine``: ``Service.begin`` too answers at once with no preparation (the
  request described, identified, read from the store and decided by nothing: it goes
  upstream as sent, as when the core fails open): what is left is the server's and the
  relay's part, uvicorn and ASGI, reading, parsing and checking the body, the upstream's
  HTTP/1.1 exchange and the answer's write;
- the floor relay + orjson (``bench.relay_floor --read-body``: uvloop, httptools, every body
  parsed), beside them.

The variants are the tree's own code with one or two methods replaced at start-up (a
``sitecustomize`` module on the server's ``PYTHONPATH``, read from ``BENCH_LAYER``), so the
differences between rows are what those layers cost: the engine's ``begin`` (``without
finish`` less ``without the engine``), ``finish`` with the writer's work (``whole`` less
``without finish``), and of that the ledger's writing (``whole`` less ``without the
ledger``). Medians over rounds. Nothing is asserted; the figures go to
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.cpu_ab import Tree, bodies_of, measure, report, rotated
from bench.overhead import ROOT, FastUpstream, Profile
from bench.servers import FloorRelay

WHOLE, NO_LEDGER = "whole", "without the ledger"
NO_FINISH, NO_ENGINE = "without finish", "without the engine"
LAYERS = (WHOLE, NO_LEDGER, NO_FINISH, NO_ENGINE)
ENV = "BENCH_LAYER"

# Read by the server's interpreter at start-up (``site`` imports ``sitecustomize`` from the
# path): the methods the variant goes without, replaced before the app is built.
SITECUSTOMIZE = """
import os

_layer = os.environ.get("BENCH_LAYER", "")
if _layer == "without the ledger":
    from proxy.adapters import writer as _writer

    def _record(self, entry, original, priced=None):
        return None

    _writer.BatchWriter.record = _record
if _layer in ("without finish", "without the engine"):
    import time

    from proxy.engine import service as _service

    def _finish(self, call, usage, status, **kwargs):
        return None

    _service.Service.finish = _finish
    if _layer == "without the engine":

        async def _begin(self, route, describe, *, started=None):
            started = time.perf_counter() if started is None else started
            return _service.Call(route, None, started)

        _service.Service.begin = _begin
"""


class LayerTree(Tree):
    """``compaction-proxy serve`` of this tree with ``layer``'s methods replaced."""

    def __init__(self, layer: str, work: Path, upstream: str) -> None:
        super().__init__(layer.replace(" ", "-"), ROOT, work, upstream)
        self.layer = layer
        self.site = work / f"site-{self.name}"
        self.site.mkdir(parents=True, exist_ok=True)
        (self.site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        self.pythonpath = f"{self.site}{os.pathsep}{self.pythonpath}"  # the hook before the tree
        self.env = {ENV: layer}


def run(rounds: int, duration: float, concurrency: int, conversations: int = 1) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-layers-"))
    upstream = FastUpstream(work / "upstream.log").start()
    servers: list[LayerTree | FloorRelay] = [
        LayerTree(layer, work, upstream.base_url) for layer in LAYERS
    ]
    servers.append(FloorRelay(work, upstream.port, read_body=True))
    profile = Profile("layers", 50, (), (concurrency,), 0.5, duration, 1_000_000)
    samples: dict[tuple[str, int, bool], list[float]] = {}
    try:
        for server in servers:
            server.start()
        bodies = {
            (history, stream): bodies_of(history, stream, conversations, work)
            for history in (2, 50)
            for stream in (False, True)
        }
        for r in range(rounds):
            for (history, stream), paths in bodies.items():
                for server in rotated(servers, r):
                    cell = measure(server, paths, concurrency, profile)
                    if cell["errors"]:
                        raise RuntimeError(f"{server.name}: {cell['errors']:.0f} errors")
                    name = getattr(server, "layer", server.name)
                    samples.setdefault((name, history, stream), []).append(cell["cpu_us"])
                    print(
                        f"round {r} {name:32} {history:>2} msgs stream={stream!s:5} "
                        f"{cell['cpu_us']:.0f} us/request",
                        file=sys.stderr,
                    )
    finally:
        for server in servers:
            server.stop()
        upstream.stop()
    return {**summary(samples, os.getloadavg()), "conversations": conversations}


def summary(
    samples: dict[tuple[str, int, bool], list[float]], load_average: tuple[float, ...]
) -> dict[str, Any]:
    """Medians over rounds, and each layer's part: the differences of those medians."""
    med = {key: statistics.median(values) for key, values in samples.items()}
    rows = []
    for history, stream in sorted({(h, s) for _, h, s in med}):
        row: dict[str, Any] = {"history": history, "stream": stream}
        row.update({name: cpu for (name, h, s), cpu in med.items() if (h, s) == (history, stream)})
        if all(layer in row for layer in LAYERS):
            row["begin"] = row[NO_FINISH] - row[NO_ENGINE]
            row["finish"] = row[WHOLE] - row[NO_FINISH]
            row["ledger"] = row[WHOLE] - row[NO_LEDGER]
        rows.append(row)
    return {"rows": rows, "load_average": list(load_average)}


def markdown(results: dict[str, Any]) -> str:
    floor = next((k for r in results["rows"] for k in r if k.startswith("python relay")), None)
    out = [
        "| history (msgs) | stream | whole | without the ledger | without finish | "
        "without the engine | engine's begin | finish + writer | of it the ledger | "
        "floor relay + orjson |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def us(value: Any) -> str:
        return f"{value:,.0f}" if isinstance(value, int | float) else "—"

    for r in results["rows"]:
        cells = [r.get(k) for k in (*LAYERS, "begin", "finish", "ledger", floor)]
        out.append(
            f"| {r['history']} | {'yes' if r['stream'] else 'no'} | "
            + " | ".join(us(c) for c in cells)
            + " |"
        )
    load = ", ".join(f"{x:.1f}" for x in results["load_average"])
    out.append("")
    many = results.get("conversations", 1)
    out.append(
        f"CPU-microseconds per request, medians over rounds; {many} conversation(s); "
        f"load average {load}."
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.layers", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=1)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    results = run(args.rounds, args.duration, args.concurrency, args.conversations)
    return report(results, args.json, markdown)


if __name__ == "__main__":
    sys.exit(main())
