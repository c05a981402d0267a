"""The fault run of the real client path (issue #29 item 4): the official openai and
anthropic clients, their own retries on, against an upstream that resets, hangs, drips,
sends garbage, answers 429 with retry-after and 500 (``tests/faultupstream.py``), while
compactions run (their detector and summarizer calls answered by the strict scripted
upstream) and the store is deleted between two rounds. What must hold:

- no request reaches the upstream twice for one attempt of a client call (the proxy never
  retries on its own): the upstream saw exactly the attempts the client made;
- no 500 of the proxy's own: every 500 the client sees is the upstream's, relayed;
- no ledger entry lost: the ledger counts every attempt the proxy answered;
- every call ends as its script says (answered, once the client's retries get past the
  faults).

Bounded in time: the upstream timeout is 2 s, every client call 60 s, the whole run a few
tens of seconds.
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2  # the anthropic client's HTTP library (openai's is httpx)
import openai

from tests.checks import LOW_TRIGGER
from tests.faultupstream import UPSTREAM_500, FaultUpstream
from tests.proxyproc import ProxyProcess, delete_folder
from tests.upstream import ScriptedUpstream

ADMIN = {"authorization": "Bearer test-admin-token"}
# (route, stream, what the upstream does on each attempt, turns of history)
CALLS: list[tuple[str, bool, str, int]] = [
    ("chat", False, "reset,ok", 2),
    ("chat", False, "hang,ok", 30),
    ("chat", False, "garbage,429,ok", 30),
    ("chat", False, "500,500,ok", 60),
    ("chat", False, "drip,ok", 2),
    ("chat", True, "reset,ok", 30),
    ("chat", True, "429,ok", 60),
    ("chat", True, "hang,500,ok", 2),
    ("messages", False, "reset,ok", 30),
    ("messages", False, "429,500,ok", 60),
    ("messages", False, "hang,ok", 2),
    ("messages", True, "garbage,ok", 30),
    ("messages", True, "500,ok", 60),
    ("messages", False, "drip,reset,ok", 30),
]


class Seen:
    """What the client saw: every response the proxy gave, by call and attempt."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.attempts: Counter[tuple[str, int]] = Counter()
        self.statuses: Counter[int] = Counter()
        self.own_500s: list[bytes] = []

    def hook(self, response: Any) -> None:
        """An ``httpx`` or ``httpx2`` response hook (the two clients use one each)."""
        call = response.request.headers.get("x-test-call", "?")
        attempt = int(response.request.headers.get("x-stainless-retry-count", "0"))
        body = response.read() if response.status_code == 500 else b""
        with self.lock:
            self.attempts[(call, attempt)] += 1
            self.statuses[response.status_code] += 1
            if response.status_code == 500 and body != UPSTREAM_500:
                self.own_500s.append(body[:300])


def history(turns: int, tag: str) -> list[dict[str, str]]:
    messages = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"{tag} question {i}: " + "word " * 60})
        messages.append({"role": "assistant", "content": f"{tag} answer {i}: " + "text " * 60})
    messages.append({"role": "user", "content": f"{tag}: and now?"})
    return messages


def one_call(px: ProxyProcess, seen: Seen, call: str, spec: tuple[str, bool, str, int]) -> str:
    """Run one client call to its end; its final answer's text."""
    route, stream, script, turns = spec
    headers = {"x-test-call": call, "x-fault": script, "x-conversation-id": call}
    hooks = {"response": [seen.hook]}
    if route == "chat":
        with httpx.Client(event_hooks=hooks, timeout=60) as http:
            oa = openai.OpenAI(
                base_url=px.base_url, api_key="sk-fault", max_retries=3, http_client=http
            )
            messages: Any = [{"role": "system", "content": "You help."}, *history(turns, call)]
            if not stream:
                reply = oa.chat.completions.create(
                    model="gpt-4o-mini", messages=messages, extra_headers=headers
                )
                return reply.choices[0].message.content or ""
            chunks = oa.chat.completions.create(
                model="gpt-4o-mini", messages=messages, stream=True, extra_headers=headers
            )
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with httpx2.Client(event_hooks=hooks, timeout=60) as http2:
        an = anthropic.Anthropic(
            base_url=px.root, api_key="sk-ant-fault", max_retries=3, http_client=http2
        )
        turns_: Any = history(turns, call)
        if not stream:
            message = an.messages.create(
                model="claude-3-5-haiku-latest", max_tokens=50, system="You help.",
                messages=turns_, extra_headers=headers,
            )  # fmt: skip
            return "".join(b.text for b in message.content if b.type == "text")
        text = []
        with an.messages.stream(
            model="claude-3-5-haiku-latest", max_tokens=50, system="You help.",
            messages=turns_, extra_headers=headers,
        ) as events:  # fmt: skip
            text.extend(events.text_stream)
        return "".join(text)


def ledger_requests(px: ProxyProcess) -> int:
    stats = httpx.get(f"{px.root}/admin/api/stats", headers=ADMIN, timeout=60)
    assert stats.status_code == 200, stats.text
    return int(stats.json()["totals"]["requests"])


def run_round(px: ProxyProcess, up: FaultUpstream, seen: Seen, round_: str) -> None:
    calls = {f"{round_}-{i}": spec for i, spec in enumerate(CALLS)}
    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = {call: pool.submit(one_call, px, seen, call, s) for call, s in calls.items()}
        texts = {call: future.result(timeout=600) for call, future in answers.items()}
    # (The chat stream's scripted answer says "hi", every other answer "ok".)
    wrong = {call: text for call, text in texts.items() if text not in ("ok", "hi")}
    assert wrong == {}
    for call in calls:
        client = {a for (c, a), n in seen.attempts.items() if c == call for _ in range(n)}
        upstream = {(a, n) for (c, a), n in up.attempts.items() if c == call}
        # Each attempt the client made reached the upstream exactly once, and nothing else did.
        assert upstream == {(a, 1) for a in client}, (call, upstream, client)
    assert seen.own_500s == []


def test_the_official_clients_through_faults_compactions_and_a_store_loss(
    tmp_path: Path,
) -> None:
    with ScriptedUpstream() as llm, FaultUpstream() as up:
        px = ProxyProcess(
            tmp_path,
            up.base_url,
            upstream={"timeout_s": 2, "connect_timeout_s": 2},
            compaction={
                **LOW_TRIGGER, "mode": "background", "llm_timeout_s": 30,
                "summary_base_url": llm.base_url, "summary_api_key": "sk-llm",
            },
            admin={"token": "test-admin-token"},
        )  # fmt: skip
        with px:
            seen = Seen()
            run_round(px, up, seen, "one")
            first = sum(seen.attempts.values())
            assert ledger_requests(px) == first  # every attempt answered is in the ledger
            delete_folder(tmp_path / "store")  # compactions may still be running
            run_round(px, up, seen, "two")
            assert ledger_requests(px) == sum(seen.attempts.values()) - first
            ready = httpx.get(f"{px.root}/readyz", timeout=30)
            assert ready.status_code == 200 and "store_recreated" in ready.json(), ready.text
        # Every fault happened, and the proxy answered each with a retryable status.
        assert set(up.faults) == {"reset", "hang", "drip", "garbage", "429", "500", "ok"}
        assert set(seen.statuses) <= {200, 429, 500, 502, 504}, seen.statuses
        assert max(attempt for _, attempt in seen.attempts) == 2  # the clients did retry
        assert llm.chat_requests("summarizer"), "no compaction ran"
