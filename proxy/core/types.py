"""The names and shapes every layer shares: the core writes them, the ledger, the admin API,
the dashboard and the metrics read them. One definition, so a new case or field is added in
one place and a typo is a type error rather than a silently empty dashboard row.

``Case`` and ``Failure`` hold plain strings (``Case.PRUNE == "prune"``), typed as the
``CaseName`` literals: they are stored in the ledger, used as JSON keys and shown in the admin
API exactly as before this module existed (an enum would not be a valid orjson key).
"""

from __future__ import annotations

from typing import Any, Final, Literal, NotRequired, TypedDict

CaseName = Literal[
    "none", "prune", "truncate", "summarize", "emergency",
    "off", "opt-out", "client-compaction", "shadow", "error", "healed",
]  # fmt: skip


class Case:
    """What happened to one request (the ledger's and the response header's ``case``)."""

    NONE: Final = "none"  # forwarded as sent (or under an earlier compaction, unchanged since)
    PRUNE: Final = "prune"  # old tool results replaced by placeholders (no LLM call)
    TRUNCATE: Final = "truncate"  # an earlier topic dropped, with a short note
    SUMMARIZE: Final = "summarize"  # older turns replaced by a summary
    EMERGENCY: Final = "emergency"  # no usable LLM result: oldest whole rounds dropped to fit
    OFF: Final = "off"  # ``x-compaction: off`` or server-side conversation state
    OPT_OUT: Final = "opt-out"  # tenant, model or conversation opted out (or paused)
    CLIENT_COMPACTION: Final = "client-compaction"  # the client compacts its own history
    SHADOW: Final = "shadow"  # measured only: forwarded byte for byte
    ERROR: Final = "error"  # the request failed before it was prepared
    # The upstream refused (400) the body a compaction changed: sent again as the client
    # sent it; the conversation is not compacted again (its ``refused:`` store key).
    HEALED: Final = "healed"


# A compaction record's case: what a stored compaction did.
COMPACTION_CASES: frozenset[str] = frozenset(
    {Case.PRUNE, Case.TRUNCATE, Case.SUMMARIZE, Case.EMERGENCY}
)
# Requests forwarded as sent by rule, never compacted.
SKIPPED_CASES: frozenset[str] = frozenset({Case.OFF, Case.OPT_OUT, Case.CLIENT_COMPACTION})


class Failure:
    """The ``case`` of an event that reports a failed attempt rather than a compaction."""

    FAILED: Final = "failed"  # the summarizer (or the whole LLM path) failed
    DETECTOR_FAILED: Final = "detector_failed"  # the detector failed; the summarizer still ran


FAILURE_CASES: frozenset[str] = frozenset({Failure.FAILED, Failure.DETECTOR_FAILED})


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
    llm_cached_tokens: NotRequired[int]  # of llm_tokens, read from the provider's cache
    prefix_hash: str
    facts_kept: int
    facts_dropped: int
    # Anchors of the replaced span by category and fate (proxy.core.anchors); #26.
    anchors: NotRequired[dict[str, dict[str, Any]]]


class FailureEvent(_EventBase):
    """A failed compaction attempt: ``soft`` when a summary was refused by its checks."""

    case: Literal["failed"]
    error: str
    soft: bool


class DetectorFailedEvent(_EventBase):
    case: Literal["detector_failed"]
    error: str


class TurnCounts(TypedDict):
    """Assistant turns and user instructions of a conversation before or after a compaction
    (``phase``), by the compaction's case: what /metrics adds up."""

    phase: Literal["before", "after"]
    case: str
    turns: int
    instructions: int


class BehaviourEvent(_EventBase):
    """#26: tool calls repeated after a compaction (new since the last such event); with
    ``turns`` when a compaction is first seen in use (its "before" counts, and the "after"
    counts of the compaction it took over from, final then)."""

    case: Literal["behaviour"]
    record: str
    repeated_calls: int
    rereads: int
    turns: NotRequired[list[TurnCounts]]


class LoopBreakerEvent(_EventBase):
    """#26: the loop breaker backed off for the conversation."""

    case: Literal["loop_breaker"]
    action: str
    reason: str


Event = CompactionEvent | FailureEvent | DetectorFailedEvent
# Stored in the same event list; readers of ``Event`` skip them (``operators.events``).
QualityEvent = BehaviourEvent | LoopBreakerEvent


def is_compaction(event: Event) -> bool:
    """Whether ``event`` reports a stored compaction (not a failure)."""
    return event["case"] in COMPACTION_CASES
