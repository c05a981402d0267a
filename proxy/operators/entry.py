"""One forwarded request as the ledger records it, and the upstream's usage read from any
API's shape. Built on the request path from a prepared request (read-only: only the fields
``PreparedView`` names are read, so this module never imports the engine)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.core.modelmap import model_info
from proxy.core.records import CompactionRecord
from proxy.core.types import CaseName


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
    ) -> RequestEntry:
        """The entry for one prepared request and the upstream's usage (any API's shape)."""
        prompt, cached, write, completion = usage_numbers(usage)
        return cls(
            ts=time.time(),
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
        )

    @property
    def saved_tokens(self) -> int:
        """Tokens really saved (none in shadow mode: see ``would_save_tokens``)."""
        return 0 if self.shadow else self.would_save_tokens

    @property
    def would_save_tokens(self) -> int:
        return max(self.original_tokens - self.forwarded_tokens, 0)

    @property
    def sent_tokens(self) -> int:
        """What really went upstream (the original in shadow mode)."""
        return self.original_tokens if self.shadow else self.forwarded_tokens

    def saved_usd(self) -> float:
        return self.saved_tokens * _input_price(self.model)

    def would_save_usd(self) -> float:
        return self.would_save_tokens * _input_price(self.model)


def _input_price(model: str) -> float:
    info = model_info(model)
    return info.input_cost_per_token if info and info.input_cost_per_token else 0.0


def usage_numbers(usage: Any) -> tuple[int, int, int, int]:
    """(prompt, cached read, cache write, completion) tokens from OpenAI or Anthropic usage."""
    if not isinstance(usage, dict):
        return 0, 0, 0, 0

    def num(value: Any) -> int:
        return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0

    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = num(details.get("cached_tokens") if isinstance(details, dict) else 0)
    cached = cached or num(usage.get("cache_read_input_tokens"))
    write = num(usage.get("cache_creation_input_tokens"))
    if "prompt_tokens" in usage:
        prompt = num(usage.get("prompt_tokens"))
    elif "input_tokens_details" in usage:
        prompt = num(usage.get("input_tokens"))  # OpenAI Responses: cached tokens included
    else:
        # Anthropic's input_tokens leaves out what was read from or written to the cache.
        prompt = num(usage.get("input_tokens")) + cached + write
    completion = num(usage.get("completion_tokens", usage.get("output_tokens")))
    return prompt, cached, write, completion
