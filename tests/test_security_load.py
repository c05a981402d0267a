"""The event loop is never blocked for long (issue #13 item 9): while the proxy parses,
fingerprints and counts a 100,000-message request, /healthz keeps answering.

Timing-independent: the window is the big request's own processing (from sending it to the
upstream receiving it), however long that takes on this machine; the assertion is that probes
were answered all through it - many answers, and no silence longer than half the window
(a blocked loop is silent for nearly all of it).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx

from tests.proxyproc import ProxyProcess
from tests.rawupstream import RawUpstream

N_MESSAGES = 100_000


def big_request() -> bytes:
    messages = [{"role": "system", "content": "You are terse."}]
    for i in range(N_MESSAGES - 1):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append({"role": role, "content": f"message {i}: short text"})
    return json.dumps({"model": "m", "messages": messages}).encode()


def test_healthz_answers_while_a_huge_request_is_processed(tmp_path: Path) -> None:
    body = big_request()
    assert len(body) > 3_000_000
    with RawUpstream() as upstream:
        with ProxyProcess(
            tmp_path,
            upstream.url("/v1"),
            admin={"token": "t"},
            compaction={"trigger_tokens": 10**9, "verbatim_window_tokens": 1000},
        ) as px:
            answers: list[float] = []
            stop = threading.Event()

            def probe() -> None:
                with httpx.Client(timeout=60) as client:
                    while not stop.is_set():
                        assert client.get(f"{px.root}/healthz").status_code == 200
                        answers.append(time.monotonic())

            prober = threading.Thread(target=probe)
            prober.start()
            try:
                started = time.monotonic()
                response = httpx.post(
                    f"{px.base_url}/chat/completions",
                    content=body,
                    headers={"content-type": "application/json"},
                    timeout=300,
                )
            finally:
                stop.set()
                prober.join()
            assert response.status_code == 200, response.text
            arrived = next(s.at for s in upstream.seen if s.method == "POST")
            window = [t for t in answers if started <= t <= arrived]
            gaps = [b - a for a, b in zip([started, *window], [*window, arrived], strict=True)]
            span = arrived - started
            assert len(window) >= 10, (len(window), span)
            assert max(gaps) < span / 2, (max(gaps), span)
