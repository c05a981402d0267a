"""Compaction events as the operators read them: checked once, then typed.

The core emits events in the ``proxy.core.types`` shapes and they are stored as JSON in the
conversation's ``ev:`` list. What comes back from a store is checked here, once, into those
shapes; the admin API, the dashboard and the metrics then read typed fields with no further
checks. An item that is not an event is skipped; an event written before a field existed
reads that field as its zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import cast

from proxy.adapters.store import Store, get_list
from proxy.core.records import conv_key
from proxy.core.types import (
    COMPACTION_CASES,
    CompactionEvent,
    DetectorFailedEvent,
    Event,
    Failure,
    FailureEvent,
)

Failed = FailureEvent | DetectorFailedEvent


def _num(value: object) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(cast(float, value)) if ok else 0.0


def _int(value: object) -> int:
    return int(_num(value))


def _str(value: object) -> str:
    return value if isinstance(value, str) else ""


def as_event(raw: object) -> Event | None:
    """``raw`` (an event as emitted or as stored) in its typed shape, or None."""
    if not isinstance(raw, Mapping):
        return None
    case, ts, model = raw.get("case"), _num(raw.get("ts")), _str(raw.get("model"))
    if case == Failure.FAILED:
        error = _str(raw.get("error"))
        return FailureEvent(
            case="failed", ts=ts, model=model, error=error, soft=raw.get("soft") is True
        )
    if case == Failure.DETECTOR_FAILED:
        error = _str(raw.get("error"))
        return DetectorFailedEvent(case="detector_failed", ts=ts, model=model, error=error)
    if case not in COMPACTION_CASES:
        return None
    return CompactionEvent(
        case=cast(CompactionEvent, raw)["case"],  # one of COMPACTION_CASES: checked above
        ts=ts,
        model=model,
        k=_int(raw.get("k")),
        covered=_int(raw.get("covered")),
        tokens_before=_int(raw.get("tokens_before")),
        tokens_after=_int(raw.get("tokens_after")),
        reason=_str(raw.get("reason")),
        confidence=_num(raw.get("confidence")),
        duration_s=_num(raw.get("duration_s")),
        llm_tokens=_int(raw.get("llm_tokens")),
        llm_cached_tokens=_int(raw.get("llm_cached_tokens")),
        prefix_hash=_str(raw.get("prefix_hash")),
        facts_kept=_int(raw.get("facts_kept")),
        facts_dropped=_int(raw.get("facts_dropped")),
    )


def split(events: Iterable[Event]) -> tuple[list[CompactionEvent], list[Failed]]:
    """The stored compactions and the failed attempts, each in the given order."""
    compactions: list[CompactionEvent] = []
    failures: list[Failed] = []
    for event in events:
        if event["case"] == Failure.FAILED or event["case"] == Failure.DETECTOR_FAILED:
            failures.append(event)
        else:
            compactions.append(event)
    return compactions, failures


def read_events(store: Store, tenant: str, conversation: str) -> list[Event]:
    """A conversation's events (its ``ev:`` list), oldest first."""
    found = (as_event(raw) for raw in get_list(store, conv_key("ev", tenant, conversation)))
    return sorted((e for e in found if e is not None), key=lambda e: e["ts"])
