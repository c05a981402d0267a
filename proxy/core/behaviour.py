"""The agent's behaviour after a compaction, and the loop breaker (#26). Pure.

The proxy sees every request that follows a compaction. When the agent calls a tool again
with the same arguments as a call whose result the compaction pruned or summarized away, it
is redoing work it had done: that is the cost users feel ("it re-reads the same files after
each compaction until the quota is gone"). Counted per compaction (the record in use):
repeated calls, the file reads among them, and assistant turns per user instruction before
and after it. Past ``loop_breaker_repeats`` repeats the loop breaker backs off for the
conversation: the latest results of what the agent re-fetched are kept out of pruning
(``keep``; it fires at most once per compaction, and each firing replaces the list), within
``prune_protect_tokens`` of kept output, newest first. An unbounded keep list was tried: on
the bench session (an agent that re-reads its 16 files all the time) pruning then freed
almost nothing and the summary tier ran 66 times instead of 4, shedding facts. Pausing
compaction was tried and dropped: a conversation that still grows then only meets the
emergency cut, which loses more. The choice and its reason are stored and shown on the
dashboard.

The keep holds across the next compactions too, for ``HOLD_TURNS`` assistant turns after it
fired (``LoopBreak.holds``): a summary leaves the kept results' whole rounds (the call and
every result it got) in place as pins, within the same ``prune_protect_tokens`` (``rounds``),
and says so in the record's pins. Once the hold is over, pruning may clear them like any
other result (their rounds' few bytes of calls stay where they are).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from proxy.core import artifacts, callwalk, prune
from proxy.core.callwalk import identity
from proxy.core.messages import Message, tool_results
from proxy.core.pins import ROUND_PIN
from proxy.core.records import CompactionRecord, entries

LISTED = 10  # repeated calls named per compaction
KEEP = "keep re-fetched results out of pruning and summaries"
# How long a decision keeps its results, in assistant turns (requests) after it fired: long
# enough to reach past the next compactions of a busy agent, bounded so that a result the
# agent no longer needs is not carried for the rest of the session.
HOLD_TURNS = 40


def _shown(name: str, arguments: Any) -> str:
    return f"{name}({prune.key_arguments(arguments)})"


@dataclass(frozen=True)
class Behaviour:
    """What the agent did after one compaction (the record ``record``)."""

    record: str  # the record's prefix hash
    case: str
    repeated_calls: int = 0
    rereads: int = 0  # repeated calls that read a file
    repeated: list[str] = field(default_factory=list)  # shown as name(key args)
    identities: list[str] = field(default_factory=list)  # what a breaker would keep
    turns_before: float = 0.0  # assistant turns per user instruction before the compaction
    turns_after: float = 0.0
    # The counts behind the two ratios (assistant turns, user instructions): what /metrics
    # adds up, so that its ratio weighs every instruction alike.
    counts_before: tuple[int, int] = (0, 0)
    counts_after: tuple[int, int] = (0, 0)

    def to_json(self) -> dict[str, Any]:
        # As the store gives it back (JSON has no tuples), so unchanged figures compare
        # equal; written out, not ``asdict``: it runs on every request of a compacted
        # conversation (#28), and ``asdict`` copies recursively, ~2 % of such a request.
        return {
            "record": self.record,
            "case": self.case,
            "repeated_calls": self.repeated_calls,
            "rereads": self.rereads,
            "repeated": list(self.repeated),
            "identities": list(self.identities),
            "turns_before": self.turns_before,
            "turns_after": self.turns_after,
            "counts_before": list(self.counts_before),
            "counts_after": list(self.counts_after),
        }


def ratio(counts: tuple[int, int]) -> float:
    """Assistant turns per user instruction."""
    assistants, instructions = counts
    return round(assistants / instructions, 2) if instructions else float(assistants)


def observe(
    messages: Sequence[Message],
    record: CompactionRecord,
    *,
    resume: tuple[str, Sequence[bytes]] | None = None,
    walks: callwalk.Walks = callwalk.WALKS,
) -> Behaviour:
    """The agent's behaviour in ``messages`` (the client's whole history) since ``record``
    took effect: calls that repeat one whose result the record no longer forwards.

    It runs on every request of a compacted conversation, so it is one pass
    (``callwalk.walk``) that parses a call's arguments (for its identity) only when a result
    the record cleared, or one after the record, answers it. (It was two passes of
    ``prune.tool_results``, which parse every call and join every output's text: 7.6 ms a
    request at 2,000 messages.) A result answers the last call issued before it with its
    id (an agent that reuses ids, "call_0" every turn, is read right). ``resume``: the
    conversation and this request's prefix chain, to go on from the pass over its previous
    request where this one extends it (``callwalk.Walks``); without it, from the start."""
    in_place = frozenset(e for e in entries(record) if isinstance(e, int))
    cut = (record.k, record.request_len or record.k, in_place)
    start = None
    if resume is not None:
        conversation, chain = resume
        start = walks.resume((conversation, record.prefix_hash), cut, chain)
    w = callwalk.walk(messages, cut, start)
    if resume is not None:
        walks.keep((conversation, record.prefix_hash), cut, chain, w)
    late, late_keys, before, after = w.late, w.late_keys, w.before, w.after
    names = {name for name, _ in late_keys}
    cleared = {key for name, key in w.early if name in names}
    repeated: list[str] = []
    identities: list[str] = []
    rereads = 0
    seen: dict[str, tuple[str, bool]] = {}  # identity -> (shown, a file read): shell parsing
    for c, (_, key) in zip(late, late_keys, strict=True):
        if key not in cleared:
            continue
        if key not in seen:
            name, raw, encoded = c or ("?", None, False)
            arguments = prune.arguments_of(raw) if encoded else raw
            files = artifacts.call_files(name, arguments)
            seen[key] = (_shown(name, arguments), any(a == artifacts.READ for a, _ in files))
        shown, reads = seen[key]
        repeated.append(shown)
        identities.append(key)
        rereads += reads
    counts_before, counts_after = (before[0], before[1]), (after[0], after[1])
    return Behaviour(
        record.prefix_hash,
        record.case,
        len(repeated),
        rereads,
        list(dict.fromkeys(repeated))[:LISTED],
        list(dict.fromkeys(identities)),
        ratio(counts_before),
        ratio(counts_after),
        counts_before,
        counts_after,
    )


@dataclass(frozen=True)
class LoopBreak:
    """The loop breaker's decision for a conversation (stored under its ``loop:`` key)."""

    action: str  # KEEP
    reason: str
    record: str  # the compaction after which the agent repeated work
    keep: list[str]  # identities kept out of pruning
    fired: int  # times it fired in this conversation
    ts: float
    at: int = 0  # the conversation's assistant turns when it fired
    until: int = 0  # the turns up to which it holds (``at + HOLD_TURNS``)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def holds(self, turns: int) -> bool:
        """Whether the keep is in force at a history of ``turns`` assistant turns."""
        return bool(self.keep) and turns <= self.until

    @classmethod
    def from_json(cls, raw: Any) -> LoopBreak | None:
        if not isinstance(raw, dict):
            return None
        try:
            return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})
        except TypeError:
            return None


def breaker(
    seen: Behaviour,
    previous: LoopBreak | None,
    threshold: int,
    now: float,
    earlier: Sequence[Any] = (),
) -> LoopBreak | None:
    """A new decision when the agent repeated ``threshold`` calls or more after this
    compaction and the breaker has not fired for it yet; else None. ``earlier``: the stored
    figures (``Behaviour.to_json``) of the compactions before this one since the breaker
    last fired: their repeats count too, so that a loop a pruning falls into the middle of
    (2 re-reads after one, 1 after the next) still reaches the threshold."""
    if threshold <= 0 or (previous is not None and previous.record == seen.record):
        return None
    before = [f for f in earlier if isinstance(f, dict) and f.get("record") != seen.record]
    calls = seen.repeated_calls + sum(int(f.get("repeated_calls") or 0) for f in before)
    if seen.repeated_calls == 0 or calls < threshold:
        return None
    fired = previous.fired + 1 if previous else 1
    shown = [str(x) for f in before for x in f.get("repeated") or []] + seen.repeated
    what = ", ".join(list(dict.fromkeys(reversed(shown)))[:3])
    also = sum(1 for f in before if f.get("repeated_calls"))
    since = f" and {also} before it" if also else ""
    reason = (
        f"after the {seen.case} compaction {seen.record[:8]}{since} the agent repeated "
        f"{calls} tool calls whose results it had cleared ({what})"
    )
    turns = seen.counts_before[0] + seen.counts_after[0]
    reason += f"; kept through later compactions for {HOLD_TURNS} turns"
    ids = [str(x) for f in before for x in f.get("identities") or []] + seen.identities
    keep = list(dict.fromkeys(reversed(ids)))[:50][::-1]
    return LoopBreak(KEEP, reason, seen.record, keep, fired, now, turns, turns + HOLD_TURNS)


def rounds(
    messages: Sequence[Message],
    counts: Sequence[int],
    keep: frozenset[str],
    start: int,
    cut: int,
    budget: int,
) -> dict[int, str]:
    """The positions of ``[start, cut)`` a summary leaves in place for the loop breaker: the
    whole round (the message that made the call, and every result of its calls) of the
    latest result of each kept call, newest first; position -> why. A round that begins
    before ``start`` or ends at or after ``cut`` is not split.

    Bounded by ``budget`` tokens of whole rounds, counting the rounds earlier summaries left
    in place before ``start`` (only the breaker's rounds carry tool calls or results there:
    other pins go without them). Those stay until the conversation's pins are spent, so the
    bound holds for the conversation, not per summary: counting only the kept result, each
    summary pinned another window of rounds and the 120-request bench session forwarded
    17,115 tokens at a 6,000 trigger (3,891 without these pins)."""
    if not keep or budget <= 0:
        return {}
    results = prune.tool_results(messages[:cut])
    latest: dict[str, prune.ToolResult] = {}
    for r in results:
        key = identity(r.name, r.arguments)
        if key in keep:
            latest[key] = r
    answers: dict[str, int] = {r.call_id: r.position for r in results}
    out: dict[int, str] = {}
    used = sum(counts[i] for i in range(start) if _in_round(messages[i]))
    for r in sorted(latest.values(), key=lambda r: -r.position):
        if r.position < start or r.position in out:
            continue
        caller = next((i for i in range(r.position - 1, start - 1, -1)
                       if r.call_id in _call_ids(messages[i])), None)  # fmt: skip
        if caller is None:
            continue
        ids = _call_ids(messages[caller])
        if not all(i in answers for i in ids):
            continue  # a call of the round unanswered before the cut: not a whole round
        where = {caller, *(answers[i] for i in ids)}
        size = sum(counts[i] for i in where if i not in out)
        if used + size > budget:
            continue
        used += size
        why = f"{ROUND_PIN}: {_shown(r.name, r.arguments)}"
        for i in where:
            out.setdefault(i, why)
    return out


def _in_round(message: Message) -> bool:
    """Whether ``message`` makes tool calls or carries tool results."""
    return bool(_call_ids(message)) or message.get("role") == "tool" or bool(tool_results(message))


def _call_ids(message: Message) -> list[str]:
    """The ids of the tool calls ``message`` makes (chat tool_calls, Anthropic tool_use)."""
    ids = [
        str(c["id"]) for c in message.get("tool_calls") or [] if isinstance(c, dict) and "id" in c
    ]
    content = message.get("content")
    if isinstance(content, list):
        ids += [
            str(b["id"])
            for b in content
            if isinstance(b, dict) and b.get("type") == "tool_use" and "id" in b
        ]
    return ids
