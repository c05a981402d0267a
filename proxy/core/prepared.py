"""What the compaction flow works on and hands back: one request after identification and
substitution (``Prepared``, immutable), and the result of one compaction attempt (``Outcome``).

``Prepared`` is frozen: each step of the flow returns a new one (``dataclasses.replace``), so
what a front door holds is exactly what was decided for it, whatever runs afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from proxy.core import layout, planner
from proxy.core.frozen import quick_init
from proxy.core.messages import Message, head_length
from proxy.core.records import CompactionRecord, KnownRecords, body_start
from proxy.core.settings import CompactionSettings
from proxy.core.sharedcall import SharedCall
from proxy.core.stability import StabilityState, TierThresholds
from proxy.core.tokens import TokenCounter
from proxy.core.types import Case, CaseName


class Sent(NamedTuple):
    """The messages a client sent (the neutral view) and each one's exact digest (None for
    one that is not JSON: the LiteLLM hook's objects)."""

    messages: list[Message]
    exact: Sequence[bytes | None]


@dataclass(frozen=True)
class Prompts:
    detector: str
    summarizer: str


@dataclass(frozen=True)
class Env:
    """What the flow reads besides the request: settings, prompts and the token counter."""

    settings: CompactionSettings
    prompts: Prompts
    counter: TokenCounter
    tiers: TierThresholds
    records: KnownRecords = dataclasses.field(default_factory=KnownRecords)

    @classmethod
    def of(
        cls,
        s: CompactionSettings,
        prompts: Prompts,
        counter: TokenCounter | None = None,
        retention_s: float | None = None,
    ) -> Env:
        tiers = TierThresholds(s.tier_l1_requests, s.tier_l2_requests, s.tier_l3_requests)
        return cls(s, prompts, counter or TokenCounter(), tiers, KnownRecords(retention_s))


@quick_init
@dataclass(frozen=True)
class Prepared:
    """One request after identification and substitution: what would be forwarded, and why."""

    tenant: str
    conversation: str
    model: str
    credential: str | None
    original: list[Message]
    original_counts: list[int]
    chain: list[bytes]  # prefix hashes of ``original``: chain[k] names its first k messages
    forwarded: list[Message]
    forwarded_counts: list[int]
    original_tokens: int
    forwarded_tokens: int
    record: CompactionRecord | None
    decision: planner.Decision
    case: CaseName = Case.NONE
    compacted_now: bool = False
    stability: StabilityState | None = None
    marked: bool = False
    summary_role: str = "system"
    # The name the detector and summarizer are called with (a LiteLLM model group, say),
    # when ``model`` is the underlying model used for token counts and prices.
    llm_model: str = ""
    # Shadow mode: ``forwarded`` is what would have been forwarded; the client's request
    # goes upstream exactly as sent.
    shadow: bool = False
    skipped: bool = False  # bypassed or opted out: never compacted, forwarded as sent
    # The id this session had before its first reply (see fingerprint.conversation_id).
    earlier_conversation: str | None = None
    outside_cache_marks: int = 0  # the client's cache marks outside the messages
    summary_joins: bool = False  # the summary is forwarded inside the next user turn
    # forwarded[i] forwards original[origins[i]], or stored bytes when None.
    origins: list[int | None] = dataclasses.field(default_factory=list)
    # Tokens the request spends besides its messages (tools, max_tokens), for the window guard.
    reserve_tokens: int = 0
    # Over the model's context window and nothing left that could be dropped.
    too_long: bool = False
    # Tool calls (behaviour.identity) whose latest result pruning keeps: the loop breaker's.
    keep_results: frozenset[str] = frozenset()
    # The summarizer call that reads the conversation's own cache (``proxy.core.sharedcall``),
    # when the front door can make it.
    shared: SharedCall | None = None
    # Messages in the request of the conversation's last LLM compaction (``records.llm_since``;
    # 0: none): where the no-treadmill rule measures growth from, and what a pruning's or
    # emergency cut's record carries on.
    llm_since: int = 0
    # The client edits its own history in place from this index on (``StabilityState
    # .edit_limit``; None: not lately): an optional compaction's record must end there.
    edit_limit: int | None = None
    # Each of ``original``'s exact digests (``fingerprint.exact_digest``), when identified so:
    # the ledger names the stored history's segments by them (``sent``).
    original_exact: Sequence[bytes | None] = ()

    def sent(self) -> list[Message] | Sent:
        """What the client sent, for the ledger: with its exact digests when identified so,
        else the messages alone (the ledger then names segments by their JSON)."""
        exact = self.original_exact
        return Sent(self.original, exact) if len(exact) == len(self.original) else self.original

    @property
    def as_sent(self) -> bool:
        """Whether the upstream must receive the client's request byte for byte."""
        return self.shadow or self.skipped

    @property
    def changed(self) -> bool:
        """Whether the forwarded messages differ from what the client sent."""
        return not self.shadow and (self.record is not None or self.marked)

    @property
    def head_len(self) -> int:
        """Leading system/developer messages, as the record fixed them (else as sent)."""
        return self.record.head_len if self.record else head_length(self.original)

    def view(self) -> layout.View:
        return layout.View(
            self.forwarded, self.origins, body_start(self.record), len(self.original)
        )

    def cut_limit(self) -> int | None:
        """The last forwarded position an optional compaction may cut at (or prune before),
        so that its record's prefix ends at or before ``edit_limit``; None: anywhere."""
        if self.edit_limit is None:
            return None
        k = self.record.k if self.record else 0
        prefix = len(self.forwarded) - (len(self.original) - k)
        return prefix + max(self.edit_limit - k, 0)

    def body_start(self) -> tuple[int, int | None]:
        """Where the compactable body begins, and the earlier summary's index if there is one."""
        earlier_at = layout.summary_position(self.view())
        return (self.head_len if earlier_at is None else earlier_at + 1), earlier_at

    def but(self, **changes: Any) -> Prepared:
        """This request with ``changes`` (a new object: Prepared never changes in place).

        What ``dataclasses.replace`` makes, without calling ``__init__``: a frozen class sets
        each of its 27 fields through ``object.__setattr__`` there, which cost more than the
        rest of a small request's decision; no field has a ``__post_init__`` to run."""
        unknown = changes.keys() - _FIELDS
        if unknown:
            raise TypeError(f"Prepared has no field {sorted(unknown)[0]!r}")
        new = object.__new__(type(self))
        attrs = new.__dict__
        attrs.update(self.__dict__)
        attrs.update(changes)
        return new


_FIELDS = frozenset(f.name for f in dataclasses.fields(Prepared))


@dataclass(frozen=True)
class Outcome:
    """The result of one compaction attempt (a new record, or why there is none)."""

    case: CaseName
    record: CompactionRecord | None
    reason: str
    failed: bool = False
    reused: bool = False  # stored meanwhile by a concurrent attempt, not made by this one


def nothing(reason: str, *, failed: bool = False) -> Outcome:
    return Outcome(Case.NONE, None, reason, failed)


def unpinned(messages: Sequence[Message], found: Any, start: int, cut: int) -> list[Message]:
    """The span ``[start, cut)`` without its pins (they are forwarded, not summarized)."""
    return [messages[i] for i in range(start, cut) if i not in found]
