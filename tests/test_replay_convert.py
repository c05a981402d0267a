"""The Claude Code converter of the replay corpus (``tests/replay/convert.claude_code``).

Claude Code writes one record per content block and runs a call while its message still
streams, so a message's later calls come between the results of its earlier ones; what the
API got is one assistant message with every call, then their results. The converter must
give that, keep only the main chain up to the client's own compaction, and drop what no
request carried.
"""

from __future__ import annotations

from typing import Any

from tests.replay.convert import LIMIT, claude_code
from tests.replay.fixtures import CUT

SOURCE = {"repo": "r", "path": "p", "commit": "c", "license": "MIT"}


def user(content: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "user", "message": {"role": "user", "content": content}, **extra}


def assistant(mid: str, *blocks: dict[str, Any], **extra: Any) -> dict[str, Any]:
    message = {"id": mid, "role": "assistant", "model": "claude-opus-4-6", "content": list(blocks)}
    return {"type": "assistant", "version": "2.1.39", "message": message, **extra}


def call(cid: str, command: str = "ls") -> dict[str, Any]:
    return {"type": "tool_use", "id": cid, "name": "Bash", "input": {"command": command}}


def result(cid: str, content: Any = "ok", **extra: Any) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": cid, "content": content, **extra}


def test_a_message_streamed_between_its_results_is_one_turn() -> None:
    lines = [
        {"type": "progress", "data": {}},
        user("Fix the bug."),
        assistant("m1", {"type": "text", "text": "Looking."}),
        assistant("m1", call("a")),
        user([result("a", [{"type": "text", "text": "x" * (LIMIT + 1)}])]),
        assistant("m2", call("b")),
        assistant("m2", call("c")),
        user([result("b")]),  # b's result before m2's third call
        assistant("m2", call("d", "git diff")),
        user([result("c", is_error=True)]),
        user([result("d"), {"type": "text", "text": "[Request interrupted by user]"}]),
        assistant("side", call("s"), isSidechain=True),  # a subagent's: not the main chain
        user([result("s")], isSidechain=True),
        assistant("err", {"type": "text", "text": "API Error"}, isApiErrorMessage=True),
        assistant("m3", {"type": "thinking", "thinking": "hmm", "signature": "REDACTED"}),
        assistant("m3", {"type": "text", "text": "Done."}, call("e")),  # answered too late
        {"type": "system", "subtype": "compact_boundary", "compactMetadata": {"preTokens": 9}},
        user("This session is being continued..."),
        user([result("e")]),
    ]
    run = claude_code(lines, SOURCE)
    assert (run["agent"], run["agent_version"], run["model"]) == (
        "claude-code", "2.1.39", "claude-opus-4-6",
    )  # fmt: skip
    shape = [
        (t["role"], [c["id"] for c in t.get("tool_calls") or []] or t.get("tool_call_id"))
        for t in run["turns"]
    ]
    assert shape == [
        ("user", None),
        ("assistant", ["a"]),
        ("tool", "a"),
        ("assistant", ["b", "c", "d"]),
        ("tool", "b"),
        ("tool", "c"),
        ("tool", "d"),
        ("user", None),
        ("assistant", None),  # the call answered after the boundary dropped, its text kept
    ]
    turns = run["turns"]
    assert turns[1]["text"] == "Looking." and turns[-1]["text"] == "Done."
    assert turns[-1]["thinking"] is None  # no valid signature in a transcript
    assert CUT.search(turns[2]["output"]) and turns[5]["is_error"] and not turns[4]["is_error"]
    assert turns[7]["text"] == "[Request interrupted by user]"
    assert run["system"] == "" and run["source"] == SOURCE


def test_a_text_merged_from_records_is_cut_once_with_its_whole_length() -> None:
    part = "y" * 1_000
    lines = [user("Go."), *(assistant("m", {"type": "text", "text": part}) for _ in range(3))]
    run = claude_code(lines, SOURCE)
    text = run["turns"][1]["text"]
    assert CUT.search(text) and text.endswith(f"[…cut: {3 * 1_000 + 2 * 2} chars]")


def test_the_part_after_the_clients_compaction_opens_with_its_summary() -> None:
    boundary = {"type": "system", "subtype": "compact_boundary", "compactMetadata": {}}
    summary = "This session is being continued from a previous conversation."
    lines = [
        user("Fix the bug."),
        assistant("m1", call("a")),
        user([result("a")]),
        boundary,
        user(summary, isCompactSummary=True),
        assistant("m2", {"type": "text", "text": "Going on."}, call("b")),
        user([result("b")]),
        assistant("m3", call("c")),  # answered only after the next compaction: dropped
        boundary,
        user([result("c")]),
        assistant("m4", {"type": "text", "text": "Third part."}),
    ]
    first = [t["role"] for t in claude_code(lines, SOURCE)["turns"]]
    assert first == ["user", "assistant", "tool"]
    turns = claude_code(lines, SOURCE, part=1)["turns"]
    assert [t["role"] for t in turns] == ["user", "assistant", "tool"]
    assert turns[0]["text"] == summary
    assert [c["id"] for c in turns[1]["tool_calls"]] == ["b"] and turns[2]["tool_call_id"] == "b"
