"""Assertions shared by the standalone proxy and LiteLLM hook tests: what the upstream got."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.tokens import TokenCounter
from tests.conversations import FACTS

SUMMARY_PREFIX = "[History Summary - "
# The compaction settings the process tests share: small enough that a 30-40 turn scripted
# conversation compacts several times.
LOW_TRIGGER: dict[str, Any] = {
    "trigger_tokens": 4000,
    "verbatim_window_tokens": 1200,
    "summary_budget_tokens": 300,
}
INLINE = {**LOW_TRIGGER, "mode": "inline"}
_counter = TokenCounter()


def tokens(messages: list[dict[str, Any]], model: str = "gpt-4o-mini") -> int:
    return _counter.count_total(messages, model)


def text(messages: list[dict[str, Any]]) -> str:
    return orjson.dumps(messages).decode()


def summary_index(messages: list[dict[str, Any]]) -> int | None:
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, str) and content.startswith(SUMMARY_PREFIX):
            return i
    return None


def assert_tool_calls_intact(messages: list[dict[str, Any]]) -> None:
    """Every assistant tool call is answered right after it; no orphan tool result."""
    issued: set[str] = set()
    for i, m in enumerate(messages):
        if m.get("role") == "tool":
            assert m.get("tool_call_id") in issued, f"orphan tool result at {i}"
        for call in m.get("tool_calls") or []:
            issued.add(call["id"])
            following = [
                x.get("tool_call_id") for x in messages[i + 1 :] if x.get("role") == "tool"
            ]
            assert call["id"] in following, f"tool call {call['id']} separated from its result"


def assert_forwarded_faithful(
    client: list[dict[str, Any]], forwarded: list[dict[str, Any]]
) -> None:
    """System prompt first, then at most one summary, then the client's tail verbatim."""
    assert forwarded[0] == client[0], "system prompt not first/intact"
    s = summary_index(forwarded)
    tail_start = 1 if s is None else s + 1
    if s is not None:
        assert s == 1, "summary must come right after the head"
    tail = forwarded[tail_start:]
    assert tail == client[len(client) - len(tail) :], "recent messages not verbatim"
    assert tail and tail[0]["role"] == "user", "kept part must start at a user turn"
    assert_tool_calls_intact(forwarded)


def assert_facts_present(messages: list[dict[str, Any]]) -> None:
    blob = text(messages)
    for fact in FACTS:
        ident = fact.split(" is ")[-1].rstrip(".").split(" lives at ")[-1]
        assert fact in blob or ident in blob, f"lost planted fact: {fact}"


def assert_prefix_stable(requests: list[list[dict[str, Any]]]) -> int:
    """Between compactions each forwarded request extends the previous one exactly.

    Returns how many consecutive pairs were checked with a summary in place.
    """
    checked = 0
    for before, after in zip(requests, requests[1:], strict=False):
        sb, sa = summary_index(before), summary_index(after)
        if sb is None or sa is None or before[sb] != after[sa]:
            continue  # a compaction happened in between
        assert after[: len(before)] == before, "forwarded prefix changed between compactions"
        assert orjson.dumps(after[: sb + 1]) == orjson.dumps(before[: sb + 1])
        checked += 1
    return checked
