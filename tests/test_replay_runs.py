"""Real agent runs nobody here wrote, replayed through a real proxy process (issue #24).

Each run in ``tests/replay/runs`` (public trajectories of real agents; sources and licenses
in ``runs/SOURCES.md``) is resent step by step in its client's own request shape
(``tests.replay.shapes``) with the official clients, and once more as Claude Code or Codex
would resend the same turns (no public Claude Code or Codex run long enough and under a
permissive license was found: their shapes carry real content this way), through one proxy at
a low trigger
(compacting inline, several times per run) and one at the default settings, against the strict
upstream. Every request is answered; the strict upstream rejects nothing (a split tool pair,
an orphan result, a body that does not open with a user turn, a reasoning item without its
call would all be 400s); every system/developer message the client sent is forwarded; the
client's newest turn reaches the upstream verbatim.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
import orjson
import pytest

from tests.checks import INLINE, SUMMARY_PREFIX
from tests.proxyproc import ProxyProcess
from tests.replay.fixtures import check_run, load_runs
from tests.replay.shapes import Step, route_of, steps
from tests.upstream import ScriptedUpstream

pytestmark = pytest.mark.slow

RUNS = load_runs()
MODELS = {
    "/v1/messages": "claude-opus-4-5",
    "/v1/responses": "gpt-4o-mini",
    "/v1/chat/completions": "gpt-4o-mini",
}
SETTINGS = {"low trigger": INLINE, "defaults": {}}
OTHER_CLIENTS = ("claude-code", "codex")


def replays() -> list[dict[str, Any]]:
    """Every run as its own client sent it, and as Claude Code or Codex (in turn) would."""
    again = [{**run, "agent": OTHER_CLIENTS[n % 2]} for n, run in enumerate(RUNS)]
    return [*RUNS, *again]


def test_the_corpus_is_real_runs_of_several_agents() -> None:
    for run in RUNS:
        check_run(run)  # >= 30 tool rounds, every call answered, a license recorded
    assert len(RUNS) >= 5, "the replay corpus has fewer than 5 runs"
    assert len({r["agent"] for r in RUNS}) >= 2, "the replay corpus has fewer than 2 agents"


def send(px: ProxyProcess, step: Step, key: str) -> None:
    """One request with the official client of its API; the answer read to its end."""
    body = dict(step.body)
    if step.path == "/v1/messages":
        client = anthropic.Anthropic(base_url=px.root, api_key=key, max_retries=0)
        beta = "claude-code-20250219,interleaved-thinking-2025-05-14"
        with client.messages.stream(**body_without_stream(body),
                                    extra_headers={"anthropic-beta": beta}) as stream:  # fmt: skip
            final = stream.get_final_message()
        assert final.content, "no answer"
        return
    client_oa = openai.OpenAI(base_url=px.base_url, api_key=key, max_retries=0)
    if step.path == "/v1/responses":
        events = list(client_oa.responses.create(**body))
        assert any(e.type == "response.completed" for e in events), "the stream never completed"
        return
    reply = client_oa.chat.completions.create(**body)
    assert reply.choices[0].message is not None


def body_without_stream(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "stream"}


def _system_texts(step: Step) -> list[str]:
    """What the client sent as system/developer messages inside the conversation."""
    body = step.body
    if step.path == "/v1/responses":
        return [i["content"][0]["text"] for i in body["input"] if i.get("role") == "developer"]
    return [m["content"] for m in body["messages"][1:] if m.get("role") == "system"]


def _newest(step: Step) -> bytes:
    """The newest item of the history, as the client serialised it."""
    key = "input" if step.path == "/v1/responses" else "messages"
    last = step.body[key][-1]
    if step.path == "/v1/messages" and isinstance(last.get("content"), list):
        last = last["content"][-1]
        last = {k: v for k, v in last.items() if k != "cache_control"}
    return orjson.dumps(last.get("content") or last.get("output") or last.get("text") or "")


@dataclass(frozen=True)
class Received:
    """One request the upstream received (what the checks read of it)."""

    path: str
    purpose: str | None
    body: bytes


@dataclass(frozen=True)
class Replayed:
    """A whole replay: each step with the number of upstream requests before it, and every
    request the upstream received, in order."""

    sent: list[tuple[Step, int]]
    received: list[Received]


# A replay of the corpus at one setting, kept for the other test that reads it
# (tests/test_forwarded_bytes.py checks the bytes of the same requests at the low trigger):
# each corpus pass costs minutes of CI, and the two tests need the same one.
_KEPT: dict[str, Replayed] = {}
SHARED = {orjson.dumps(INLINE, option=orjson.OPT_SORT_KEYS).decode()}


def replayed(
    tmp_path: Path, compaction: dict[str, Any], runs: list[dict[str, Any]] | None = None
) -> Replayed:
    """``runs`` (default: the corpus, ``replays()``) through a real proxy process at
    ``compaction`` against the strict upstream. A replay of the corpus another test made at
    the same settings is handed over once (then forgotten); the strict upstream rejecting
    anything fails the test that replays."""
    key = orjson.dumps(compaction, option=orjson.OPT_SORT_KEYS).decode()
    kept = _KEPT.pop(key, None) if runs is None else None
    if kept is not None:
        return kept
    with (
        ScriptedUpstream() as up,
        ProxyProcess(tmp_path, up.base_url, compaction=compaction) as px,
    ):
        sent: list[tuple[Step, int]] = []
        for n, run in enumerate(replays() if runs is None else runs):
            path = None
            for step in steps(run, MODELS[route_of(run)]):
                path = step.path
                before = len(up.requests)
                send(px, step, key=f"sk-replay-{n}")
                sent.append((step, before))
            assert path is not None, f"run {run['file']} gave no request"
        received = [Received(r.path, r.purpose, r.body) for r in up.requests]
    assert up.rejections == []
    result = Replayed(sent, received)
    if runs is None and key in SHARED:
        _KEPT[key] = result
    return result


@pytest.mark.parametrize("settings", sorted(SETTINGS))
def test_real_agent_runs_replay_through_every_tier(tmp_path: Path, settings: str) -> None:
    run = replayed(tmp_path, SETTINGS[settings])
    sent = run.sent
    compacted = sum(is_compacted(body) for _, body in checked(run))
    paths = {step.path for step, _ in sent}
    assert paths == {"/v1/messages", "/v1/responses", "/v1/chat/completions"}
    if settings == "low trigger":
        assert compacted >= len(sent) // 2, f"only {compacted} of {len(sent)} requests compacted"


def checked(run: Replayed) -> list[tuple[Step, bytes]]:
    """Each step with the body the upstream got for it, once checked: every system/developer
    message the client sent and its newest turn are in it, verbatim."""
    out = []
    for step, before in run.sent:
        body = next(r for r in run.received[before:] if _client_call(r, step.path)).body
        for text in _system_texts(step):
            assert orjson.dumps(text)[1:-1] in body, "a system/developer message was dropped"
        assert _newest(step)[1:-1] in body, "the newest turn was not forwarded verbatim"
        out.append((step, body))
    return out


def is_compacted(body: bytes) -> bool:
    """Whether a forwarded body carries our summary or a pruned tool result."""
    return SUMMARY_PREFIX.encode() in body or b"tool result cleared" in body


def _client_call(rec: Received, path: str) -> bool:
    return rec.path == path and rec.purpose is None
