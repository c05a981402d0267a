"""The proxy as users run it: a real process, the official openai client, a recording upstream.

Asserted on what the upstream received (DESIGN §4-§5, the proxy issue's acceptance list).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.checks import (
    LOW_TRIGGER,
    assert_facts_present,
    assert_forwarded_faithful,
    assert_prefix_stable,
    summary_index,
    text,
    tokens,
)
from tests.conversations import adrive_conversation, drive_conversation
from tests.proxyproc import ProxyProcess
from tests.upstream import ScriptedUpstream

SYSTEM = "You are a careful coding assistant for the billing service."
COMPACTION = LOW_TRIGGER
MODEL = "gpt-4o-mini"


@pytest.fixture(scope="module")
def upstream() -> Any:
    with ScriptedUpstream() as up:
        yield up


def _message_dict(message: Any) -> dict[str, Any]:
    return message if isinstance(message, dict) else message.model_dump(exclude_none=True)


def _stream_to_message(stream: Any) -> dict[str, Any]:
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    usage_chunks = 0
    for chunk in stream:
        if chunk.usage is not None:
            usage_chunks += 1
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content.append(delta.content)
            for tc in delta.tool_calls or []:
                slot = calls.setdefault(
                    tc.index,
                    {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                )
                if tc.id:
                    slot["id"] = tc.id
                if tc.function and tc.function.name:
                    slot["function"]["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot["function"]["arguments"] += tc.function.arguments
    assert usage_chunks == 0, "a usage chunk the client did not ask for leaked through"
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def _check_run(
    upstream: ScriptedUpstream,
    sent: list[list[dict[str, Any]]],
    headers: list[dict[str, str]],
    start_index: int,
) -> None:
    forwarded = [r.json["messages"] for r in upstream.chat_requests()[start_index:]]
    assert len(forwarded) == len(sent)
    for client_msgs, fwd in zip(sent, forwarded, strict=True):
        assert_forwarded_faithful(client_msgs, fwd)
    assert tokens(forwarded[-1]) <= 0.4 * tokens(sent[-1]), (
        f"last turn forwarded {tokens(forwarded[-1])} of {tokens(sent[-1])} tokens"
    )
    assert_facts_present(forwarded[-1])
    assert assert_prefix_stable(forwarded) >= 5
    assert len(upstream.chat_requests("summarizer")) >= 2
    for h in headers:
        assert h["x-compaction-case"] in {"none", "summarize", "truncate", "emergency"}
        assert int(h["x-compaction-original-tokens"]) >= int(h["x-compaction-forwarded-tokens"])
    assert any(h["x-compaction-case"] == "summarize" for h in headers)


@pytest.mark.parametrize("mode", ["inline", "background"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_sync_client_long_tool_conversation(
    upstream: ScriptedUpstream, tmp_path: Path, mode: str, stream: bool
) -> None:
    upstream.reset()
    with ProxyProcess(tmp_path, upstream.base_url, compaction={**COMPACTION, "mode": mode}) as px:
        client = openai.OpenAI(base_url=px.base_url, api_key="sk-user-one", max_retries=0)
        sent: list[list[dict[str, Any]]] = []
        headers: list[dict[str, str]] = []

        def send(messages: list[dict[str, Any]]) -> dict[str, Any]:
            sent.append(messages)
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, stream=stream
            )
            headers.append(dict(raw.headers))
            parsed = raw.parse()
            return (
                _stream_to_message(parsed) if stream else _message_dict(parsed.choices[0].message)
            )

        final = drive_conversation(send, 40, SYSTEM)
        assert sum(1 for m in final if m["role"] == "user") == 40
        assert any(m.get("tool_calls") for m in final)
        _check_run(upstream, sent, headers, 0)


@pytest.mark.parametrize("mode", ["inline", "background"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_async_client_long_tool_conversation(
    upstream: ScriptedUpstream, tmp_path: Path, mode: str, stream: bool
) -> None:
    upstream.reset()
    with ProxyProcess(tmp_path, upstream.base_url, compaction={**COMPACTION, "mode": mode}) as px:
        sent: list[list[dict[str, Any]]] = []
        headers: list[dict[str, str]] = []

        async def run() -> list[dict[str, Any]]:
            client = openai.AsyncOpenAI(base_url=px.base_url, api_key="sk-user-one", max_retries=0)

            async def asend(messages: list[dict[str, Any]]) -> dict[str, Any]:
                sent.append(messages)
                raw = await client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=messages, stream=stream
                )
                headers.append(dict(raw.headers))
                parsed = raw.parse()
                if not stream:
                    return _message_dict(parsed.choices[0].message)
                chunks = [c async for c in parsed]
                return _stream_to_message(chunks)

            try:
                return await adrive_conversation(asend, 40, SYSTEM)
            finally:
                await client.close()

        asyncio.run(run())
        _check_run(upstream, sent, headers, 0)


def px_wait_for(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


def _run_plain(px: ProxyProcess, api_key: str = "sk-user-one") -> list[dict[str, Any]]:
    client = openai.OpenAI(base_url=px.base_url, api_key=api_key, max_retries=0)

    def send(messages: list[dict[str, Any]]) -> Any:
        return _message_dict(
            client.chat.completions.create(model=MODEL, messages=messages).choices[0].message
        )

    return drive_conversation(send, 30, SYSTEM)


def test_edited_early_message_never_gets_a_stale_summary(
    upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    upstream.reset()
    with ProxyProcess(
        tmp_path, upstream.base_url, compaction={**COMPACTION, "mode": "inline"}
    ) as px:
        final = _run_plain(px)
        assert summary_index(upstream.chat_requests()[-1].json["messages"]) is not None
        assert "OPS-4821" in final[1]["content"]
        edited = [dict(m) for m in final]
        edited[1]["content"] = edited[1]["content"].replace("OPS-4821", "OPS-9999")
        edited.append({"role": "user", "content": "Which ticket are we on?"})
        client = openai.OpenAI(base_url=px.base_url, api_key="sk-user-one", max_retries=0)
        client.chat.completions.create(model=MODEL, messages=edited)
        forwarded = upstream.chat_requests()[-1].json["messages"]
        assert "OPS-4821" not in text(forwarded), "stale summary applied to an edited history"
        assert "OPS-9999" in text(forwarded)
        assert_forwarded_faithful(edited, forwarded)


def test_second_api_key_never_reuses_the_first_keys_records(
    upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    upstream.reset()
    with ProxyProcess(
        tmp_path,
        upstream.base_url,
        # A high emergency factor: the second key's request must not be compacted inline,
        # so what it forwards shows whether the first key's record was reused.
        compaction={**COMPACTION, "mode": "background", "emergency_factor": 20.0},
    ) as px:
        final = _run_plain(px, api_key="sk-user-one")
        final.append({"role": "user", "content": "One more question."})
        first = openai.OpenAI(base_url=px.base_url, api_key="sk-user-one", max_retries=0)
        first.chat.completions.create(model=MODEL, messages=final)
        assert summary_index(upstream.chat_requests()[-1].json["messages"]) is not None
        summaries_before = len(upstream.chat_requests("summarizer"))

        second = openai.OpenAI(base_url=px.base_url, api_key="sk-user-two", max_retries=0)
        raw = second.chat.completions.with_raw_response.create(model=MODEL, messages=final)
        forwarded = upstream.chat_requests()[-1].json["messages"]
        assert forwarded == final, "another key's compaction record was reused"
        assert raw.headers["x-compaction-case"] == "none"
        assert upstream.chat_requests()[-1].headers["authorization"] == "Bearer sk-user-two"
        # The second key's own background compaction starts from scratch. (Told apart by the
        # key its calls carry: the first key's background compaction may still be calling.)
        def seconds() -> list[Any]:
            calls = upstream.chat_requests("summarizer")[summaries_before:]
            return [r for r in calls if r.headers.get("authorization") == "Bearer sk-user-two"]

        px_wait_for(lambda: bool(seconds()))
        summary_request = seconds()[-1].body.decode()
        assert "EARLIER SUMMARY" not in summary_request
        assert "[History Summary" not in summary_request
