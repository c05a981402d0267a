"""Anthropic's /v1/messages through the same core, driven by the official anthropic client."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest

from proxy.core.tokens import TokenCounter
from tests.checks import INLINE, assert_facts_present
from tests.conversations import tool_result, user_turns
from tests.proxyproc import ProxyProcess
from tests.upstream import ScriptedUpstream, strip_marks

MODEL = "claude-sonnet-4-5-20250929"
SYSTEM = "You are a careful coding assistant for the billing service."
SUMMARY_PREFIX = "[History Summary - "
_counter = TokenCounter()
# The SDK warns that this dated model name is being retired; the name is only a label here.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _tokens(system: str, messages: list[dict[str, Any]]) -> int:
    return _counter.count_total([{"role": "system", "content": system}, *messages], MODEL)


def _plain(content: Any) -> Any:
    """Content as the client wrote it: a marked one-block list back to its string."""
    content = strip_marks(content)
    if isinstance(content, list) and len(content) == 1 and content[0].get("type") == "text":
        if set(content[0]) == {"type", "text"}:
            return content[0]["text"]
    return content


def _drive(client: anthropic.Anthropic, turns: int, stream: bool) -> list[list[dict[str, Any]]]:
    messages: list[dict[str, Any]] = []
    sent: list[list[dict[str, Any]]] = []

    def call() -> list[dict[str, Any]]:
        sent.append([dict(m) for m in messages])
        kwargs: dict[str, Any] = dict(model=MODEL, max_tokens=512, system=SYSTEM, messages=messages)
        if stream:
            with client.messages.stream(**kwargs) as s:
                final = s.get_final_message()
        else:
            final = client.messages.create(**kwargs)
        return [b.model_dump(exclude_none=True) for b in final.content]

    for text in user_turns(turns):
        messages.append({"role": "user", "content": text})
        for _ in range(5):
            blocks = call()
            messages.append({"role": "assistant", "content": blocks})
            uses = [b for b in blocks if b["type"] == "tool_use"]
            if not uses:
                break
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": b["id"],
                            "content": tool_result(
                                {
                                    "function": {
                                        "name": b["name"],
                                        "arguments": orjson.dumps(b["input"]).decode(),
                                    }
                                }
                            ),
                        }
                        for b in uses
                    ],
                }
            )
    return sent


def _assert_tool_pairs(messages: list[dict[str, Any]]) -> None:
    issued: set[str] = set()
    for m in messages:
        content = m["content"] if isinstance(m["content"], list) else []
        for block in content:
            if block.get("type") == "tool_use":
                issued.add(block["id"])
            if block.get("type") == "tool_result":
                assert block["tool_use_id"] in issued, "tool_result separated from its tool_use"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_messages_route_compacts_a_tool_using_conversation(tmp_path: Path, stream: bool) -> None:
    with ScriptedUpstream() as up:
        with ProxyProcess(
            tmp_path,
            up.base_url,
            compaction=INLINE,
        ) as px:
            client = anthropic.Anthropic(base_url=px.root, api_key="sk-ant-test", max_retries=0)
            sent = _drive(client, 30, stream)
        received = [r for r in up.requests if r.path == "/v1/messages" and r.purpose is None]
        forwarded = [r.json for r in received]
        assert len(forwarded) == len(sent)
        # The client's credential reaches the upstream as the client sent it.
        sent_key = received[-1].headers.get("x-api-key") or received[-1].headers["authorization"]
        assert sent_key.endswith("sk-ant-test")
        summaries = 0
        for client_msgs, body in zip(sent, forwarded, strict=True):
            assert _plain(body["system"]) == SYSTEM, "system prompt changed"
            msgs = [{**m, "content": strip_marks(m["content"])} for m in body["messages"]]
            # User and assistant turns alternate: the summary is a block of one user turn,
            # after the pins (the task first, verbatim) and before the first kept user turn.
            roles = [m["role"] for m in msgs]
            assert all(a != b for a, b in zip(roles, roles[1:], strict=False)), roles
            expected = [{**m, "content": _plain(m["content"])} for m in client_msgs]
            blocks = msgs[0]["content"] if isinstance(msgs[0]["content"], list) else []
            at = [
                n for n, b in enumerate(blocks) if str(b.get("text", "")).startswith(SUMMARY_PREFIX)
            ]
            tail = [{**m, "content": _plain(m["content"])} for m in msgs]
            if at:
                summaries += 1
                assert _plain(blocks[: at[0]][:1]) == expected[0]["content"], "task not first"
                rest = blocks[at[0] + 1 :]
                tail = tail[1:]
                if rest:
                    tail.insert(0, {"role": "user", "content": _plain(rest)})
            # Verbatim up to cache marks (and a one-block list vs its string, the same thing).
            assert tail == expected[len(expected) - len(tail) :], "recent turns not verbatim"
            first = tail[0]
            assert first["role"] in ("user", "assistant")  # a turn, or a cut between rounds
            assert not (
                isinstance(first["content"], list)
                and any(b.get("type") == "tool_result" for b in first["content"])
            )
            _assert_tool_pairs(tail)
            marks = orjson.dumps(body).count(b'"cache_control"')
            assert 1 <= marks <= 4, "Anthropic breakpoints: at least the system, at most 4"
        assert summaries >= 10
        last = forwarded[-1]
        last_msgs = [{**m, "content": _plain(m["content"])} for m in last["messages"]]
        assert _tokens(SYSTEM, last_msgs) <= 0.4 * _tokens(SYSTEM, sent[-1])
        assert_facts_present(last_msgs)
        # Claude's prices: the summarizer is asked in the client's own shape, its prefix read
        # from the conversation's cache (tests/test_shared_summary.py checks the calls).
        shared = [r for r in up.requests if r.path == "/v1/messages" and r.purpose == "summarizer"]
        assert shared, "the summarizer call read the conversation's cache"
        assert up.rejections == []


def test_messages_route_errors_are_anthropic_shaped(tmp_path: Path) -> None:
    with ScriptedUpstream() as up, ProxyProcess(tmp_path, up.base_url) as px:
        r = httpx.post(
            f"{px.base_url}/messages",
            content=b"{nope",
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        r = httpx.post(f"{px.base_url}/messages", json={"model": MODEL, "messages": []})
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
        client = anthropic.Anthropic(base_url=px.root, api_key="k", max_retries=0)
        with pytest.raises(anthropic.RateLimitError):
            client.messages.create(
                model=MODEL,
                max_tokens=10,
                messages=[{"role": "user", "content": "hi"}],
                extra_headers={"x-test-status": "429"},
            )
        # A client that sets its own cache marks is never touched.
        own = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}
                ],
            }
        ]
        client.messages.create(model=MODEL, max_tokens=10, system=SYSTEM, messages=own)
        last = [r for r in up.requests if r.path == "/v1/messages"][-1].json
        assert last["messages"] == own and last["system"] == SYSTEM
