"""Forwarders and servers side by side: the proxy under each, against direct, interleaved.

    python -m bench.servers [--smoke] [--rounds N] [--duration S] [--json PATH]

Every variant runs at once as its own process in front of one fast upstream
(``bench.upstream_fast``), the same 50-message body (below the trigger), one worker each:

- ``direct``: the load generator straight to the upstream (the baseline);
- ``uvicorn + httpx``: ``compaction-proxy serve`` with ``upstream.transport: httpx``;
- ``uvicorn + aiohttp``: the same with ``upstream.transport: aiohttp`` (the default);
- ``granian + aiohttp``: the same app (``proxy.cli:app_factory``) under granian's ASGI
  server (uvloop), when granian is installed;
- ``litellm (no callbacks)``: ``litellm --config`` to the same upstream, when its proxy
  server is installed (``--no-litellm`` leaves it out).

uvicorn runs as ``compaction-proxy serve`` does (``loop="auto"``, ``http="auto"``: uvloop and
httptools when installed, which they are with ``uvicorn[standard]``). Each round measures
every variant once per cell (concurrency 1 and 32, streaming and not), in a rotating order;
the figures are the medians over rounds of each cell's p50, p99 and req/s, and the ratios to
direct are per round, then the median. After the rounds, each proxy's resident memory
(VmRSS, and its peak VmHWM) and how many requests it served. The load generator's own CPU
share per cell says whether it, rather than the server, was the limit. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from bench.overhead import (
    MEASURE_COMPACTION,
    PLAIN_KEY,
    FastUpstream,
    LiteLLMServer,
    Profile,
    _stop,
    _wait_http,
    load,
    request_body,
    settle,
    status_mb,
)
from tests.proxyproc import cli_path, free_port

ROOT = Path(__file__).resolve().parent.parent
HISTORY = 50
DEFAULT = "uvicorn + aiohttp"  # what ``compaction-proxy serve`` runs with the default config
CONCURRENCY = (1, 32)


class Variant:
    """One server process in front of the upstream (or none: ``direct``)."""

    def __init__(self, name: str, server: str, transport: str, work: Path, upstream: str):
        self.name, self.server, self.transport = name, server, transport
        self.port = free_port()
        self.tmp = work / name.replace(" ", "").replace("+", "-")
        self.tmp.mkdir(parents=True, exist_ok=True)
        config = {
            "listen": {"host": "127.0.0.1", "port": self.port},
            "upstream": {"base_url": upstream, "timeout_s": 30, "transport": transport},
            "store": {"url": f"diskcache://{self.tmp / 'store'}"},
            "compaction": MEASURE_COMPACTION,
        }
        self.config_path = self.tmp / "proxy.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = self.tmp / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.requests = 0

    def start(self) -> Variant:
        env = {**os.environ, "COMPACTION_PROXY_CONFIG": str(self.config_path)}
        env.pop("COMPACTION_PROXY_OVERRIDES", None)
        if self.server == "uvicorn":
            command = [cli_path(), "serve", "--config", str(self.config_path)]
        else:
            granian = Path(sys.executable).parent / "granian"
            command = [
                str(granian), "--interface", "asgi", "--factory", "--host", "127.0.0.1",
                "--port", str(self.port), "--workers", "1", "--loop", "uvloop",
                "--http", "1", "--no-ws", "proxy.cli:app_factory",
            ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        _wait_http(
            f"http://127.0.0.1:{self.port}/healthz", self.proc, self.name, self.log_path, 120
        )
        return self

    def stop(self) -> None:
        _stop(self.proc)


def run(rounds: int, duration: float, smoke: bool = False, litellm: bool = True) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-servers-"))
    upstream = FastUpstream(work / "upstream.log").start()
    profile = Profile("servers", HISTORY, (), CONCURRENCY, 0.3, duration, 100_000)
    variants: list[Variant] = []
    others: list[LiteLLMServer] = []
    samples: dict[tuple[str, bool, int], list[dict[str, Any]]] = {}
    try:
        specs = [
            ("uvicorn + httpx", "uvicorn", "httpx"),
            ("uvicorn + aiohttp", "uvicorn", "aiohttp"),
        ]
        if importlib.util.find_spec("granian"):
            specs.append(("granian + aiohttp", "granian", "aiohttp"))
        variants = [Variant(n, s, t, work, upstream.base_url).start() for n, s, t in specs]
        names: list[tuple[str, int, int | None, str]] = [("direct", upstream.port, None, PLAIN_KEY)]
        names += [(v.name, v.port, v.proc.pid if v.proc else None, PLAIN_KEY) for v in variants]
        if litellm:
            try:
                peer = LiteLLMServer(work / "litellm", upstream.base_url, hook=False).start()
                assert peer.proc is not None
                others.append(peer)
                names.append(("litellm (no callbacks)", peer.port, peer.proc.pid, peer.master_key))
            except RuntimeError as exc:  # a missing or broken litellm[proxy] leaves its row out
                print(f"litellm left out: {exc}", file=sys.stderr)
        bodies = {}
        for stream in (False, True):
            bodies[stream] = work / f"body-{int(stream)}.json"
            bodies[stream].write_bytes(request_body(HISTORY, stream))
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for stream in (False, True):
                for c in CONCURRENCY:
                    for name, port, pid, key in order:
                        if pid is not None:
                            settle(pid, 10)
                        result = load(port, bodies[stream], key, c, profile)
                        samples.setdefault((name, stream, c), []).append(result)
                        print(
                            f"round {r} {name:18} stream={int(stream)} c={c:<3} "
                            f"p50={result['p50_ms']:.2f} p99={result['p99_ms']:.2f} "
                            f"{result['rps']:.0f} req/s errors={result['errors']}",
                            file=sys.stderr,
                        )
        memory = {}
        for name, _port, pid, _key in names:
            if pid is None:
                continue
            served = sum(
                s["requests"] for (n, _, _), runs in samples.items() if n == name for s in runs
            )
            memory[name] = {
                "rss_mb": status_mb(pid, "VmRSS"),
                "peak_rss_mb": status_mb(pid, "VmHWM"),
                "measured_requests": served,
            }
    finally:
        for v in variants:
            v.stop()
        for peer in others:
            peer.stop()
        upstream.stop()
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for (name, stream, c), runs in samples.items():
        direct = samples[("direct", stream, c)]
        row = {
            "variant": name,
            "stream": stream,
            "concurrency": c,
            "p50_ms": statistics.median(s["p50_ms"] for s in runs),
            "p99_ms": statistics.median(s["p99_ms"] for s in runs),
            "rps": statistics.median(s["rps"] for s in runs),
            "errors": sum(s["errors"] for s in runs),
            "client_cpu_share": statistics.median(
                s["client_cpu_s"] / max(s["window_s"], 1e-9) for s in runs
            ),
            "added_p50_ms": statistics.median(
                s["p50_ms"] - d["p50_ms"] for s, d in zip(runs, direct, strict=True)
            ),
            "rps_vs_direct": statistics.median(
                s["rps"] / d["rps"] for s, d in zip(runs, direct, strict=True) if d["rps"]
            ),
            "p99_vs_direct": statistics.median(
                s["p99_ms"] / d["p99_ms"] for s, d in zip(runs, direct, strict=True) if d["p99_ms"]
            ),
        }
        rows.append(row)
    return {
        "rounds": rounds,
        "duration_s": duration,
        "history": HISTORY,
        "rows": rows,
        "memory": memory,
        "load_average": os.getloadavg(),
    }


def markdown(results: dict[str, Any]) -> str:
    out = [
        "| server + forwarder | stream | concurrency | p50 ms | added p50 ms | p99 ms "
        "| p99 ÷ direct | req/s | req/s ÷ direct | load generator CPU |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = sorted(results["rows"], key=lambda r: (r["stream"], r["concurrency"]))
    for r in rows:
        direct = r["variant"] == "direct"
        errors = f" ({r['errors']} errors)" if r["errors"] else ""
        added, p99x, rpsx = (
            ("—", "—", "—")
            if direct
            else (
                f"{r['added_p50_ms']:.2f}",
                f"{r['p99_vs_direct']:.2f}×",
                f"{r['rps_vs_direct']:.2f}×",
            )
        )
        out.append(
            f"| {r['variant']}{errors} | {'yes' if r['stream'] else 'no'} | {r['concurrency']} | "
            f"{r['p50_ms']:.2f} | {added} | {r['p99_ms']:.2f} | {p99x} | {r['rps']:,.0f} | "
            f"{rpsx} | {r['client_cpu_share']:.0%} |"
        )
    out += ["", "| server + forwarder | measured requests served | VmRSS MiB after | peak MiB |"]
    out.append("|---|---:|---:|---:|")
    for name, m in results["memory"].items():
        out.append(
            f"| {name} | {m['measured_requests']:,} | {m['rss_mb'] or 0:.0f} "
            f"| {m['peak_rss_mb'] or 0:.0f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.servers", description=__doc__)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--no-litellm", action="store_true")
    args = parser.parse_args(argv)
    rounds, duration = (1, 0.3) if args.smoke else (args.rounds, args.duration)
    results = run(rounds, duration, args.smoke, litellm=not args.no_litellm)
    print(markdown(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
