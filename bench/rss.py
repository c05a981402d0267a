"""Resident memory of one proxy worker, at start-up and after a number of requests.

    python -m bench.rss [--requests 5000] [--history 50] [--distinct N] [--json PATH]

Starts ``compaction-proxy serve`` with the default server and forwarder (uvicorn + h1,
one worker: the process that serves is the one measured) in front of the fast upstream
(``bench.upstream_fast``), and reads ``/proc/<pid>/status`` and ``smaps_rollup``:

1. once ``/healthz`` answers (start-up: imports, tokenizers, LiteLLM's model map);
2. after ``--requests`` requests of one ``--history``-message body below the trigger, sent by
   the load generator (``bench.loadgen``, concurrency 4, the same body as ``bench.servers``);
3. with ``--distinct N``, after N more requests that are each a different conversation
   (every message new), from one httpx client: what varied traffic adds (the per-message
   token-count memo fills, records are written).

Memory is not distorted by a busy machine the way timings are, so this can run on a shared
one; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.core import conversation
from bench.overhead import LAST_USER, MODEL, PLAIN_KEY, FastUpstream, Profile, load, request_body
from bench.servers import Variant

CONCURRENCY = 4


def memory(pid: int) -> dict[str, float]:
    """VmRSS, VmHWM (peak) and the resident split of ``pid`` (anonymous: the heap, which the
    process itself grew; file-backed: shared libraries and mapped files), in MiB."""
    out: dict[str, float] = {}
    for path, fields in (
        (f"/proc/{pid}/status", {"VmRSS": "rss", "VmHWM": "peak"}),
        (f"/proc/{pid}/smaps_rollup", {"Anonymous": "anonymous", "Rss": "_rss"}),
    ):
        for line in Path(path).read_text().splitlines():
            key = line.split(":", 1)[0]
            if key in fields:
                out[fields[key]] = int(line.split()[1]) / 1024
    out["file_backed"] = out.pop("_rss") - out["anonymous"]
    return out


def distinct(port: int, n: int, history: int) -> int:
    """``n`` requests, each a conversation no other request shares; returns the 200s."""
    ok = 0
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    headers = {"authorization": f"Bearer {PLAIN_KEY}", "content-type": "application/json"}
    with httpx.Client(timeout=60, trust_env=False) as client:
        for i in range(n):
            messages = conversation(max(history - 1, 2), seed=10_000 + i)
            messages.append({"role": "user", "content": LAST_USER})
            body = {"model": MODEL, "messages": messages, "max_tokens": 64}
            response = client.post(url, content=orjson.dumps(body), headers=headers)
            ok += response.status_code == 200
    return ok


def run(requests: int, history: int, n_distinct: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-rss-"))
    upstream = FastUpstream(work / "upstream.log").start()
    variant: Variant | None = None
    try:
        variant = Variant("proxy", "uvicorn", "h1", work, upstream.base_url).start()
        assert variant.proc is not None
        pid = variant.proc.pid
        results: dict[str, Any] = {"history": history, "model": MODEL, "stages": []}
        results["stages"].append({"after": "start-up (/healthz answered)", **memory(pid)})
        body = work / "body.json"
        body.write_bytes(request_body(history, stream=False))
        profile = Profile("rss", history, (), (CONCURRENCY,), 0.0, 3600.0, requests)
        sent = load(variant.port, body, PLAIN_KEY, CONCURRENCY, profile)
        results["stages"].append(
            {
                "after": f"{sent['requests']:,} requests of one {history}-message body "
                f"({sent['errors']} errors)",
                **memory(pid),
            }
        )
        if n_distinct:
            ok = distinct(variant.port, n_distinct, history)
            results["stages"].append(
                {
                    "after": f"then {n_distinct:,} distinct {history}-message conversations "
                    f"({n_distinct - ok} errors)",
                    **memory(pid),
                }
            )
        return results
    finally:
        if variant is not None:
            variant.stop()
        upstream.stop()
        shutil.rmtree(work, ignore_errors=True)


def markdown(results: dict[str, Any]) -> str:
    out = [
        "| after | VmRSS MiB | peak (VmHWM) MiB | anonymous MiB | file-backed MiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in results["stages"]:
        out.append(
            f"| {s['after']} | {s['rss']:.0f} | {s['peak']:.0f} | {s['anonymous']:.0f} "
            f"| {s['file_backed']:.0f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rss", description=__doc__)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--history", type=int, default=50)
    parser.add_argument("--distinct", type=int, default=0, metavar="N")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    results = run(args.requests, args.history, args.distinct)
    print(markdown(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
