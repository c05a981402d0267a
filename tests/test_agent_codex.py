"""Codex CLI itself (npm @openai/codex) through the proxy on the Responses API.

A custom model provider in ``$CODEX_HOME/config.toml`` points at the proxy
(``wire_api = "responses"``); ``codex exec`` then ``codex exec resume --last`` carry one
session over many turns. The strict scripted upstream answers with reasoning items
(``encrypted_content``) on every reply and with parallel ``exec_command`` calls when asked,
so Codex runs its shell tool and sends everything back as input items.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.agentclients import agent_binary, clean_env, run_agent, summarize_in_prose, wait_for
from tests.checks import INLINE, SUMMARY_PREFIX
from tests.proxyproc import ProxyProcess
from tests.upstream import ScriptedUpstream, filler_sentence, message_text

pytestmark = pytest.mark.slow

TURNS = 9  # codex exec, then 8 resumes
NOTES = "NOTES-MARKER-3141: the staging port is 8443."
REASONING = "REASONING-SECRET-"
ADMIN_TOKEN = "e2e-admin-token"
FIRST_PROMPT = "Turn 0: look at this project and keep notes. " + filler_sentence(7, 30)


class CodexScript:
    """Replies like a reasoning model behind Codex: a reasoning item first, then two shell
    calls at once when the user asks for checks, prose otherwise."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        self.n += 1
        last = body["messages"][-1] if body["messages"] else {}
        reply: dict[str, Any] = {"role": "assistant", "reasoning": f"{REASONING}{self.n}"}
        if last.get("role") == "user" and "run the checks" in message_text(last):
            reply["content"] = None
            reply["tool_calls"] = [
                {"id": f"call_{self.n:06d}_{i}", "type": "function",
                 "function": {"name": "exec_command", "arguments": f'{{"cmd": "{cmd}"}}'}}
                for i, cmd in enumerate(("cat notes.txt", "echo checks-ok"))
            ]  # fmt: skip
        else:
            reply["content"] = f"Reply {self.n}. {filler_sentence(self.n, 60)}"
        return reply


def _prompt(turn: int) -> str:
    if turn == 0:
        return FIRST_PROMPT
    ask = "Please run the checks again. " if turn % 2 else ""
    return f"Turn {turn}: {ask}{filler_sentence(2000 + turn, 30)}"


def _configure(home: Path, base_url: str) -> None:
    home.mkdir()
    (home / "config.toml").write_text(
        'model = "gpt-5-codex"\n'
        'model_provider = "viaproxy"\n'
        "[model_providers.viaproxy]\n"
        'name = "compaction-proxy"\n'
        f'base_url = "{base_url}"\n'
        'wire_api = "responses"\n'
        'env_key = "E2E_PROXY_KEY"\n'
    )


def _codex(codex: str, work: Path, env: dict[str, str], prompt: str, resume: bool) -> str:
    out = work.parent / "last-message.txt"
    args = [codex, "exec", "--skip-git-repo-check", "--output-last-message", str(out)]
    if resume:
        args += ["resume", "--last"]
    done = run_agent([*args, prompt], work, env)
    assert done.returncode == 0, (
        f"codex exited {done.returncode} on {prompt[:40]!r}\n{done.stdout[-2000:]}\n"
        f"{done.stderr[-3000:]}"
    )
    return out.read_text()


def _conversations(px: ProxyProcess) -> dict[str, int]:
    """Requests recorded per conversation id, from the admin API."""
    r = httpx.get(
        f"{px.root}/admin/api/conversations",
        params={"per_page": 200},
        headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=30,
    )
    r.raise_for_status()
    return {row["id"]: int(row["requests"]) for row in r.json()["items"]}


def _settled(px: ProxyProcess, up: ScriptedUpstream) -> dict[str, int]:
    """The ledger once it holds every client request the upstream answered."""
    answered = len([r for r in up.requests if r.path == "/v1/responses" and r.purpose is None])
    wait_for(lambda: sum(_conversations(px).values()) >= answered, what="ledger entries")
    return _conversations(px)


def test_codex_exec_resume_through_compactions(tmp_path: Path) -> None:
    codex = agent_binary("codex")
    work, home = tmp_path / "project", tmp_path / "codex-home"
    work.mkdir()
    (work / "notes.txt").write_text(NOTES + "\n")
    with (
        ScriptedUpstream(reply=CodexScript(), summarizer=summarize_in_prose) as up,
        ProxyProcess(tmp_path, up.base_url, compaction=INLINE, admin={"token": ADMIN_TOKEN}) as px,
    ):
        _configure(home, px.base_url)
        env = clean_env(
            {"HOME": str(tmp_path), "CODEX_HOME": str(home), "E2E_PROXY_KEY": "sk-codex-e2e-dummy"}
        )
        replies = [_codex(codex, work, env, _prompt(t), resume=t > 0) for t in range(TURNS)]
        session_a = _settled(px, up)
        a_requests = len([r for r in up.requests if r.path == "/v1/responses" and r.purpose is None])
        # A second, separate session that starts exactly like the first one.
        _codex(codex, work, env, FIRST_PROMPT, resume=False)
        _codex(codex, work, env, _prompt(2), resume=True)
        both = _settled(px, up)
    responses = [r for r in up.requests if r.path == "/v1/responses" and r.purpose is None]
    b_requests = len(responses) - a_requests

    for turn, reply in enumerate(replies):
        assert reply.startswith("Reply "), (turn, reply)
    assert up.rejections == [], f"the strict upstream rejected: {up.rejections}"
    bodies = [r.body.decode() for r in responses]
    # Codex ran its tool (both parallel calls) and sent the output back.
    assert any(NOTES in b and "checks-ok" in b and "function_call_output" in b for b in bodies)
    # Reasoning items went back to the upstream (they belong to their turns) ...
    assert any('"type":"reasoning"' in b and "gAAAAB" in b for b in bodies)
    # ... compaction happened ...
    compacted = [b for b in bodies[:a_requests] if SUMMARY_PREFIX in b]
    assert len(compacted) >= 3, f"only {len(compacted)} of {a_requests} requests compacted"
    internal = [r for r in up.requests if r.purpose in ("summarizer", "detector")]
    assert any(r.purpose == "summarizer" for r in internal)
    # ... and reasoning content never reached the summarizer or the detector.
    for rec in internal:
        text = rec.body.decode()
        assert REASONING not in text, f"reasoning summary leaked to the {rec.purpose}"
        assert "gAAAAB" not in text, f"encrypted reasoning leaked to the {rec.purpose}"
        assert not re.search(r"\brs_\w", text), f"a reasoning id leaked to the {rec.purpose}"

    # Conversation identity: one id for session A from its first reply on; session B, whose
    # first item is the same, leaves A's conversation as soon as it has a reply of its own.
    main_a, count_a = max(session_a.items(), key=lambda kv: kv[1])
    assert count_a >= a_requests - 1, f"session A spread over {session_a}"
    grown = {k: v - session_a.get(k, 0) for k, v in both.items() if v > session_a.get(k, 0)}
    assert main_a not in grown, f"session B's requests were counted in A's conversation {main_a}"
    new = {k: v for k, v in grown.items() if k not in session_a}
    assert new and max(new.values()) >= b_requests - 1, (
        f"session B ({b_requests} requests) did not get a conversation of its own: {grown}"
    )
