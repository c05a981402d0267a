"""Naive truncations at a given token budget, and what a history still holds. Pure."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

Message = dict[str, Any]


def all_text(value: Any) -> str:
    """Every string inside a forwarded body (contents, tool arguments, names), joined."""
    out: list[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict):
            for item in v.values():
                walk(item)
        elif isinstance(v, list):
            for item in v:
                walk(item)

    walk(value)
    return "\n".join(out)


def present(answers: Iterable[str], messages: Sequence[Message]) -> list[str]:
    """The answers that occur verbatim in the messages."""
    text = all_text(list(messages))
    return [a for a in answers if a in text]


def _head(messages: Sequence[Message]) -> int:
    n = 0
    while n < len(messages) and messages[n].get("role") in ("system", "developer"):
        n += 1
    return n


def drop_the_middle(
    messages: Sequence[Message], counts: Sequence[int], budget: int
) -> list[Message]:
    """The head, then as many of the oldest and newest messages as fit, half the budget each
    (what the oldest half does not use goes to the newest)."""
    head = _head(messages)
    room = budget - 3 - sum(counts[:head])
    front_room = room // 2
    front, used = head, 0
    while front < len(messages) and used + counts[front] <= front_room:
        used += counts[front]
        front += 1
    back, back_used = len(messages), 0
    while back > front and used + back_used + counts[back - 1] <= room:
        back_used += counts[back - 1]
        back -= 1
    return [*messages[:front], *messages[back:]]


def keep_last_turns(
    messages: Sequence[Message], counts: Sequence[int], budget: int
) -> list[Message]:
    """The head and the most recent whole user turns that fit (at least the last message)."""
    head = _head(messages)
    room = budget - 3 - sum(counts[:head])
    start, used, best = len(messages), 0, len(messages) - 1
    while start > head and used + counts[start - 1] <= room:
        used += counts[start - 1]
        start -= 1
        if messages[start].get("role") == "user":
            best = start
    return [*messages[:head], *messages[best:]]
