"""The spans of one request and of one compaction (``proxy.engine.tracing`` makes them):
which attributes, events and timings they carry. The GenAI semantic conventions' names where
they have one (``gen_ai.*``), ``compaction_proxy.*`` for ours; content only when the operator
turned it on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import orjson

from proxy.core import costs, keyfacts
from proxy.core.modelmap import provider_family
from proxy.core.types import COMPACTION_CASES
from proxy.operators.entry import usage_numbers

log = logging.getLogger("compaction_proxy.tracing")

CONTENT_LIMIT = 64 * 1024  # characters of captured content per attribute
_ANTHROPIC_ROUTES = frozenset({"messages"})


class SpanHandle(Protocol):
    """A recording span (``proxy.adapters.otel.Span``)."""

    def set(self, attributes: Mapping[str, Any]) -> None: ...
    def event(self, name: str, attributes: Mapping[str, Any]) -> None: ...
    def traceparent(self) -> str: ...
    def tracestate(self) -> str | None: ...
    def fail(self, error_type: str) -> None: ...
    def end(self, end_ns: int | None = None) -> None: ...


class Backend(Protocol):
    """Where spans go (``proxy.adapters.otel.OtlpBackend``)."""

    def start(
        self,
        name: str,
        kind: str,
        attributes: Mapping[str, Any],
        *,
        parent: SpanHandle | None = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
        start_ns: int | None = None,
    ) -> SpanHandle: ...

    def shutdown(self) -> None: ...


class Spans(Protocol):
    """What a request's or a compaction's trace needs of the tracer."""

    backend: Backend
    capture_content: bool


def provider_name(route: str, model: str) -> str:
    """``gen_ai.provider.name``: the API whose conventions the request follows."""
    if route in _ANTHROPIC_ROUTES:
        return "anthropic"
    family = provider_family(model)
    if family == "other" and "/" in model:
        return model.split("/", 1)[0]  # a LiteLLM provider prefix: bedrock/..., vertex_ai/...
    return "openai" if family == "other" else family


def now_ns_at(perf: float) -> int:
    """The wall clock (ns) at ``perf`` (a ``time.perf_counter()`` reading)."""
    return time.time_ns() - int((time.perf_counter() - perf) * 1e9)


def content(value: Any) -> str:
    text = value if isinstance(value, str) else orjson.dumps(value).decode()
    return text[:CONTENT_LIMIT]


class RequestTrace:
    """The spans of one client request, between ``Service.begin`` and ``finish``."""

    __slots__ = ("tracer", "span", "route", "upstream")

    def __init__(self, tracer: Spans, span: SpanHandle, route: str) -> None:
        self.tracer, self.span, self.route = tracer, span, route
        self.upstream: SpanHandle | None = None

    def prepared(self, prepared: Any, overhead_s: float) -> None:
        """What ``begin`` decided (``prepared`` None: the core failed, forwarded as sent)."""
        if prepared is None:
            safely(self.span.set, {"compaction_proxy.case": "error"})
            return
        attributes = {
            "gen_ai.conversation.id": prepared.conversation,
            "compaction_proxy.case": prepared.case,
            "compaction_proxy.tokens.original": prepared.original_tokens,
            "compaction_proxy.tokens.forwarded": prepared.forwarded_tokens,
            "gen_ai.conversation.compacted": prepared.case in COMPACTION_CASES,
            "compaction_proxy.overhead_ms": round(overhead_s * 1000, 3),
        }
        if prepared.record is not None:
            attributes["compaction_proxy.record"] = prepared.record.prefix_hash
        if self.tracer.capture_content:
            attributes["gen_ai.input.messages"] = content(prepared.forwarded)
        safely(self.span.set, attributes)

    def upstream_headers(self) -> dict[str, str]:
        """Starts the upstream call's span (once): the ``traceparent`` (and ``tracestate``)
        headers the forwarded request carries."""
        try:
            if self.upstream is None:
                self.upstream = self.tracer.backend.start(
                    "upstream", "client", {}, parent=self.span
                )
            headers = {"traceparent": self.upstream.traceparent()}
            state = self.upstream.tracestate()
            if state:
                headers["tracestate"] = state
            return headers
        except Exception:
            log.warning("could not start the upstream span", exc_info=True)
            return {}

    def finish(
        self,
        prepared: Any,
        usage: Any,
        status: int,
        response_model: str | None,
        forwarded_at: float | None = None,
    ) -> None:
        """``forwarded_at``: when the request went upstream (perf_counter), for an upstream
        span ``upstream_headers`` did not start."""
        try:
            prompt, cached, written, completion = usage_numbers(usage)
            attributes: dict[str, Any] = {"http.response.status_code": status}
            if usage is not None:
                attributes |= {
                    "gen_ai.usage.input_tokens": prompt,
                    "gen_ai.usage.output_tokens": completion,
                    "gen_ai.usage.cache_read.input_tokens": cached,
                    "gen_ai.usage.cache_creation.input_tokens": written,
                }
            if response_model:
                attributes["gen_ai.response.model"] = response_model
            if prepared is not None and usage is not None:
                prices = costs.prices_for(prepared.model)
                if prices.known:
                    saved = (
                        0
                        if prepared.shadow
                        else prepared.original_tokens - prepared.forwarded_tokens
                    )
                    billed = costs.input_cost(prices, prompt, cached, written)
                    billed += completion * prices.output
                    attributes["compaction_proxy.usd.billed"] = round(billed, 8)
                    attributes["compaction_proxy.usd.saved"] = round(
                        max(saved, 0) * prices.input, 8
                    )
            upstream = self.upstream
            if upstream is None:
                upstream = self.tracer.backend.start(
                    "upstream", "client", {}, parent=self.span,
                    start_ns=None if forwarded_at is None else now_ns_at(forwarded_at),
                )  # fmt: skip
            upstream.set({"http.response.status_code": status})
            self.span.set(attributes)
            if status >= 400:
                error = "client_closed" if status == 499 else str(status)
                upstream.fail(error)
                self.span.fail(error)
                self.span.set({"error.type": error})
            upstream.end()
            self.span.end()
        except Exception:
            log.warning("could not end a request span", exc_info=True)


class CompactionTrace:
    """The span of one compaction attempt."""

    __slots__ = ("tracer", "span")

    def __init__(self, tracer: Spans, span: SpanHandle) -> None:
        self.tracer, self.span = tracer, span

    def outcome(self, outcome: Any) -> None:
        """The attempt's result; a new record adds the ``gen_ai.conversation.compacted`` event
        with the dropped facts' ids (``<record>#<n>``: the n-th fact of the record's loss
        report in the admin API) and categories."""
        try:
            record = outcome.record
            self.span.set(
                {"compaction_proxy.case": outcome.case, "compaction_proxy.failed": outcome.failed}
            )
            if record is None or outcome.reused:
                return
            dropped = list(record.facts_dropped)
            attributes: dict[str, Any] = {
                "gen_ai.conversation.compacted": True,
                "compaction_proxy.case": record.case,
                "compaction_proxy.record": record.prefix_hash,
                "compaction_proxy.tokens.before": record.tokens_before,
                "compaction_proxy.tokens.after": record.tokens_after,
                "compaction_proxy.messages.covered": record.covered,
                "compaction_proxy.facts.kept": len(record.facts_kept)
                + len(record.facts_appended)
                + len(record.facts_elsewhere),
                "compaction_proxy.facts.dropped": len(dropped),
                "compaction_proxy.facts.dropped.ids": [
                    f"{record.prefix_hash}#{i}" for i in range(len(dropped))
                ],
                "compaction_proxy.facts.dropped.categories": fact_categories(dropped),
                "compaction_proxy.llm.tokens": record.llm_tokens,
                "compaction_proxy.llm.usd": round(record.llm_usd, 8),
            }
            if self.tracer.capture_content and record.summary is not None:
                attributes["compaction_proxy.summary"] = content(record.summary.get("content"))
            self.span.event("gen_ai.conversation.compacted", attributes)
            self.span.set({"gen_ai.conversation.compacted": True})
        except Exception:
            log.warning("could not describe a compaction span", exc_info=True)


def fact_categories(facts: Sequence[str]) -> list[str]:
    """Each fact's kind (``path``, ``url``, ``error``, ...) as the key-facts guard finds it."""
    kinds = []
    for fact in facts:
        found = keyfacts.facts_in(fact, limit=1)
        kinds.append(found[0].kind if found else "other")
    return kinds


def safely(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:
        log.warning("tracing call failed", exc_info=True)
