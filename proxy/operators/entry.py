"""One forwarded request as the ledger records it, and the upstream's usage read from any
API's shape. Built on the request path from a prepared request (read-only: only the fields
``PreparedView`` names are read, so this module never imports the engine)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.core import billing
from proxy.core.frozen import quick_init
from proxy.core.modelmap import input_price
from proxy.core.planner import HOLD, TREADMILL, Decision
from proxy.core.records import CompactionRecord
from proxy.core.types import SKIPPED_CASES, CaseName


class PreparedView(Protocol):
    """What a ``RequestEntry`` reads of a prepared request (``proxy.engine``'s ``Prepared``)."""

    @property
    def tenant(self) -> str: ...
    @property
    def conversation(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def case(self) -> CaseName: ...
    @property
    def original(self) -> Sequence[Any]: ...
    @property
    def forwarded(self) -> Sequence[Any]: ...
    @property
    def original_tokens(self) -> int: ...
    @property
    def forwarded_tokens(self) -> int: ...
    @property
    def record(self) -> CompactionRecord | None: ...
    @property
    def shadow(self) -> bool: ...
    @property
    def earlier_conversation(self) -> str | None: ...
    @property
    def decision(self) -> Decision: ...
    @property
    def reserve_tokens(self) -> int: ...
    @property
    def changed(self) -> bool: ...


@quick_init
@dataclass(frozen=True)
class RequestEntry:
    """One forwarded request, as recorded."""

    ts: float
    tenant: str
    conversation: str
    model: str
    route: str
    case: CaseName
    status: int
    original_messages: int
    forwarded_messages: int
    original_tokens: int
    forwarded_tokens: int
    prompt_tokens: int
    cached_tokens: int
    cache_write_tokens: int
    completion_tokens: int
    latency_s: float
    overhead_s: float
    record: str | None = None  # prefix hash of the compaction in effect, if any
    # Shadow mode: the upstream got the original; ``forwarded_*`` is what it would have got.
    shadow: bool = False
    # The id the session had on its first request, before its first reply (see
    # fingerprint.conversation_id): that request's row joins this one.
    earlier_conversation: str | None = None
    # Longer than the model's context window as the client sent it: what compaction took off
    # is "kept within the window", never money saved (the client could not have sent it).
    over_window: bool = False
    # Why nothing was taken off this request (``held_reason``), for the phantom-savings report.
    held: str | None = None
    # The provider's prompt-cache TTL the counterfactual is priced with (``billing``).
    cache_ttl_s: float | None = None
    # The messages went upstream as the client sent them (no compaction in effect): then the
    # request is its own counterfactual, whatever the provider's cache did (``billing``).
    unchanged: bool = False

    @classmethod
    def of(
        cls,
        prepared: PreparedView,
        *,
        route: str,
        status: int,
        usage: Any,
        latency_s: float,
        overhead_s: float,
        ts: float | None = None,
        cache_ttl_s: float | None = None,
        numbers: tuple[int, int, int, int] | None = None,
    ) -> RequestEntry:
        """The entry for one prepared request and the upstream's usage (any API's shape).
        ``ts``: when it was answered (default: now; a replay passes its own clock);
        ``numbers``: ``usage_numbers(usage)`` when the caller has them already."""
        numbers = usage_numbers(usage) if numbers is None else numbers
        prompt, cached, write, completion = numbers
        reserve = getattr(prepared, "reserve_tokens", 0) or 0
        over = billing.over_window(prepared.model, prepared.original_tokens + reserve)
        return cls(
            ts=time.time() if ts is None else ts,
            tenant=prepared.tenant,
            conversation=prepared.conversation,
            model=prepared.model,
            route=route,
            case=prepared.case,
            status=status,
            original_messages=len(prepared.original),
            forwarded_messages=len(prepared.forwarded),
            original_tokens=prepared.original_tokens,
            forwarded_tokens=prepared.forwarded_tokens,
            prompt_tokens=prompt,
            cached_tokens=cached,
            cache_write_tokens=write,
            completion_tokens=completion,
            latency_s=round(latency_s, 4),
            overhead_s=round(overhead_s, 6),
            record=prepared.record.prefix_hash if prepared.record else None,
            shadow=prepared.shadow,
            earlier_conversation=prepared.earlier_conversation,
            over_window=over and not prepared.shadow,
            held=held_reason(prepared),
            cache_ttl_s=cache_ttl_s,
            unchanged=not prepared.changed,
        )

    @property
    def saved_tokens(self) -> int:
        """Tokens really saved (none in shadow mode: see ``would_save_tokens``; none over the
        context window: see ``kept_tokens``)."""
        return 0 if self.shadow or self.over_window else self.would_save_tokens

    @property
    def kept_tokens(self) -> int:
        """Tokens taken off a request the client could not have sent: kept within the window."""
        return self.would_save_tokens if self.over_window and not self.shadow else 0

    @property
    def would_save_tokens(self) -> int:
        return max(self.original_tokens - self.forwarded_tokens, 0)

    @property
    def sent_tokens(self) -> int:
        """What really went upstream (the original in shadow mode)."""
        return self.original_tokens if self.shadow else self.forwarded_tokens

    def saved_usd(self) -> float:
        return self.saved_tokens * input_price(self.model)

    def would_save_usd(self) -> float:
        return self.would_save_tokens * input_price(self.model)


# Why a request went upstream as long as the client sent it (the phantom-savings report).
HELD_REASONS = {
    "below_trigger": "every conversation under the trigger",
    "opt_out": "opted out (configured tenants or models, paused, x-compaction: off)",
    "failing": "the summarizer failing (cooling down after failed compactions)",
    "cache": (
        "the cache making it unprofitable (cost policy, cache warm: the rewrite and the "
        "detector and summarizer calls would cost more than the reads saved; calls on a "
        "smaller detection_model / summary_model cost less)"
    ),
    "treadmill": "too soon after the last compaction (no treadmill)",
    "policy": "the cost policy refusing",
    "disabled": "compaction disabled",
    "shadow": "shadow mode (measured only)",
    "pending": "over the trigger, but no compaction worth doing was found yet",
    "nothing_to_cut": "nothing that could be cut",
}


def held_reason(prepared: PreparedView) -> str | None:
    """Why nothing was taken off ``prepared`` (a ``HELD_REASONS`` key); None when something was."""
    if prepared.original_tokens > prepared.forwarded_tokens and not prepared.shadow:
        return None
    decision = getattr(prepared, "decision", None)
    reason = decision.reason if decision is not None else ""
    if prepared.shadow:
        return "shadow"
    if prepared.case in SKIPPED_CASES or getattr(prepared, "skipped", False):
        return "opt_out"
    if reason == "below trigger":
        return "below_trigger"
    if reason == "compaction disabled":
        return "disabled"
    if reason.startswith("cooling down"):
        return "failing"
    if reason.startswith("over trigger"):
        return "pending"
    if reason.startswith(TREADMILL):
        return "treadmill"
    if reason.startswith(HOLD):
        return "cache" if "cache" in reason else "policy"
    return "nothing_to_cut"


def _num(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def usage_numbers(usage: Any) -> tuple[int, int, int, int]:
    """(prompt, cached read, cache write, completion) tokens from OpenAI or Anthropic usage."""
    if not isinstance(usage, dict):
        return 0, 0, 0, 0
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = _num(details.get("cached_tokens") if isinstance(details, dict) else 0)
    cached = cached or _num(usage.get("cache_read_input_tokens"))
    write = _num(usage.get("cache_creation_input_tokens"))
    if "prompt_tokens" in usage:
        prompt = _num(usage.get("prompt_tokens"))
    elif "input_tokens_details" in usage:
        prompt = _num(usage.get("input_tokens"))  # OpenAI Responses: cached tokens included
    else:
        # Anthropic's input_tokens leaves out what was read from or written to the cache.
        prompt = _num(usage.get("input_tokens")) + cached + write
    completion = _num(usage.get("completion_tokens", usage.get("output_tokens")))
    return prompt, cached, write, completion
