"""Cache stability: which parts of the forwarded prompt stay put, and where cache marks go.

Pure (DESIGN §6). Providers cache exact prefixes, so the tracker counts for each item of the
forwarded prompt (``system``, ``summary``, ``history:<fp>``) how many consecutive requests it
stayed unchanged in place, and promotes long-stable items to tiers L1-L3. For providers with
explicit breakpoints (Anthropic ``cache_control``, at most 4 per request) marks go at tier
ends. After a compaction every ``history:*`` item is purged and re-registers at N = 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy.core.frozen import quick_init
from proxy.core.messages import Message

MAX_BREAKPOINTS = 4
EPHEMERAL = {"type": "ephemeral"}


@dataclass(frozen=True)
class TierThresholds:
    """Consecutive unchanged requests needed for tiers L1, L2 and L3."""

    l1: int = 1
    l2: int = 3
    l3: int = 10

    def tier(self, n: int) -> int:
        return 3 if n >= self.l3 else 2 if n >= self.l2 else 1 if n >= self.l1 else 0


# How many requests a client's in-place edit of its history is remembered (``edit_limit``):
# a client that edits on every request (or every few) keeps it fresh; a one-off edit (a
# branch, a single clearing) stops constraining compactions after this.
EDIT_MEMORY = 5


@quick_init
@dataclass(frozen=True)
class StabilityState:
    """The tracker for one conversation: the items in order with their counts; and where the
    client last changed a message it had sent before (``edit_at``, an index of its history;
    -1: never seen), ``edit_age`` requests ago."""

    record: str | None
    items: tuple[tuple[str, int], ...]
    edit_at: int = -1
    edit_age: int = 0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"record": self.record, "items": [list(i) for i in self.items]}
        if self.edit_at >= 0:
            out.update(edit_at=self.edit_at, edit_age=self.edit_age)
        return out

    @classmethod
    def from_json(cls, data: Any) -> StabilityState | None:
        if not isinstance(data, dict) or not isinstance(data.get("items"), list):
            return None
        items = []
        for item in data["items"]:
            if (
                isinstance(item, list)
                and len(item) == 2
                and isinstance(item[0], str)
                and isinstance(item[1], int)
            ):
                items.append((item[0], item[1]))
        record = data.get("record")
        at, age = data.get("edit_at"), data.get("edit_age")
        if type(at) is not int or type(age) is not int or at < 0 or age < 0:
            at, age = -1, 0
        return cls(record if isinstance(record, str) else None, tuple(items), at, age)

    def edit_limit(self) -> int | None:
        """The index of the client's history up to which a compaction's record may reach
        (its ``k``) and still match the client's next requests, when the client edits its
        own older messages in place (clears old tool results, keeps only its last
        observations): the message it changed last, if that was within ``EDIT_MEMORY``
        requests. None: no such edit seen lately."""
        return self.edit_at if self.edit_at >= 0 and self.edit_age < EDIT_MEMORY else None


class _ItemNames:
    """``history:<the fingerprint's first 16 hex digits>`` of fingerprints seen lately (#28).

    Every request names each message of its history (``prompt_items`` of 50 messages:
    ~6.5 us formatted, ~3 looked up), and an agent's next request holds the last one's
    messages. The same name object each time also makes ``observe``'s comparison of two
    requests' items an identity check. Bounded: two generations of at most ``size`` names
    (~150 bytes each); safe from threads (dict operations)."""

    def __init__(self, size: int = 20_000) -> None:
        self.size = size
        self._new: dict[bytes, str] = {}
        self._old: dict[bytes, str] = {}

    def __call__(self, fps: Sequence[bytes]) -> list[str]:
        get = self._new.get
        items = [get(fp) for fp in fps]
        if None in items:
            named = zip(items, fps, strict=True)
            return [name if name is not None else self._named(fp) for name, fp in named]
        return items  # type: ignore[return-value]

    def _named(self, fp: bytes) -> str:
        name = self._old.get(fp)
        if name is None:
            name = f"history:{fp[:8].hex()}"
        if len(self._new) >= self.size:
            self._old, self._new = self._new, {}
        self._new[fp] = name
        return name


_ITEM_NAMES = _ItemNames()


def prompt_items(fps: Sequence[bytes], head_len: int, summary_index: int | None) -> list[str]:
    """Item ids of a forwarded prompt, given each message's fingerprint."""
    items = _ITEM_NAMES(fps)  # (a new list: changed below)
    for i in range(min(head_len, len(items))):
        items[i] = "system:" + items[i][8:]
    if summary_index is not None and head_len <= summary_index < len(items):
        items[summary_index] = "summary:" + items[summary_index][8:]
    return items


def observe(
    previous: StabilityState | None,
    items: Sequence[str],
    record: str | None,
    origins: Sequence[int | None] | None = None,
) -> StabilityState:
    """The tracker after one more request: an item unchanged in place, with everything
    before it unchanged too, counts one more; any other item restarts at 0.

    A different record than last time means a compaction happened: every ``history:*`` item
    is purged first, so it registers afresh at N = 0.

    Under the same record, an item that differs before the previous prompt's end (neither
    appended to nor shrunk to a prefix, as a regenerated reply is) is a message the client
    changed after sending it: its index in the client's history (``origins``: each item's,
    when a record forwards stored messages; by default the item's own) is ``edit_at``.
    """
    old = list(previous.items) if previous else []
    if previous is not None and previous.record != record:
        old = [(item, n) if not item.startswith("history:") else ("", 0) for item, n in old]
    # A provider cache is a prefix: after the first change nothing is reused.
    same = 0
    for (was, _), item in zip(old, items, strict=False):
        if was != item:
            break
        same += 1
    counted = [(item, old[i][1] + 1) for i, item in enumerate(items[:same])]
    counted += [(item, 0) for item in items[same:]]
    edit_at, edit_age = -1, 0
    if previous is not None and previous.edit_at >= 0:
        edit_at, edit_age = previous.edit_at, previous.edit_age + 1
    if previous is not None and previous.record == record:
        changed = _changed(old, items, same)
        at = origins[changed] if origins is not None and changed is not None else changed
        if at is not None:  # (a stored message never changes: the client's own did)
            edit_at, edit_age = at, 0
    return StabilityState(record, tuple(counted), edit_at, edit_age)


def _changed(old: Sequence[tuple[str, int]], items: Sequence[str], same: int) -> int | None:
    """The index in ``items`` of the first message after the head that differs from the
    one in its place before the previous prompt's end (``same``: the items the two share
    from the start): an edit of the client's history. A head that changed (a clock in the
    system prompt) is not one: it is forwarded as sent and never compacted, so it constrains
    no cut."""
    if same >= min(len(old), len(items)):
        return None
    if not items[same].startswith("system:") and not old[same][0].startswith("system:"):
        return same  # (the head, if any, unchanged: the common case, no second walk)
    was_head = 0
    while was_head < len(old) and old[was_head][0].startswith("system:"):
        was_head += 1
    head = 0
    while head < len(items) and items[head].startswith("system:"):
        head += 1
    for i in range(min(len(old) - was_head, len(items) - head)):
        if old[was_head + i][0] != items[head + i]:
            return head + i
    return None


def tiers(state: StabilityState, thresholds: TierThresholds) -> list[int]:
    return [thresholds.tier(n) for _, n in state.items]


def _run_end(
    levels: Sequence[int], start: int, minimum: int, markable: Sequence[bool]
) -> int | None:
    """The last markable index of the unbroken run from ``start`` with tier >= ``minimum``."""
    end = None
    for i in range(start, len(levels)):
        if levels[i] < minimum:
            break
        if markable[i]:
            end = i
    return end


_UNMARKABLE = frozenset({"thinking", "redacted_thinking"})


def markable(message: Message) -> bool:
    """Whether a mark can go on this message: it goes on its last content part, which must
    not be a thinking block (the Messages API's thinking blocks have no ``cache_control``
    and must come back unmodified: a mark there is a 400)."""
    content = message.get("content")
    if isinstance(content, str):
        return bool(content)
    return (
        isinstance(content, list)
        and bool(content)
        and isinstance(content[-1], dict)
        and content[-1].get("type") not in _UNMARKABLE
    )


def breakpoints(
    levels: Sequence[int],
    head_len: int,
    summary_index: int | None,
    can_mark: Sequence[bool] | None = None,
    limit: int = MAX_BREAKPOINTS,
) -> list[int]:
    """Message indices to mark: the head's end, the summary, and the ends of stable runs.

    ``can_mark[i]`` says whether message i can carry a mark (a tool-call turn with no text
    cannot); a run's mark goes on its last message that can. At most ``limit`` marks (the
    provider's 4 minus the client's own marks elsewhere in the request).
    """
    can_mark = can_mark if can_mark is not None else [True] * len(levels)
    marks: list[int] = []
    if head_len:
        marks.append(head_len - 1)
    body = head_len
    if summary_index is not None:
        marks.append(summary_index)
        body = summary_index + 1
    for minimum in (2, 1):
        end = _run_end(levels, body, minimum, can_mark)
        if end is not None:
            marks.append(end)
    unique = sorted(set(marks))
    # Never more than the limit: keep the latest ones, which cover the longest prefixes.
    limit = max(0, min(limit, MAX_BREAKPOINTS))
    return unique[-limit:] if limit else []


def has_cache_marks(messages: Sequence[Message]) -> bool:
    """Whether the client placed any ``cache_control`` of its own."""
    for m in messages:
        if "cache_control" in m:
            return True
        content = m.get("content")
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and "cache_control" in part:
                    return True
    return False


def with_marks(messages: Sequence[Message], indices: Sequence[int]) -> list[Message]:
    """Copies of the marked messages with ``cache_control`` on their last content part."""
    out = list(messages)
    for i in indices:
        if not markable(out[i]):
            continue
        message = dict(out[i])
        content = message.get("content")
        if isinstance(content, str):
            message["content"] = [{"type": "text", "text": content, "cache_control": EPHEMERAL}]
        elif isinstance(content, list):
            parts = list(content)
            parts[-1] = {**parts[-1], "cache_control": EPHEMERAL}
            message["content"] = parts
        out[i] = message
    return out
