"""Small, pure facts about chat messages shared by the planner, detector and summarizer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

Message = dict[str, Any]

HEAD_ROLES = frozenset({"system", "developer"})
SUMMARY_PREFIX = "[History Summary - "
# Private reasoning: Anthropic thinking blocks and Responses reasoning items (carried in the
# view as one block of their own). Forwarded and counted, never rendered into a transcript
# (so never summarized or mined for key facts), and never separated from their turn.
# Private reasoning, and compacted histories only their maker can read (encrypted).
OPAQUE_BLOCKS = frozenset(
    {"thinking", "redacted_thinking", "reasoning", "compaction", "compaction_summary"}
)


def _blocks(message: Message, kind: str) -> list[dict[str, Any]]:
    content = message.get("content")
    if not isinstance(content, list):
        return []
    return [b for b in content if isinstance(b, dict) and b.get("type") == kind]


def tool_uses(message: Message) -> list[str]:
    """Ids of the tool calls this message issues (OpenAI ``tool_calls`` or Anthropic
    ``tool_use`` blocks)."""
    ids = [
        c["id"]
        for c in message.get("tool_calls") or []
        if isinstance(c, dict) and isinstance(c.get("id"), str)
    ]
    ids.extend(b["id"] for b in _blocks(message, "tool_use") if isinstance(b.get("id"), str))
    return ids


def tool_results(message: Message) -> list[str]:
    """Ids of the tool calls this message answers (an OpenAI ``tool`` message or Anthropic
    ``tool_result`` blocks in a user message)."""
    if message.get("role") == "tool":
        return [str(message.get("tool_call_id"))]
    return [
        b["tool_use_id"]
        for b in _blocks(message, "tool_result")
        if isinstance(b.get("tool_use_id"), str)
    ]


def _block_text(block: dict[str, Any]) -> str:
    kind = block.get("type")
    if isinstance(block.get("text"), str):
        return str(block["text"])
    if kind == "tool_use":
        args = orjson.dumps(block.get("input", {})).decode()
        return f"called tool {block.get('name', '?')}({args}) [id {block.get('id')}]"
    if kind == "tool_result":
        inner = block.get("content")
        body = inner if isinstance(inner, str) else text_of({"content": inner})
        error = " (error)" if block.get("is_error") else ""
        return f"TOOL RESULT ({block.get('tool_use_id')}){error}: {body}"
    if kind in OPAQUE_BLOCKS:
        return ""  # private reasoning: not part of what the conversation established
    if kind in ("image_url", "image"):
        return "[image]"
    return f"[{kind}]" if kind else ""


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
                text = _block_text(part)
                if text:
                    parts.append(text)
            elif isinstance(part, str):
                parts.append(part)
        return "\n".join(parts)
    return str(content)


def is_opaque(message: Message) -> bool:
    """Whether the message holds only private reasoning (a Responses reasoning item, or an
    assistant turn of thinking blocks alone)."""
    content = message.get("content")
    return (
        isinstance(content, list)
        and bool(content)
        and not message.get("tool_calls")
        and all(isinstance(b, dict) and b.get("type") in OPAQUE_BLOCKS for b in content)
    )


def head_length(messages: Sequence[Message]) -> int:
    """Leading system/developer messages: never summarized, always first."""
    n = 0
    for m in messages:
        if m.get("role") not in HEAD_ROLES:
            break
        n += 1
    return n


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
        if is_opaque(message):
            return f"{label}: (private reasoning, not shown)"
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
