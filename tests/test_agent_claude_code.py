"""Claude Code itself (npm @anthropic-ai/claude-code) through the proxy, turn after turn.

``claude -p … --continue`` runs in a scratch project whose CLAUDE.md holds a rule; the
scripted upstream speaks /v1/messages (streaming, with thinking blocks and sometimes a
tool_use so the agent runs its Read tool) and is as strict as Anthropic's API.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import orjson
import pytest

from tests.agentclients import agent_binary, clean_env, run_agent, summarize_in_prose
from tests.checks import INLINE, SUMMARY_PREFIX
from tests.proxyproc import ProxyProcess
from tests.upstream import ScriptedUpstream, filler_sentence, message_text

pytestmark = pytest.mark.slow

TURNS = 12
RULE = "CM-RULE-5150: never edit files under vendor/ and always answer in English."
NOTES = "NOTES-MARKER-8812: the retry budget is 250 ms per call."
THINKING = "THINKING-SECRET-"


class ClaudeScript:
    """Replies like a model driving Claude Code: a thinking block on every reply, a Read
    tool call when the user asks to read the notes, prose otherwise."""

    def __init__(self, notes: Path) -> None:
        self.notes, self.n = notes, 0

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        self.n += 1
        # Claude Code puts `system` messages after the user's turn: look past them.
        turns = [m for m in body["messages"] if m.get("role") != "system"]
        last = turns[-1] if turns else {}
        blob = orjson.dumps(last.get("content")).decode()
        reply: dict[str, Any] = {"role": "assistant", "reasoning": f"{THINKING}{self.n}"}
        if last.get("role") == "user" and "read the notes" in blob and "tool_result" not in blob:
            args = orjson.dumps({"file_path": str(self.notes)}).decode()
            reply["content"] = "Let me read the notes."
            reply["tool_calls"] = [
                {
                    "id": f"call_{self.n:010d}",
                    "type": "function",
                    "function": {"name": "Read", "arguments": args},
                }
            ]
        else:
            reply["content"] = f"Reply {self.n}. {filler_sentence(self.n, 60)}"
        return reply


def _system_texts(body: dict[str, Any]) -> list[str]:
    """The text of each `system` message inside ``messages`` (cache marks aside)."""
    return [message_text(m) for m in body["messages"] if m.get("role") == "system"]


def _prompt(turn: int) -> str:
    ask = "Please read the notes file and summarise it. " if turn % 3 == 1 else ""
    return f"Turn {turn}: {ask}{filler_sentence(1000 + turn, 40)}"


def _run(claude: str, work: Path, env: dict[str, str], turn: int) -> dict[str, Any]:
    args = [claude, "-p", _prompt(turn), "--output-format", "json", "--allowedTools", "Read"]
    if turn:
        args.append("--continue")
    done = run_agent(args, work, env)
    assert done.returncode == 0, (
        f"turn {turn}: claude exited {done.returncode}\n{done.stdout[-2000:]}\n"
        f"{done.stderr[-2000:]}"
    )
    result: dict[str, Any] = json.loads(done.stdout)
    assert result["is_error"] is False and result["subtype"] == "success", result
    return result


def _project(tmp: Path, extra_rules: int = 0) -> tuple[Path, Path, Path]:
    """A scratch project with a CLAUDE.md rule (and ``extra_rules`` more lines of them) and a
    notes file, and a home for Claude Code."""
    work, home = tmp / "project", tmp / "home"
    work.mkdir()
    home.mkdir()
    more = "".join(f"- Rule {n}: {filler_sentence(2000 + n, 30)}\n" for n in range(extra_rules))
    (work / "CLAUDE.md").write_text(f"# Project rules\n\n- {RULE}\n{more}")
    notes = work / "notes.txt"
    notes.write_text(NOTES + "\n")
    return work, home, notes


def _claude_env(home: Path, base_url: str) -> dict[str, str]:
    """Claude Code offline, pointed at the proxy."""
    return clean_env(
        {
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": base_url,
            "ANTHROPIC_API_KEY": "sk-ant-e2e-dummy",
            "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }
    )


@pytest.mark.parametrize("claude_md", ["short", "too large to pin"])
def test_claude_code_continues_through_compactions(tmp_path: Path, claude_md: str) -> None:
    """Claude Code with its default model, turn after turn with ``--continue``. With a
    CLAUDE.md too large to pin at this trigger, its first user turn (which carries CLAUDE.md)
    is summarized like any content, and Claude Code's system message at messages[1] would
    lead the compacted body: the issue #24 session, bricked by a 400 after its first
    compaction."""
    claude = agent_binary("claude")
    large = claude_md != "short"
    work, home, notes = _project(tmp_path, extra_rules=40 if large else 0)
    script = ClaudeScript(notes)
    with (
        ScriptedUpstream(reply=script, summarizer=summarize_in_prose) as up,
        ProxyProcess(tmp_path, up.base_url, compaction=INLINE) as px,
    ):
        env = _claude_env(home, px.root)
        results = [_run(claude, work, env, turn) for turn in range(TURNS)]

    # Every turn answered with the upstream's words, relayed through the proxy.
    for turn, result in enumerate(results):
        assert result["result"].startswith("Reply "), (turn, result["result"])
    forwarded = [r for r in up.requests if r.path == "/v1/messages" and r.purpose is None]
    assert len(forwarded) >= TURNS + TURNS // 3, "fewer model calls than turns and tool rounds"
    assert up.rejections == [], f"the strict upstream rejected: {up.rejections}"

    bodies = [orjson.dumps(r.json).decode() for r in forwarded]
    # The agent really ran its tool: the file's content came back as a tool_result.
    assert any(NOTES in b and '"tool_result"' in b for b in bodies), "Read never ran"
    # Compaction happened, more than once, and the summarizer did the work.
    compacted = [b for b in bodies if SUMMARY_PREFIX in b]
    assert len(compacted) >= 3, f"only {len(compacted)} of {len(bodies)} requests compacted"
    assert len(up.summarizer_calls()) >= 2, "fewer than two compactions"
    # Claude Code's reachability probe reached the provider (not a 404 of ours).
    probes = sorted({(r.method, r.path) for r in up.requests if not r.path.startswith("/v1/")})
    assert ("HEAD", "/") in probes, f"Claude Code's HEAD / did not reach the upstream: {probes}"
    # Every forwarded body opens with a user turn (the strict upstream checked it too).
    assert all(r.json["messages"][0]["role"] == "user" for r in forwarded)
    if not large:
        # The CLAUDE.md rule reaches the model on every request, compacted or not.
        missing = [i for i, b in enumerate(bodies) if RULE not in b]
        assert not missing, f"CLAUDE.md rule missing from forwarded requests {missing}"
    # Claude Code's mid-conversation system message is never summarized away.
    first_system = _system_texts(forwarded[0].json)
    assert first_system, "Claude Code sent no mid-conversation system message this time"
    for i, rec in enumerate(forwarded):
        assert first_system[0] in _system_texts(rec.json), f"system message lost in request {i}"
    # The latest turns reach the model verbatim.
    assert _prompt(TURNS - 1) in bodies[-1] and _prompt(TURNS - 2) in bodies[-1]
    # Thinking blocks are opaque: never shown to the standalone summarizer or the detector
    # (their prose transcripts). The summarizer call in the client's shape carries the
    # conversation as Claude Code's own requests do (the provider requires the blocks and
    # has them already), and no summary forwarded quotes them.
    for rec in up.requests:
        if rec.purpose in ("summarizer", "detector") and rec.path == "/v1/chat/completions":
            text = rec.body.decode()
            assert THINKING not in text and "gAAAAB" not in text, "thinking leaked to the " + (
                rec.purpose or ""
            )
    for rec in forwarded:
        for m in rec.json["messages"]:
            for b in m["content"] if isinstance(m["content"], list) else []:
                if str(b.get("text", "")).startswith(SUMMARY_PREFIX):
                    assert THINKING not in b["text"], "a summary quotes thinking"


def test_count_tokens_passes_through(tmp_path: Path) -> None:
    """Anthropic's token-counting endpoint (part of the surface Claude Code's SDK speaks)
    reaches the upstream as sent, and its answer comes back."""
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    with ScriptedUpstream() as up, ProxyProcess(tmp_path, up.base_url) as px:
        client = anthropic.Anthropic(base_url=px.root, api_key="sk-ant-e2e-dummy", max_retries=0)
        counted = client.messages.count_tokens(
            model="claude-sonnet-4-5",
            system=RULE,
            messages=messages,
        )
    received = [r for r in up.requests if r.path == "/v1/messages/count_tokens"]
    assert len(received) == 1 and received[0].json["messages"] == messages
    assert counted.input_tokens == up.count_tokens([{"role": "system", "content": RULE}, *messages])


CONTINUED = "This session is being continued from a previous conversation"


def test_claude_codes_own_compaction_is_respected(tmp_path: Path) -> None:
    """``/compact`` in Claude Code: its summary request passes through untouched, and the
    summary it then continues from is never summarized again (issue #17)."""
    claude = agent_binary("claude")
    work, home, notes = _project(tmp_path)
    with (
        ScriptedUpstream(reply=ClaudeScript(notes), summarizer=summarize_in_prose) as up,
        ProxyProcess(tmp_path, up.base_url, compaction=INLINE) as px,
    ):
        env = _claude_env(home, px.root)
        for turn in range(6):
            _run(claude, work, env, turn)
        before = len([r for r in up.requests if r.path == "/v1/messages"])
        done = run_agent([claude, "-p", "/compact", "--continue"], work, env)
        assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        compact_requests = [r for r in up.requests if r.path == "/v1/messages"][before:]
        after_compact = len([r for r in up.requests if r.path == "/v1/messages"])
        for turn in range(6, 10):
            _run(claude, work, env, turn)

    assert up.rejections == [], f"the strict upstream rejected: {up.rejections}"
    assert compact_requests, "/compact sent nothing upstream"
    own = [r for r in compact_requests if "detailed summary of the conversation" in r.body.decode()]
    assert own, "Claude Code's summary request did not reach the upstream"
    for rec in own:
        assert SUMMARY_PREFIX not in rec.body.decode(), "the client's compaction was compacted"
    later = [r for r in up.requests if r.path == "/v1/messages"][after_compact:]
    continued = [r for r in later if CONTINUED in r.body.decode()]
    assert continued, "Claude Code did not continue from its own summary"
    for rec in up.requests:
        if rec.purpose == "summarizer":
            assert CONTINUED not in rec.body.decode(), "the client's summary was summarized"
