"""Further real sessions (``tests/replay/more``): their format, and the shape the main corpus
lacks: a history that opens with the client's own summary.

Claude Code compacts by itself near its window and goes on from a new history whose first user
turn is its summary ("This session is being continued from a previous conversation..."). The
proxy must keep that summary verbatim through its own compactions (it is the only record of
everything before it: summarizing it again loses what the client chose to keep) and forward the
newest turn as sent. Each continued session of ``more/`` is driven through the core in process
(``Compactor``, the scripted summarizer of the benchmarks) at a low trigger, request by request
as the client resent it. Two rules keep the summary (checked by mutation: the test fails only
with both off): it is pinned as the client's own summary, and a cut inside the long agentic turn
it opens pins that turn's user message.
"""

from __future__ import annotations

import asyncio
import tempfile
from typing import Any

import orjson

from bench import agent_session
from proxy.adapters.store import DiskStore
from proxy.config import load_prompt
from proxy.core.messages import Message
from proxy.core.prepared import Prompts
from proxy.core.settings import CompactionSettings
from proxy.core.tokens import TokenCounter
from proxy.engine.compactor import Compactor
from tests.replay.fixtures import MORE_DIR, check_run, load_runs
from tests.replay.shapes import chat_body, steps

MODEL = "gpt-4o-mini"
# The first user turn is pinned by default (``pin_first_user``): off here, so that the summary
# is kept by the rules above, not as the task.
SETTINGS = CompactionSettings(
    trigger_tokens=6_000, verbatim_window_tokens=2_000, policy="tokens", pin_first_user=False
)


def test_the_further_runs_are_real_sessions_in_the_corpus_format() -> None:
    runs = load_runs(MORE_DIR)
    assert len(runs) >= 8, "tests/replay/more has fewer than 8 runs"
    sources = (MORE_DIR / "SOURCES.md").read_text()
    for run in runs:
        check_run(run)  # >= 30 tool rounds, every call answered, a license recorded
        assert f"`{run['file']}`" in sources, f"{run['file']} is not in more/SOURCES.md"
    continued = [r for r in runs if r["file"].endswith("-continued.json")]
    assert len(continued) >= 4, "fewer than 4 sessions after a client's own compaction"


def _requests(run: dict[str, Any]) -> list[list[Message]]:
    """The history the client sent before each of its assistant turns (chat completions)."""
    return [
        chat_body(run, run["turns"][: step.turns], MODEL)["messages"]
        for step in steps({**run, "agent": "chat"}, MODEL)
    ]


async def _drive(requests: list[list[Message]]) -> tuple[list[list[Message]], int]:
    counter = TokenCounter()
    llm = agent_session.ScriptedLLM(agent_session.SUMMARIZERS["digits"], counter)
    prompts = Prompts(detector=load_prompt("detector"), summarizer=load_prompt("summarizer"))
    cases: list[str] = []
    forwarded: list[list[Message]] = []
    with tempfile.TemporaryDirectory(prefix="replay-more-") as tmp:
        store = DiskStore(tmp)
        engine = Compactor(
            SETTINGS, store, llm, prompts, counter=counter,
            on_event=lambda e: cases.append(str(e.get("case"))),
        )  # fmt: skip
        for history in requests:
            p = await engine.prepare(history, model=MODEL, tenant="t", credential="k")
            forwarded.append(p.forwarded)
            engine.schedule(p)
            await engine.drain(timeout=60)
        store.close()
    done = sum(c in ("prune", "summarize", "truncate", "emergency") for c in cases)
    return forwarded, done


def test_a_history_opened_by_the_clients_summary_keeps_it_through_our_compactions() -> None:
    runs = [r for r in load_runs(MORE_DIR) if r["file"].endswith("-continued.json")]
    assert runs, "no continued session in tests/replay/more"
    for run in runs:
        requests = _requests(run)
        summary = next(m for m in requests[0] if m["role"] == "user")
        assert "being continued from a previous conversation" in summary["content"], run["file"]
        forwarded, compactions = asyncio.run(_drive(requests))
        assert compactions >= 1, f"{run['file']}: never compacted at a 6,000-token trigger"
        shorter = 0
        for history, sent in zip(requests, forwarded, strict=True):
            users = [m for m in sent if m["role"] == "user"]
            assert users and users[0] == summary, f"{run['file']}: the client's summary lost"
            assert sent[-1] == history[-1], f"{run['file']}: the newest turn not as sent"
            shorter += len(orjson.dumps(sent)) < len(orjson.dumps(history))
        assert shorter >= len(requests) // 3, f"{run['file']}: only {shorter} requests shortened"
