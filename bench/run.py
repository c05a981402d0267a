"""Run every benchmark and write the report.

    python -m bench.run            # full (about 35 minutes on 2 cores): docs/benchmarks.md
                                   # and docs/savings.png
    python -m bench.run --smoke    # tiny sizes, a few minutes: a temporary folder (or --out)

Sections: 1. overhead (``bench.overhead``), 2. core cost (``python -m bench.core``),
3. savings (``bench.savings``, with the chart), 4. compaction policies (``bench.policies``),
5. where the added time goes (``python -m bench.stages``), 6. servers and forwarders side by
side, interleaved, with ratios to direct (``python -m bench.servers``), 7. a 300-request
coding-agent session (``bench.agent_session``), 8. memory of one worker after 5,000 requests
(``python -m bench.rss``), 9. net billed dollars of replayed agent sessions with both
providers' cache rules (``python -m bench.economics``).
The report states the machine, the command, and an "aims" table computed from the figures.
A hand-written analysis between the ``<!-- analysis:start -->`` and ``<!-- analysis:end -->``
markers of an existing report is kept when the report is regenerated. Smoke mode never
writes into ``docs/``. Exit status 1 if any section failed (the others still run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from bench import agent_session, economics, overhead, policies, rss, savings, servers, stages

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REPORT = "benchmarks.md"
CHART = "savings.png"
ANALYSIS_START = "<!-- analysis:start -->"
ANALYSIS_END = "<!-- analysis:end -->"
NO_ANALYSIS = "_No analysis written for this run._"
VERSIONS = (
    "litellm", "starlette", "uvicorn", "granian", "httpx", "aiohttp", "uvloop", "httptools",
    "orjson", "tiktoken",
)  # fmt: skip


# ---- the machine ------------------------------------------------------------------------------


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def machine() -> dict[str, Any]:
    cpuinfo = _read("/proc/cpuinfo")
    model = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if "model name" in line),
        platform.processor() or "unknown",
    )
    mem_kb = next(
        (int(line.split()[1]) for line in _read("/proc/meminfo").splitlines()
         if line.startswith("MemTotal:")),
        0,
    )  # fmt: skip
    pretty = next(
        (line.split("=", 1)[1].strip('"') for line in _read("/etc/os-release").splitlines()
         if line.startswith("PRETTY_NAME=")),
        platform.system(),
    )  # fmt: skip
    versions = {}
    for name in VERSIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "virtualised": " hypervisor" in cpuinfo or "hypervisor" in cpuinfo.split(),
        "memory_gib": round(mem_kb / 1024 / 1024, 1),
        "os": f"{pretty}, Linux {platform.release()}",
        "python": platform.python_version(),
        "versions": versions,
    }


# ---- sections ---------------------------------------------------------------------------------


def _module(name: str, args: list[str], work: Path, timeout: int = 1800) -> tuple[Any, str]:
    """``python -m bench.<name> --json FILE <args>`` in its own process: its JSON and its
    standard output."""
    json_path = work / f"{name}.json"
    command = [sys.executable, "-m", f"bench.{name}", "--json", str(json_path), *args]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"bench.{name} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(json_path.read_text()), done.stdout


def run_core(smoke: bool, work: Path) -> dict[str, Any]:
    """``python -m bench.core`` in its own process: its markdown and its JSON."""
    result, out = _module("core", ["--smoke"] if smoke else [], work)
    return {"markdown": out.strip(), **result}


def run_stages(smoke: bool, work: Path) -> dict[str, Any]:
    """``python -m bench.stages`` in its own process (it runs the proxy's app in-process)."""
    result: dict[str, Any] = _module("stages", ["--smoke"] if smoke else [], work)[0]
    return result


def run_servers(smoke: bool, litellm: bool, work: Path) -> dict[str, Any]:
    """``python -m bench.servers`` (forwarders and servers side by side, interleaved)."""
    args = (["--smoke"] if smoke else []) + ([] if litellm else ["--no-litellm"])
    result: dict[str, Any] = _module("servers", args, work, timeout=3600)[0]
    return result


def run_rss(smoke: bool, work: Path) -> dict[str, Any]:
    """``python -m bench.rss`` (one worker's memory after 5,000 requests, or 200 in smoke)."""
    result: dict[str, Any] = _module("rss", ["--requests", "200"] if smoke else [], work)[0]
    return result


def _section(name: str, fn: Callable[[], Any], failures: list[str]) -> Any:
    started = time.monotonic()
    print(f"== {name}", file=sys.stderr, flush=True)
    try:
        result = fn()
    except Exception:
        failures.append(name)
        error = traceback.format_exc()
        print(error, file=sys.stderr)
        return {"error": error}
    print(f"== {name}: {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
    return result


# ---- aims -------------------------------------------------------------------------------------


def _row(rows: list[dict[str, Any]], kind: str, history: int, stream: bool, c: int) -> Any:
    return next(
        (r for r in rows if r["kind"] == kind and r["history"] == history
         and r["stream"] == stream and r["concurrency"] == c),
        None,
    )  # fmt: skip


def aims(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(aim, measured, verdict) for every aim the figures allow to check."""
    out: list[tuple[str, str, str]] = []
    ov = results.get("overhead", {})
    if "rows" in ov:
        rows, prof, workers = ov["rows"], ov["profile"], ov.get("workers", 1)
        small, big, top = prof["small"], max(prof["sizes"]), max(prof["concurrency"])
        for kind, history, limit in (("proxy", small, 1.0), ("proxy-subst", big, 3.0)):
            for stream in (False, True):
                row, direct = (
                    _row(rows, kind, history, stream, 1),
                    _row(rows, "direct", history, stream, 1),
                )
                if row and direct:
                    added = row["p50_ms"] - direct["p50_ms"]
                    what = "below trigger" if kind == "proxy" else "with substitution"
                    out.append((
                        f"added p50 < {limit:g} ms, concurrency 1, {row['messages']:,}-message "
                        "request "
                        f"{what}, {'streaming' if stream else 'non-streaming'}",
                        f"{added:.2f} ms",
                        "met" if added < limit else "missed",
                    ))  # fmt: skip
        for stream in (False, True):
            ours, theirs = (
                _row(rows, "proxy", small, stream, top),
                _row(rows, "litellm", small, stream, top),
            )
            if ours and theirs and theirs["rps"]:
                ratio = ours["rps"] / theirs["rps"]
                mode = "streaming" if stream else "non-streaming"
                out.append((
                    f"≥ 3× LiteLLM's req/s at concurrency {top}, {workers} worker(s) each, {mode}",
                    f"{ratio:.2f}× ({ours['rps']:,.0f} vs {theirs['rps']:,.0f} req/s)",
                    "met" if ratio >= 3 else "missed",
                ))  # fmt: skip
                out.append((
                    f"lower p99 than LiteLLM at concurrency {top}, {mode}",
                    f"{ours['p99_ms']:,.1f} vs {theirs['p99_ms']:,.1f} ms",
                    "met" if ours["p99_ms"] < theirs["p99_ms"] else "missed",
                ))  # fmt: skip
    out += _server_aims(results.get("servers", {}), results.get("rss", {}))
    agent = results.get("agent")
    if isinstance(agent, list):
        for r in agent:
            ratio = r["usd"] / r["baseline_usd"] if r["baseline_usd"] else 1.0
            where = f"agent session, trigger {r['trigger_tokens']:,}"
            out.append((
                f"$ ≤ 0.35× forwarding unchanged ({where})",
                f"{ratio:.3f}×",
                "met" if ratio <= 0.35 else "missed",
            ))  # fmt: skip
            out.append((
                f"≥ 90% of forwarded tokens cacheable ({where})",
                f"{r['cacheable_share']:.1%} (ceiling {1 - r['new_share']:.1%})",
                "met" if r["cacheable_share"] >= 0.9 else "missed",
            ))  # fmt: skip
    econ = results.get("economics")
    if isinstance(econ, list):
        out += economics.aims(econ)
    core = results.get("core", {})
    if core.get("results"):
        best = min(core["results"], key=lambda r: abs(r["messages"] - 1000))
        warm = best["median_ms"]["total_warm"]
        out.append((
            f"warm core cost < 2 ms for {best['messages']:,} messages",
            f"{warm:.2f} ms",
            "met" if warm < 2 else "missed",
        ))  # fmt: skip
    return out


def _server_aims(sr: dict[str, Any], memory: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Issue #16's aims, from the interleaved side-by-side run of the default setup."""
    out: list[tuple[str, str, str]] = []
    rows = [r for r in sr.get("rows", []) if r["variant"] == servers.DEFAULT]
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["history"], r["stream"])):
        mode = "streaming" if r["stream"] else "non-streaming"
        n = r["history"]
        if r["concurrency"] == 1:
            if n != servers.HISTORIES[-1]:
                continue  # the aim names the 50-message request
            out.append((
                f"added p50 ≤ 1.0 ms, concurrency 1, {n} messages, {mode} "
                f"({servers.DEFAULT}, median of rounds)",
                f"{r['added_p50_ms']:.2f} ms",
                "met" if r["added_p50_ms"] <= 1.0 else "missed",
            ))  # fmt: skip
        else:
            out += _concurrency_aims(r, f"{n} messages, {mode}", "")
    for r in sr.get("latency_rows", []):
        if r["variant"] == servers.DEFAULT:
            mode = "streaming" if r["stream"] else "non-streaming"
            where = f", upstream answering in {r['delay_ms']} ms"
            out += _concurrency_aims(r, f"{r['history']} messages, {mode}", where)
    stages = memory.get("stages") or []
    if len(stages) >= 2:
        after = stages[1]
        out.append((
            f"RSS of one worker ≤ 150 MB after {after['after']} (`bench.rss`)",
            f"{after['rss']:.0f} MiB",
            "met" if after["rss"] <= 150 else "missed",
        ))  # fmt: skip
    return out


def _concurrency_aims(r: dict[str, Any], what: str, where: str) -> list[tuple[str, str, str]]:
    c = r["concurrency"]
    return [
        (
            f"≥ 0.8× direct's req/s at concurrency {c}, {what}{where}",
            f"{r['rps_vs_direct']:.2f}× ({r['rps']:,.0f} req/s)",
            "met" if r["rps_vs_direct"] >= 0.8 else "missed",
        ),
        (
            f"p99 within 2× direct's at concurrency {c}, {what}{where}",
            f"{r['p99_vs_direct']:.1f}× ({r['p99_ms']:,.1f} ms)",
            "met" if r["p99_vs_direct"] <= 2 else "missed",
        ),
    ]


# ---- the report -------------------------------------------------------------------------------


def _kept_analysis(path: Path) -> str:
    text = _read(str(path))
    if ANALYSIS_START in text and ANALYSIS_END in text:
        return text.split(ANALYSIS_START, 1)[1].split(ANALYSIS_END, 1)[0].strip()
    return NO_ANALYSIS


def _failed(result: Any) -> str | None:
    if isinstance(result, dict) and "error" in result:
        return f"**This section failed:**\n\n```\n{result['error'][-3000:]}\n```"
    return None


def report(results: dict[str, Any], command: str, analysis: str, chart_name: str | None) -> str:
    m = results["machine"]
    smoke = results["smoke"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    load = results["load_average"]
    lines = [
        "# Benchmarks",
        "",
        "Every figure below comes from side-by-side runs on the one machine described here, in "
        "one invocation of the command below; latencies are medians (p50) or 99th percentiles "
        "of all measured requests, comparisons are ratios or differences against a baseline "
        "measured in the same run. Nothing here is a test: CI runs the smoke mode only to keep "
        "the harness working.",
        "",
    ]
    if smoke:
        lines += [
            "> **Smoke run**: tiny sizes and durations, to check the harness. These figures are "
            "not comparable with the full run's and the aims below use the smoke sizes.",
            "",
        ]
    lines += [
        "## Machine and command",
        "",
        f"- {m['cpus']} CPUs: {m['cpu_model']}{' (virtual machine)' if m['virtualised'] else ''}"
        f"; {m['memory_gib']} GiB memory; {m['os']}",
        f"- Python {m['python']}; {versions}",
        f"- Run {results['date']}, {results['seconds'] / 60:.1f} minutes; load average "
        f"{load['start']:.2f} at the start, {load['end']:.2f} at the end (other work on the "
        "machine shows up here).",
        "",
        "```bash",
        command,
        "```",
        "",
        "The load generator, the upstream and the server under test are three processes sharing "
        "the same CPUs, so at high concurrency all three compete; that is the same for every "
        "row.",
        "",
        "## Aims",
        "",
        "| aim | measured | |",
        "|---|---:|---|",
    ]
    lines += [f"| {a} | {measured} | {verdict} |" for a, measured, verdict in aims(results)]
    lines += ["", "## 1. Overhead", "", _doc(overhead), ""]
    ov = results["overhead"]
    lines.append(_failed(ov) or _overhead_setup(ov) + "\n\n" + overhead.markdown(ov))
    lines += ["", "## 2. Core cost", ""]
    core = results["core"]
    lines += [
        "`python -m bench.core" + (" --smoke" if smoke else "") + "` (fingerprints, prefix "
        "chain, record lookup in a diskcache store, token count), in its own process:",
        "",
    ]
    lines.append(_failed(core) or core["markdown"])
    lines += ["", "## 3. Savings", "", _doc(savings), ""]
    sv = results["savings"]
    lines.append(_failed(sv) or savings.markdown(sv))
    if chart_name and not _failed(sv):
        lines += ["", f"![Original vs forwarded prompt tokens per request]({chart_name})"]
    lines += ["", "## 4. Compaction policies", "", _doc(policies), ""]
    pol = results["policies"]
    lines.append(_failed(pol) or policies.markdown(pol))
    lines += ["", "## 5. Where the added time goes", "", _doc(stages), ""]
    st = results["stages"]
    lines.append(
        _failed(st)
        or f"Milliseconds, medians of {st['reps']} interleaved repetitions.\n\n"
        + stages.markdown(st)
    )
    lines += ["", "## 6. Servers and forwarders side by side", "", _doc(servers), ""]
    sr = results["servers"]
    lines.append(
        _failed(sr)
        or f"{sr['rounds']} rounds of {sr['duration_s']:g} s per cell; "
        f"{' and '.join(str(h) for h in sr['histories'])}-message bodies.\n\n"
        + servers.markdown(sr)
    )
    lines += ["", "## 7. Agent session", "", _doc(agent_session), ""]
    agent = results.get("agent")
    lines.append(_failed(agent) or agent_session.markdown(agent or []))
    lines += ["", "## 8. Memory of one worker", "", _doc(rss), ""]
    mem = results.get("rss")
    lines.append(_failed(mem) or rss.markdown(mem or {"stages": []}))
    lines += ["", "## 9. Net billed dollars", "", _doc(economics), ""]
    econ = results.get("economics")
    lines.append(_failed(econ) or economics.markdown(econ or []))
    lines += ["", "## Analysis", "", ANALYSIS_START, analysis, ANALYSIS_END, ""]
    return "\n".join(lines)


def _doc(module: Any) -> str:
    """A module docstring without its usage block, as report prose."""
    text = (module.__doc__ or "").strip()
    paragraphs = [p for p in text.split("\n\n") if not p.lstrip().startswith("python -m")]
    return "\n\n".join(paragraphs[1:] if len(paragraphs) > 1 else paragraphs)


def _overhead_setup(ov: dict[str, Any]) -> str:
    p = ov["profile"]
    return (
        f"Concurrency {', '.join(str(c) for c in p['concurrency'])}; per cell {p['warmup_s']:g} s "
        f"of warm-up, then at most {p['duration_s']:g} s or {p['max_requests']:,} requests. "
        f"{ov.get('workers', 1)} worker(s) per server. Substitution records built by the "
        "product: "
        f"compaction `{overhead.SEED_COMPACTION}` for the seeding request, then "
        f"`{overhead.MEASURE_COMPACTION}` (default trigger 24,000) while measuring."
    )


# ---- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, about a minute")
    parser.add_argument("--out", metavar="DIR", help="where the report and chart go")
    parser.add_argument("--json", metavar="PATH", help="also write every result as JSON")
    parser.add_argument("--no-litellm", action="store_true", help="leave out the LiteLLM rows")
    parser.add_argument("--workers", type=int, default=1, help="workers per server (default 1)")
    args = parser.parse_args(argv)

    if args.out:
        out = Path(args.out).resolve()
    elif args.smoke:
        out = Path(tempfile.mkdtemp(prefix="bench-smoke-"))
    else:
        out = DOCS
    if args.smoke and out == DOCS.resolve():
        parser.error("smoke mode never writes into docs/: pass another --out")
    out.mkdir(parents=True, exist_ok=True)

    command = "python -m bench.run" + (" --smoke" if args.smoke else "")
    command += " --no-litellm" if args.no_litellm else ""
    command += f" --workers {args.workers}" if args.workers != 1 else ""
    started = time.monotonic()
    failures: list[str] = []
    results: dict[str, Any] = {
        "smoke": args.smoke,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "load_average": {"start": os.getloadavg()[0]},
    }
    with tempfile.TemporaryDirectory(prefix="bench-run-") as work:
        results["core"] = _section("core", lambda: run_core(args.smoke, Path(work)), failures)
        results["stages"] = _section("stages", lambda: run_stages(args.smoke, Path(work)), failures)
        results["servers"] = _section(
            "servers",
            lambda: run_servers(args.smoke, not args.no_litellm, Path(work)),
            failures,
        )
        results["rss"] = _section("rss", lambda: run_rss(args.smoke, Path(work)), failures)
    ov_profile = overhead.SMOKE if args.smoke else overhead.FULL
    results["overhead"] = _section(
        "overhead",
        lambda: overhead.run(ov_profile, litellm=not args.no_litellm, workers=args.workers),
        failures,
    )
    sv_profile = savings.SMOKE if args.smoke else savings.FULL
    results["savings"] = _section("savings", lambda: savings.run(sv_profile), failures)
    turns = policies.SMOKE_TURNS if args.smoke else policies.FULL_TURNS
    results["policies"] = _section(
        "policies", lambda: policies.run(turns, sv_profile.compaction), failures
    )
    results["agent"] = _section("agent", lambda: agent_session.runs(args.smoke), failures)
    results["economics"] = _section("economics", lambda: economics.run(args.smoke), failures)
    results["load_average"]["end"] = os.getloadavg()[0]
    results["seconds"] = round(time.monotonic() - started, 1)

    chart_name = None
    if "sessions" in results["savings"]:
        chart_name = CHART
        savings.chart(results["savings"], out / CHART)
    report_path = out / REPORT
    text = report(results, command, _kept_analysis(report_path), chart_name)
    report_path.write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"wrote {report_path}" + (f" and {out / CHART}" if chart_name else ""))
    if failures:
        print(f"failed sections: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
