"""How long ``/healthz`` goes unanswered while the proxy handles one huge request (#29).

    python -m bench.healthz_probe [--runs 2] [--messages 100000] [--mb 30] [--case ...]

Starts a proxy process in front of a raw loopback upstream (which also answers the
detector and summarizer calls), and a prober in a process of its own that sends
``GET /healthz`` every 50 ms on one keep-alive connection and writes down when each answer
came. One proxy per run, one run per case:

- ``first``: the first request of a 100,000-message conversation, over the emergency bound:
  compacted inline before it is forwarded;
- ``background``: the same conversation between the trigger and the emergency bound:
  forwarded as sent, then compacted in the background;
- ``reuse``: the next request of a conversation whose compaction is stored (the record
  substituted);
- ``30mb``: the first request of one single 30 MB message.

Reported per run: the longest gap between two answers from sending the request until the
work it caused is over (its answer, then until the proxy is idle again: a background
compaction, the after-response writes), and the slowest single probe. With a 50 ms period
a gap under 100 ms means no stall longer than ~50 ms.
Figures only: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.overhead import settle
from proxy.core.tokens import TokenCounter
from tests.proxyproc import ProxyProcess
from tests.rawupstream import RawUpstream

CASES = ("first", "background", "reuse", "30mb")
PERIOD_S = 0.05
# Runs in its own process: the bench's own work (building and sending 30 MB) never delays
# a probe. CLOCK_MONOTONIC is one clock for every process on the machine.
_PROBER = """
import http.client, sys, time
conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=120)
while True:
    sent = time.monotonic()
    conn.request("GET", "/healthz")
    conn.getresponse().read()
    print(sent, time.monotonic(), flush=True)
    time.sleep(float(sys.argv[2]))
"""


def history(n: int, tag: str = "") -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for i in range(n - 1):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append({"role": role, "content": f"{tag}message {i}: short text"})
    return messages


def payload(messages: list[dict[str, Any]]) -> bytes:
    return json.dumps({"model": "m", "messages": messages}).encode()


def probe_run(
    upstream: RawUpstream, tmp: Path, compaction: dict[str, Any], bodies: list[bytes]
) -> tuple[float, float, float]:
    """Send ``bodies`` in order to a fresh proxy; (longest gap ms, slowest probe ms,
    request s) around the last one (the earlier ones prepare it: a stored record)."""
    with ProxyProcess(
        tmp, upstream.url("/v1"), admin={"token": "t"}, compaction=compaction,
        upstream={"timeout_s": 600},
    ) as px:  # fmt: skip
        for body in bodies[:-1]:
            post(px, body)
            idle(px)
        prober = subprocess.Popen(
            [sys.executable, "-c", _PROBER, str(px.port), str(PERIOD_S)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            time.sleep(0.5)
            started = time.monotonic()
            post(px, bodies[-1])
            done = time.monotonic()
            idle(px)
            until = time.monotonic()
        finally:
            prober.terminate()
        lines = prober.communicate()[0].split()
    pairs = [(float(a), float(b)) for a, b in zip(lines[::2], lines[1::2], strict=True)]
    answers = [b for _, b in pairs if started <= b <= until]
    gaps = [b - a for a, b in zip([started, *answers], answers, strict=False)]
    slowest = max((b - a for a, b in pairs if started <= b <= until), default=0.0)
    # The probe in flight at the end counts too: silence until ``until``.
    gaps.append(until - (answers[-1] if answers else started))
    return max(gaps) * 1000, slowest * 1000, done - started


def post(px: ProxyProcess, body: bytes) -> None:
    response = httpx.post(
        f"{px.base_url}/chat/completions", content=body,
        headers={"content-type": "application/json"}, timeout=600,
    )  # fmt: skip
    assert response.status_code == 200, response.text[:300]


def idle(px: ProxyProcess) -> None:
    """Wait until the work a request left behind is over (a background compaction, the
    after-response writes): the proxy at under 5% of a CPU for 0.3 s."""
    assert px.proc is not None
    settle(px.proc.pid, limit_s=300)


def case_setup(case: str, messages: int, mb: float) -> tuple[dict[str, Any], list[bytes]]:
    """The compaction settings and the bodies (the measured one last) of one case."""
    if case == "30mb":
        text = "word " * int(mb * 1024 * 1024 / 5)
        return {}, [payload([{"role": "user", "content": text}])]
    conversation = history(messages)
    if case == "first":
        return {}, [payload(conversation)]
    if case == "reuse":
        more = [*conversation, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "and then?"}]  # fmt: skip
        return {}, [payload(conversation), payload(more)]
    # Between the trigger and the emergency bound (2 x trigger): compacted after the answer.
    tokens = sum(TokenCounter().count_messages(conversation, "m"))
    return {"trigger_tokens": int(tokens / 1.5)}, [payload(conversation)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.healthz_probe", description=__doc__)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--mb", type=float, default=30.0)
    parser.add_argument("--case", choices=CASES, action="append")
    args = parser.parse_args(argv)
    print("case        size     run  request s  longest gap ms  slowest probe ms")
    with RawUpstream() as upstream:
        for case in args.case or CASES:
            compaction, bodies = case_setup(case, args.messages, args.mb)
            for run in range(args.runs):
                tmp = Path(tempfile.mkdtemp(prefix="healthz-probe-"))
                gap, slowest, took = probe_run(upstream, tmp, compaction, bodies)
                size = f"{len(bodies[-1]) / 1e6:.1f} MB"
                print(f"{case:<11} {size:<8} {run:>3} {took:>10.2f} {gap:>15.0f} {slowest:>17.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
