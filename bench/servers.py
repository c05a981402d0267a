"""Forwarders and servers side by side: the proxy under each, against direct, interleaved.

    python -m bench.servers [--smoke] [--rounds N] [--duration S] [--json PATH]

Every variant runs at once as its own process in front of one fast upstream
(``bench.upstream_fast``), the same 2- or 50-message body (below the trigger), one worker each:

- ``direct``: the load generator straight to the upstream (the baseline);
- ``uvicorn + h1``: ``compaction-proxy serve`` as configured by default
  (``upstream.transport: h1``, ``proxy.adapters.h1``);
- ``uvicorn + aiohttp``, ``uvicorn + httpx``: the same with ``upstream.transport: aiohttp``
  or ``httpx``;
- ``uvicorn + h1, 2 workers``: the default with ``--workers 2`` (the machine's second CPU,
  which the load generator and the upstream use too);
- ``uvicorn + h1, Redis store``: the default with ``store.url`` a private ``redis-server``
  (what replicas share), when ``redis-server`` is installed;
- ``granian + h1``: the same app (``proxy.cli:app_factory``) under granian's ASGI
  server (uvloop), when granian is installed;
- ``nginx (C, relays only)``: nginx as a plain reverse proxy to the same upstream (one
  worker, kept-alive upstream connections, no buffering), when ``nginx`` is installed: no
  parsing of the body, no Python. It is the reference for what any proxy in front of this
  upstream, on these CPUs, can reach;
- ``python relay (floor)`` and ``python relay (floor) + orjson``: ``bench.relay_floor``, the
  least a Python proxy can do (uvloop, requests framed by httptools and written upstream as
  sent, answers passed back unparsed), without and with parsing each body: the floor under
  any Python proxy, and what reading the conversation costs on its own;
- ``litellm (no callbacks)``: ``litellm --config`` to the same upstream, when its proxy
  server is installed (``--no-litellm`` leaves it out).

uvicorn runs as ``compaction-proxy serve`` does (``loop="auto"``, ``http="auto"``: uvloop and
httptools when installed, which they are with ``uvicorn[standard]``). Each round measures
every variant once per cell (2 and 50 messages, concurrency 1 and 32, streaming and not), in
a rotating order;
the figures are the medians over rounds of each cell's p50, p99 and req/s, and the ratios to
direct are per round, then the median. After the rounds, each proxy's resident memory
(VmRSS, and its peak VmHWM) and how many requests it served. Each cell also gives the CPU
share (of one CPU, over its measured window) of the load generator, the server under test and
the upstream: a process near 100 % is the limit of that row, whichever it is.

Then the same comparison with an upstream that takes as long as a provider to answer
(``--delay-ms``, each of ``LATENCIES_MS``; still far quicker than any LLM API): direct against
the default proxy at concurrency 32, 50 messages. With the instant upstream, direct's figures
are the upstream's own CPU limit on the machine the proxy shares; with a delay they are what
a client waiting on a provider gets. Nothing is asserted.
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
    process_tree,
    request_body,
    settle,
    start_ready,
    status_mb,
)
from tests.proxyproc import RedisServer, cli_path, free_port

ROOT = Path(__file__).resolve().parent.parent
HISTORIES = (2, 50)
DEFAULT = "uvicorn + h1"  # what ``compaction-proxy serve`` runs with the default config
CONCURRENCY = (1, 32)
LATENCIES_MS = (10, 50, 200)  # the upstream's time to answer in the second comparison


class Variant:
    """One server process in front of the upstream (or none: ``direct``)."""

    def __init__(
        self,
        name: str,
        server: str,
        transport: str,
        work: Path,
        upstream: str,
        store: str | None = None,
        workers: int = 1,
    ):
        self.name, self.server, self.transport = name, server, transport
        self.workers = workers
        self.port = free_port()
        self.tmp = work / "".join(c for c in name if c.isalnum() or c in "-.")
        self.tmp.mkdir(parents=True, exist_ok=True)
        config = {
            "listen": {"host": "127.0.0.1", "port": self.port},
            "upstream": {"base_url": upstream, "timeout_s": 30, "transport": transport},
            "store": {"url": store or f"diskcache://{self.tmp / 'store'}"},
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
            command += ["--workers", str(self.workers)]
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


NGINX_CONF = """
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    client_max_body_size 64m;
    client_body_buffer_size 4m;
    upstream fast {{ server 127.0.0.1:{upstream}; keepalive 256; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://fast;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


class Nginx:
    """nginx (``NGINX_CONF``) in front of the upstream, in the foreground."""

    def __init__(self, work: Path, upstream_port: int) -> None:
        self.name = "nginx (C, relays only)"
        self.port = free_port()
        self.tmp = work / "nginx"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.conf = self.tmp / "nginx.conf"
        self.conf.write_text(
            NGINX_CONF.format(tmp=self.tmp, upstream=upstream_port, port=self.port)
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def binary() -> str | None:
        """The installed nginx (Debian puts it in /usr/sbin, often not on PATH), or None."""
        found = shutil.which("nginx")
        return found or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)

    def start(self) -> Nginx:
        binary = self.binary()
        assert binary is not None
        command = [binary, "-p", str(self.tmp), "-c", str(self.conf), "-g", "daemon off;"]
        log_path = self.tmp / "stderr.log"
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        _wait_http(f"http://127.0.0.1:{self.port}/v1/models", self.proc, self.name, log_path, 30)
        return self

    def stop(self) -> None:
        _stop(self.proc)


class FloorRelay:
    """``python -m bench.relay_floor`` in front of the upstream (``read_body``: it also parses
    every body)."""

    def __init__(self, work: Path, upstream_port: int, read_body: bool) -> None:
        self.name = "python relay (floor)" + (" + orjson" if read_body else "")
        self.read_body = read_body
        self.log_path = work / f"floor-{int(read_body)}.log"
        self.upstream_port = upstream_port
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> FloorRelay:
        module = ["bench.relay_floor", "--upstream-port", str(self.upstream_port)]
        module += ["--read-body"] if self.read_body else []
        self.proc, self.port = start_ready(module, self.log_path, self.name)
        return self

    def stop(self) -> None:
        _stop(self.proc)


def _median_or_none(values: Any) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _summary(
    samples: dict[tuple[Any, ...], list[dict[str, Any]]], direct_of: Any
) -> list[dict[str, Any]]:
    """Medians over rounds per cell; ratios to direct taken per round, then the median."""
    rows = []
    for key, runs in samples.items():
        direct = samples[direct_of(key)]
        rows.append({
            "p50_ms": statistics.median(s["p50_ms"] for s in runs),
            "p99_ms": statistics.median(s["p99_ms"] for s in runs),
            "rps": statistics.median(s["rps"] for s in runs),
            "errors": sum(s["errors"] for s in runs),
            **{
                share: _median_or_none(s[share] for s in runs)
                for share in ("client_cpu_share", "server_cpu_share", "upstream_cpu_share")
            },
            "added_p50_ms": statistics.median(
                s["p50_ms"] - d["p50_ms"] for s, d in zip(runs, direct, strict=True)
            ),
            "rps_vs_direct": statistics.median(
                s["rps"] / d["rps"] for s, d in zip(runs, direct, strict=True) if d["rps"]
            ),
            "p99_vs_direct": statistics.median(
                s["p99_ms"] / d["p99_ms"] for s, d in zip(runs, direct, strict=True) if d["p99_ms"]
            ),
            "_key": key,
        })  # fmt: skip
    return rows


def _cell(
    name: str, port: int, pid: int | None, key: str, body: Path, c: int, p: Profile, upstream: int
) -> Any:
    """One load run against ``port``, with the CPU shares of the load generator, the server
    (``pid``; none for direct) and the upstream (``upstream``) over its measured window."""
    tree = process_tree(pid) if pid is not None else []
    if pid is not None:
        settle(pid, 10)  # its workers included
    result = load(port, body, key, c, p, watch=(*tree, upstream))
    window, used = max(result["cpu_window_s"], 1e-9), result["watched_cpu_s"]
    parts = [used.get(str(one)) for one in tree]
    server = None if not parts or None in parts else sum(x for x in parts if x is not None)
    up = used.get(str(upstream))
    result["client_cpu_share"] = result["client_cpu_s"] / window
    result["server_cpu_share"] = server / window if server is not None else None
    result["upstream_cpu_share"] = up / window if up is not None else None
    print(
        f"{name:22} {body.name} c={c:<3} p50={result['p50_ms']:.2f} "
        f"p99={result['p99_ms']:.2f} {result['rps']:.0f} req/s errors={result['errors']}",
        file=sys.stderr,
    )
    return result


def run(rounds: int, duration: float, smoke: bool = False, litellm: bool = True) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-servers-"))
    upstream = FastUpstream(work / "upstream.log").start()
    profile = Profile("servers", HISTORIES[-1], (), CONCURRENCY, 0.3, duration, 100_000)
    variants: list[Variant] = []
    relays: list[Nginx | FloorRelay] = []
    others: list[LiteLLMServer] = []
    servers: list[RedisServer] = []
    slow: list[tuple[int, FastUpstream, Variant]] = []
    samples: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    late: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    try:
        specs = [
            (DEFAULT, "uvicorn", "h1"),
            ("uvicorn + aiohttp", "uvicorn", "aiohttp"),
            ("uvicorn + httpx", "uvicorn", "httpx"),
        ]
        if importlib.util.find_spec("granian"):
            specs.append(("granian + h1", "granian", "h1"))
        variants = [Variant(n, s, t, work, upstream.base_url).start() for n, s, t in specs]
        two = Variant(f"{DEFAULT}, 2 workers", "uvicorn", "h1", work, upstream.base_url, workers=2)
        variants.append(two.start())
        if shutil.which("redis-server"):  # the replicas' store, where it is installed
            redis = RedisServer(work)
            redis.start()
            servers.append(redis)
            name = f"{DEFAULT}, Redis store"
            variants.append(Variant(name, "uvicorn", "h1", work, upstream.base_url, redis.url))
            variants[-1].start()
        names: list[tuple[str, int, int | None, str]] = [("direct", upstream.port, None, PLAIN_KEY)]
        names += [(v.name, v.port, v.proc.pid if v.proc else None, PLAIN_KEY) for v in variants]
        if Nginx.binary() is not None:
            try:
                nginx = Nginx(work, upstream.port).start()
                assert nginx.proc is not None
                relays.append(nginx)
                names.append((nginx.name, nginx.port, nginx.proc.pid, PLAIN_KEY))
            except RuntimeError as exc:  # a broken nginx leaves its row out
                print(f"nginx left out: {exc}", file=sys.stderr)
        for read_body in (False, True):
            floor = FloorRelay(work, upstream.port, read_body).start()
            assert floor.proc is not None
            relays.append(floor)
            names.append((floor.name, floor.port, floor.proc.pid, PLAIN_KEY))
        if litellm:
            try:
                peer = LiteLLMServer(work / "litellm", upstream.base_url, hook=False).start()
                assert peer.proc is not None
                others.append(peer)
                names.append(("litellm (no callbacks)", peer.port, peer.proc.pid, peer.master_key))
            except RuntimeError as exc:  # a missing or broken litellm[proxy] leaves its row out
                print(f"litellm left out: {exc}", file=sys.stderr)
        assert upstream.proc is not None
        up_pid = upstream.proc.pid
        bodies = {}
        for history in HISTORIES:
            for stream in (False, True):
                bodies[history, stream] = work / f"body-{history}-{int(stream)}.json"
                bodies[history, stream].write_bytes(request_body(history, stream))
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for stream in (False, True):
                for history in HISTORIES:
                    for c in CONCURRENCY:
                        for name, port, pid, key in order:
                            body = bodies[history, stream]
                            result = _cell(name, port, pid, key, body, c, profile, up_pid)
                            samples.setdefault((name, stream, history, c), []).append(result)
        memory = {}
        for name, _port, pid, _key in names:
            if pid is None or any(name == relay.name for relay in relays) or name == two.name:
                continue  # relays, and the master of two workers, are not a worker
            served = sum(
                s["requests"] for (n, *_), runs in samples.items() if n == name for s in runs
            )
            memory[name] = {
                "rss_mb": status_mb(pid, "VmRSS"),
                "peak_rss_mb": status_mb(pid, "VmHWM"),
                "measured_requests": served,
            }
        # The same comparison behind an upstream that takes a while to answer.
        for ms in LATENCIES_MS:
            up = FastUpstream(work / f"upstream-{ms}.log", delay_ms=ms).start()
            slow.append((ms, up, Variant(f"{DEFAULT} {ms}", "uvicorn", "h1", work, up.base_url)))
            slow[-1][2].start()
        history = HISTORIES[-1]
        for r in range(rounds):
            for stream in (False, True):
                for ms, up, v in slow:
                    pid = v.proc.pid if v.proc else None
                    pair = [("direct", up.port, None), (DEFAULT, v.port, pid)][:: 1 - 2 * (r % 2)]
                    for name, port, pid_ in pair:
                        body = bodies[history, stream]
                        label, up_pid = f"{name} {ms} ms", up.proc.pid if up.proc else 0
                        result = _cell(label, port, pid_, PLAIN_KEY, body, 32, profile, up_pid)
                        late.setdefault((name, stream, ms), []).append(result)
    finally:
        for v in variants:
            v.stop()
        for relay in relays:
            relay.stop()
        for peer in others:
            peer.stop()
        for redis in servers:
            redis.stop()
        for _, up, v in slow:
            v.stop()
            up.stop()
        upstream.stop()
        shutil.rmtree(work, ignore_errors=True)
    rows = _summary(samples, lambda k: ("direct", *k[1:]))
    for row in rows:
        row["variant"], row["stream"], row["history"], row["concurrency"] = row.pop("_key")
    latency_rows = _summary(late, lambda k: ("direct", *k[1:]))
    for row in latency_rows:
        row["variant"], row["stream"], row["delay_ms"] = row.pop("_key")
        row["concurrency"], row["history"] = 32, HISTORIES[-1]
    return {
        "rounds": rounds,
        "duration_s": duration,
        "histories": list(HISTORIES),
        "rows": rows,
        "latency_rows": latency_rows,
        "memory": memory,
        "load_average": os.getloadavg(),
    }


def _line(r: dict[str, Any], first: str) -> str:
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
    return (
        f"| {r['variant']}{errors} | {first} | {'yes' if r['stream'] else 'no'} | "
        f"{r['concurrency']} | {r['p50_ms']:.2f} | {added} | {r['p99_ms']:.2f} | {p99x} | "
        f"{r['rps']:,.0f} | {rpsx} | {_share(r['client_cpu_share'])} | "
        f"{'—' if direct else _share(r['server_cpu_share'])} | {_share(r['upstream_cpu_share'])} |"
    )


def _share(value: float | None) -> str:
    return "?" if value is None else f"{value:.0%}"


def markdown(results: dict[str, Any]) -> str:
    head = (
        " | stream | concurrency | p50 ms | added p50 ms | p99 ms | p99 ÷ direct | req/s "
        "| req/s ÷ direct | load generator CPU | server CPU | upstream CPU |"
    )
    out = ["| server + forwarder | history (msgs)" + head, "|---|---:|---|" + "---:|" * 10]
    rows = sorted(results["rows"], key=lambda r: (r["stream"], r["history"], r["concurrency"]))
    out += [_line(r, str(r["history"])) for r in rows]
    out += ["", "| server + forwarder | measured requests served | VmRSS MiB after | peak MiB |"]
    out.append("|---|---:|---:|---:|")
    for name, m in results["memory"].items():
        out.append(
            f"| {name} | {m['measured_requests']:,} | {m['rss_mb'] or 0:.0f} "
            f"| {m['peak_rss_mb'] or 0:.0f} |"
        )
    late = results.get("latency_rows") or []
    if late:
        out += ["", "With an upstream that waits before answering (50 messages):", ""]
        out += [
            "| server + forwarder | upstream answers after" + head,
            "|---|---:|---|" + "---:|" * 10,
        ]
        late = sorted(late, key=lambda r: (r["stream"], r["delay_ms"], r["variant"] != "direct"))
        out += [_line(r, f"{r['delay_ms']} ms") for r in late]
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
