"""Traces of the proxy, opt-in (OpenTelemetry, GenAI semantic conventions): every span both
front doors export is made here, from what ``Service.begin`` / ``finish`` and the compactor
already hold, so the server and the LiteLLM hook cannot drift apart.

Off unless an OTLP endpoint is set: ``tracing.endpoint`` in the config, or the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` (with
``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``: ``http/protobuf``, the default, or ``grpc``). Off,
nothing of OpenTelemetry is imported. On, but without the ``[otel]`` extra installed, start-up
logs one warning saying so and the proxy serves without traces.

Spans of one request:
- ``chat {model}`` (server): the request as the client sent it, with the GenAI attributes
  (operation, provider, request and response model, input/output and cache tokens,
  conversation id) and ours (``compaction_proxy.*``: case, tokens before and after, the
  dollars billed, saved and net (the ledger's, once its writer priced the request), the
  tenant's hash);
- ``upstream`` (client): the forwarded call; its ``traceparent`` goes upstream, in the
  client's trace when the client sent one;
- a relayed request (``/v1/models``, embeddings, the probes: ``proxy.engine.relayspans``):
  its own server span and an ``upstream`` one, likewise;
- ``compaction`` (internal): a compaction run for this request, inline or in the background
  after it, with a ``gen_ai.conversation.compacted`` event naming the facts it dropped by id
  and category (never their text); under it one ``chat {model}`` span per detector or
  summarizer call.

Message content (the forwarded messages, summaries) is exported only when
``tracing.capture_content`` is true or ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT``
is ``true``. Nothing here ever raises into a request: a failing span is logged and forgotten.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from proxy.adapters.llm import TRACE_HEADERS
from proxy.config import TRACE_PROTOCOLS, Config, Tracing
from proxy.core.messages import Message
from proxy.core.traceids import Root
from proxy.engine.relayspans import RelayTrace
from proxy.engine.spans import (
    Backend,
    CompactionTrace,
    RequestTrace,
    SpanHandle,
    provider_name,
    safely,
)

log = logging.getLogger("compaction_proxy.tracing")

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
CONTENT_VAR = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
EXTRA = "pip install 'compaction-proxy[otel]'"


# The span new detector/summarizer and compaction spans go under: the request's, set by the
# service around ``prepare`` and ``schedule`` (a background compaction's task copies it).
CURRENT: ContextVar[SpanHandle | Root | None] = ContextVar("compaction_proxy_span", default=None)


@dataclass(frozen=True)
class Target:
    """Where and how traces are exported."""

    endpoint: str | None  # None: the exporter reads OTEL_EXPORTER_OTLP_* itself
    protocol: str
    capture_content: bool
    source: str  # what turned traces on (for the start-up line)


def target(settings: Tracing, environ: Mapping[str, str]) -> Target | None:
    """Where traces go under ``settings`` and ``environ``; None when they are off."""
    source = next((v for v in ENDPOINT_VARS if environ.get(v)), None)
    if not settings.endpoint and source is None:
        return None
    protocol = settings.protocol or next((environ[v] for v in PROTOCOL_VARS if environ.get(v)), "")
    protocol = protocol.strip().lower() or "http/protobuf"
    if protocol not in TRACE_PROTOCOLS:
        log.warning(
            "OTLP protocol %r is not supported; exporting traces over http/protobuf", protocol
        )
        protocol = "http/protobuf"
    endpoint = settings.endpoint
    if endpoint and protocol != "grpc" and not endpoint.rstrip("/").endswith("/v1/traces"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"  # a base URL, as OTEL_..._ENDPOINT is
    capture = settings.capture_content or environ.get(CONTENT_VAR, "").lower() == "true"
    return Target(endpoint, protocol, capture, "tracing.endpoint" if endpoint else str(source))


def start_tracing(config: Config, registry: Any = None) -> Tracer | None:
    """The service's tracer, or None when traces are off or cannot be exported (the reason
    is logged once; the proxy serves either way). ``registry``: the metrics registry the
    dropped-spans counter joins."""
    where = target(config.tracing, os.environ)
    if where is None:
        return None
    try:
        from proxy.adapters.otel import OtlpBackend

        backend = OtlpBackend(where.endpoint, where.protocol, registry)
    except ImportError as exc:
        log.warning(
            "traces are requested (%s) but the OpenTelemetry exporter is not installed "
            "(%s); serving without traces. Install it with: %s",
            where.source,
            exc.name or exc,
            EXTRA,
        )
        return None
    except Exception:
        log.exception("traces are requested (%s) but cannot start; serving without traces")
        return None
    log.info(
        "exporting traces",
        extra={
            "protocol": where.protocol,
            "source": where.source,
            "content": where.capture_content,
        },
    )
    return Tracer(backend, capture_content=where.capture_content)


class Tracer:
    """Makes the spans; every method is safe to call on the request path (never raises)."""

    def __init__(self, backend: Backend, *, capture_content: bool = False) -> None:
        self.backend = backend
        self.capture_content = capture_content

    def request(
        self,
        route: str,
        model: str,
        tenant: str,
        started: float,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> RequestTrace | None:
        """The span of one client request that arrived at ``started`` (perf_counter): in the
        client's trace when ``traceparent`` is a valid one."""
        try:
            root = self.backend.root(f"chat {model}", traceparent, tracestate)
            return RequestTrace(self, root, route, model, tenant, started)
        except Exception:
            log.warning("could not start a request span", exc_info=True)
            return None

    def relay(
        self,
        method: str,
        path: str,
        tenant: str,
        traceparent: str | None,
        tracestate: str | None,
    ) -> RelayTrace | None:
        """The spans of a relayed request (``proxy.engine.relayspans``), arriving now."""
        try:
            root = self.backend.root(f"{method} {path}", traceparent, tracestate)
            return RelayTrace(self.backend, root, method, path, tenant)
        except Exception:
            log.warning("could not start a relayed request's span", exc_info=True)
            return None

    def llm_span(self, model: str, purpose: str) -> SpanHandle | None:
        """A detector or summarizer call's span, under the current one (None outside a request)."""
        parent = CURRENT.get()
        if parent is None:
            return None
        try:
            attributes = {
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": provider_name("", model),
                "gen_ai.request.model": model,
                "compaction_proxy.purpose": purpose,
            }
            return self.backend.start(f"chat {model}", "client", attributes, parent=parent)
        except Exception:
            log.warning("could not start an LLM span", exc_info=True)
            return None

    @contextlib.contextmanager
    def compaction(self, *, inline: bool) -> Iterator[CompactionTrace | None]:
        """A compaction span under the current one (None outside a request); its detector
        and summarizer spans go under it."""
        parent = CURRENT.get()
        if parent is None:
            yield None
            return
        try:
            span = self.backend.start(
                "compaction", "internal", {"compaction_proxy.inline": inline}, parent=parent
            )
        except Exception:
            log.warning("could not start a compaction span", exc_info=True)
            yield None
            return
        token = CURRENT.set(span)
        try:
            yield CompactionTrace(self, span)
        finally:
            CURRENT.reset(token)
            safely(span.end)

    def shutdown(self) -> None:
        """Export what is queued and stop (blocking: call it from a thread)."""
        safely(self.backend.shutdown)


class TracedLLM:
    """The detector/summarizer client with a span around each call (under ``CURRENT``)."""

    def __init__(self, inner: Any, tracer: Tracer) -> None:
        self.inner, self.tracer = inner, tracer

    async def complete(
        self,
        model: str,
        messages: Sequence[Message],
        *,
        max_tokens: int,
        purpose: str,
        credential: str | None,
    ) -> Any:
        return await self._traced(
            model,
            purpose,
            lambda: self.inner.complete(
                model, messages, max_tokens=max_tokens, purpose=purpose, credential=credential
            ),
        )

    async def shared(self, call: Any, body: dict[str, Any], *, purpose: str) -> Any:
        """The summarizer call in the client's shape (``HttpLLM.shared``), traced alike."""
        return await self._traced(
            str(body.get("model", "")),
            purpose,
            lambda: self.inner.shared(call, body, purpose=purpose),
        )

    async def _traced(self, model: str, purpose: str, make: Callable[[], Awaitable[Any]]) -> Any:
        span = self.tracer.llm_span(model, purpose)
        if span is None:
            return await make()
        token = TRACE_HEADERS.set(_headers_of(span))  # the call's request carries its context
        try:
            reply = await make()
        except BaseException as exc:
            safely(span.fail, type(exc).__name__)
            safely(span.set, {"error.type": type(exc).__name__})
            safely(span.end)
            raise
        finally:
            TRACE_HEADERS.reset(token)
        attributes = {
            "gen_ai.response.model": reply.model,
            "gen_ai.usage.input_tokens": reply.prompt_tokens,
            "gen_ai.usage.output_tokens": reply.completion_tokens,
        }
        if reply.finish_reason:
            attributes["gen_ai.response.finish_reasons"] = [reply.finish_reason]
        safely(span.set, attributes)
        safely(span.end)
        return reply


def _headers_of(span: SpanHandle) -> dict[str, str] | None:
    try:
        return span.headers()
    except Exception:
        log.warning("could not format an LLM span's traceparent", exc_info=True)
        return None


@contextlib.contextmanager
def current(trace: RequestTrace | None) -> Iterator[None]:
    """Make ``trace``'s request span the parent of compaction and LLM spans in this block
    (and in tasks it creates)."""
    if trace is None:
        yield
        return
    token = CURRENT.set(trace.span)
    try:
        yield
    finally:
        CURRENT.reset(token)
