"""How long ``/healthz`` goes unanswered while the proxy handles one huge request.

    python -m bench.healthz_probe [--runs 3] [--messages 100000]

Starts a proxy process in front of a raw loopback upstream, loops ``GET /healthz`` on one
keep-alive connection, sends one chat request of ``--messages`` short messages (3.7 MB at
100,000), and prints the longest silence between two answers from sending the request until
one second after its answer (the after-response work counts too). Figures only: nothing is
asserted (tests/test_security_load.py checks the behaviour without timing it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from tests.proxyproc import ProxyProcess
from tests.rawupstream import RawUpstream


def body(n: int) -> bytes:
    messages = [{"role": "system", "content": "You are terse."}]
    for i in range(n - 1):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append({"role": role, "content": f"message {i}: short text"})
    return json.dumps({"model": "m", "messages": messages}).encode()


def one_run(payload: bytes) -> tuple[float, float, int]:
    """(longest silence s, request s, probes answered) for one fresh proxy process."""
    tmp = Path(tempfile.mkdtemp())
    compaction = {"trigger_tokens": 10**9, "verbatim_window_tokens": 1000}
    with (
        RawUpstream() as up,
        ProxyProcess(tmp, up.url("/v1"), admin={"token": "t"}, compaction=compaction) as px,
    ):
        answers: list[float] = []
        stop = threading.Event()

        def probe() -> None:
            with httpx.Client(timeout=60) as client:
                while not stop.is_set():
                    client.get(f"{px.root}/healthz")
                    answers.append(time.monotonic())

        prober = threading.Thread(target=probe)
        prober.start()
        time.sleep(0.3)
        started = time.monotonic()
        response = httpx.post(
            f"{px.base_url}/chat/completions",
            content=payload,
            headers={"content-type": "application/json"},
            timeout=300,
        )
        done = time.monotonic()
        time.sleep(1.0)
        stop.set()
        prober.join()
        assert response.status_code == 200, response.text[:300]
        seen = [a for a in answers if started <= a <= done + 1.0]
        gaps = [b - a for a, b in zip([started, *seen], seen, strict=False)]
        return max(gaps), done - started, len(seen)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.healthz_probe", description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--messages", type=int, default=100_000)
    args = parser.parse_args(argv)
    payload = body(args.messages)
    for run in range(args.runs):
        silence, took, probes = one_run(payload)
        print(
            f"run {run}: {len(payload) / 1e6:.1f} MB, request {took:.2f} s, "
            f"{probes} probes answered, longest silence {silence * 1000:.0f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
