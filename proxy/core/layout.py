"""What a new record forwards in place of a prefix, for every tier (DESIGN §4, §10). Pure.

Every tier works on the forwarded list (the previous record already applied) and produces a
new record: a list of entries (see ``proxy.records``) that replaces the forwarded messages up
to some position ``end``, after which the forwarded list is the client's own tail ``m[k:]``.
A forwarded message keeps its entry: the client's own message stays an index (its bytes are the
client's), a stored message stays the same stored bytes, so a new record changes the forwarded
prefix only where the tier changed something.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from proxy.core.frozen import quick_init
from proxy.core.messages import SUMMARY_PREFIX, Message, tool_results
from proxy.core.pins import ROUND_PIN, Pins, without_tool_results
from proxy.core.records import Entry


@quick_init
@dataclass(frozen=True)
class View:
    """A forwarded list with what each position forwards."""

    messages: Sequence[Message]
    origins: Sequence[int | None]  # original index per position; None: stored bytes
    prefix_len: int  # positions before this come from the record's prefix
    original_len: int

    def entry(self, position: int) -> Entry:
        origin = self.origins[position]
        return origin if origin is not None else self.messages[position]

    def k_at(self, end: int) -> int:
        """The original index the forwarded position ``end`` (>= prefix_len) stands for."""
        if end >= len(self.messages):
            return self.original_len
        origin = self.origins[end]
        assert origin is not None and end >= self.prefix_len
        return origin


@dataclass(frozen=True)
class Layout:
    """A new record's prefix: ``entries`` replace ``m[:k]``; ``kept`` are the forwarded
    positions they keep (for token counts) and ``added`` the new stored messages."""

    entries: list[Entry]
    k: int
    kept: list[int]
    added: list[Message]


def summary_position(view: View) -> int | None:
    """Where the previous record's summary (or emergency note) is forwarded, if anywhere."""
    for i in range(view.prefix_len - 1, -1, -1):
        content = view.messages[i].get("content")
        if (
            view.origins[i] is None
            and isinstance(content, str)
            and content.startswith(SUMMARY_PREFIX)
        ):
            return i
    return None


def joined_runs(messages: Sequence[Message]) -> list[list[int]]:
    """Positions forwarded as one user turn each where turns must alternate (/v1/messages):
    every run of two or more user turns with nothing but system messages between them (the
    summary, the pins our placement put beside it, the first kept user turn after it). The
    API merges such turns itself, so joining them changes no meaning; system messages in
    between take no part in alternation and follow the joined turn."""
    runs: list[list[int]] = []
    current: list[int] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "user":
            current.append(i)
        elif role != "system":
            if len(current) > 1:
                runs.append(current)
            current = []
    if len(current) > 1:
        runs.append(current)
    return runs


def turn_opener(messages: Sequence[Message], cut: int, lower: int) -> int | None:
    """The user message that opened the turn a round cut falls in (a cut inside a turn keeps
    the instruction that the rounds carry out)."""
    if cut >= len(messages) or messages[cut].get("role") == "user":
        return None
    for i in range(cut - 1, lower - 1, -1):
        m = messages[i]
        if m.get("role") == "user" and not tool_results(m):
            return i
    return None


def _opens_turn(message: Message) -> bool:
    return message.get("role") == "user" and not tool_results(message)


def replaced(
    view: View,
    head_len: int,
    body_start: int,
    cut: int,
    pins: Pins,
    summary: Message | None,
) -> Layout:
    """Summarize, truncate or drop ``[head_len, cut)``: the head, earlier pins and the pins of
    the span stay in place (in order), then the new summary or note, then the rounds the loop
    breaker keeps, then the rest verbatim.
    (A pin that then leads a /v1/messages body, a system message the client sent after a
    turn no longer forwarded, is put after the first user turn by the surface.)"""
    old_summary = summary_position(view)
    entries: list[Entry] = []
    kept: list[int] = []
    added: list[Message] = []
    rounds: list[int] = []
    for i in range(cut):
        if i < head_len or (i < body_start and i != old_summary) or (i >= body_start and i in pins):
            # A pin's tool results go with their calls (summarized away); a round the loop
            # breaker keeps is pinned whole, its results with it.
            whole = pins.reasons.get(i, "").startswith(ROUND_PIN)
            if i >= body_start and whole:
                rounds.append(i)
                continue
            if i >= body_start and tool_results(view.messages[i]):
                stripped = without_tool_results(view.messages[i])
                if stripped is not None:
                    entries.append(stripped)
                    added.append(stripped)
                continue
            entries.append(view.entry(i))
            kept.append(i)
    if summary is not None:
        entries.append(summary)
        added.append(summary)
    # Rounds the loop breaker keeps go after the summary (a user message): before it, with no
    # pinned user turn ahead (a task too large to pin), an assistant turn would open the body,
    # which /v1/messages refuses. After the summary they also fall in the next record's body,
    # so they are released when the breaker's hold ends. With no summary and no user turn
    # ahead they cannot be placed: they go with the rest of the cut.
    if rounds and (summary is not None or any(_opens_turn(view.messages[i]) for i in kept)):
        entries.extend(view.entry(i) for i in rounds)
        kept.extend(rounds)
    end = max(cut, view.prefix_len)
    for i in range(cut, end):
        entries.append(view.entry(i))
        kept.append(i)
    kept.extend(range(end, len(view.messages)))
    return Layout(entries, view.k_at(end), kept, added)


def pruned(view: View, replacements: Mapping[int, Message]) -> Layout:
    """The forwarded list with some messages replaced (pruned tool results), all else kept."""
    end = max(max(replacements) + 1, view.prefix_len)
    entries: list[Entry] = []
    kept: list[int] = []
    added: list[Message] = []
    for i in range(end):
        if i in replacements:
            entries.append(replacements[i])
            added.append(replacements[i])
        else:
            entries.append(view.entry(i))
            kept.append(i)
    kept.extend(range(end, len(view.messages)))
    return Layout(entries, view.k_at(end), kept, added)
