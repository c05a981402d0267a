"""Assertions shared by the standalone proxy and LiteLLM hook tests: what the upstream got."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.core.tokens import TokenCounter
from tests.conversations import FACTS

SUMMARY_PREFIX = "[History Summary - "
# The compaction settings the process tests share: small enough that a 30-40 turn scripted
# conversation compacts several times. At a trigger this low a compaction cannot leave half
# the trigger (the pinned task and two exchanges are more) and never pays for its calls, so
# the money rules of #25 (compact_to_share, the spacing of timing.too_soon, the cost policy)
# would refuse most of them: these tests exercise the mechanics of compaction, with those
# rules off; tests/test_economics.py exercises the rules.
LOW_TRIGGER: dict[str, Any] = {
    "trigger_tokens": 4000,
    "verbatim_window_tokens": 1200,
    "summary_budget_tokens": 300,
    "compact_to_share": 1.0,
    "min_requests_between_compactions": 0,
    "policy": "tokens",
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


def summary_text(messages: list[dict[str, Any]]) -> str | None:
    """The text of the summary message in ``messages`` (None: there is none)."""
    i = summary_index(messages)
    return None if i is None else str(messages[i]["content"])


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


CLEARED = "[tool result cleared by compaction-proxy: "


def same_message(client: dict[str, Any], forwarded: dict[str, Any]) -> bool:
    """The client's message forwarded as it is, or the same tool result pruned."""
    if client == forwarded:
        return True
    return (
        client.get("role") == "tool"
        and forwarded.get("role") == "tool"
        and client.get("tool_call_id") == forwarded.get("tool_call_id")
        and str(forwarded.get("content", "")).startswith(CLEARED)
    )


def assert_forwarded_faithful(
    client: list[dict[str, Any]], forwarded: list[dict[str, Any]]
) -> None:
    """System prompt first; then pins, at most one summary and the client's tail verbatim
    (old tool results possibly pruned): nothing forwarded that the client did not send, in
    the client's order."""
    assert forwarded[0] == client[0], "system prompt not first/intact"
    s = summary_index(forwarded)
    j = 0
    for i, m in enumerate(forwarded):
        if i == s:
            continue
        while j < len(client) and not same_message(client[j], m):
            j += 1
        assert j < len(client), f"forwarded message {i} is not the client's, or out of order"
        j += 1
    if s is not None:
        assert all(m["role"] in ("system", "developer", "user") for m in forwarded[1:s]), (
            "only pins come before the summary"
        )
        after = forwarded[s + 1 :]
        # The client's own tail, verbatim; ahead of it, only whole tool rounds the loop
        # breaker keeps (#26: a call and its results, the client's, in its order - above).
        n = 0
        while n < min(len(after), len(client)) and same_message(client[-1 - n], after[-1 - n]):
            n += 1
        rounds, tail = after[: len(after) - n], after[len(after) - n :]
        assert all(
            m["role"] == "tool" or (m["role"] == "assistant" and m.get("tool_calls"))
            for m in rounds
        ), "recent messages not verbatim"
        assert tail and tail[0]["role"] in ("user", "assistant"), "kept part must start a turn"
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
        if text(before).count(CLEARED) != text(after[: len(before)]).count(CLEARED):
            continue  # a pruning happened in between
        assert after[: len(before)] == before, "forwarded prefix changed between compactions"
        assert orjson.dumps(after[: sb + 1]) == orjson.dumps(before[: sb + 1])
        checked += 1
    return checked
