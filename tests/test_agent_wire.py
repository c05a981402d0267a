"""What coding agents send, through a real proxy process, against the strict upstream.

Mid-conversation system messages, the summary joined to a user turn, client cache marks on
tools, reasoning items and thinking blocks. Official clients (openai, anthropic) on real
sockets. (The rest of the wire: tests/test_proxy_wire.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import openai
import orjson
import pytest

from proxy.core.tokens import TokenCounter
from tests.checks import INLINE
from tests.conversations import take_responses_output, tool_result, user_turns
from tests.proxyproc import ProxyProcess
from tests.strict import count_cache_control
from tests.upstream import ScriptedUpstream, default_reply

CLAUDE = "claude-sonnet-4-5-20250929"
SYSTEM = "You are a careful coding assistant for the billing service."
REMINDER = "<system-reminder>The user's CLAUDE.md says: run the tests.</system-reminder>"
SUMMARY_PREFIX = "[History Summary - "
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _anthropic_session(
    client: anthropic.Anthropic,
    turns: int,
    *,
    system_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> list[list[dict[str, Any]]]:
    """A tool-using Messages conversation; returns what was sent each time."""
    messages: list[dict[str, Any]] = []
    sent = []
    for n, text in enumerate(user_turns(turns)):
        messages.append({"role": "user", "content": text})
        if system_message and n == 0:
            # Claude Code sends a system message as messages[1].
            messages.append({"role": "system", "content": REMINDER})
        for _ in range(5):
            sent.append(list(messages))
            kwargs: dict[str, Any] = dict(
                model=CLAUDE, max_tokens=512, system=SYSTEM, messages=messages
            )
            if tools:
                kwargs["tools"] = tools
            reply = client.messages.create(**kwargs)
            blocks = [b.model_dump(exclude_none=True) for b in reply.content]
            messages.append({"role": "assistant", "content": blocks})
            uses = [b for b in blocks if b["type"] == "tool_use"]
            if not uses:
                break
            results = []
            for b in uses:
                call = {"function": {"name": b["name"], "arguments": orjson.dumps(b["input"])}}
                results.append(
                    {"type": "tool_result", "tool_use_id": b["id"], "content": tool_result(call)}
                )
            messages.append({"role": "user", "content": results})
    return sent


def _joined_summary(message: dict[str, Any]) -> bool:
    """Whether our summary is a block of this user turn (after the pins, the task first)."""
    blocks = message["content"] if isinstance(message["content"], list) else []
    return any(str(b.get("text", "")).startswith(SUMMARY_PREFIX) for b in blocks)


def _forwarded_messages(up: ScriptedUpstream) -> list[dict[str, Any]]:
    return [r.json for r in up.requests if r.path == "/v1/messages" and r.purpose is None]


def test_claude_code_system_message_is_accepted_and_forwarded_in_place(tmp_path: Path) -> None:
    with ScriptedUpstream() as up, ProxyProcess(tmp_path, up.base_url, compaction=INLINE) as px:
        client = anthropic.Anthropic(base_url=px.root, api_key="sk-ant", max_retries=0)
        sent = _anthropic_session(client, 16, system_message=True)
        forwarded = _forwarded_messages(up)
    assert len(forwarded) == len(sent)
    compacted = 0
    for client_msgs, body in zip(sent, forwarded, strict=True):
        msgs = body["messages"]
        if _joined_summary(msgs[0]):
            compacted += 1
            # Pinned: forwarded in place, after the task and summary's joined user turn.
            assert {"role": "system", "content": REMINDER} in msgs
        else:
            # Not compacted: the system message is where the client put it.
            assert msgs[1] == {"role": "system", "content": REMINDER}
            assert len(msgs) == len(client_msgs)
        # Never a cut point: what is kept starts at a user turn.
        assert msgs[0]["role"] == "user"
    assert compacted, "the conversation never compacted"
    assert up.rejections == []


def test_forwarded_token_count_is_what_was_forwarded_after_the_summary_joins(
    tmp_path: Path,
) -> None:
    counter = TokenCounter()
    with ScriptedUpstream() as up, ProxyProcess(tmp_path, up.base_url, compaction=INLINE) as px:
        client = anthropic.Anthropic(base_url=px.root, api_key="sk-ant", max_retries=0)
        messages: list[dict[str, Any]] = []
        reported = []
        for n, text in enumerate(user_turns(14)):
            messages.append({"role": "user", "content": text.replace("[[tool:", "[[no-tool:")})
            raw = client.messages.with_raw_response.create(
                model=CLAUDE, max_tokens=100, system=SYSTEM, messages=messages
            )
            reported.append(int(raw.headers["x-compaction-forwarded-tokens"]))
            messages.append({"role": "assistant", "content": f"Noted step {n}."})
        forwarded = _forwarded_messages(up)
    joined = 0
    for body, tokens in zip(forwarded, reported, strict=True):
        view = [{"role": "system", "content": body["system"]}, *body["messages"]]
        assert tokens == counter.count_total(view, CLAUDE)
        joined += _joined_summary(body["messages"][0])
    assert joined, "no compaction"
    assert up.rejections == []


def test_client_cache_mark_on_tools_counts_towards_the_four(tmp_path: Path) -> None:
    tools = [
        {"name": "read_file", "description": "read", "input_schema": {"type": "object"}},
        {
            "name": "run_tests",
            "description": "run",
            "input_schema": {"type": "object"},
            "cache_control": {"type": "ephemeral"},  # Anthropic's documented pattern
        },
    ]
    with ScriptedUpstream() as up, ProxyProcess(tmp_path, up.base_url, compaction=INLINE) as px:
        client = anthropic.Anthropic(base_url=px.root, api_key="sk-ant", max_retries=0)
        _anthropic_session(client, 14, tools=tools)
        forwarded = _forwarded_messages(up)
    marks = [sum(count_cache_control(b.get(k)) for k in ("tools", "system", "messages"))
             for b in forwarded]  # fmt: skip
    assert max(marks) == 4, marks  # ours were added, within the limit
    assert all(m <= 4 for m in marks)
    assert up.rejections == []


def _responses_session(
    client: openai.OpenAI, turns: int, stream: bool = False
) -> list[list[dict[str, Any]]]:
    items: list[dict[str, Any]] = []
    sent = []
    for text in user_turns(turns):
        items.append({"role": "user", "content": text})
        for _ in range(5):
            sent.append(list(items))
            kwargs: dict[str, Any] = dict(
                model="gpt-5",
                instructions=SYSTEM,
                input=items,
                include=["reasoning.encrypted_content"],
            )
            if stream:
                response = [e for e in client.responses.create(stream=True, **kwargs)][-1].response
            else:
                response = client.responses.create(**kwargs)
            output = [o.model_dump(exclude_none=True) for o in response.output]
            if not take_responses_output(items, output):
                break
    return sent


PRIVATE = "PRIVATE-PLAN"


def _reasoning_reply(request: dict[str, Any]) -> dict[str, Any]:
    """The default reply, thought about first (a reasoning item / thinking block)."""
    turn = len(request.get("messages") or [])
    return {**default_reply(request), "reasoning": f"{PRIVATE}-{turn}: check src/secret_{turn}.py"}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_reasoning_items_stay_opaque_and_attached(tmp_path: Path, stream: bool) -> None:
    with ScriptedUpstream(reply=_reasoning_reply) as up:
        with ProxyProcess(tmp_path, up.base_url, compaction=INLINE) as px:
            client = openai.OpenAI(base_url=px.base_url, api_key="sk-test", max_retries=0)
            sent = _responses_session(client, 16, stream)
        forwarded = [r.json for r in up.requests if r.path == "/v1/responses" and r.purpose is None]
        internal = up.chat_requests("summarizer") + up.chat_requests("detector")
    secrets = {i["encrypted_content"] for s in sent for i in s if i.get("type") == "reasoning"}
    ids = {i["id"] for s in sent for i in s if i.get("type") == "reasoning"}
    assert secrets and up.chat_requests("summarizer"), "no reasoning or no compaction"
    # Encrypted reasoning in the history: no summarizer call in the client's shape, which
    # would show it to the model (sharedcall.hides_reasoning).
    assert not [r for r in up.summarizer_calls() if r.path == "/v1/responses" and r.purpose is None]
    shortened = 0
    for client_items, body in zip(sent, forwarded, strict=True):
        items = body["input"]
        shortened += len(items) < len(client_items)
        # Every forwarded reasoning item still has the item it produced right after it.
        for i, item in enumerate(items):
            if item.get("type") == "reasoning":
                assert items[i + 1].get("role", "assistant") == "assistant"
                assert items[i + 1].get("type") in ("message", "function_call")
    assert shortened
    for r in internal:
        blob = r.body.decode()
        assert PRIVATE not in blob and "secret_" not in blob, "reasoning reached the summarizer"
        assert not any(s[:24] in blob for s in secrets), "reasoning reached the summarizer"
        assert not any(rid in blob for rid in ids), "reasoning ids reached the summarizer"
    for body in forwarded:
        for item in body["input"]:
            text = orjson.dumps(item).decode()
            if SUMMARY_PREFIX in text:
                assert "rs_" not in text and "secret_" not in text
    assert up.rejections == []


def test_thinking_blocks_stay_opaque(tmp_path: Path) -> None:
    with ScriptedUpstream(reply=_reasoning_reply) as up:
        with ProxyProcess(tmp_path, up.base_url, compaction=INLINE) as px:
            client = anthropic.Anthropic(base_url=px.root, api_key="sk-ant", max_retries=0)
            sent = _anthropic_session(client, 14)
        internal = up.chat_requests("summarizer") + up.chat_requests("detector")
        forwarded = _forwarded_messages(up)
        shared = [r for r in up.summarizer_calls() if r.path == "/v1/messages"]
    assert any(
        b.get("type") == "thinking"
        for m in sent[-1]
        if isinstance(m["content"], list)
        for b in m["content"]
    )
    assert up.summarizer_calls(), "no compaction"
    # The standalone calls' transcripts never show thinking.
    for r in internal:
        assert PRIVATE not in r.body.decode() and "secret_" not in r.body.decode()
    # The call in the client's shape carries the thinking blocks as the client's requests do
    # (the client has read them; the provider requires them, signatures and all).
    client_blocks = {orjson.dumps(b) for s in sent for m in s if isinstance(m["content"], list)
                     for b in m["content"] if b.get("type") == "thinking"}  # fmt: skip
    for r in shared:
        for m in r.json["messages"]:
            for b in m["content"] if isinstance(m["content"], list) else []:
                if b.get("type") == "thinking":
                    assert orjson.dumps(b) in client_blocks, "a thinking block was altered"
    summaries = [
        b["text"]
        for body in forwarded
        for b in body["messages"][0]["content"]
        if isinstance(b, dict) and b.get("text", "").startswith(SUMMARY_PREFIX)
    ]
    assert summaries and not any("secret_" in t or "gAAAAB" in t for t in summaries)
    assert up.rejections == []
