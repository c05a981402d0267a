"""A recorded agent run (``runs/*.json``, see ``fixtures``) as the requests its client resends.

Replay is open loop (DESIGN §11): before each assistant turn of the run, the client sends its
whole history so far in its own request shape, whatever the upstream answers. The shapes
follow what the real clients send (``shared/data/client-shapes``):

- Claude Code on /v1/messages: system blocks with ``cache_control``, a ``<system-reminder>``
  block in the first user turn, the agent-types ``system`` message at ``messages[1]`` (Claude
  Code 2.1.197 sends it there), thinking blocks with signatures, tool results in the next
  user turn, a cache mark on the last user block, ``stream: true``.
- Codex on /v1/responses: developer instructions and an ``<environment_context>`` user item,
  encrypted reasoning items before their calls, ``function_call`` /
  ``function_call_output``, ``store: false``, a ``prompt_cache_key``.
- Every other agent (SWE-agent, mini-swe-agent, OpenHands, ...) on /v1/chat/completions, as
  LiteLLM sends it: ``tool_calls`` and ``tool`` messages.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

Body = dict[str, Any]
Turn = dict[str, Any]

MARK = {"type": "ephemeral"}
AGENT_TYPES = (
    "Available agent types for the Agent tool:\n- general-purpose: research and multi-step "
    "tasks.\n- Explore: fast codebase exploration.\n- Plan: implementation plans."
)
REMINDER = (
    "<system-reminder>\nAs you answer the user's questions, you can use the following "
    "context:\n# claudeMd\nContents of /repo/CLAUDE.md (project instructions):\n\n- REPLAY-RULE-"
    "77: run the tests before you say a change is done.\n</system-reminder>"
)
ENVIRONMENT = (
    "<environment_context>\n  <cwd>/repo</cwd>\n  <shell>bash</shell>\n</environment_context>"
)
DEFAULT_SYSTEM = "You are an agent that solves software engineering tasks with tools."


@dataclass(frozen=True)
class Step:
    """One request of a replay: the path, the body, and the run's turns it carries."""

    path: str
    body: Body
    turns: int


def route_of(run: Body) -> str:
    agent = str(run.get("agent", ""))
    if agent.startswith("claude"):
        return "/v1/messages"
    if agent.startswith("codex"):
        return "/v1/responses"
    return "/v1/chat/completions"


def steps(run: Body, model: str) -> Iterator[Step]:
    """Every request the client sends: its history before each assistant turn."""
    turns: list[Turn] = run["turns"]
    path = route_of(run)
    render = {"/v1/messages": messages_body, "/v1/responses": responses_body}.get(path, chat_body)
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant" or i == 0:
            continue
        before = [t for t in turns[:i] if t["role"] != "system"]
        if not before or before[-1]["role"] == "assistant":
            continue  # the run's assistant spoke twice in a row: one request, not two
        yield Step(path, render(run, turns[:i], model), i)


def _tools(turns: list[Turn], *, flat: bool) -> list[Body]:
    names = sorted({c["name"] for t in turns for c in t.get("tool_calls") or []})
    schema = {"type": "object", "properties": {}, "additionalProperties": True}
    if flat:  # Responses: function tools are flat
        return [{"type": "function", "name": n, "description": n, "parameters": schema}
                for n in names]  # fmt: skip
    return [{"type": "function", "function": {"name": n, "description": n, "parameters": schema}}
            for n in names]  # fmt: skip


def _text(value: Any) -> str:
    return value if isinstance(value, str) and value.strip() else ""


# ---- Claude Code, /v1/messages ----------------------------------------------------------------


def messages_body(run: Body, turns: list[Turn], model: str) -> Body:
    out: list[Body] = []
    system_turns = 0
    for t in turns:
        role = t["role"]
        if role == "system":
            out.append({"role": "system", "content": _text(t["text"]) or "(notice)"})
            system_turns += 1
        elif role == "user":
            text = {"type": "text", "text": _text(t["text"]) or "(empty)"}
            last = _last_turn(out)
            if last is not None and last["role"] == "user":
                last["content"].append(text)  # after tool results, in the same turn
            elif not out:
                out.append({"role": "user", "content": [{"type": "text", "text": REMINDER}, text]})
                out.append({"role": "system", "content": AGENT_TYPES})
            else:
                out.append({"role": "user", "content": [text]})
        elif role == "assistant":
            blocks: list[Body] = []
            if _text(t.get("thinking")):
                signature = base64.b64encode(f"sig:{len(out)}".encode()).decode()
                blocks.append({"type": "thinking", "thinking": t["thinking"],
                               "signature": signature})  # fmt: skip
            if _text(t.get("text")):
                blocks.append({"type": "text", "text": t["text"]})
            for c in t.get("tool_calls") or []:
                blocks.append({"type": "tool_use", "id": c["id"], "name": c["name"],
                               "input": c["input"]})  # fmt: skip
            out.append({"role": "assistant", "content": blocks or [{"type": "text", "text": "."}]})
        else:
            result = {"type": "tool_result", "tool_use_id": t["tool_call_id"],
                      "content": _text(t.get("output")) or "(no output)"}  # fmt: skip
            if t.get("is_error"):
                result["is_error"] = True
            last = _last_turn(out)
            if last is not None and last["role"] == "user" and _all_results(last):
                last["content"].append(result)
            else:
                out.append({"role": "user", "content": [result]})
    final = _last_turn(out)
    if final is not None and final["role"] == "user":
        final["content"][-1] = {**final["content"][-1], "cache_control": MARK}
    system = run.get("system") or DEFAULT_SYSTEM
    return {
        "model": model,
        "max_tokens": 32000,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197;"},
            {"type": "text", "text": "You are a Claude agent.", "cache_control": MARK},
            {"type": "text", "text": system, "cache_control": MARK},
        ],
        "messages": out,
        "tools": [
            {
                "name": f["function"]["name"],
                "description": f["function"]["description"],
                "input_schema": f["function"]["parameters"],
            }
            for f in _tools(turns, flat=False)
        ],  # fmt: skip
        "metadata": {"user_id": "replay"},
        "thinking": {"type": "adaptive"},
        "stream": True,
    }


def _last_turn(out: list[Body]) -> Body | None:
    return next((m for m in reversed(out) if m["role"] != "system"), None)


def _all_results(message: Body) -> bool:
    return all(b.get("type") == "tool_result" for b in message["content"])


# ---- Codex, /v1/responses ---------------------------------------------------------------------


def responses_body(run: Body, turns: list[Turn], model: str) -> Body:
    items: list[Body] = [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": run.get("system") or DEFAULT_SYSTEM}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": ENVIRONMENT}]},
    ]  # fmt: skip
    for n, t in enumerate(turns):
        role = t["role"]
        if role in ("user", "system"):
            kind = "user" if role == "user" else "developer"
            text = _text(t["text"]) or "(empty)"
            items.append({"type": "message", "role": kind,
                          "content": [{"type": "input_text", "text": text}]})  # fmt: skip
        elif role == "assistant":
            calls = t.get("tool_calls") or []
            if _text(t.get("thinking")) or calls:
                opaque = base64.b64encode(f"enc:{n}:{t.get('thinking') or ''}"[:200].encode())
                items.append({"type": "reasoning", "id": f"rs_{n:05d}", "summary": [],
                              "encrypted_content": opaque.decode()})  # fmt: skip
            if _text(t.get("text")):
                items.append({"type": "message", "role": "assistant", "id": f"msg_{n:05d}",
                              "content": [{"type": "output_text", "text": t["text"],
                                           "annotations": []}]})  # fmt: skip
            elif not calls:
                items.append({"type": "message", "role": "assistant", "id": f"msg_{n:05d}",
                              "content": [{"type": "output_text", "text": ".",
                                           "annotations": []}]})  # fmt: skip
            for c in calls:
                items.append({"type": "function_call", "call_id": c["id"], "name": c["name"],
                              "arguments": json.dumps(c["input"])})  # fmt: skip
        else:
            items.append({"type": "function_call_output", "call_id": t["tool_call_id"],
                          "output": _text(t.get("output")) or "(no output)"})  # fmt: skip
    return {
        "model": model,
        "input": items,
        "tools": _tools(turns, flat=True),
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "replay-session",
        "stream": True,
    }


# ---- everyone else, /v1/chat/completions ------------------------------------------------------


def chat_body(run: Body, turns: list[Turn], model: str) -> Body:
    msgs: list[Body] = [{"role": "system", "content": run.get("system") or DEFAULT_SYSTEM}]
    for t in turns:
        role = t["role"]
        if role in ("user", "system"):
            msgs.append({"role": role, "content": _text(t["text"]) or "(empty)"})
        elif role == "assistant":
            calls = [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(c["input"])}}
                for c in t.get("tool_calls") or []
            ]  # fmt: skip
            message: Body = {"role": "assistant", "content": _text(t.get("text")) or None}
            if calls:
                message["tool_calls"] = calls
            elif message["content"] is None:
                message["content"] = "."
            msgs.append(message)
        else:
            msgs.append({"role": "tool", "tool_call_id": t["tool_call_id"],
                         "content": _text(t.get("output")) or "(no output)"})  # fmt: skip
    return {"model": model, "messages": msgs, "tools": _tools(turns, flat=False), "stream": False}
