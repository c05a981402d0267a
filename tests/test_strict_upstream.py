"""The strict scripted upstream rejects what the real providers reject, in their 400 shape."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

from tests.strict import check_chat, check_messages, check_responses
from tests.upstream import ScriptedUpstream

CALL = {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": "{}"}}
USE = {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}
REASONING = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"}


def _chat(*messages: dict[str, Any]) -> str | None:
    return check_chat({"model": "m", "messages": list(messages)})


def _anthropic(*messages: dict[str, Any], **extra: Any) -> str | None:
    return check_messages({"model": "m", "max_tokens": 5, "messages": list(messages), **extra})


def _responses(*items: dict[str, Any]) -> str | None:
    return check_responses({"model": "m", "input": list(items)})


U = {"role": "user", "content": "hi"}
A = {"role": "assistant", "content": "hello"}


def test_chat_tool_pairing() -> None:
    calls = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    answer = {"role": "tool", "tool_call_id": "call_1", "content": "ok"}
    assert _chat(U, calls, answer, A, U) is None
    assert "tool" in str(_chat(U, answer, A))  # a result without its call
    assert "Missing: call_1" in str(_chat(U, calls, U))  # a call without its result
    assert "Missing" in str(_chat(U, calls))  # ... also at the end
    assert _chat(U, calls, A, answer) is not None  # the result must follow the call
    assert _chat(U, calls, answer, answer) is not None  # answered twice
    assert _chat(U, {"role": "assistant", "content": None}) is not None  # empty assistant
    assert _chat({"role": "user", "content": []}) is not None  # empty content array


def test_anthropic_rules() -> None:
    use = {"role": "assistant", "content": [USE]}
    result = {"role": "user", "content": [RESULT]}
    assert _anthropic(U, use, result, A, U) is None
    assert "tool_use" in str(_anthropic(U, use, U))  # tool_use without its result
    assert "tool_result" in str(_anthropic(U, A, result))  # result without its tool_use
    assert "alternate" in str(_anthropic(U, U))  # two user turns
    assert "alternate" in str(_anthropic(U, A, A, U))
    assert check_messages({"messages": [U, U]}, alternation=False) is None
    assert "first message" in str(_anthropic(A, U))
    assert "non-empty" in str(_anthropic({"role": "user", "content": ""}))
    empty_block = {"role": "user", "content": [{"type": "text", "text": ""}]}
    assert "non-empty" in str(_anthropic(empty_block))
    assert _anthropic(U, {"role": "assistant", "content": ""}) is None  # prefill may be empty
    # A system message inside messages (Claude Code) takes no part in alternation.
    system = {"role": "system", "content": "reminder"}
    assert _anthropic(U, system, A, U) is None
    mark = {"cache_control": {"type": "ephemeral"}}
    marked = {"role": "user", "content": [{"type": "text", "text": "x", **mark}]}
    tools = [{"name": f"t{i}", "input_schema": {}, **mark} for i in range(2)]
    system_blocks = [{"type": "text", "text": "s", **mark}]
    assert _anthropic(marked, tools=tools, system=system_blocks) is None  # 4 marks
    five = _anthropic(marked, A, marked, tools=tools, system=system_blocks)
    assert "maximum of 4" in str(five)
    # Thinking blocks have no cache_control in the API's schema (and must come back as sent).
    for block in ({"type": "thinking", "thinking": "t", "signature": "s"},
                  {"type": "redacted_thinking", "data": "d"}):  # fmt: skip
        cut = {"role": "assistant", "content": [block]}  # a reply cut while thinking
        assert _anthropic(U, cut, U) is None
        refused = _anthropic(U, {"role": "assistant", "content": [{**block, **mark}]}, U)
        assert "messages.1.content.0" in str(refused) and "cache_control" in str(refused)


def test_responses_rules() -> None:
    user = {"role": "user", "content": "hi"}
    text = [{"type": "output_text", "text": "ok"}]
    message = {"type": "message", "role": "assistant", "content": text}
    call = {"type": "function_call", "call_id": "c1", "name": "read", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "ok"}
    assert _responses(user, REASONING, message, user) is None
    assert _responses(user, REASONING, call, output) is None
    assert "reasoning" in str(_responses(user, REASONING))  # nothing after it
    assert "reasoning" in str(_responses(user, REASONING, user))
    assert "No tool output" in str(_responses(user, call))
    assert "No tool call" in str(_responses(user, output))
    assert _responses({"role": "user", "content": ""}) is not None
    assert check_responses({"input": "plain text"}) is None


def test_rejections_come_in_the_providers_shape_and_are_recorded() -> None:
    with ScriptedUpstream(expect_rejections=True) as up:
        oa = openai.OpenAI(base_url=up.base_url, api_key="k", max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            oa.chat.completions.create(
                model="m", messages=[U, {"role": "tool", "tool_call_id": "x", "content": "r"}]
            )
        assert err.value.body["type"] == "invalid_request_error"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError):
            oa.responses.create(model="m", input=[U, REASONING])  # type: ignore[list-item]
        an = anthropic.Anthropic(base_url=up.base_url[:-3], api_key="k", max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as aerr:
            an.messages.create(model="m", max_tokens=5, messages=[U, U])  # type: ignore[list-item]
        assert aerr.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        assert [r["path"] for r in up.rejections] == [
            "/v1/chat/completions",
            "/v1/responses",
            "/v1/messages",
        ]
    # Leaving the block with rejections nobody expected fails the test.
    with pytest.raises(AssertionError, match="rejected"):
        with ScriptedUpstream() as up:
            oa = openai.OpenAI(base_url=up.base_url, api_key="k", max_retries=0)
            with pytest.raises(openai.BadRequestError):
                oa.chat.completions.create(model="m", messages=[{"role": "user", "content": []}])
