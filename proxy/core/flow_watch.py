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
from proxy.core.types import BehaviourEvent, LoopBreakerEvent

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
    figures.pop(seen.record, None)
    figures[seen.record] = seen.to_json()
    figures = dict(list(figures.items())[-KEPT_RECORDS:])
    t, conv = p.tenant, p.conversation
    try:
        yield Remember(conv_key("behave", t, conv), figures)
        old = before if isinstance(before, dict) else {}
        more = seen.repeated_calls - int(old.get("repeated_calls", 0))
        if more > 0:
            event: BehaviourEvent = {
                "case": "behaviour", "record": seen.record, "repeated_calls": more,
                "rereads": max(0, seen.rereads - int(old.get("rereads", 0))),
                "ts": time.time(), "model": p.model,
            }  # fmt: skip
            yield Emit(t, conv, event)
        decision = behaviour.breaker(seen, loop, env.settings.loop_breaker_repeats, time.time())
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
