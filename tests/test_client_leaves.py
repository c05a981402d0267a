"""A client that leaves a stream ends its upstream request at once (#28: the pushed stream is
relayed in the request's own task, and the proxy's server protocol, not a watcher task,
tells it the client left). Through a real proxy process, with the strict upstream."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai

from tests.proxyproc import ProxyProcess
from tests.upstream import ScriptedUpstream

MODEL = "gpt-4o-mini"


def test_a_client_leaving_a_silent_stream_ends_the_upstream_request(tmp_path: Path) -> None:
    """The upstream's events come 60 s apart and its read timeout is 120 s: only the client's
    leaving can end the upstream request within the 30 s this waits (a guard against a
    hang, not a measure: the cut comes within milliseconds). It is recorded as the client's
    leaving (499), and the proxy serves the next stream whole."""
    with ScriptedUpstream() as upstream:
        proxy = ProxyProcess(tmp_path, upstream.base_url, upstream={"timeout_s": 120})
        with proxy:
            content = "slow, for a client that leaves"
            body = {
                "model": MODEL,
                "stream": True,
                "messages": [{"role": "user", "content": content}],
            }
            with httpx.stream(
                "POST",
                f"{proxy.base_url}/chat/completions",
                json=body,
                headers={"x-test-stream-delay": "60"},
                timeout=30,
            ) as r:
                assert r.status_code == 200
                for _ in r.iter_bytes():
                    break  # the first event came: leave
            assert upstream.stream_cut.wait(30), "the upstream stream ran on after the client left"
            deadline = time.monotonic() + 30
            while '"upstream_status":499' not in proxy.logs():
                assert time.monotonic() < deadline, "no request line with the client's leaving"
                time.sleep(0.05)
            client = openai.OpenAI(base_url=proxy.base_url, api_key="k-leaves", max_retries=0)
            events = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "and now?"}], stream=True
            )
            text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
            assert text
            assert upstream.chat_requests()[-1].json["messages"][-1]["content"] == "and now?"
