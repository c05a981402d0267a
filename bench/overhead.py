"""Overhead of the proxy in the hot path: latency, throughput and memory, side by side.

    python -m bench.overhead [--smoke] [--json PATH] [--no-litellm] [--workers N]

Every row sends the same request body, back to back, from a load generator in its own
process (``bench.loadgen``) to a fast fixed-reply upstream in its own process
(``bench.upstream_fast``), either directly or through one server under test:

- ``direct``: straight to the upstream (the baseline of "added latency");
- ``proxy, below trigger``: compaction-proxy, a history under ``trigger_tokens`` and no
  stored compaction (identify, count, decide, forward, ledger);
- ``proxy, substitution``: compaction-proxy forwarding a stored compaction in place of the
  history's old part. The record is built beforehand by the product itself: a proxy with a
  low trigger in inline mode compacts each history once (its detector and summarizer calls
  answered by the fast upstream); the measured proxy then runs with the default trigger on
  the same store, and one request per row checks ``x-compaction-case: summarize``;
- ``litellm``: ``litellm --config`` (no callbacks, no database) to the same upstream;
- ``litellm + hook``: the same with ``callbacks: hooks.litellm_compaction.compaction_hook``.

Each server runs one worker and is restarted per row, so ``peak RSS`` (VmHWM of the server and
its children, read from /proc before it stops) belongs to that row. Before each cell the
harness waits until the server is idle again (work left over from the previous cell, such as
queued ledger writes, would otherwise be billed to the next one). Latency is measured from
the request's first byte written to the response's last byte read (whole stream included);
p50/p99 are over all measured requests of a cell; ``req/s`` is measured requests over the
measuring window. Nothing here is asserted: this is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from bench.core import conversation  # the histories of the core-cost table
from bench.loadgen import process_cpu_s
from tests.proxyproc import ProxyProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
MODEL = "gpt-4o-mini"
PLAIN_KEY = "sk-bench-plain"  # tenants: the below-trigger and substitution histories ...
SUBST_KEY = "sk-bench-subst"  # ... never share records
LAST_USER = "Please go on with the next step and keep the diff small."
# Seeding: a low trigger compacts every history inline on its first request (on tokens alone:
# at this trigger the money rules of #25 would rightly refuse, and a record is all we need).
SEED_COMPACTION = {
    "trigger_tokens": 3000, "verbatim_window_tokens": 2000, "mode": "inline",
    "policy": "tokens", "compact_to_share": 1.0,
}  # fmt: skip
# Measuring: the default trigger (24,000 tokens); the same verbatim window as the seeding.
MEASURE_COMPACTION = {"verbatim_window_tokens": 2000}
HOOK = "hooks.litellm_compaction.compaction_hook"


@dataclass(frozen=True)
class Profile:
    name: str
    small: int  # history (messages) of the below-trigger and LiteLLM rows
    sizes: tuple[int, ...]  # histories of the substitution rows
    concurrency: tuple[int, ...]
    warmup_s: float
    duration_s: float
    max_requests: int


FULL = Profile("full", 50, (50, 500, 2000), (1, 16, 64), 1.0, 6.0, 20_000)
SMOKE = Profile("smoke", 20, (20, 60), (1, 8), 0.1, 0.3, 200)


@dataclass(frozen=True)
class Target:
    """One row group: a path to the upstream at one history size."""

    kind: str  # direct | proxy | proxy-subst | litellm | litellm-hook
    label: str
    history: int
    key: str
    expect_case: str | None = None


# ---- processes ---------------------------------------------------------------------------------


def _wait_http(url: str, proc: subprocess.Popen[bytes], what: str, log: Path, limit: float) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}):\n{_tail(log)}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not start in {limit:.0f}s:\n{_tail(log)}")


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def start_ready(
    module: list[str], log_path: Path, what: str
) -> tuple[subprocess.Popen[bytes], int]:
    """``python -m <module...>`` (a bench server that prints ``ready <port>`` once it listens,
    its stderr to ``log_path``): the process and its port."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", *module], stdout=subprocess.PIPE, stderr=log, cwd=ROOT
        )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().split()
    if len(line) != 2 or line[0] != "ready":
        _stop(proc)
        raise RuntimeError(f"{what} did not start:\n{_tail(log_path)}")
    return proc, int(line[1])


class FastUpstream:
    """``python -m bench.upstream_fast`` on a free port of 127.0.0.1."""

    def __init__(
        self,
        log_path: Path,
        delay_ms: float = 0.0,
        drip_events: int = 0,
        drip_ms: float = 1.0,
        tls: tuple[Path, Path] | None = None,
    ) -> None:
        self.log_path = log_path
        self.delay_ms = delay_ms
        self.drip = ["--drip-events", str(drip_events), "--drip-ms", str(drip_ms)]
        self.tls = tls  # (certificate, key): HTTPS, trusted by its clients' SSL_CERT_FILE
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}/v1"

    def start(self) -> FastUpstream:
        module = ["bench.upstream_fast", "--port", "0", "--delay-ms", str(self.delay_ms)]
        module += self.drip  # (streams as providers send them: an event a write)
        if self.tls:
            module += ["--tls-cert", str(self.tls[0]), "--tls-key", str(self.tls[1])]
        self.proc, self.port = start_ready(module, self.log_path, "fast upstream")
        return self

    def stop(self) -> None:
        _stop(self.proc)


class LiteLLMServer:
    """``litellm --config`` (one worker, no database) with one model on the fast upstream."""

    def __init__(self, tmp: Path, upstream_url: str, *, hook: bool, workers: int = 1) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp = tmp
        self.workers = workers
        self.port = free_port()
        self.master_key = "sk-" + secrets.token_hex(24)
        config: dict[str, Any] = {
            "model_list": [
                {
                    "model_name": MODEL,
                    "litellm_params": {
                        "model": f"openai/{MODEL}",
                        "api_base": upstream_url,
                        "api_key": "sk-fake",
                    },
                }
            ],
            "general_settings": {"master_key": "os.environ/LITELLM_MASTER_KEY"},
        }
        self.env = {
            **os.environ,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_MASTER_KEY": self.master_key,
            "NO_PROXY": "127.0.0.1,localhost",
        }
        self.env.pop("COMPACTION_PROXY_CONFIG", None)
        if hook:
            config["litellm_settings"] = {"callbacks": HOOK}
            settings = {
                "store": {"url": f"diskcache://{tmp / 'store'}"},
                "compaction": MEASURE_COMPACTION,
            }
            settings_path = tmp / "compaction.yaml"
            settings_path.write_text(yaml.safe_dump(settings))
            self.env["COMPACTION_PROXY_CONFIG"] = str(settings_path)
            self.env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
            )
        self.config_path = tmp / "litellm.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = tmp / "litellm.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LiteLLMServer:
        cli = Path(sys.executable).parent / "litellm"
        command = [str(cli) if cli.exists() else "litellm", "--config", str(self.config_path)]
        command += [
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--num_workers",
            str(self.workers),
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.tmp
            )
        url = f"http://127.0.0.1:{self.port}/health/liveliness"
        try:
            _wait_http(url, self.proc, "litellm", self.log_path, 180)
        except RuntimeError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        _stop(self.proc)


# ---- measuring --------------------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a server's workers are child processes), from /proc."""
    tree, todo, found = _children(), [pid], []
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(tree.get(p, []))
    return found


def status_mb(pid: int, field: str) -> float | None:
    """``field`` of /proc status (VmRSS, VmHWM) summed over ``pid`` and its descendants (a
    server's workers are child processes), in MiB."""
    total, found = 0, False
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    total += int(line.split()[1])
                    found = True
        except OSError:
            continue
    return total / 1024 if found else None


def peak_rss_mb(pid: int) -> float | None:
    """Peak resident set (VmHWM) of ``pid`` and its descendants, in MiB."""
    return status_mb(pid, "VmHWM")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its descendants so far."""
    return sum(process_cpu_s(p) or 0.0 for p in process_tree(pid))


def settle(pid: int, limit_s: float = 60.0) -> float:
    """Wait until the server has finished work left over from the last cell (ledger writes,
    logging): under 5% of a CPU for 0.3 s. Returns the seconds waited."""
    started = time.monotonic()
    before = cpu_seconds(pid)
    while time.monotonic() - started < limit_s:
        time.sleep(0.3)
        now = cpu_seconds(pid)
        if now - before < 0.015:
            break
        before = now
    return time.monotonic() - started


def request_body(history: int, stream: bool) -> bytes:
    """A chat request of ``history`` messages (the last one a user turn), as the client sends."""
    messages = conversation(max(history - 1, 2), seed=history)
    messages.append({"role": "user", "content": LAST_USER})
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 64}
    if stream:
        body["stream"] = True
    return orjson.dumps(body)


def check(port: int, body: bytes, key: str, expect_case: str | None) -> dict[str, Any]:
    """One request before measuring: status 200, and the compaction case the row claims."""
    response = httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        content=body,
        headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
        timeout=120,
    )
    if response.status_code != 200:
        raise RuntimeError(f"check request: HTTP {response.status_code}: {response.text[:500]}")
    case = response.headers.get("x-compaction-case")
    if expect_case is not None and case != expect_case:
        raise RuntimeError(f"check request: x-compaction-case is {case!r}, not {expect_case!r}")
    original = response.headers.get("x-compaction-original-tokens")
    forwarded = response.headers.get("x-compaction-forwarded-tokens")
    return {
        "case": case,
        "original_tokens": int(original) if original else None,
        "forwarded_tokens": int(forwarded) if forwarded else None,
    }


def load(
    port: int,
    body_file: Path,
    key: str,
    concurrency: int,
    profile: Profile,
    watch: tuple[int, ...] = (),
) -> dict[str, Any]:
    """One load generator run; ``watch``: PIDs whose CPU over the window it reports too."""
    command = [
        sys.executable, "-m", "bench.loadgen", "--port", str(port),
        "--body-file", str(body_file), "--header", f"authorization: Bearer {key}",
        "--concurrency", str(concurrency), "--warmup", str(profile.warmup_s),
        "--duration", str(profile.duration_s), "--max-requests", str(profile.max_requests),
        # Every cell gets figures, however busy the machine: at least a few requests a worker.
        "--min-requests", str(concurrency * 3),
    ]  # fmt: skip
    command += [arg for pid in watch for arg in ("--watch-pid", str(pid))]
    limit = profile.warmup_s + profile.duration_s + 120
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=limit)
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def targets(profile: Profile, litellm: bool) -> list[Target]:
    """The rows, in order. A history size always means the same request body; the tenant
    (API key) alone decides whether a stored compaction applies."""
    sizes = sorted({profile.small, *profile.sizes})
    out = [Target("direct", "direct to upstream", n, PLAIN_KEY) for n in sizes]
    out.append(Target("proxy", "proxy, below trigger", profile.small, PLAIN_KEY, "none"))
    out += [
        Target("proxy-subst", "proxy, substitution", n, SUBST_KEY, "summarize")
        for n in profile.sizes
    ]
    if litellm:
        out.append(Target("litellm", "litellm (no callbacks)", profile.small, PLAIN_KEY))
        out.append(Target("litellm-hook", "litellm + our hook", profile.small, PLAIN_KEY, "none"))
    return out


@contextmanager
def server_for(
    target: Target, work: Path, upstream: FastUpstream, seeded_store: Path, workers: int
) -> Iterator[tuple[int, str, int | None]]:
    """Start the server under test; yield (port, auth key, pid for RSS)."""
    tmp = work / f"{target.kind}-{target.history}"
    tmp.mkdir(parents=True, exist_ok=True)
    if target.kind == "direct":
        yield upstream.port, target.key, None
        return
    if target.kind in ("proxy", "proxy-subst"):
        store = seeded_store if target.kind == "proxy-subst" else tmp / "store"
        proxy = ProxyProcess(
            tmp, upstream.base_url, store={"url": f"diskcache://{store}"},
            compaction=MEASURE_COMPACTION,
        )  # fmt: skip
        proxy.start(["--workers", str(workers)])
        try:
            assert proxy.proc is not None
            yield proxy.port, target.key, proxy.proc.pid
        finally:
            proxy.stop()
        return
    hook = target.kind == "litellm-hook"
    server = LiteLLMServer(tmp, upstream.base_url, hook=hook, workers=workers).start()
    try:
        assert server.proc is not None
        yield server.port, server.master_key, server.proc.pid
    finally:
        server.stop()


def seed_records(
    work: Path,
    upstream: FastUpstream,
    sizes: Iterable[int],
    store: Path,
    key: str = SUBST_KEY,
) -> list[Any]:
    """Compact the ``n``-message history of each of ``sizes`` once, through the product,
    into ``store`` (``key``'s tenant)."""
    tmp = work / "seeding"
    tmp.mkdir(parents=True, exist_ok=True)
    seeded = []
    with ProxyProcess(
        tmp, upstream.base_url, store={"url": f"diskcache://{store}"}, compaction=SEED_COMPACTION
    ) as proxy:
        for n in sizes:
            body = request_body(n, stream=False)
            seeded.append({"history": n, **check(proxy.port, body, key, "summarize")})
    return seeded


def run(
    profile: Profile, *, litellm: bool = True, workers: int = 1, log: Any = sys.stderr
) -> dict[str, Any]:
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    work = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    upstream = FastUpstream(work / "upstream.log").start()
    try:
        store = work / "seeded-store"
        seeded = seed_records(work, upstream, profile.sizes, store)
        print(f"seeded {len(seeded)} compaction records", file=log)
        bodies: dict[tuple[int, bool], Path] = {}
        for target in targets(profile, litellm):
            for stream in (False, True):
                if (target.history, stream) not in bodies:
                    path = work / f"body-{target.history}-{int(stream)}.json"
                    path.write_bytes(request_body(target.history, stream))
                    bodies[(target.history, stream)] = path
            try:
                rows += measure_target(target, work, upstream, store, bodies, profile, workers, log)
            except RuntimeError as exc:
                if not target.kind.startswith("litellm"):
                    raise
                skipped.append(f"{target.label}: {str(exc)[:300]}")
                print(f"skipped {target.label}: {exc}", file=log)
    finally:
        upstream.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {
        "profile": profile.__dict__,
        "workers": workers,
        "rows": rows,
        "seeded": seeded,
        "skipped": skipped,
        "seconds": round(time.monotonic() - started, 1),
    }


def measure_target(
    target: Target,
    work: Path,
    upstream: FastUpstream,
    store: Path,
    bodies: dict[tuple[int, bool], Path],
    profile: Profile,
    workers: int,
    log: Any,
) -> list[dict[str, Any]]:
    rows = []
    with server_for(target, work, upstream, store, workers) as (port, key, pid):
        body = bodies[(target.history, False)]
        seen = check(port, body.read_bytes(), key, target.expect_case)
        messages = len(orjson.loads(body.read_bytes())["messages"])
        for stream in (False, True):
            for concurrency in profile.concurrency:
                body_file = bodies[(target.history, stream)]
                if pid is not None:
                    settle(pid)
                result = load(port, body_file, key, concurrency, profile)
                rows.append(
                    {
                        "kind": target.kind,
                        "label": target.label,
                        "history": target.history,
                        "messages": messages,
                        "stream": stream,
                        **seen,
                        **result,
                    }
                )
                print(
                    f"{target.label:24} {messages:5} msgs stream={int(stream)} "
                    f"c={concurrency:<3} p50={result['p50_ms']:.2f}ms "
                    f"p99={result['p99_ms']:.2f}ms {result['rps']:.0f} req/s "
                    f"errors={result['errors']}",
                    file=log,
                )
        rss = peak_rss_mb(pid) if pid is not None else None
    for row in rows:
        row["peak_rss_mb"] = rss
    return rows


# ---- report -----------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None or value != value:  # None or NaN
        return "—"
    return f"{value:,.{digits}f}"


def markdown(results: dict[str, Any]) -> str:
    rows = results["rows"]
    small = results["profile"]["small"]

    def find(kind: str, history: int, stream: bool, concurrency: int) -> dict[str, Any] | None:
        return next(
            (
                r
                for r in rows
                if r["kind"] == kind
                and r["history"] == history
                and r["stream"] == stream
                and r["concurrency"] == concurrency
            ),
            None,
        )

    out = []
    for stream in (False, True):
        title = "Streaming" if stream else "Non-streaming"
        out.append(f'**{title}** (`"stream": {str(stream).lower()}`)\n')
        out.append(
            "| path | history (msgs) | concurrency | p50 ms | p99 ms | added p50 ms vs direct "
            "| req/s | req/s ÷ LiteLLM | peak RSS MiB |"
        )
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            if r["stream"] != stream:
                continue
            direct = find("direct", r["history"], stream, r["concurrency"])
            litellm = find("litellm", small, stream, r["concurrency"])
            added = (
                None if direct is None or r["kind"] == "direct" else r["p50_ms"] - direct["p50_ms"]
            )
            ratio = (
                r["rps"] / litellm["rps"]
                if litellm is not None and r["history"] == small and litellm["rps"]
                else None
            )
            errors = f" ({r['errors']} errors)" if r["errors"] else ""
            out.append(
                f"| {r['label']}{errors} | {r['messages']:,} | {r['concurrency']} | "
                f"{_fmt(r['p50_ms'])} | {_fmt(r['p99_ms'])} | {_fmt(added)} | "
                f"{_fmt(r['rps'], 0)} | {_fmt(ratio)}{'×' if ratio else ''} | "
                f"{_fmt(r['peak_rss_mb'], 0)} |"
            )
        out.append("")
    seen = {}
    for r in rows:
        if r["kind"].startswith("proxy"):
            seen[(r["label"], r["messages"])] = r
    out.append("What the proxy forwarded in those rows (from its response headers):\n")
    out.append(
        "| row | history (msgs) | x-compaction-case | tokens sent by the client "
        "| tokens forwarded |"
    )
    out.append("|---|---:|---|---:|---:|")
    for (label, messages), r in seen.items():
        out.append(
            f"| {label} | {messages:,} | `{r['case']}` | {_fmt(r['original_tokens'], 0)} | "
            f"{_fmt(r['forwarded_tokens'], 0)} |"
        )
    for note in results.get("skipped", []):
        out.append(f"\nRow left out: {note}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and durations")
    parser.add_argument("--no-litellm", action="store_true", help="leave out the LiteLLM rows")
    parser.add_argument("--workers", type=int, default=1, help="workers per server (default 1)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    profile = SMOKE if args.smoke else FULL
    results = run(profile, litellm=not args.no_litellm, workers=args.workers)
    print(markdown(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
