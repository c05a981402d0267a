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
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.environment_variables import OTEL_TRACES_SAMPLER
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
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

from proxy.core.traceids import Root

log = logging.getLogger("compaction_proxy.tracing")

SERVICE_NAME = "compaction-proxy"
_KINDS = {"server": SpanKind.SERVER, "client": SpanKind.CLIENT, "internal": SpanKind.INTERNAL}
_HEX = frozenset("0123456789abcdef")
_UNSET = Status(StatusCode.UNSET)


def parse_traceparent(header: str | None) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a W3C ``traceparent``; None when absent or
    malformed (the request then starts a trace of its own). Parsed by hand: the propagator's
    regular expressions cost more than the rest of a span."""
    parts = header.strip().lower().split("-") if header else []
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
    return trace_id, span_id, bool(int(flags, 16) & 1)


def _state(header: str | None) -> TraceState | None:
    if not header:
        return None
    try:
        return TraceState.from_header([header])
    except Exception:
        return None


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
    """One recording span (compactions, detector and summarizer calls)."""

    __slots__ = ("_span",)

    def __init__(self, span: Any) -> None:
        self._span = span

    def set(self, attributes: Mapping[str, Any]) -> None:
        self._span.set_attributes(attributes)

    def event(self, name: str, attributes: Mapping[str, Any]) -> None:
        self._span.add_event(name, attributes)

    def fail(self, error_type: str) -> None:
        self._span.set_status(Status(StatusCode.ERROR, error_type))

    def end(self, end_ns: int | None = None) -> None:
        self._span.end(end_time=end_ns)

    def headers(self) -> dict[str, str]:
        """This span's W3C ``traceparent`` (and ``tracestate``), for a request it makes."""
        c = self._span.get_span_context()
        flags = int(c.trace_flags) & 0xFF
        found = {"traceparent": f"00-{c.trace_id:032x}-{c.span_id:016x}-{flags:02x}"}
        if c.trace_state:
            found["tracestate"] = c.trace_state.to_header()
        return found


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
        # A full queue is counted in the metric above, not logged once per span dropped.
        logging.getLogger("opentelemetry.sdk._shared_internal").setLevel(logging.ERROR)
        # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES still apply (Resource.create), and
        # OTEL_TRACES_SAMPLER (the provider's sampler, asked once per request).
        self.resource = Resource.create({"service.name": SERVICE_NAME})
        self.provider = TracerProvider(resource=self.resource)
        exporter = _Counted(_exporter(endpoint, protocol), self._drop)
        self.processor = _CountedBatch(exporter, self._drop)
        self.provider.add_span_processor(self.processor)
        self._tracer = self.provider.get_tracer("compaction_proxy")
        self._scope = InstrumentationScope("compaction_proxy")
        self._ids = RandomIdGenerator()
        sampler = os.environ.get(OTEL_TRACES_SAMPLER, "parentbased_always_on").strip().lower()
        self._custom_sampler = sampler != "parentbased_always_on"

    def _drop(self, reason: str, n: int) -> None:
        self.dropped.labels(reason).inc(n)

    def new_span_id(self) -> int:
        return self._ids.generate_span_id()

    def root(self, name: str, traceparent: str | None, tracestate: str | None) -> Root:
        """A request span's ids: under the client's span when its ``traceparent`` is valid,
        sampled as the provider's sampler decides (by default: as the client's is)."""
        client = parse_traceparent(traceparent)
        span_id = self._ids.generate_span_id()
        if client is None:
            trace_id, parent_id, sampled, context = self._ids.generate_trace_id(), None, True, None
        else:
            trace_id, parent_id, sampled = client
            if self._custom_sampler:
                flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
                remote = SpanContext(trace_id, parent_id, True, flags, _state(tracestate))
                context = trace.set_span_in_context(NonRecordingSpan(remote))
        if self._custom_sampler:
            found = self.provider.sampler.should_sample(context, trace_id, name, SpanKind.SERVER)
            sampled = found.decision.is_sampled()
        # The default sampler (parent-based, else always on) decided above without a call.
        return Root(trace_id, span_id, parent_id, sampled,
                    tracestate if client is not None else None)  # fmt: skip

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
    ) -> None:
        """A finished span, straight to the batch processor: made from plain values in one
        step, without the SDK's live span (its locks and per-attribute checks cost tens of
        microseconds; our attributes are plain strings, numbers and booleans already)."""
        sampled = TraceFlags(TraceFlags.SAMPLED)
        parent = None
        if parent_id is not None:
            parent = SpanContext(trace_id, parent_id, remote_parent, sampled)
        status = Status(StatusCode.ERROR, error) if error else _UNSET
        span = ReadableSpan(
            name,
            context=SpanContext(trace_id, span_id, False, sampled),
            parent=parent,
            resource=self.resource,
            attributes=attributes,
            kind=_KINDS[kind],
            status=status,
            start_time=start_ns,
            end_time=end_ns,
            instrumentation_scope=self._scope,
        )
        self.processor.on_end(span)

    def start(self, name: str, kind: str, attributes: Mapping[str, Any], *, parent: Any) -> Span:
        """A live span under ``parent`` (a ``Span``, or a request's ``Root``)."""
        if isinstance(parent, Span):
            context = trace.set_span_in_context(parent._span)
        else:
            flags = TraceFlags(TraceFlags.SAMPLED if parent.sampled else TraceFlags.DEFAULT)
            remote = SpanContext(parent.trace_id, parent.span_id, False, flags)
            context = trace.set_span_in_context(NonRecordingSpan(remote))
        kind_ = _KINDS[kind]
        return Span(self._tracer.start_span(name, context, kind_, attributes=attributes))

    def shutdown(self) -> None:
        """Export what is queued (bounded by the exporter's timeout) and stop."""
        self.provider.shutdown()
