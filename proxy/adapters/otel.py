"""The OpenTelemetry SDK behind ``proxy.engine.tracing``: spans exported over OTLP in batches.

Imported only when traces are turned on (``proxy.engine.tracing.start_tracing``), so a proxy
without them never loads OpenTelemetry. Needs the ``[otel]`` extra: ``opentelemetry-sdk`` and
the OTLP exporter of the chosen protocol (``opentelemetry-exporter-otlp-proto-http`` or
``-grpc``); an ``ImportError`` names what is missing.

The provider is the proxy's own (never the global one a host such as LiteLLM may have set),
and spans go through a ``BatchSpanProcessor``: a bounded queue that a background thread
exports, so a request never waits for the collector. A span that does not fit in the queue,
or a batch the collector refused, is counted in
``compaction_proxy_trace_spans_dropped_total{reason}`` and lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)
from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger("compaction_proxy.tracing")

SERVICE_NAME = "compaction-proxy"
_KINDS = {"server": SpanKind.SERVER, "client": SpanKind.CLIENT, "internal": SpanKind.INTERNAL}
_HEX = frozenset("0123456789abcdef")


def parent_context(traceparent: str | None, tracestate: str | None) -> Any:
    """The W3C ``traceparent`` a client sent as an OpenTelemetry context (None when absent or
    malformed: the span then starts a trace of its own). Parsed by hand: the propagator's
    regular expressions cost more than the rest of a span."""
    parts = traceparent.strip().lower().split("-") if traceparent else []
    if len(parts) < 4 or (parts[0] == "00" and len(parts) != 4):
        return None
    version, trace_hex, span_hex, flags = parts[:4]
    if (
        len(version) != 2
        or version == "ff"
        or len(trace_hex) != 32
        or len(span_hex) != 16
        or len(flags) != 2
        or not set(version + trace_hex + span_hex + flags) <= _HEX
    ):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    state = None
    if tracestate:
        try:
            state = TraceState.from_header([tracestate])
        except Exception:
            state = None
    parent = SpanContext(
        trace_id, span_id, is_remote=True, trace_flags=TraceFlags(int(flags, 16) & 1),
        trace_state=state,
    )  # fmt: skip
    return trace.set_span_in_context(NonRecordingSpan(parent))


class _Counted(SpanExporter):
    """The OTLP exporter, counting the spans of every batch the collector did not take."""

    def __init__(self, inner: SpanExporter, on_drop: Callable[[str, int], None]) -> None:
        self._inner, self._on_drop = inner, on_drop

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self._inner.export(spans)
        except Exception:
            log.warning("trace export failed", exc_info=True)
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self._on_drop("export_failed", len(spans))
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class _CountedBatch(BatchSpanProcessor):
    """A ``BatchSpanProcessor`` that counts the spans its full queue pushes out."""

    def __init__(self, exporter: SpanExporter, on_drop: Callable[[str, int], None]) -> None:
        super().__init__(exporter)
        self._on_drop = on_drop
        batch = getattr(self, "_batch_processor", None)
        self._queue = getattr(batch, "_queue", None)
        self._capacity = getattr(batch, "_max_queue_size", None)

    def on_end(self, span: ReadableSpan) -> None:
        queue, capacity = self._queue, self._capacity
        if queue is not None and capacity is not None and len(queue) >= capacity:
            self._on_drop("queue_full", 1)  # the SDK drops the oldest queued span
        super().on_end(span)


def _exporter(endpoint: str | None, protocol: str) -> SpanExporter:
    """The OTLP exporter for ``protocol``; ``endpoint`` None: the exporter reads the standard
    ``OTEL_EXPORTER_OTLP_*`` variables itself (endpoint, headers, timeout, compression)."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(endpoint=endpoint)


class Span:
    """One recording span, as ``proxy.engine.tracing`` uses it."""

    __slots__ = ("_span",)

    def __init__(self, span: Any) -> None:
        self._span = span

    def set(self, attributes: Mapping[str, Any]) -> None:
        self._span.set_attributes(attributes)

    def event(self, name: str, attributes: Mapping[str, Any]) -> None:
        self._span.add_event(name, attributes)

    def traceparent(self) -> str:
        """This span as the W3C ``traceparent`` of a request it makes."""
        c = self._span.get_span_context()
        return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"

    def tracestate(self) -> str | None:
        state = self._span.get_span_context().trace_state
        return state.to_header() if state else None

    def fail(self, error_type: str) -> None:
        self._span.set_status(Status(StatusCode.ERROR, error_type))

    def end(self, end_ns: int | None = None) -> None:
        self._span.end(end_time=end_ns)


class OtlpBackend:
    """A tracer provider of the proxy's own with one batched OTLP exporter."""

    def __init__(
        self, endpoint: str | None, protocol: str, registry: CollectorRegistry | None
    ) -> None:
        self.dropped = Counter(
            "compaction_proxy_trace_spans_dropped",
            "Spans that were never exported: the export queue was full (queue_full) or the "
            "collector did not take their batch (export_failed).",
            ["reason"],
            registry=registry,
        )
        for reason in ("queue_full", "export_failed"):
            self.dropped.labels(reason)
        # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES still apply (Resource.create).
        resource = Resource.create({"service.name": SERVICE_NAME})
        self.provider = TracerProvider(resource=resource)
        exporter = _Counted(_exporter(endpoint, protocol), self._drop)
        self.provider.add_span_processor(_CountedBatch(exporter, self._drop))
        self._tracer = self.provider.get_tracer("compaction_proxy")

    def _drop(self, reason: str, n: int) -> None:
        self.dropped.labels(reason).inc(n)

    def start(
        self,
        name: str,
        kind: str,
        attributes: Mapping[str, Any],
        *,
        parent: Any = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
        start_ns: int | None = None,
    ) -> Span:
        """A new span: a child of ``parent`` (a ``Span``), else of the client's ``traceparent``, else the
        root of a new trace."""
        if parent is not None:
            context = trace.set_span_in_context(parent._span)
        else:
            context = parent_context(traceparent, tracestate)
        span = self._tracer.start_span(
            name, context=context, kind=_KINDS[kind], attributes=attributes, start_time=start_ns
        )
        return Span(span)

    def shutdown(self) -> None:
        """Export what is queued (bounded by the exporter's timeout) and stop."""
        self.provider.shutdown()
