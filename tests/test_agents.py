"""Agent sessions (DESIGN §10): pruning, cuts between tool rounds, pins, the emergency path.

Pure rules first (``proxy.prune``, ``proxy.pins``, ``proxy.planner``), then the engine
(``proxy.compactor.Compactor`` with the in-process fake LLM) on each surface's shapes.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.adapters.store import DiskStore
from proxy.core import pins, prune
from proxy.core.errors import CompactionFailed
from proxy.core.messages import SUMMARY_PREFIX
from proxy.core.planner import cut_points
from proxy.core.prepared import Prepared
from proxy.core.records import body_start
from proxy.core.settings import CompactionSettings
from proxy.core.surfaces import (
    _messages_from_view,
    _messages_to_view,
    _responses_from_view,
    _responses_to_view,
)
from proxy.core.tokens import TokenCounter
from proxy.engine.compactor import Compactor
from tests.test_compactor import MODEL, PROMPTS, FakeLLM

Message = dict[str, Any]
COUNTER = TokenCounter()
TASK = "Fix the failing tests in src/billing. Always answer in French."
BIG = "line of output with some numbers 12345 and words parser ledger invoice retry\n" * 60


def count(text: str) -> int:
    return COUNTER.count_text(text, MODEL)


def openai_loop(rounds: int, *, parallel: int = 1, output: str = BIG) -> list[Message]:
    """One instruction followed by ``rounds`` tool rounds (OpenAI chat shapes)."""
    msgs: list[Message] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": TASK},
    ]
    for r in range(rounds):
        ids = [f"call_{r}_{j}" for j in range(parallel)]
        msgs.append(
            {
                "role": "assistant",
                "content": f"Step {r}: reading files.",
                "tool_calls": [
                    {
                        "id": i,
                        "type": "function",
                        "function": {
                            "name": "read_file",
                            "arguments": json.dumps({"path": f"src/mod_{r}_{j}.py"}),
                        },
                    }
                    for j, i in enumerate(ids)
                ],
            }
        )
        for i in ids:
            msgs.append({"role": "tool", "tool_call_id": i, "content": f"{i}\n{output}"})
    return msgs


def echo_summary(messages: list[Message]) -> str:
    """A scripted summarizer whose summary is made of the span's own words (the summary checks
    reject a summary that is not about its span)."""
    text = str(messages[-1]["content"])
    lines = [line for line in text.splitlines() if "called tool" in line]
    words = re.findall(r"[A-Za-z]{3,}", " ".join(lines).lower())
    return "The assistant " + " ".join(list(dict.fromkeys(words))[:25]) + "."


def settings(**overrides: Any) -> CompactionSettings:
    base: dict[str, Any] = {
        "policy": "tokens",  # the mechanics of compaction; the money rules: test_economics
        "trigger_tokens": 6000,
        "verbatim_window_tokens": 1500,
        "summary_budget_tokens": 200,
        "prune_protect_tokens": 1500,
        "prune_clear_at_least": 1000,
        "mode": "inline",
    }
    return CompactionSettings(**{**base, **overrides})


def prepare(msgs: list[Message], s: CompactionSettings, tmp: Path, llm: Any = None) -> Prepared:
    async def go() -> Prepared:
        store = DiskStore(tmp / "store")
        try:
            c = Compactor(s, store, llm or FakeLLM(echo_summary), PROMPTS, counter=COUNTER)
            return await c.prepare(msgs, model=MODEL, tenant="t", credential="k")
        finally:
            store.close()

    return asyncio.run(go())


# ---- pruning: the pure rules -----------------------------------------------------------------


def test_prune_clears_old_results_with_a_placeholder_naming_the_call() -> None:
    msgs = openai_loop(8)
    found = prune.plan(msgs, settings(prune_keep_tool_results=3), count)
    results = prune.tool_results(msgs)
    assert found.replacements and found.freed_tokens > 0
    # Never the most recent N, and the newest within the protect window stay.
    for r in results[-3:]:
        assert r.position not in found.replacements
    first = found.replacements[results[0].position]
    assert first["role"] == "tool" and first["tool_call_id"] == results[0].call_id
    assert first["content"].startswith(prune.CLEARED)
    assert "read_file(path=src/mod_0_0.py)" in first["content"]
    assert f"returned {count(results[0].text)} tokens" in first["content"]
    # Deterministic: the same history prunes to the same bytes.
    again = prune.plan(msgs, settings(prune_keep_tool_results=3), count)
    opt = orjson.OPT_NON_STR_KEYS
    assert orjson.dumps(again.replacements, option=opt) == orjson.dumps(
        found.replacements, option=opt
    )
    # Already-cleared results are left alone.
    pruned = [found.replacements.get(i, m) for i, m in enumerate(msgs)]
    assert not prune.plan(pruned, settings(prune_keep_tool_results=3), count).replacements


def test_prune_keeps_excluded_tools_and_the_recent_results() -> None:
    msgs = openai_loop(8)
    everything = prune.plan(msgs, settings(prune_keep_tool_results=8), count)
    assert not everything.replacements  # all 8 are "the most recent 8"
    excluded = prune.plan(msgs, settings(prune_exclude_tools=("read_file",)), count)
    assert not excluded.replacements


def test_prune_repeated_identical_call_keeps_only_the_latest_output() -> None:
    msgs = openai_loop(6, output="some output " * 50)
    # Round 1 and round 4 read the same file: the older output goes even though it is small
    # and inside the protect window.
    msgs[4]["tool_calls"][0]["function"]["arguments"] = json.dumps({"path": "src/same.py"})
    msgs[10]["tool_calls"][0]["function"]["arguments"] = json.dumps({"path": "src/same.py"})
    s = settings(prune_keep_tool_results=1, prune_protect_tokens=10**6)
    found = prune.plan(msgs, s, count)
    assert list(found.replacements) == [5]
    assert "called again later" in found.replacements[5]["content"]


def test_prune_anthropic_blocks_and_responses_items_stay_valid() -> None:
    body = {
        "model": MODEL,
        "max_tokens": 100,
        "system": "sys",
        "messages": [
            {"role": "user", "content": TASK},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "tu1",
                        "name": "bash",
                        "input": {"command": "pytest -x"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "tu1",
                        "content": [{"type": "text", "text": BIG}],
                    },
                    {"type": "text", "text": "<system-reminder>keep going</system-reminder>"},
                ],
            },
            {"role": "assistant", "content": "done"},
        ],
    }
    view = _messages_to_view(body)
    found = prune.plan(view, settings(prune_keep_tool_results=0, prune_protect_tokens=0), count)
    out = _messages_from_view(body, [found.replacements.get(i, m) for i, m in enumerate(view)])
    blocks = out["messages"][2]["content"]
    assert blocks[0]["type"] == "tool_result" and blocks[0]["tool_use_id"] == "tu1"
    assert "bash(command=pytest -x)" in blocks[0]["content"]
    assert blocks[1] == body["messages"][2]["content"][1]  # the pinned text block is untouched

    rbody = {
        "model": MODEL,
        "input": [
            {"role": "user", "content": TASK},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "grep",
                "arguments": '{"pattern": "TODO"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": BIG},
            {"role": "assistant", "content": "found them"},
        ],
    }
    rview = _responses_to_view(rbody)
    found = prune.plan(rview, settings(prune_keep_tool_results=0, prune_protect_tokens=0), count)
    items = _responses_from_view(
        rbody, [found.replacements.get(i, m) for i, m in enumerate(rview)]
    )["input"]
    assert items[2]["type"] == "function_call_output" and items[2]["call_id"] == "c1"
    assert (
        items[2]["output"].startswith(prune.CLEARED) and "grep(pattern=TODO)" in items[2]["output"]
    )


# ---- pins: the pure rules --------------------------------------------------------------------


def test_pins_cover_system_task_client_instructions_and_patterns() -> None:
    msgs: list[Message] = [
        {"role": "system", "content": "head"},
        {"role": "user", "content": TASK},
        {"role": "assistant", "content": "ok"},
        {"role": "system", "content": "mid-conversation rule"},
        {"role": "user", "content": "<system-reminder>CLAUDE.md says: tabs</system-reminder> go"},
        {"role": "user", "content": "<environment_context>cwd=/repo</environment_context>"},
        {"role": "user", "content": "TICKET-9 matters"},
        {"role": "user", "content": "plain"},
    ]
    s = settings(pin_patterns=("TICKET-\\d+",))
    counts = [10] * len(msgs)
    found = pins.find(msgs, counts, list(range(len(msgs))), 1, s, 1)
    assert sorted(found.reasons) == [1, 3, 4, 5, 6]
    assert pins.find(
        msgs, counts, list(range(len(msgs))), 1, settings(pin_first_user=False), 1
    ).reasons.keys() == {3, 4, 5}
    # A pin over its share of the trigger is ordinary content, and said so.
    big = [10, 5000, 10, 10, 10, 10, 10, 10]
    found = pins.find(msgs, big, list(range(len(msgs))), 1, s, 1)
    assert 1 not in found and "5000 tokens" in found.oversized[1]
    # A system message in the body is pinned whatever its size (issue #10: never summarized).
    big = [10, 10, 10, 5000, 10, 10, 10, 10]
    found = pins.find(msgs, big, list(range(len(msgs))), 1, s, 1)
    assert 3 in found and 3 not in found.oversized


def test_round_cuts_are_legal_inside_one_user_turn() -> None:
    msgs = openai_loop(4, parallel=3)
    cuts = cut_points(msgs)
    # 1: the task; then every assistant message after a completed round of 3 results.
    assert cuts == [1, 6, 10, 14]
    assert cut_points(msgs, rounds=False) == [1]


# ---- the engine ------------------------------------------------------------------------------


def test_pruning_runs_inline_before_any_llm_call(tmp_path: Path) -> None:
    llm = FakeLLM()
    s = settings(mode="background")
    msgs = openai_loop(12)
    p = prepare(msgs, s, tmp_path, llm)
    assert p.original_tokens > s.trigger_tokens
    assert p.record is not None and p.record.case == "prune"
    assert p.forwarded_tokens <= s.trigger_tokens
    assert not llm.calls  # no LLM: pruning was enough
    assert p.record.pruned and all("read_file(path=src/mod_" in x for x in p.record.pruned)
    assert p.forwarded[1] == msgs[1]  # the task, verbatim
    assert len(p.forwarded) == len(msgs)  # structure intact: one placeholder per result


def test_pruning_that_frees_too_little_is_not_applied(tmp_path: Path) -> None:
    s = settings(mode="background", prune_clear_at_least=10**6, emergency_factor=3.0)
    p = prepare(openai_loop(12), s, tmp_path)
    assert p.record is None


def test_single_instruction_loop_is_summarized_between_rounds(tmp_path: Path) -> None:
    # Small outputs: pruning cannot help, the rounds themselves are the bulk.
    msgs = openai_loop(120, output="ok " * 30)
    s = settings(prune=False)
    p = prepare(msgs, s, tmp_path)
    assert p.record is not None and p.record.case == "summarize"
    assert p.forwarded_tokens <= s.trigger_tokens
    assert p.forwarded[1] == msgs[1]  # the task stays verbatim, in place
    assert any(str(m.get("content", "")).startswith(SUMMARY_PREFIX) for m in p.forwarded)
    tail = p.forwarded[body_start(p.record) :]
    assert tail[0]["role"] == "assistant"  # a cut between rounds


def test_claude_md_rule_survives_compaction_on_anthropic_shapes(tmp_path: Path) -> None:
    rule = "<system-reminder>Contents of /repo/CLAUDE.md: always answer in French</system-reminder>"
    messages: list[Message] = [
        {
            "role": "user",
            "content": [{"type": "text", "text": rule}, {"type": "text", "text": "fix it"}],
        }
    ]
    for r in range(120):
        messages.append(
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": f"t{r}",
                        "name": "bash",
                        "input": {"command": f"ls {r}"},
                    }
                ],
            }
        )
        messages.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": f"t{r}", "content": "ok " * 40}],
            }
        )
    body = {
        "model": MODEL,
        "max_tokens": 100,
        "system": "You are Claude Code.",
        "messages": messages,
    }
    s = settings(prune=False, summary_role="user")
    p = prepare(_messages_to_view(body), s, tmp_path)
    assert p.record is not None and p.forwarded_tokens <= s.trigger_tokens
    out = _messages_from_view(body, p.forwarded)
    # The rule, verbatim and first; the summary joins the same user turn (turns alternate).
    assert out["messages"][0]["content"][:2] == messages[0]["content"]
    roles = [m["role"] for m in out["messages"]]
    assert all(x != y for x, y in zip(roles, roles[1:], strict=False)), roles
    assert_anthropic_valid(out["messages"])


def assert_anthropic_valid(messages: list[Message]) -> None:
    """Every tool_use answered in the very next user turn (consecutive turns of one role are
    combined by the API), and no tool_result without its tool_use just before."""
    merged: list[Message] = []
    for m in messages:
        blocks = (
            m["content"]
            if isinstance(m["content"], list)
            else [{"type": "text", "text": m["content"]}]
        )
        if merged and merged[-1]["role"] == m["role"]:
            merged[-1]["content"].extend(blocks)
        else:
            merged.append({"role": m["role"], "content": list(blocks)})
    assert merged[0]["role"] == "user"
    for i, m in enumerate(merged):
        uses = {b["id"] for b in m["content"] if b.get("type") == "tool_use"}
        results = {b["tool_use_id"] for b in m["content"] if b.get("type") == "tool_result"}
        if results:
            before = merged[i - 1]["content"] if i else []
            assert results <= {b["id"] for b in before if b.get("type") == "tool_use"}
        if uses:
            after = merged[i + 1]["content"] if i + 1 < len(merged) else []
            got = {b["tool_use_id"] for b in after if b.get("type") == "tool_result"}
            assert i + 1 == len(merged) or uses <= got


def test_emergency_prunes_then_drops_rounds_down_to_the_trigger(tmp_path: Path) -> None:
    s = settings(emergency_factor=1.5, prune_clear_at_least=10**6)  # inline pruning never pays
    msgs = openai_loop(60)
    p = prepare(msgs, s, tmp_path, FakeLLM(summarizer=CompactionFailed, detector=CompactionFailed))
    assert p.record is not None and p.record.case == "emergency"
    assert p.forwarded_tokens <= s.trigger_tokens  # down to the trigger, not just the limit
    assert p.forwarded[1] == msgs[1]
    assert p.record.pruned


@pytest.mark.parametrize("reserve", [0, 50_000])
def test_over_the_context_window_with_nothing_to_drop_is_flagged(
    tmp_path: Path, reserve: int
) -> None:
    # One huge user message: nothing can be dropped or pruned.
    msgs: list[Message] = [{"role": "user", "content": "word " * 140_000}]

    async def go() -> Prepared:
        store = DiskStore(tmp_path / "store")
        try:
            c = Compactor(settings(), store, FakeLLM(), PROMPTS, counter=COUNTER)
            return await c.prepare(msgs, model=MODEL, tenant="t", reserve_tokens=reserve)
        finally:
            store.close()

    p = asyncio.run(go())
    assert p.too_long
