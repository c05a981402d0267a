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
from proxy.core.traceids import Root
from proxy.core.types import COMPACTION_CASES
from proxy.operators.entry import usage_numbers

log = logging.getLogger("compaction_proxy.tracing")

CONTENT_LIMIT = 64 * 1024  # characters of captured content per attribute
_ANTHROPIC_ROUTES = frozenset({"messages"})


class SpanHandle(Protocol):
    """A recording span (``proxy.adapters.otel.Span``)."""

    def set(self, attributes: Mapping[str, Any]) -> None: ...
    def event(self, name: str, attributes: Mapping[str, Any]) -> None: ...
    def fail(self, error_type: str) -> None: ...
    def end(self, end_ns: int | None = None) -> None: ...
    def headers(self) -> dict[str, str]: ...


class Backend(Protocol):
    """Where spans go (``proxy.adapters.otel.OtlpBackend``)."""

    def start(
        self,
        name: str,
        kind: str,
        attributes: Mapping[str, Any],
        *,
        parent: SpanHandle | Root,
    ) -> SpanHandle: ...

    def root(self, name: str, traceparent: str | None, tracestate: str | None) -> Root: ...
    def new_span_id(self) -> int: ...

    def emit(
        self,
        name: str,
        kind: str,
        trace_id: int,
        span_id: int,
        parent_id: int | None,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any],
        error: str | None = None,
        *,
        remote_parent: bool = False,
    ) -> None: ...

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


def child_headers(root: Root, span_id: int) -> dict[str, str]:
    """The W3C ``traceparent`` (and ``tracestate``) naming span ``span_id`` of ``root``'s
    trace as the parent of the request it goes with."""
    flags = "01" if root.sampled else "00"
    headers = {"traceparent": f"00-{root.trace_id:032x}-{span_id:016x}-{flags}"}
    if root.tracestate:
        headers["tracestate"] = root.tracestate
    return headers


def now_ns_at(perf: float) -> int:
    """The wall clock (ns) at ``perf`` (a ``time.perf_counter()`` reading)."""
    return time.time_ns() - int((time.perf_counter() - perf) * 1e9)


def content(value: Any) -> str:
    text = value if isinstance(value, str) else orjson.dumps(value).decode()
    return text[:CONTENT_LIMIT]


class RequestTrace:
    """The spans of one client request, between ``Service.begin`` and ``finish``.

    Cheap on the request path: ``begin`` only draws the ids (``Root``) and ``upstream_headers``
    formats a ``traceparent``; both spans are made and handed to the exporter in one go by
    ``finish``, once the client has its answer (the SDK's own span objects cost tens of
    microseconds a request on the event loop; #27 allows 0.1 ms for all of tracing).

    A request the ledger records waits there for its net dollars (``pricing``/``priced``,
    called by the batched writer): ``finish`` fixes both spans' attributes and times, and
    they are exported with the net once the writer priced it (within its flush interval).
    """

    __slots__ = (
        "tracer", "root", "route", "model", "tenant", "started", "upstream_id", "upstream_ns",
        "waiting", "net", "ready",
    )  # fmt: skip

    def __init__(
        self, tracer: Spans, root: Root, route: str, model: str, tenant: str, started: float
    ) -> None:
        self.tracer, self.root, self.route = tracer, root, route
        self.model, self.tenant, self.started = model, tenant, started
        self.upstream_id: int | None = None
        self.upstream_ns: int | None = None
        self.waiting = False  # the ledger's net is coming (``pricing``)
        self.net: float | None = None
        self.ready: tuple[dict[str, Any], str | None, int, int, int] | None = None

    @property
    def span(self) -> Root:
        """What compaction and LLM spans of this request go under."""
        return self.root

    def upstream_headers(self) -> dict[str, str]:
        """The ``traceparent`` (and ``tracestate``) of the upstream call's span (which starts
        now), for the forwarded request."""
        try:
            root = self.root
            if self.upstream_id is None:
                self.upstream_id = self.tracer.backend.new_span_id()
                self.upstream_ns = time.time_ns()
            return child_headers(root, self.upstream_id)
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
        overhead_s: float = 0.0,
    ) -> None:
        """Both spans, ended now. ``forwarded_at``: when the request went upstream
        (perf_counter), for an upstream span ``upstream_headers`` did not start."""
        if not self.root.sampled:
            return
        try:
            attributes = self._attributes(prepared, usage, status, response_model, overhead_s)
            error = None
            if status >= 400:
                error = "client_closed" if status == 499 else str(status)
                attributes["error.type"] = error
            end = time.time_ns()
            upstream_ns = self.upstream_ns
            if upstream_ns is None:
                upstream_ns = end if forwarded_at is None else now_ns_at(forwarded_at)
            self.ready = (attributes, error, now_ns_at(self.started), upstream_ns, end)
            if not self.waiting:
                self._emit()
        except Exception:
            log.warning("could not export a request's spans", exc_info=True)

    def pricing(self) -> None:
        """The ledger will price this request (``proxy.adapters.writer.Priced``)."""
        self.waiting = True

    def priced(self, net_usd: float | None) -> None:
        """The ledger's net dollars of this request: on the request span, which goes now."""
        self.waiting, self.net = False, net_usd
        if self.ready is not None:
            try:
                self._emit()
            except Exception:
                log.warning("could not export a request's spans", exc_info=True)

    def _emit(self) -> None:
        """Both spans, as ``finish`` fixed them, with the net once priced."""
        if self.ready is None:
            return
        (attributes, error, start, upstream_ns, end), self.ready = self.ready, None
        if self.net is not None:
            attributes["compaction_proxy.usd.net"] = self.net
        backend, root = self.tracer.backend, self.root
        upstream = {"http.response.status_code": attributes["http.response.status_code"]}
        backend.emit(
            "upstream", "client", root.trace_id, self.upstream_id or backend.new_span_id(),
            root.span_id, upstream_ns, end, upstream, error,
        )  # fmt: skip
        backend.emit(
            f"chat {self.model}", "server", root.trace_id, root.span_id, root.parent_id,
            start, end, attributes, error, remote_parent=True,
        )  # fmt: skip

    def _attributes(
        self, prepared: Any, usage: Any, status: int, response_model: str | None, overhead_s: float
    ) -> dict[str, Any]:
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": provider_name(self.route, self.model),
            "gen_ai.request.model": self.model,
            "compaction_proxy.route": self.route,
            "compaction_proxy.tenant": self.tenant,
            "compaction_proxy.overhead_ms": round(overhead_s * 1000, 3),
            "http.response.status_code": status,
        }
        if response_model:
            attributes["gen_ai.response.model"] = response_model
        prompt, cached, written, completion = usage_numbers(usage)
        if usage is not None:
            attributes["gen_ai.usage.input_tokens"] = prompt
            attributes["gen_ai.usage.output_tokens"] = completion
            attributes["gen_ai.usage.cache_read.input_tokens"] = cached
            attributes["gen_ai.usage.cache_creation.input_tokens"] = written
        if prepared is None:
            attributes["compaction_proxy.case"] = "error"
            return attributes
        attributes["gen_ai.conversation.id"] = prepared.conversation
        attributes["compaction_proxy.case"] = prepared.case
        attributes["compaction_proxy.tokens.original"] = prepared.original_tokens
        attributes["compaction_proxy.tokens.forwarded"] = prepared.forwarded_tokens
        attributes["gen_ai.conversation.compacted"] = prepared.case in COMPACTION_CASES
        if prepared.record is not None:
            attributes["compaction_proxy.record"] = prepared.record.prefix_hash
        if self.tracer.capture_content:
            attributes["gen_ai.input.messages"] = content(prepared.forwarded)
        if usage is not None:
            prices = costs.prices_for(prepared.model)
            if prices.known:
                saved = prepared.original_tokens - prepared.forwarded_tokens
                saved = 0 if prepared.shadow else saved
                billed = costs.input_cost(prices, prompt, cached, written)
                billed += completion * prices.output
                attributes["compaction_proxy.usd.billed"] = round(billed, 8)
                attributes["compaction_proxy.usd.saved"] = round(max(saved, 0) * prices.input, 8)
        return attributes


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
                "compaction_proxy.llm.cached_tokens": record.llm_cached_tokens,
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
