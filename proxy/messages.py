"""Small, pure facts about chat messages shared by the planner, detector and summarizer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

Message = dict[str, Any]

HEAD_ROLES = frozenset({"system", "developer"})
SUMMARY_PREFIX = "[History Summary - "


def text_of(message: Message) -> str:
    """The message's readable text: string content, or its text parts joined."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, dict):
                if isinstance(part.get("text"), str):
                    parts.append(part["text"])
                elif part.get("type") == "image_url":
                    parts.append("[image]")
                elif part.get("type"):
                    parts.append(f"[{part['type']}]")
            elif isinstance(part, str):
                parts.append(part)
        return "\n".join(parts)
    return str(content)


def head_length(messages: Sequence[Message]) -> int:
    """Leading system/developer messages: never summarized, always first."""
    n = 0
    for m in messages:
        if m.get("role") not in HEAD_ROLES:
            break
        n += 1
    return n


def user_turns(messages: Sequence[Message]) -> int:
    return sum(1 for m in messages if m.get("role") == "user")


def render(message: Message) -> str:
    """One message as prose: ``ROLE: text`` with tool calls and results spelled out.

    The detector and summarizer never see raw tool shapes (DESIGN §5): providers reject tool
    shapes without schemas and tool-happy models answer them with a tool call, not text.
    """
    role = str(message.get("role", "unknown")).upper()
    text = text_of(message)
    lines: list[str] = []
    if role == "TOOL":
        call_id = message.get("tool_call_id") or "?"
        lines.append(f"TOOL RESULT ({call_id}): {text}")
    else:
        name = message.get("name")
        label = f"{role} ({name})" if name else role
        if text:
            lines.append(f"{label}: {text}")
        for call in message.get("tool_calls") or []:
            if not isinstance(call, dict):
                continue
            fn = call.get("function") or {}
            args = fn.get("arguments", "")
            if not isinstance(args, str):
                args = orjson.dumps(args).decode()
            lines.append(f"{label} called tool {fn.get('name', '?')}({args}) [id {call.get('id')}]")
        fc = message.get("function_call")
        if isinstance(fc, dict):
            fc_args = fc.get("arguments", "")
            lines.append(f"{label} called function {fc.get('name', '?')}({fc_args})")
        if not lines:
            lines.append(f"{label}: (empty)")
    return "\n".join(lines)


def transcript(messages: Sequence[Message]) -> str:
    return "\n\n".join(render(m) for m in messages)
