"""A request's tool schemas are counted once per distinct set (#28): the token count
(``TokenCounter.count_json``, behind ``reserve_tokens``) and Anthropic's cache marks outside
the messages (``tool_cache_marks``) give what counting them afresh gives."""

from __future__ import annotations

import orjson

from proxy.core import tokens
from proxy.core.surfaces import ANTHROPIC_MESSAGES, count_cache_marks, tool_cache_marks
from proxy.core.tokens import TokenCounter
from proxy.engine.chat import WrittenOnce, reserve_tokens

MARK = {"type": "ephemeral"}


def tools(n: int, marked: int = -1) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for i in range(n):
        tool: dict[str, object] = {
            "name": f"tool_{i}",
            "description": f"Does thing number {i} to the repository. " * (i + 1),
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
        }
        if i == marked:
            tool["cache_control"] = MARK
        out.append(tool)
    return out


def test_remembered_counts_are_the_counts_of_the_text() -> None:
    counter = TokenCounter()
    for model in ("gpt-4o", "gpt-4", "claude-sonnet-4-5", "no-such-model-anywhere"):
        for n in (1, 5, 12):
            raw = orjson.dumps(tools(n))
            fresh = counter.count_text(raw.decode(), model)
            assert fresh > 0
            assert counter.count_json(raw, model) == fresh  # first sight
            assert counter.count_json(raw, model) == fresh  # remembered
    # The same bytes under another encoding are counted for that encoding.
    raw = orjson.dumps(tools(5))
    assert counter.count_json(raw, "gpt-4o") == counter.count_text(raw.decode(), "gpt-4o")
    assert counter.count_json(raw, "gpt-4") == counter.count_text(raw.decode(), "gpt-4")


def test_the_memory_of_tool_counts_is_bounded() -> None:
    counter = TokenCounter()
    for i in range(tokens._TEXT_MEMO + 10):
        counter.count_json(orjson.dumps([{"name": f"t{i}"}]), "gpt-4o")
    assert len(counter._texts) <= tokens._TEXT_MEMO


def test_reserve_tokens_counts_the_schemas_and_the_reply() -> None:
    counter = TokenCounter()
    body = {"model": "gpt-4o", "tools": tools(4), "max_tokens": 100}
    expected = counter.count_text(orjson.dumps(body["tools"]).decode(), "gpt-4o") + 100
    assert reserve_tokens(body, counter) == expected
    assert reserve_tokens(body, counter) == expected
    # The tools' JSON made once by the caller (``describe``) counts the same.
    assert reserve_tokens(body, counter, orjson.dumps(body["tools"])) == expected


def test_tool_cache_marks_are_count_cache_marks() -> None:
    mentions = tools(3)
    mentions[1]["description"] = 'Never set "cache_control" yourself.'
    nested = tools(2)
    nested[0]["input_schema"] = {"cache_control": MARK, "type": "object"}
    cases = [None, [], tools(6), tools(6, marked=5), mentions, nested, tools(3, marked=0)]
    for case in cases:
        assert tool_cache_marks(case) == count_cache_marks(case)
        body = {"tools": case} if case is not None else {}
        assert ANTHROPIC_MESSAGES.outside_cache_marks(body) == count_cache_marks(case)
        made = orjson.dumps(case) if case else None  # as ``describe`` passes it on
        assert ANTHROPIC_MESSAGES.outside_cache_marks(body, made) == count_cache_marks(case)
    assert tool_cache_marks(tools(6, marked=5)) == 1
    assert tool_cache_marks(nested) == 1


def test_the_tools_json_is_written_once_per_object_and_bounded() -> None:
    written = WrittenOnce(size=2)
    first = tools(3)
    made = written(first)
    assert made == orjson.dumps(first)
    assert written(first) is made  # the same object: the bytes written for it
    equal = tools(3)
    assert written(equal) == made and written(equal) is not made  # another object: written
    third = tools(1)
    assert written(third) == orjson.dumps(third)
    assert written(first) is not made  # pushed out by the two since: written again
    assert len(written._made) == 2
    # Each entry holds its object, so no later object can take its id meanwhile.
    assert written._made[id(first)][0] is first
