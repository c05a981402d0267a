"""Watching the agent after a compaction, as a sans-I/O flow (#26; ``behaviour``).

Runs on the request path when a record is in use: counts what the agent repeated since that
compaction (pure, one pass over the history), stores the figures only when they changed,
reports what is new as an event (metrics, timeline), and lets the loop breaker decide.
"""

from __future__ import annotations

import time
from typing import Any

from proxy.core import behaviour
from proxy.core.commands import Emit, Flow, Remember
from proxy.core.errors import StoreError
from proxy.core.prepared import Env, Prepared
from proxy.core.records import conv_key
from proxy.core.types import BehaviourEvent, LoopBreakerEvent, TurnCounts

KEPT_RECORDS = 20  # compactions whose figures a conversation keeps


def watch(
    env: Env,
    p: Prepared,
    seen: behaviour.Behaviour,
    stored: Any,
    loop: behaviour.LoopBreak | None,
) -> Flow[behaviour.LoopBreak | None]:
    """The loop breaker's decision in force after this request (``loop`` when unchanged).
    ``seen``: ``behaviour.observe`` of this request; ``stored``: the conversation's
    ``behave:`` value as read (compaction -> figures)."""
    figures = dict(stored) if isinstance(stored, dict) else {}
    before = figures.get(seen.record)
    if before == seen.to_json():
        return loop
    turns = _turns(figures, seen) if before is None else []
    figures.pop(seen.record, None)
    figures[seen.record] = seen.to_json()
    figures = dict(list(figures.items())[-KEPT_RECORDS:])
    t, conv = p.tenant, p.conversation
    try:
        yield Remember(conv_key("behave", t, conv), figures)
        old = before if isinstance(before, dict) else {}
        more = seen.repeated_calls - int(old.get("repeated_calls", 0))
        if more > 0 or turns:
            event: BehaviourEvent = {
                "case": "behaviour", "record": seen.record, "repeated_calls": max(0, more),
                "rereads": max(0, seen.rereads - int(old.get("rereads", 0))),
                "ts": time.time(), "model": p.model,
            }  # fmt: skip
            if turns:
                event["turns"] = turns
            yield Emit(t, conv, event)
        decision = behaviour.breaker(
            seen, loop, env.settings.loop_breaker_repeats, time.time(), _since(figures, loop)
        )
        if decision is None:
            return loop
        yield Remember(conv_key("loop", t, conv), decision.to_json())
        fired: LoopBreakerEvent = {
            "case": "loop_breaker", "action": decision.action, "reason": decision.reason[:300],
            "ts": decision.ts, "model": p.model,
        }  # fmt: skip
        yield Emit(t, conv, fired)
        return decision
    except StoreError:
        return loop  # figures missed for this request; the next one counts again


def _turns(figures: dict[str, Any], seen: behaviour.Behaviour) -> list[TurnCounts]:
    """When a compaction is first seen in use: its "before" counts, and the "after" counts
    of the compaction in use until now (final: no later request adds to them). Reported
    once per compaction, so /metrics sums each conversation's turns once; the latest
    compaction's "after" counts reach it when the next one takes over (the conversation's
    page shows them as they grow)."""
    out: list[TurnCounts] = []
    previous = next(reversed(figures.values()), None) if figures else None
    if isinstance(previous, dict):
        counts = previous.get("counts_after")
        if (
            isinstance(counts, list)
            and len(counts) == 2
            and all(isinstance(n, int) for n in counts)
        ):
            case = str(previous.get("case") or "?")[:20]
            out.append(
                {"phase": "after", "case": case, "turns": counts[0], "instructions": counts[1]}
            )
    assistants, instructions = seen.counts_before
    out.append(
        {"phase": "before", "case": seen.case, "turns": assistants, "instructions": instructions}
    )
    return out


def _since(figures: dict[str, Any], loop: behaviour.LoopBreak | None) -> list[Any]:
    """The stored figures of the compactions after the one the breaker last fired for (all
    of them when it never fired), oldest first."""
    records = list(figures)
    if loop is not None and loop.record in figures:
        records = records[records.index(loop.record) + 1 :]
    return [figures[r] for r in records]
