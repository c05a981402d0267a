"""The pass ``behaviour.observe`` makes over a history, resumed where it stopped (#28).

``observe`` runs on every request of a compacted conversation and walks the client's whole
history: which calls each assistant turn issued, which results answer which call, the turns
before and after the record. An agent's next request is its previous one plus a few
messages, so walking it all again is work in proportion to the session's length for what
changed by a turn: 1.8 ms a request at 2,100 messages. A ``Walk`` is the pass's state after
its first ``length`` messages; ``Walks`` keeps the latest one per conversation and record,
and the next request resumes it when its first ``length`` messages are the same ones. That
is checked, not trusted: the request's prefix chain at ``length`` (``fingerprint.
prefix_chain``, a hash over the tenant and every message's fingerprint up to there) must be
the one the walk was made over, and the record's cut (``k``, where "after" begins, the
results it forwards in place) must be the one it was walked for. Anything else walks from
the start. Pure, besides that bounded memory: a walk is copied before it is resumed, so two
requests of one conversation in two threads never share one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.core import prune
from proxy.core.messages import Message, tool_results

Cut = tuple[int, int, frozenset[int]]  # the record's k, where "after" begins, kept in place
Keyed = tuple[str, str]  # a call's tool name and identity


def identity(name: str, arguments: Any) -> str:
    """A tool call's identity: its name and arguments, canonical (key order ignored).
    Arguments nested deeper than orjson writes are named by their ``repr`` (the same for the
    same arguments), never an error that would take the request's preparation down."""
    try:
        return orjson.dumps([name, arguments], option=orjson.OPT_SORT_KEYS).decode()
    except orjson.JSONEncodeError:
        try:
            text = repr(arguments)
        except RecursionError:
            text = "?"
        return orjson.dumps([name, text]).decode()


def identity_of(call: prune.Call | None) -> Keyed:
    """(tool name, identity) of a call; ``?`` for a result whose call is not in the history."""
    if call is None:
        return "?", identity("?", None)
    name, raw, encoded = call
    return name, identity(name, prune.arguments_of(raw) if encoded else raw)


@dataclass
class Walk:
    """The pass's state after ``messages[:length]``."""

    length: int = 0
    calls: dict[str, prune.Call] = field(default_factory=dict)  # id -> the latest call
    early: list[Keyed] = field(default_factory=list)  # calls answered before k, cleared
    late: list[prune.Call | None] = field(default_factory=list)  # answered from "since" on
    late_keys: list[Keyed] = field(default_factory=list)  # (in step with ``late``)
    before: list[int] = field(default_factory=lambda: [0, 0])  # assistant turns, instructions
    after: list[int] = field(default_factory=lambda: [0, 0])

    def copy(self) -> Walk:
        return Walk(
            self.length,
            dict(self.calls),
            list(self.early),
            list(self.late),
            list(self.late_keys),
            list(self.before),
            list(self.after),
        )


def walk(messages: Sequence[Message], cut: Cut, start: Walk | None = None) -> Walk:
    """The pass over ``messages`` from ``start`` (a copy of it; from the first message when
    None). A result answers the last call issued before it with its id. Each answered call's
    identity is taken once, as the walk reaches it (its arguments parsed then), not again on
    every later request."""
    k, since, in_place = cut
    w = start.copy() if start is not None else Walk()
    calls, early, late, late_keys = w.calls, w.early, w.late, w.late_keys
    for i in range(w.length, len(messages)):
        m = messages[i]
        role = m.get("role")
        counts = w.before if i < since else w.after
        if role == "assistant":
            counts[0] += 1
            calls.update(prune.issued(m))
            continue
        if role == "user" and not (tool_results(m) and only_results(m)):
            counts[1] += 1
        answered = tool_results(m) if role in ("tool", "user") else []
        if i < k and i not in in_place:
            early.extend(identity_of(calls.get(c)) for c in answered)
        if i >= since:
            answering = [calls.get(c) for c in answered]
            late.extend(answering)
            late_keys.extend(identity_of(c) for c in answering)
    w.length = len(messages)
    return w


def only_results(message: Message) -> bool:
    """Whether a user message holds tool results and nothing else."""
    content = message.get("content")
    return isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "tool_result" for b in content
    )


class Walks:
    """The latest walk per (conversation, record), at most ``size`` of them (the oldest
    forgotten first): a walk of a 2,000-message history holds ~200 KB (its calls and their
    identities), so 32 of them ~6 MB at most. Safe to share between threads."""

    def __init__(self, size: int = 32) -> None:
        self._size = size
        self._kept: dict[tuple[str, str], tuple[Cut, bytes, Walk]] = {}
        self._lock = threading.Lock()

    def resume(self, key: tuple[str, str], cut: Cut, chain: Sequence[bytes]) -> Walk | None:
        """The kept walk of ``key`` if it was made over this request's first messages for
        this cut (``chain``: the request's prefix chain, ``chain[n]`` naming its first n)."""
        with self._lock:
            found = self._kept.get(key)
        if found is None:
            return None
        kept_cut, at, w = found
        if kept_cut != cut or w.length >= len(chain) or chain[w.length] != at:
            return None
        return w

    def keep(self, key: tuple[str, str], cut: Cut, chain: Sequence[bytes], w: Walk) -> None:
        if w.length >= len(chain):
            return
        with self._lock:
            self._kept.pop(key, None)  # re-inserted last: the dict stays ordered by age
            self._kept[key] = (cut, chain[w.length], w)
            while len(self._kept) > self._size:
                del self._kept[next(iter(self._kept))]


WALKS = Walks()
