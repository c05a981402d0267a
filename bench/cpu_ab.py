"""The proxy's CPU per request, two source trees side by side (#28).

    python -m bench.cpu_ab --before /tmp/before [--after .] [--rounds 5] [--duration 2]
        [--concurrency 8] [--floor] [--agent] [--drip-events N --drip-ms M] [--tls]
        [--json PATH]

One fast upstream (``bench.upstream_fast``) and one ``compaction-proxy serve`` per tree (the
tree first on ``PYTHONPATH``, one worker, a diskcache store, the default config), each fed
by ``bench.loadgen --watch-pid`` with the same 2- and 50-message bodies (below the trigger,
streaming and not), rounds interleaved in a rotating order. The figure is the server's CPU
seconds over the measured window divided by the requests measured in it: CPU-microseconds
per request, which depends little on who else shares the CPUs (req/s does). Medians over
rounds; the load average is printed with the table. ``--conversations N`` sends N bodies
whose messages' text differs all through (as long, other words, as different sessions'
does), in turn: N conversations, so the ledger's batched writer
writes one row per conversation and flush as it does in real traffic (with one conversation
a flush writes one row for ~80 requests). ``--floor`` adds ``bench.relay_floor``
with ``--read-body`` (uvloop, httptools, every body parsed by orjson) in the same rounds.
``--agent`` adds ``bench.agent_body``'s request: a coding agent's at a real agent's sizes
(53 messages, 24 tools in ~62 KB of schemas, a 5.6 KB system prompt), what the proxy sees
most in production. ``--subst N`` (repeatable) adds the N-message body of a conversation
past the trigger with its compaction in effect (compacted once, as ``bench.overhead``'s
substitution rows are, into a store each tree starts from): a long session's request, whose
body is over ``OFFLOAD_BYTES`` from ~270 messages on. ``--drip-events N --drip-ms M``
measures streams only, each answered as a provider sends one: N events, a write each, M ms
apart (``bench.upstream_fast --drip-events``); a proxy busy for longer than M reads several
at once. ``--tls`` puts the upstream behind HTTPS, as providers are (the trees trust its
self-signed certificate through ``SSL_CERT_FILE``). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import orjson
import yaml

from bench import tlscert
from bench.agent_body import agent_body
from bench.overhead import (
    MEASURE_COMPACTION,
    ROOT,
    FastUpstream,
    Profile,
    _wait_http,
    load,
    seed_records,
)
from bench.servers import FloorRelay, process_tree, request_body, settle
from tests.proxyproc import cli_path, free_port

KEY = "sk-bench-cpu"
T = TypeVar("T")
AGENT = "agent"  # ``bench.agent_body``'s request: 53 messages, 24 tools, a 5.6 KB system prompt
_WORDS = ("the", "file", "test", "read", "error", "line", "patch", "run", "diff", "value")
SUBST = "subst-"  # + N: the N-message body of a conversation whose compaction is stored


class Tree:
    """``compaction-proxy serve`` running the code of one source tree."""

    def __init__(
        self, name: str, root: Path, work: Path, upstream: str, seed: Path | None = None
    ) -> None:
        self.name, self.root, self.seed = name, root, seed
        self.port = free_port()
        self.tmp = work / name
        self.tmp.mkdir(parents=True, exist_ok=True)
        config = {
            "listen": {"host": "127.0.0.1", "port": self.port},
            "upstream": {"base_url": upstream, "timeout_s": 30},
            "store": {"url": f"diskcache://{self.tmp / 'store'}"},
            "compaction": MEASURE_COMPACTION,
        }
        self.config_path = self.tmp / "proxy.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.proc: subprocess.Popen[bytes] | None = None
        # The server's import path (the tree first) and any variables of its own.
        self.pythonpath = str(root)
        self.env: dict[str, str] = {}

    def start(self) -> Tree:
        if self.seed is not None:  # the compactions stored before, as this tree's store
            shutil.copytree(self.seed, self.tmp / "store", dirs_exist_ok=True)
        env = {**os.environ, "PYTHONPATH": self.pythonpath, **self.env}
        env.pop("COMPACTION_PROXY_OVERRIDES", None)
        log_path = self.tmp / "server.log"
        command = [cli_path(), "serve", "--config", str(self.config_path)]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root
            )
        _wait_http(f"http://127.0.0.1:{self.port}/healthz", self.proc, self.name, log_path, 120)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(15)


def bodies_of(history: int | str, stream: bool, conversations: int, work: Path) -> list[Path]:
    """``conversations`` request bodies of ``history`` messages (or ``AGENT``'s body) that
    differ in every message's text (as long): as many conversations to the proxy (one: the
    benchmark's usual body)."""
    paths = []
    for n in range(conversations):
        if history == AGENT:
            raw = agent_body(stream, n)
        elif isinstance(history, str) and history.startswith(SUBST):
            raw = request_body(int(history[len(SUBST) :]), stream)  # (one conversation)
        else:
            body = orjson.loads(request_body(int(history), stream))
            rng = random.Random(n)  # another session: other text, as long, all through
            for message in body["messages"] if n else ():
                if isinstance(message.get("content"), str):
                    size = len(message["content"])
                    words = " ".join(rng.choice(_WORDS) for _ in range(size // 4 + 1))
                    message["content"] = words[:size]
            raw = orjson.dumps(body)
        path = work / f"body-{history}-{stream}-{n}.json"
        path.write_bytes(raw)
        paths.append(path)
    return paths


def load_many(
    port: int, paths: list[Path], concurrency: int, profile: Profile, watch: tuple[int, ...]
) -> dict[str, Any]:
    """``bench.overhead.load`` with every body of ``paths`` (the load generator cycles them)."""
    if len(paths) == 1:
        return load(port, paths[0], KEY, concurrency, profile, watch)
    command = [
        sys.executable, "-m", "bench.loadgen", "--port", str(port),
        "--header", f"authorization: Bearer {KEY}", "--concurrency", str(concurrency),
        "--warmup", str(profile.warmup_s), "--duration", str(profile.duration_s),
        "--max-requests", str(profile.max_requests), "--min-requests", str(concurrency * 3),
    ]  # fmt: skip
    command += [arg for path in paths for arg in ("--body-file", str(path))]
    command += [arg for pid in watch for arg in ("--watch-pid", str(pid))]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


class Server(Protocol):
    """A server process under load: ``Tree``, ``FloorRelay``."""

    name: str
    port: int
    proc: subprocess.Popen[bytes] | None


def measure(
    server: Server, paths: list[Path], concurrency: int, profile: Profile
) -> dict[str, float]:
    """One cell: ``server``'s CPU-microseconds per request (its whole process tree's CPU over
    the measured window, over the requests measured in it) under the load of ``paths``, with
    its req/s, p50 and errors."""
    assert server.proc is not None
    tree = process_tree(server.proc.pid)
    settle(server.proc.pid, 10)
    result = load_many(server.port, paths, concurrency, profile, tuple(tree))
    used = sum(result["watched_cpu_s"].get(str(p)) or 0.0 for p in tree)
    n = result["rps"] * result["cpu_window_s"]
    return {
        "cpu_us": used / max(n, 1) * 1e6,
        "rps": result["rps"],
        "p50_ms": result["p50_ms"],
        "errors": result["errors"],
    }


def rotated(servers: list[T], r: int) -> list[T]:
    """Round ``r``'s order: each server first in turn, so none is always measured first."""
    return servers[r % len(servers) :] + servers[: r % len(servers)]


def report(
    results: dict[str, Any], json_path: str | None, render: Callable[[dict[str, Any]], str]
) -> int:
    """A benchmark's ending: its results as JSON to ``json_path`` (when given), its table
    (``render``) on standard output; the exit status."""
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2))
    print(render(results))
    return 0


def run(
    trees: dict[str, Path],
    rounds: int,
    duration: float,
    concurrency: int,
    floor: bool = False,
    conversations: int = 1,
    agent: bool = False,
    subst: tuple[int, ...] = (),
    drip: tuple[int, float] = (0, 1.0),
    tls: bool = False,
) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-cpu-ab-"))
    pair = tlscert.self_signed(work) if tls else None
    upstream = FastUpstream(
        work / "upstream.log", drip_events=drip[0], drip_ms=drip[1], tls=pair
    ).start()
    seed = work / "seeded-store" if subst else None
    if seed is not None:  # the compactions every tree starts from
        seed_records(work, upstream, subst, seed, key=KEY)
    servers: list[Tree | FloorRelay] = [
        Tree(name, root, work, upstream.base_url, seed) for name, root in trees.items()
    ]
    for tree in servers:
        if pair is not None and isinstance(tree, Tree):  # (trusted as httpx reads it)
            tree.env["SSL_CERT_FILE"] = str(pair[0])
    if floor:  # the least a Python proxy that parses every body does, beside them
        servers.append(FloorRelay(work, upstream.port, read_body=True))
    profile = Profile("cpu_ab", 50, (), (concurrency,), 0.5, duration, 1_000_000)
    samples: dict[tuple[str, str, bool], list[dict[str, float]]] = {}
    histories: tuple[int | str, ...] = (2, 50, AGENT) if agent else (2, 50)
    histories += tuple(f"{SUBST}{n}" for n in subst)
    try:
        for server in servers:
            server.start()
        bodies = {
            (str(history), stream): bodies_of(
                history, stream, 1 if str(history).startswith(SUBST) else conversations, work
            )
            for history in histories
            for stream in ((True,) if drip[0] else (False, True))  # (a drip is a stream)
        }
        for r in range(rounds):
            order = rotated(servers, r)
            for (history, stream), path in bodies.items():
                for server in order:
                    cell = measure(server, path, concurrency, profile)
                    samples.setdefault((server.name, history, stream), []).append(cell)
                    print(
                        f"round {r} {server.name:30} {history:>5} msgs stream={stream!s:5} "
                        f"{cell['cpu_us']:.0f} us/request {cell['rps']:.0f} req/s "
                        f"errors={cell['errors']}",
                        file=sys.stderr,
                    )
    finally:
        for server in servers:
            server.stop()
        upstream.stop()
    rows = []
    for (name, history, stream), cells in samples.items():
        rows.append({
            "tree": name, "history": history, "stream": stream,
            **{k: statistics.median(c[k] for c in cells) for k in ("cpu_us", "rps", "p50_ms")},
            "errors": sum(c["errors"] for c in cells),
        })  # fmt: skip
    return {
        "rows": rows,
        "load_average": os.getloadavg(),
        "concurrency": concurrency,
        "conversations": conversations,
        "drip_events": drip[0],
        "drip_ms": drip[1],
        "tls": tls,
    }


def markdown(results: dict[str, Any]) -> str:
    out = [
        f"concurrency {results['concurrency']}, {results['conversations']} conversation(s); "
        + (
            f"streams of {results['drip_events']} events {results['drip_ms']:g} ms apart; "
            if results.get("drip_events")
            else ""
        )
        + ("the upstream over HTTPS; " if results.get("tls") else "")
        + "load average at the end "
        + ", ".join(f"{x:.2f}" for x in results["load_average"]),
        "",
        "| tree | history (msgs) | stream | CPU us per request | req/s | p50 ms | errors |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in sorted(results["rows"], key=lambda r: (r["history"], r["stream"], r["tree"])):
        out.append(
            f"| {r['tree']} | {r['history']} | {'yes' if r['stream'] else 'no'} | "
            f"{r['cpu_us']:.0f} | {r['rps']:,.0f} | {r['p50_ms']:.2f} | {r['errors']} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_ab", description=__doc__)
    parser.add_argument("--before", type=Path, required=True, help="the old source tree")
    parser.add_argument("--after", type=Path, default=Path.cwd(), help="the new source tree")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--floor", action="store_true", help="the floor relay + orjson too")
    parser.add_argument(
        "--conversations",
        type=int,
        default=1,
        help="bodies of as many conversations, sent in turn (the ledger writes one row each)",
    )
    parser.add_argument(
        "--agent",
        action="store_true",
        help="also bench.agent_body's request (a real agent's sizes)",
    )
    parser.add_argument(
        "--subst",
        type=int,
        action="append",
        default=[],
        metavar="N",
        help="also the N-message body of a compacted conversation (repeatable)",
    )
    parser.add_argument(
        "--drip-events",
        type=int,
        default=0,
        metavar="N",
        help="streams only, the upstream sending each as N events, a write each",
    )
    parser.add_argument("--drip-ms", type=float, default=1.0, help="the time between them")
    parser.add_argument(
        "--tls",
        action="store_true",
        help="the upstream over HTTPS (a self-signed certificate the trees trust), as providers"
        " are; not with --floor (the floor relay speaks plain TCP to its upstream)",
    )
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.tls and args.floor:
        parser.error("--tls and --floor do not go together")
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    results = run(
        trees,
        args.rounds,
        args.duration,
        args.concurrency,
        args.floor,
        args.conversations,
        args.agent,
        tuple(args.subst),
        (args.drip_events, args.drip_ms),
        args.tls,
    )
    return report(results, args.json, markdown)


if __name__ == "__main__":
    sys.exit(main())
