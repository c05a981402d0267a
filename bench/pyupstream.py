"""The proxy in front of a Python upstream, as a new user would try it (#28).

    python -m bench.pyupstream [--rounds 5] [--duration 3] [--json PATH]

The upstream is a Starlette app under uvicorn (uvloop and httptools, one worker) answering
``POST /v1/chat/completions`` at once with ``bench.upstream_fast``'s fixed reply (the request
read as JSON, the reply a dict made JSON): the simplest upstream a Python user would write,
and one that shares this machine's two CPUs with the proxy and the load generator as any
local upstream would. Beside it, the same cells against
``bench.upstream_fast`` (asyncio protocol over httptools, no framework: near C speed).
``compaction-proxy serve`` (the default config, one worker) runs in front of each; each round
measures direct and through the proxy, at concurrency 1 and 32, for the 2- and 50-message
bodies (below the trigger, not streamed), in a rotating order. Reported: medians over rounds
of p50 and req/s, the added p50 at concurrency 1 (proxy's p50 minus direct's, per round) and
the req/s ratio at concurrency 32 (proxy ÷ direct, per round), with the CPU per request of
each process. ``--floor`` adds ``bench.relay_floor --read-body`` (uvloop, httptools, every body
parsed by orjson: the least a Python proxy that reads the request does) in front of each
upstream, measured the same way: whether any Python proxy could reach a req/s ratio on this
machine at all. Each direct row at concurrency 32 also gives the CPU a forwarder could spend
per request and still reach 0.9× direct's req/s (``budget_us``: the machine's CPUs less what
the upstream and the load generator spend per request at that rate, over that rate; see
``cpu_budget``). Nothing is asserted.

Only ever binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bench.cpu_ab import KEY, Tree, bodies_of, report, rotated
from bench.overhead import ROOT, FastUpstream, Profile, _stop, load, process_tree, settle
from bench.overhead import start_ready as _start_ready
from bench.servers import FloorRelay
from bench.upstream_fast import JSON_BODY
from tests.proxyproc import free_port

REPLY = json.loads(JSON_BODY)


async def _completions(request: Request) -> Response:
    # As a user would write it: the request read as JSON, the reply a dict made JSON.
    body = await request.json()
    return JSONResponse({**REPLY, "model": body.get("model", REPLY["model"])})


app = Starlette(routes=[Route("/v1/chat/completions", _completions, methods=["POST"])])


class PyUpstream:
    """``python -m bench.pyupstream --serve PORT``: the app above under uvicorn."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.proc: Any = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> PyUpstream:
        module = ["bench.pyupstream", "--serve", str(free_port())]
        self.proc, self.port = _start_ready(module, self.log_path, "python upstream")
        return self

    def stop(self) -> None:
        _stop(self.proc)


def _serve(port: int) -> None:
    import uvicorn

    class Ready(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            print(f"ready {port}", flush=True)

    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    Ready(config).run()


def cpu_budget(
    direct_rps: float, upstream_us: float, client_us: float, cpus: int, ratio: float = 0.9
) -> float:
    """The CPU-microseconds per request a forwarder may spend and still carry ``ratio`` of
    direct's req/s, when the upstream and the load generator share the machine's ``cpus``
    with it: at ``ratio × direct_rps`` requests a second the upstream spends ``upstream_us``
    and the load generator ``client_us`` per request (their figures measured direct), and
    whatever CPU is left is the forwarder's. An estimate, not a bound: at a slower rate
    each process wakes for fewer requests at a time and spends more per request, while a
    forwarder that keeps fewer connections to the upstream makes the upstream's requests
    cheaper (the floor relay does: docs/benchmarks.md, #28)."""
    rate = ratio * direct_rps
    left = cpus * 1e6 - rate * (upstream_us + client_us)  # CPU-us a second left over
    return left / rate


def run(rounds: int, duration: float, floor: bool = False) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-pyupstream-"))
    upstreams = {
        "python (Starlette + uvicorn)": PyUpstream(work / "py.log"),
        "fast (bench.upstream_fast)": FastUpstream(work / "fast.log"),
    }
    profile = Profile("pyupstream", 50, (), (1, 32), 0.5, duration, 1_000_000)
    cells: dict[tuple[str, str, int, int], list[dict[str, float]]] = {}
    proxies: dict[str, Tree] = {}
    floors: dict[str, FloorRelay] = {}
    try:
        for name, upstream in upstreams.items():
            upstream.start()
            slug = "proxy-" + "".join(c for c in name if c.isalnum())
            proxies[name] = Tree(slug, ROOT, work, upstream.base_url).start()
            if floor:  # (a folder each: the relay names its log by its mode alone)
                (work / slug).mkdir(parents=True, exist_ok=True)
                floors[name] = FloorRelay(work / slug, upstream.port, read_body=True).start()
        bodies = {history: bodies_of(history, False, 1, work)[0] for history in (2, 50)}
        for r in range(rounds):
            for name, upstream in upstreams.items():
                assert upstream.proc is not None
                targets = [("direct", upstream.port, upstream.proc.pid),
                           ("proxy", proxies[name].port, proxies[name].proc.pid)]  # fmt: skip
                if name in floors:
                    relay = floors[name]
                    assert relay.proc is not None
                    targets.append(("floor", relay.port, relay.proc.pid))
                targets = rotated(targets, r)
                for history, body in bodies.items():
                    for concurrency in (1, 32):
                        for via, port, pid in targets:
                            watch = tuple(process_tree(pid)) + tuple(
                                process_tree(upstream.proc.pid)
                            )
                            settle(pid, 10)
                            result = load(port, body, KEY, concurrency, profile, watch)
                            n = max(result["rps"] * result["cpu_window_s"], 1)
                            cpu = result["watched_cpu_s"]
                            cell = {
                                "p50_ms": result["p50_ms"],
                                "rps": result["rps"],
                                "errors": result["errors"],
                                "upstream_cpu_us": (cpu.get(str(upstream.proc.pid)) or 0) / n * 1e6,
                                "proxy_cpu_us": sum(cpu.get(str(p)) or 0 for p in process_tree(pid))
                                / n * 1e6 if via != "direct" else 0.0,
                                "client_cpu_us": result["client_cpu_s"] / n * 1e6,
                            }  # fmt: skip
                            cells.setdefault((name, via, history, concurrency), []).append(cell)
                            print(
                                f"round {r} {name:30} {via:6} {history:>2} msgs c={concurrency:<2} "
                                f"p50 {cell['p50_ms']:.2f} ms {cell['rps']:.0f} req/s",
                                file=sys.stderr,
                            )
    finally:
        for relay in floors.values():
            relay.stop()
        for tree in proxies.values():
            tree.stop()
        for upstream in upstreams.values():
            upstream.stop()
    return _summary(cells)


def _summary(cells: dict[tuple[str, str, int, int], list[dict[str, float]]]) -> dict[str, Any]:
    rows = []
    for (name, via, history, concurrency), got in sorted(cells.items()):
        row: dict[str, Any] = {"upstream": name, "via": via, "history": history,
                               "concurrency": concurrency}  # fmt: skip
        for key in got[0]:
            row[key] = statistics.median(c[key] for c in got)
        direct = cells.get((name, "direct", history, concurrency))
        if via != "direct" and direct:
            pairs = list(zip(got, direct, strict=False))
            row["added_p50_ms"] = statistics.median(p["p50_ms"] - d["p50_ms"] for p, d in pairs)
            row["rps_ratio"] = statistics.median(p["rps"] / max(d["rps"], 1e-9) for p, d in pairs)
        if via == "direct" and concurrency > 1:
            cpus = os.cpu_count() or 1
            row["budget_us"] = statistics.median(
                cpu_budget(c["rps"], c["upstream_cpu_us"], c["client_cpu_us"], cpus) for c in got
            )
        rows.append(row)
    return {"rows": rows}


def markdown(results: dict[str, Any]) -> str:
    out = [
        "| upstream | via | history (msgs) | concurrency | p50 ms | added p50 ms | req/s | "
        "req/s ÷ direct | forwarder CPU us/req | upstream CPU us/req | "
        "load generator CPU us/req | budget for 0.9× (us/req) | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        added = f"{r['added_p50_ms']:.2f}" if "added_p50_ms" in r else "—"
        ratio = f"{r['rps_ratio']:.2f}×" if "rps_ratio" in r else "—"
        proxy = f"{r['proxy_cpu_us']:.0f}" if r["via"] != "direct" else "—"
        budget = f"{r['budget_us']:.0f}" if "budget_us" in r else "—"
        out.append(
            f"| {r['upstream']} | {r['via']} | {r['history']} | {r['concurrency']} | "
            f"{r['p50_ms']:.2f} | {added} | {r['rps']:,.0f} | {ratio} | {proxy} | "
            f"{r['upstream_cpu_us']:.0f} | {r['client_cpu_us']:.0f} | {budget} | "
            f"{r['errors']:.0f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pyupstream", description=__doc__)
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--floor", action="store_true", help="the floor relay + orjson too")
    args = parser.parse_args(argv)
    if args.serve:
        _serve(args.serve)
        return 0
    results = run(args.rounds, args.duration, args.floor)
    return report(results, args.json, markdown)


if __name__ == "__main__":
    sys.exit(main())
