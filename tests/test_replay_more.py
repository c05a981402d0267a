"""Further real sessions (``tests/replay/more``): their format, and the shape the main corpus
lacks: a history that opens with the client's own summary.

Claude Code compacts by itself near its window and goes on from a new history whose first user
turn is its summary ("This session is being continued from a previous conversation..."). The
proxy must keep that summary verbatim through its own compactions (it is the only record of
everything before it: summarizing it again loses what the client chose to keep) and forward the
newest turn as sent. Each continued session of ``more/`` is driven through the core in process
(``eval.anchor_eval.drive``, the scripted summarizer of the benchmarks) at a low trigger,
request by request as the client resent it. Two rules keep the summary (checked by mutation:
the test fails only with both off): it is pinned as the client's own summary, and a cut inside
the long agentic turn it opens pins that turn's user message.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson

from eval.anchor_eval import MODEL, drive, request_ends
from proxy.core.settings import CompactionSettings
from tests.checks import INLINE
from tests.replay.fixtures import MORE_DIR, check_run, load_runs
from tests.replay.shapes import chat_body
from tests.test_replay_runs import checked, is_compacted, replayed

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


def test_a_history_opened_by_the_clients_summary_keeps_it_through_our_compactions() -> None:
    runs = [r for r in load_runs(MORE_DIR) if r["file"].endswith("-continued.json")]
    assert runs, "no continued session in tests/replay/more"
    for run in runs:
        # The history the client sent before each of its assistant turns (chat completions).
        msgs = chat_body(run, run["turns"], MODEL)["messages"]
        ends = request_ends(msgs)
        requests = [msgs[:end] for end in ends]
        summary = next(m for m in msgs if m["role"] == "user")
        assert "being continued from a previous conversation" in summary["content"], run["file"]
        forwarded, compactions = asyncio.run(drive(msgs, ends, "digits", SETTINGS))
        assert compactions >= 1, f"{run['file']}: never compacted at a 6,000-token trigger"
        shorter = 0
        for history, sent in zip(requests, forwarded, strict=True):
            users = [m for m in sent if m["role"] == "user"]
            assert users and users[0] == summary, f"{run['file']}: the client's summary lost"
            assert sent[-1] == history[-1], f"{run['file']}: the newest turn not as sent"
            shorter += len(orjson.dumps(sent)) < len(orjson.dumps(history))
        assert shorter >= len(requests) // 3, f"{run['file']}: only {shorter} requests shortened"


def test_a_continued_claude_code_session_through_a_real_proxy(tmp_path: Path) -> None:
    """The smallest continued session end to end: resent as Claude Code sends it (its system
    blocks, cache marks, ``<system-reminder>``) with the official ``anthropic`` client through
    a real proxy process compacting inline at a low trigger, against the strict upstream
    (which fails the test on anything it rejects): every request carries the client's summary,
    its system messages and its newest turn verbatim, and the proxy compacts. (In this shape
    the summary's turn also carries Claude Code's ``<system-reminder>``, a pin of its own: the
    test fails only with no user turn pinned at all.)"""
    runs = [r for r in load_runs(MORE_DIR) if r["file"].endswith("-continued.json")]
    run = min(runs, key=lambda r: len(orjson.dumps(r)))
    assert run["agent"] == "claude-code"
    summary = orjson.dumps(run["turns"][0]["text"])[1:-1]
    assert b"being continued from a previous conversation" in summary
    replay = replayed(tmp_path, INLINE, [run])
    bodies = checked(replay)
    assert {step.path for step, _ in bodies} == {"/v1/messages"}
    for _, body in bodies:
        assert summary in body, f"{run['file']}: the client's summary was not forwarded"
    compacted = sum(is_compacted(body) for _, body in bodies)
    assert compacted >= len(bodies) // 2, f"only {compacted} of {len(bodies)} requests compacted"
