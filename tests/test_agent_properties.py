"""Property tests over random agent sessions on all three surfaces (hypothesis).

Random sessions: 1-3 user instructions (sometimes carrying a ``<system-reminder>``), each
followed by 0-25 tool rounds of 1-4 parallel calls with outputs of a few to a few hundred
words, repeated identical calls now and then, Responses reasoning items before calls; a
single-instruction loop is the one-instruction case. Each is compacted inline by the engine
(pruning, summaries cut between rounds, the emergency path when the summarizer fails) and the
body the proxy would forward is checked with ``tests.strict``, the rules the real providers
enforce: no call separated from its result, no orphan result, alternation on /v1/messages,
reasoning followed by its item. The task is always forwarded verbatim.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
import tempfile
from typing import Any

import orjson
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from proxy.adapters.store import DiskStore
from proxy.core.errors import CompactionFailed
from proxy.core.settings import CompactionSettings
from proxy.core.surfaces import ANTHROPIC_MESSAGES, OPENAI_CHAT, OPENAI_RESPONSES, Surface
from proxy.core.tokens import TokenCounter
from proxy.engine.compactor import Compactor
from tests.strict import check_chat, check_messages, check_responses
from tests.test_agents import echo_summary
from tests.test_compactor import MODEL, PROMPTS, FakeLLM

Message = dict[str, Any]
COUNTER = TokenCounter()
WORDS = "parser ledger invoice retry cache deploy staging error path config test build".split()
PROPERTY = settings(
    max_examples=int(os.environ.get("PROPERTY_EXAMPLES", "40")),
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SURFACES = {
    "chat": (OPENAI_CHAT, check_chat),
    "messages": (ANTHROPIC_MESSAGES, check_messages),
    "responses": (OPENAI_RESPONSES, check_responses),
}
TASK = "Fix the flaky ledger test. Always answer in French."
SYSTEM_NOTE = "<system-reminder>CLAUDE.md: run the tests before answering.</system-reminder>"


@st.composite
def sessions(draw: st.DrawFn) -> tuple[str, list[Any]]:
    """A surface name and a session as steps: ("user", text) | ("system", text) | ("round",
    [(id, name, args, output)], reasoning) | ("answer", text) (see ``body_of``)."""
    shape = draw(st.sampled_from(sorted(SURFACES)))
    rng = random.Random(draw(st.integers(0, 2**32)))
    steps: list[Any] = []
    n = 0
    for i in range(draw(st.integers(1, 3))):
        reminder = (
            "<system-reminder>CLAUDE.md: tabs</system-reminder> " if rng.random() < 0.3 else ""
        )
        steps.append(("user", TASK if i == 0 else f"{reminder}Now step {i}."))
        if i == 0 and rng.random() < 0.3:
            steps.append(("system", SYSTEM_NOTE))  # as Claude Code sends one mid-conversation
        for _ in range(draw(st.integers(0, 25))):
            calls = []
            for _ in range(draw(st.integers(1, 4))):
                n += 1
                path = f"src/{rng.choice(WORDS)}.py" if rng.random() < 0.8 else "src/same.py"
                size = rng.choice([3, 30, 150, 400])
                output = " ".join(rng.choice(WORDS) for _ in range(size))
                calls.append((f"call_{n}", rng.choice(["read", "grep"]), {"path": path}, output))
            steps.append(("round", calls, rng.random() < 0.5))
        if draw(st.booleans()):
            steps.append(("answer", f"Done with step {i}."))
    return shape, steps


def body_of(shape: str, steps: list[Any]) -> dict[str, Any]:
    """The request a client of that surface sends for the whole session so far."""
    if shape == "chat":
        msgs: list[Message] = [{"role": "system", "content": "You are an agent."}]
        for step in steps:
            if step[0] in ("user", "system"):
                msgs.append({"role": step[0], "content": step[1]})
            elif step[0] == "answer":
                msgs.append({"role": "assistant", "content": step[1]})
            else:
                msgs.append(
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": i, "type": "function",
                             "function": {"name": name, "arguments": json.dumps(args)}}
                            for i, name, args, _ in step[1]
                        ],
                    }
                )  # fmt: skip
                msgs += [
                    {"role": "tool", "tool_call_id": i, "content": o} for i, _, _, o in step[1]
                ]
        return {"model": MODEL, "messages": msgs}
    if shape == "messages":
        turns: list[Message] = []
        for step in steps:
            if step[0] == "system":
                turns.append({"role": "system", "content": step[1]})
            elif step[0] == "user":
                block = {"type": "text", "text": step[1]}
                last = [t for t in turns if t["role"] != "system"]
                if last and last[-1]["role"] == "user":
                    last[-1]["content"].append(block)  # after tool results, in one turn
                else:
                    turns.append({"role": "user", "content": [block]})
            elif step[0] == "answer":
                turns.append({"role": "assistant", "content": [{"type": "text", "text": step[1]}]})
            else:
                uses = [{"type": "tool_use", "id": i, "name": name, "input": args}
                        for i, name, args, _ in step[1]]  # fmt: skip
                if step[2]:  # a thinking block opens the turn, as with extended thinking
                    thinking = {"type": "thinking", "thinking": "Plan.", "signature": "c2ln"}
                    uses = [thinking, *uses]
                turns.append({"role": "assistant", "content": uses})
                results = [{"type": "tool_result", "tool_use_id": i, "content": o}
                           for i, _, _, o in step[1]]  # fmt: skip
                turns.append({"role": "user", "content": results})
        if turns[-1]["role"] == "assistant":
            turns.append({"role": "user", "content": "continue"})
        return {"model": MODEL, "max_tokens": 512, "system": "You are an agent.", "messages": turns}
    items: list[Message] = []
    for step in steps:
        if step[0] in ("user", "system"):
            items.append({"type": "message", "role": step[0], "content": step[1]})
        elif step[0] == "answer":
            items.append({"type": "message", "role": "assistant", "content": step[1]})
        else:
            if step[2]:
                items.append({"type": "reasoning", "id": f"rs_{step[1][0][0]}", "summary": []})
            for i, name, args, _ in step[1]:
                items.append({"type": "function_call", "call_id": i, "name": name,
                              "arguments": json.dumps(args)})  # fmt: skip
            for i, _, _, o in step[1]:
                items.append({"type": "function_call_output", "call_id": i, "output": o})
    return {"model": MODEL, "instructions": "You are an agent.", "input": items}


@st.composite
def agent_settings(draw: st.DrawFn) -> CompactionSettings:
    trigger = draw(st.integers(600, 4000))
    return CompactionSettings(
        policy="tokens",  # the mechanics of compaction; the money rules: test_economics
        trigger_tokens=trigger,
        verbatim_window_tokens=draw(st.integers(50, trigger // 3)),
        summary_budget_tokens=100,
        min_verbatim_exchanges=draw(st.integers(1, 3)),
        mode="inline",
        prune_keep_tool_results=draw(st.integers(0, 4)),
        prune_protect_tokens=draw(st.integers(0, trigger // 3)),
        prune_clear_at_least=draw(st.sampled_from([1, 200, 10**6])),
        summary_role="user",
    )


def forward(shape: str, body: dict[str, Any], s: CompactionSettings, summary: Any) -> tuple:
    surface, _ = SURFACES[shape]

    async def go() -> tuple:
        with tempfile.TemporaryDirectory() as tmp:
            store = DiskStore(tmp)
            try:
                c = Compactor(s, store, FakeLLM(summary), PROMPTS, counter=COUNTER)
                p = await c.prepare(
                    surface.to_view(copy.deepcopy(body)),
                    model=MODEL,
                    tenant="t",
                    summary_role=surface.summary_role,
                )
            finally:
                store.close()
        return p, (surface.from_view(body, p.forwarded) if p.changed else body)

    return asyncio.run(go())


def task_forwarded(shape: str, out: dict[str, Any]) -> bool:
    return TASK in orjson.dumps(out).decode()


@PROPERTY
@given(
    sessions(), agent_settings(), st.sampled_from([echo_summary, echo_summary, CompactionFailed])
)
def test_random_agent_sessions_forward_what_providers_accept(
    session: tuple[str, list[Any]], s: CompactionSettings, summary: Any
) -> None:
    shape, steps = session
    surface: Surface
    surface, check = SURFACES[shape]
    body = body_of(shape, steps)
    assert check(body) is None, "the generated session itself must be valid"
    p, out = forward(shape, body, s, summary)
    event(f"{shape}: {p.case}")
    assert check(out) is None, check(out)
    assert p.forwarded_tokens <= p.original_tokens
    assert task_forwarded(shape, out), "the task message was not forwarded"
    if ("system", SYSTEM_NOTE) in steps:  # pinned wherever it was sent
        assert SYSTEM_NOTE in orjson.dumps(out).decode()
    if p.record is not None and p.record.case != "emergency" and summary is echo_summary:
        assert p.forwarded_tokens < p.record.tokens_before
