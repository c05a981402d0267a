"""Pins stay where the client put them, on every surface, for every tier (issue #24).

Random agent sessions with system/developer messages at random places (Claude Code sends one
right after its first user turn), pinned user turns, thinking blocks and reasoning items, a
task that is sometimes too large to pin; each is compacted by the engine with every tier
forced in turn (prune, summarize, truncate with and without its note, emergency), then grown
by more rounds and prepared again from the same store (the older record substituted, often a
second compaction on top of the first). Every body the proxy would forward is checked with
``tests.strict``: the first message of /v1/messages is a user turn and roles alternate, tool
calls keep their results, and every pinned system message is still forwarded, after the turn
it followed.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import re
import tempfile
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from proxy.adapters.store import DiskStore
from proxy.core.errors import CompactionFailed
from proxy.core.prepared import Prepared
from proxy.core.settings import CompactionSettings
from proxy.engine.compactor import Compactor
from tests.test_agent_properties import COUNTER, PROPERTY, SURFACES, WORDS, body_of
from tests.test_agents import echo_summary
from tests.test_compactor import MODEL, NULL_DETECTION, PROMPTS, FakeLLM

Message = dict[str, Any]
TASK = "Fix the flaky ledger test."
AGENTS_NOTE = "Available agent types: claude, explore, plan."
BIG_TASK = TASK + " " + " ".join(["The attached log follows."] + ["ledger retry"] * 900)


def truncating_detector(messages: list[Message]) -> str:
    """A confident boundary at the last user turn the detector was shown but one."""
    lines = str(messages[-1]["content"]).splitlines()
    users = [int(x.split("]")[0][1:]) for x in lines if re.match(r"\[\d+\] USER:", x)]
    if len(users) < 2:
        return NULL_DETECTION
    detection = {"boundary_index": users[-2], "boundary_reason": "new task",
                 "confidence": 0.9, "summary": "Old topic: the ledger."}  # fmt: skip
    return json.dumps(detection)


TIERS: dict[str, dict[str, Any]] = {
    "prune": {"llm": (echo_summary, NULL_DETECTION), "prune_clear_at_least": 1},
    "summarize": {"llm": (echo_summary, NULL_DETECTION), "prune": False},
    "truncate": {"llm": (echo_summary, truncating_detector), "prune": False},
    "truncate-bare": {
        "llm": (echo_summary, truncating_detector),
        "prune": False,
        "truncate_keeps_note": False,
    },
    "emergency": {"llm": (CompactionFailed, NULL_DETECTION), "prune": False},
}


@st.composite
def sessions(draw: st.DrawFn) -> tuple[str, list[Any], int]:
    """A surface, a session as steps (see ``body_of``) and where its first request ends."""
    shape = draw(st.sampled_from(sorted(SURFACES)))
    rng = random.Random(draw(st.integers(0, 2**32)))
    steps: list[Any] = [("user", BIG_TASK if rng.random() < 0.4 else TASK)]
    n = 0
    system_at = {draw(st.integers(0, 6)) for _ in range(draw(st.integers(1, 3)))}
    for turn in range(draw(st.integers(3, 6))):
        if turn:
            reminder = "<system-reminder>CLAUDE.md: tabs</system-reminder> "
            steps.append(("user", f"{reminder if rng.random() < 0.3 else ''}Now step {turn}."))
        if turn in system_at:
            steps.append(("system", f"{AGENTS_NOTE} (#{turn})"))
        for _ in range(draw(st.integers(1, 8))):
            calls = []
            for _ in range(draw(st.integers(1, 3))):
                n += 1
                output = " ".join(rng.choice(WORDS) for _ in range(rng.choice([20, 150, 300])))
                calls.append((f"call_{n}", "read", {"path": f"src/f{n % 7}.py"}, output))
            steps.append(("round", calls, rng.random() < 0.5))
        steps.append(("answer", f"Done with step {turn}."))
        if turn + 1 in system_at and rng.random() < 0.5:  # after the answer, before the user
            steps.append(("system", f"{AGENTS_NOTE} (after {turn})"))
    first = draw(st.integers(len(steps) // 2, len(steps)))
    return shape, steps, first


def settings_for(tier: str) -> CompactionSettings:
    values = {k: v for k, v in TIERS[tier].items() if k != "llm"}
    return CompactionSettings(
        trigger_tokens=1500,
        verbatim_window_tokens=300,
        summary_budget_tokens=100,
        min_verbatim_exchanges=1,
        mode="inline",
        prune_keep_tool_results=1,
        prune_protect_tokens=200,
        summary_role="user",
        **values,
    )


def forward_twice(
    shape: str, bodies: list[dict[str, Any]], tier: str, store_dir: str
) -> list[tuple[Prepared, dict[str, Any]]]:
    """Each body prepared in turn against one store: what the proxy forwards for each."""
    surface, _ = SURFACES[shape]
    summarizer, detector = TIERS[tier]["llm"]

    async def go() -> list[tuple[Prepared, dict[str, Any]]]:
        store = DiskStore(store_dir)
        out = []
        try:
            llm = FakeLLM(summarizer, detector)
            c = Compactor(settings_for(tier), store, llm, PROMPTS, counter=COUNTER)
            for body in bodies:
                p = await c.prepare(
                    surface.to_view(copy.deepcopy(body)),
                    model=MODEL,
                    tenant="t",
                    summary_role=surface.summary_role,
                    summary_joins=surface.summary_joins,
                )
                out.append((p, surface.from_view(body, p.forwarded) if p.changed else body))
        finally:
            store.close()
        return out

    return asyncio.run(go())


def system_notes_in_order(shape: str, body: dict[str, Any]) -> list[str]:
    key = "input" if shape == "responses" else "messages"
    return re.findall(r"Available agent types: claude, explore, plan\. \([^)]*\)",
                      orjson.dumps(body[key]).decode())  # fmt: skip


def check_forwarded(shape: str, sent: dict[str, Any], out: dict[str, Any]) -> None:
    _, check = SURFACES[shape]
    assert check(out) is None, check(out)
    if shape == "messages":
        assert out["messages"][0]["role"] == "user"
    # Every pinned system message is still forwarded, in the client's order.
    assert system_notes_in_order(shape, out) == system_notes_in_order(shape, sent)
    if BIG_TASK not in orjson.dumps(sent).decode():  # a task too large to pin is content
        assert TASK in orjson.dumps(out).decode()


@PROPERTY
@given(sessions(), st.sampled_from(sorted(TIERS)))
def test_pins_keep_their_place_for_every_tier_surface_and_position(
    session: tuple[str, list[Any], int], tier: str
) -> None:
    shape, steps, first = session
    _, check = SURFACES[shape]
    bodies = [body_of(shape, steps[:first]), body_of(shape, steps)]
    for body in bodies:
        assert check(body) is None, "the generated session itself must be valid"
    with tempfile.TemporaryDirectory() as tmp:
        results = forward_twice(shape, bodies, tier, tmp)
    for (p, out), body in zip(results, bodies, strict=True):
        event(f"{shape} {tier}: {p.case}")
        check_forwarded(shape, body, out)
        assert p.forwarded_tokens <= p.original_tokens


def claude_code_session(rounds: int) -> dict[str, Any]:
    """Claude Code's shape: the task (with its reminders) then a system message, then rounds."""
    steps: list[Any] = [("user", BIG_TASK), ("system", f"{AGENTS_NOTE} (#0)")]
    for r in range(rounds):
        output = " ".join(WORDS[(r + j) % len(WORDS)] for j in range(200))
        steps.append(
            ("round", [(f"toolu_{r}", "Read", {"file_path": f"src/f{r}.py"}, output)], True)
        )
        if r % 4 == 3:
            steps.append(("answer", f"Done with part {r}."))
            steps.append(("user", f"Next part after {r}."))
    return body_of("messages", steps)


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_a_mid_conversation_system_message_never_leads_after_a_compaction(
    tier: str, tmp_path: Path
) -> None:
    """The session from the issue: a task too large to pin, Claude Code's system message at
    messages[1]; after a compaction, and the next request on the stored record, the first
    forwarded message is a user turn and the system message follows it."""
    first, second = claude_code_session(24), claude_code_session(32)
    results = forward_twice("messages", [first, second], tier, str(tmp_path / "store"))
    assert any(p.record is not None for p, _ in results), "the tier must compact"
    for (_p, out), body in zip(results, [first, second], strict=True):
        check_forwarded("messages", body, out)
        roles = [m["role"] for m in out["messages"]]
        assert roles[0] == "user" and "system" in roles[:3], roles[:4]
