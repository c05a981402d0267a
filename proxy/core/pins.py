"""Pinned content: messages that are never summarized or pruned (DESIGN §10). Pure.

A pin stays in place, in its original order, whatever tier runs: the leading system/developer
messages (the head), system/developer messages in the body, the task (the conversation's
first user message), user turns carrying client instructions (Claude Code's
``<system-reminder>`` and CLAUDE.md text, Codex's AGENTS.md, ``<environment_context>`` and
``<user_instructions>``) and whatever matches the configured ``pin_patterns``.

A pin is a promise, not a loophole: one larger than ``pin_max_share`` of the trigger (a pasted
50k-token document as the first message) is handled like any other content, and said so.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from proxy.core.controls import is_client_summary
from proxy.core.messages import HEAD_ROLES, Message, tool_results
from proxy.core.settings import CompactionSettings

# Client instructions carried inside user turns (only text the user side wrote: a marker inside
# a tool result is tool output, not an instruction).
CLIENT_MARKERS = (
    r"<system-reminder>",
    r"<environment_context>",
    r"<user_instructions>",
    r"Contents of \S*CLAUDE\.md",
    r"AGENTS\.md instructions",
    r"<INSTRUCTIONS>",
)


# The reason of a pin the loop breaker (#26, ``behaviour.rounds``) placed: a whole tool round
# kept with its results, never stripped of them.
ROUND_PIN = "kept by the loop breaker"


@dataclass(frozen=True)
class Pins:
    """Pinned positions of a forwarded list, and the would-be pins that were too large."""

    reasons: dict[int, str]  # position -> why it is pinned
    oversized: dict[int, str]  # position -> why it would have been pinned

    def __contains__(self, index: object) -> bool:
        return index in self.reasons


@lru_cache(maxsize=64)
def _pattern(patterns: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{p})" for p in (*CLIENT_MARKERS, *patterns)))


def _user_text(message: Message) -> str:
    """The text the user side wrote: string content or text blocks, never tool results."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    parts = []
    for block in content:
        if isinstance(block, dict) and block.get("type") in ("text", "input_text"):
            text = block.get("text")
            if isinstance(text, str):
                parts.append(text)
    return "\n".join(parts)


def first_user_index(messages: Sequence[Message]) -> int | None:
    """Index of the conversation's first user message (the task), if any."""
    return next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)


def reason(message: Message, *, first_user: bool, settings: CompactionSettings) -> str | None:
    """Why ``message`` is pinned, or None."""
    role = message.get("role")
    if role in HEAD_ROLES:
        return f"{role} message"
    if role != "user":
        return None
    if first_user and settings.pin_first_user:
        return "the task (first user message)"
    if is_client_summary(message):
        # What the client kept of its own compaction: summarizing it again loses twice.
        return "the client's own summary"
    text = _user_text(message)
    if text:
        found = _pattern(tuple(settings.pin_patterns)).search(text)
        if found:
            return f"client instructions ({found.group(0)[:40]})"
    return None


def find(
    messages: Sequence[Message],
    counts: Sequence[int],
    origins: Sequence[int | None],
    first_user: int | None,
    settings: CompactionSettings,
    start: int = 0,
) -> Pins:
    """Pins among ``messages[start:]``; ``origins[i]`` is the original index of position i
    (None for our own stored messages, which are never pins) and ``first_user`` the original
    index of the conversation's first user message.

    A pin over ``pin_max_share`` of the trigger is not pinned, nor are pins past twice that
    share in total (system messages and the task first, then client instructions, newest
    first): pins count toward the budget and must leave room for the conversation. System and
    developer messages are the exception: like the head they are the client's own
    instructions (Claude Code's agent list is ~1.4k tokens), never summarized away whatever
    their size; they still count toward the budget, first.
    """
    limit = int(settings.trigger_tokens * settings.pin_max_share)
    candidates: list[tuple[int, int, str]] = []
    oversized: dict[int, str] = {}
    for i in range(start, len(messages)):
        origin = origins[i]
        if origin is None and not tool_results(messages[i]):
            continue  # our own summary or note (a pruned user turn can still carry a pin)
        is_task = origin == first_user
        why = reason(messages[i], first_user=is_task, settings=settings)
        if why is None:
            continue
        system = messages[i].get("role") != "user"
        if counts[i] > limit and not system:
            oversized[i] = f"{why}: {counts[i]} tokens, over {limit}"
            continue
        first = system or (is_task and settings.pin_first_user)
        rank = 0 if first else 1
        candidates.append((rank, -i, why))
    reasons: dict[int, str] = {}
    total = 0
    for _, neg, why in sorted(candidates):
        i = -neg
        if total + counts[i] > 2 * limit and messages[i].get("role") == "user":
            oversized[i] = f"{why}: pin budget of {2 * limit} tokens spent"
            continue
        total += counts[i]
        reasons[i] = why
    return Pins(dict(sorted(reasons.items())), dict(sorted(oversized.items())))


def with_pin(pins: Pins, index: int | None, why: str) -> Pins:
    """``pins`` plus one more (the user turn a round cut falls in), unless it is too large."""
    if index is None or index in pins.reasons or index in pins.oversized:
        return pins
    return Pins({**pins.reasons, index: why}, pins.oversized)


def without_tool_results(message: Message) -> Message | None:
    """A pin as it may be forwarded apart from its round: without tool results (their calls
    are summarized away). None when the message carries nothing else."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    kept: list[Any] = [
        b for b in content if not (isinstance(b, dict) and b.get("type") == "tool_result")
    ]
    if len(kept) == len(content):
        return message
    if not kept:
        return None
    return {**message, "content": kept}
