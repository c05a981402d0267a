"""The names and shapes every layer shares: the core writes them, the ledger, the admin API,
the dashboard and the metrics read them. One definition, so a new case or field is added in
one place and a typo is a type error rather than a silently empty dashboard row.

``Case`` is a ``StrEnum``: its members are the strings stored in the ledger and shown in the
admin API (``Case.PRUNE == "prune"``), so stored data written before this module existed
reads the same.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, TypedDict


class Case(StrEnum):
    """What happened to one request (the ledger's and the response header's ``case``)."""

    NONE = "none"  # forwarded as sent (or under an earlier compaction, unchanged since)
    PRUNE = "prune"  # old tool results replaced by placeholders (no LLM call)
    TRUNCATE = "truncate"  # an earlier topic dropped, with a short note
    SUMMARIZE = "summarize"  # older turns replaced by a summary
    EMERGENCY = "emergency"  # no usable LLM result: oldest whole rounds dropped to fit
    OFF = "off"  # ``x-compaction: off`` or server-side conversation state
    OPT_OUT = "opt-out"  # tenant, model or conversation opted out (or paused)
    CLIENT_COMPACTION = "client-compaction"  # the client compacts its own history
    SHADOW = "shadow"  # measured only: forwarded byte for byte
    ERROR = "error"  # the request failed before it was prepared


# A compaction record's case: what a stored compaction did.
COMPACTION_CASES: frozenset[Case] = frozenset(
    {Case.PRUNE, Case.TRUNCATE, Case.SUMMARIZE, Case.EMERGENCY}
)
# Requests forwarded as sent by rule, never compacted.
SKIPPED_CASES: frozenset[Case] = frozenset({Case.OFF, Case.OPT_OUT, Case.CLIENT_COMPACTION})


class Failure(StrEnum):
    """The ``case`` of an event that reports a failed attempt rather than a compaction."""

    FAILED = "failed"  # the summarizer (or the whole LLM path) failed
    DETECTOR_FAILED = "detector_failed"  # the detector failed; the summarizer still ran


FAILURE_CASES: frozenset[Failure] = frozenset(Failure)


class _EventBase(TypedDict):
    ts: float
    model: str


class CompactionEvent(_EventBase):
    """A stored compaction (``ev:`` list of the conversation; metrics)."""

    case: Literal["prune", "truncate", "summarize", "emergency"]
    k: int
    covered: int
    tokens_before: int
    tokens_after: int
    reason: str
    confidence: float
    duration_s: float
    llm_tokens: int
    prefix_hash: str
    facts_kept: int
    facts_dropped: int


class FailureEvent(_EventBase):
    """A failed compaction attempt: ``soft`` when a summary was refused by its checks."""

    case: Literal["failed"]
    error: str
    soft: bool


class DetectorFailedEvent(_EventBase):
    case: Literal["detector_failed"]
    error: str


Event = CompactionEvent | FailureEvent | DetectorFailedEvent


def is_compaction(event: Event) -> bool:
    """Whether ``event`` reports a stored compaction (not a failure)."""
    return event["case"] in COMPACTION_CASES
