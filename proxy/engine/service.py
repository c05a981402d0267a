"""One request lifecycle behind both front doors: ``begin`` -> forward -> ``finish``.

The Starlette server (``proxy.server``) and the LiteLLM hook (``hooks``) each translate their
own request into an ``Incoming``, call ``Service.begin`` (request controls, the compactor's
``prepare``), forward what it returns in their own way, and call ``Service.finish`` once the
answer is known (the log line, ``Metrics.observe_request``, the ledger entry through the
batched writer, and on success the stability tracker and any background compaction through
``Compactor.schedule``). So the same request leaves the same ledger entry and metrics
whichever door it came through. ``build_service`` builds a ``Service`` from a ``Config``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.adapters.health import StoreHealth, open_store_or_degraded
from proxy.adapters.llm import LLM
from proxy.adapters.store import Store, open_store
from proxy.config import Config, load_prompt
from proxy.core import billing
from proxy.core.controls import request_controls
from proxy.core.errors import ContextTooLong, StoreError
from proxy.core.modelmap import context_window
from proxy.core.prepared import Prepared, Prompts
from proxy.core.records import conv_key
from proxy.core.types import Case
from proxy.engine.compactor import Compactor
from proxy.engine.incoming import Incoming
from proxy.engine.tracing import RequestTrace, TracedLLM, Tracer, current, start_tracing
from proxy.logs import info_line
from proxy.operators import ledger
from proxy.operators.metrics import Metrics

log = logging.getLogger("compaction_proxy.service")


def too_long(prepared: Prepared | None, model: str) -> ContextTooLong | None:
    """The error for a request that, even compacted, is over the model's context window
    (nothing is left to drop: the provider would reject it); None when it fits. Both front
    doors answer it themselves, in their route's error shape, instead of forwarding."""
    if prepared is None or not prepared.too_long:
        return None
    return ContextTooLong(
        f"the conversation needs {prepared.forwarded_tokens} tokens after compaction "
        f"(plus {prepared.reserve_tokens} for tools and the reply), more than the "
        f"context window of {model}; start a new conversation or shorten it"
    )


def record_rejection(
    logger: logging.Logger,
    metrics: Metrics | None,
    route: str,
    status: int,
    reason: str,
    **extra: Any,
) -> None:
    """Log (on the front door's ``logger``) and count one 4xx a front door answered itself:
    route and reason, never content."""
    logger.info("rejected", extra={"route": route, "status": status, "reason": reason, **extra})
    if metrics is not None:
        metrics.observe_rejection(route, reason)


@dataclass
class Call:
    """One request between ``begin`` and ``finish``. ``prepared`` is None when the
    compaction core failed (the request then goes upstream as the client sent it)."""

    route: str
    prepared: Prepared | None
    started: float  # time.perf_counter() when the request arrived
    overhead_s: float = 0.0  # the proxy's own time before forwarding
    finished: bool = field(default=False, repr=False)
    # What the upstream refused, when the call was sent again as the client sent it.
    refused: Prepared | None = field(default=None, repr=False)
    trace: RequestTrace | None = field(default=None, repr=False)  # None: traces are off

    def trace_headers(self) -> dict[str, str]:
        """The ``traceparent`` the forwarded request carries (its span starts now); empty
        when traces are off."""
        return self.trace.upstream_headers() if self.trace is not None else {}

    def forwarding(self) -> None:
        """Mark the moment the request leaves for the upstream: the proxy's overhead ends."""
        self.overhead_s = time.perf_counter() - self.started


@dataclass
class Service:
    """The store, the compactor (with its batched writer), the metrics and the store's
    health: what a front door needs, owned here and closed by ``close``."""

    config: Config
    store: Store
    compactor: Compactor
    metrics: Metrics
    health: StoreHealth
    owns_store: bool = True
    tracer: Tracer | None = None  # traces (proxy.engine.tracing), when turned on

    async def begin(
        self, route: str, describe: Callable[[], Incoming], *, started: float | None = None
    ) -> Call:
        """Controls and ``prepare`` for the request ``describe`` returns; ``route`` labels it
        in the ledger and the metrics. Never raises: any error in ``describe`` or in the core
        is logged and the call goes on unprepared (fail open). ``started``: when the request
        arrived (default: now)."""
        started = time.perf_counter() if started is None else started
        prepared: Prepared | None
        trace: RequestTrace | None = None
        try:
            incoming = describe()
            if self.tracer is not None:
                trace = self.tracer.request(
                    route, incoming.model, incoming.tenant, started,
                    incoming.traceparent, incoming.tracestate,
                )  # fmt: skip
            controls = request_controls(
                self.config.compaction,
                header=incoming.compaction_header,
                tenant=incoming.tenant,
                tenant_name=incoming.tenant_name,
                model=incoming.model,
                messages=incoming.messages,
                stateful=incoming.stateful,
            )
            if trace is None:  # (no context manager at all on the untraced path)
                prepared = await self._prepare(incoming, controls)
            else:
                with current(trace):  # an inline compaction's spans go under the request's
                    prepared = await self._prepare(incoming, controls)
        except Exception:  # fail open: a compaction problem never fails the request
            log.exception("compaction core failed; forwarding unchanged")
            prepared = None
        call = Call(route, prepared, started, trace=trace)
        call.forwarding()
        return call

    async def _prepare(self, incoming: Incoming, controls: Any) -> Prepared:
        return await self.compactor.prepare(
            incoming.messages,
            model=incoming.counted_model or incoming.model,
            llm_model=incoming.model if incoming.counted_model else None,
            tenant=incoming.tenant,
            credential=incoming.credential,
            conversation_header=incoming.conversation_header,
            controls=controls,
            summary_role=incoming.summary_role,
            offload=incoming.offload,
            outside_cache_marks=incoming.outside_cache_marks,
            summary_joins=incoming.summary_joins,
            reserve_tokens=incoming.reserve_tokens,
            reuse=incoming.reuse,
            shared=incoming.shared,
        )

    async def send_as_sent(self, call: Call) -> bool:
        """The upstream refused (400) the body this call forwarded: whether to send the
        client's own body once instead. Yes when the compaction changed the body (nothing
        else of ours could be at fault) and the client's body fits the model's context
        window; the call then counts as forwarded as sent (case ``healed``). Once per call.

        The conversation is marked before the retry goes out (so no later request can use
        its records, however soon it comes): while marked, its records are not forwarded
        and no new one is made; a defect of ours costs one retry, never the session
        (``sent_as_sent`` takes the mark back when the client's body is refused too)."""
        p = call.prepared
        if p is None or call.refused is not None or not _retriable(p):
            return False
        call.refused = p
        call.prepared = p.but(
            case=Case.HEALED,
            skipped=True,
            record=None,
            forwarded=p.original,
            forwarded_counts=p.original_counts,
            forwarded_tokens=p.original_tokens,
            origins=list(range(len(p.original))),
            stability=None,
        )
        try:
            await asyncio.to_thread(self._mark_refused, p, call.route)
        except StoreError as exc:  # the retry still goes; only the mark is lost
            log.warning("could not mark a refused conversation", extra={"error": str(exc)})
        return True

    async def sent_as_sent(self, call: Call, status: int) -> None:
        """The client's own body (``send_as_sent``) was answered ``status``: refused too, the
        request itself was at fault, and the conversation's mark is taken back (before the
        client has the answer, so that its next request is compacted as before)."""
        p = call.refused
        if p is None or status != 400:
            return
        key = conv_key("refused", p.tenant, p.conversation)
        try:
            await asyncio.to_thread(self.store.delete, key)
        except StoreError as exc:
            log.warning("could not take back a refused mark", extra={"error": str(exc)})

    def _mark_refused(self, refused: Prepared, route: str) -> None:
        """While this mark is there, the conversation's records are not forwarded (sync)."""
        mark = {
            "ts": time.time(),
            "route": route,
            "record": refused.record.prefix_hash if refused.record else None,
            "case": refused.record.case if refused.record else refused.case,
        }
        key = conv_key("refused", refused.tenant, refused.conversation)
        self.store.set(key, mark, self.config.retention_s)

    def finish(
        self,
        call: Call,
        usage: Any,
        status: int,
        *,
        upstream_s: float | None = None,
        response_model: str | None = None,
    ) -> None:
        """After the response: the log line, the metrics, the ledger entry (queued for the
        batched writer) and, on a 200, the stability tracker and any background compaction.

        Once per call (later calls are ignored); never raises and never blocks. ``upstream_s``:
        the upstream's time when the front door knows it (else measured since ``started``);
        ``response_model``: the model the upstream named in its answer (for traces)."""
        if call.finished:
            return
        call.finished = True
        try:
            if call.trace is None:
                self._finish(call, usage, status, upstream_s)
            else:
                # A background compaction's spans go under this request's (its task copies it).
                with current(call.trace):
                    self._finish(call, usage, status, upstream_s)
        except Exception:
            log.exception("after-response handling failed")
        if call.trace is not None:
            call.trace.finish(
                call.prepared, usage, status, response_model,
                call.started + call.overhead_s, call.overhead_s,
            )  # fmt: skip

    def _finish(self, call: Call, usage: Any, status: int, upstream_s: float | None) -> None:
        prepared = call.prepared
        if upstream_s is None:
            latency = time.perf_counter() - call.started
        else:
            latency = call.overhead_s + max(upstream_s, 0.0)
        numbers = ledger.usage_numbers(usage)
        cached = numbers[1]
        info_line(
            log, "request", {
                "route": call.route,
                "conversation": prepared.conversation if prepared else None,
                "case": prepared.case if prepared else "error",
                "tokens_before": prepared.original_tokens if prepared else None,
                "tokens_after": prepared.forwarded_tokens if prepared else None,
                "upstream_status": status,
                "latency_ms": round(latency * 1000, 2),
                "overhead_ms": round(call.overhead_s * 1000, 3),
                "cached_tokens": cached,
            },
        )  # fmt: skip
        self.metrics.observe_request(
            prepared, status, latency, call.overhead_s, cached, route=call.route
        )
        if prepared is None:
            return
        if call.refused is not None:
            self._settle_refusal(call.route, call.refused, status)
        elif status == 400 and _retriable(prepared):
            # A front door that cannot send the client's body again (LiteLLM sends the
            # request itself): the next request of the conversation passes as sent, so a
            # defect of ours costs this request, never the session.
            self._settle_refusal(call.route, prepared, status, retried=False)
        if status == 200:
            self.compactor.schedule(prepared)
        entry = ledger.RequestEntry.of(
            prepared,
            route=call.route,
            status=status,
            usage=usage,
            latency_s=latency,
            overhead_s=call.overhead_s,
            cache_ttl_s=billing.rules_for(prepared.model, self.config.compaction).ttl_s,
            numbers=numbers,
        )
        self.compactor.writer.record(entry, prepared.sent(), call.trace)

    def _settle_refusal(
        self, route: str, refused: Prepared, status: int, *, retried: bool = True
    ) -> None:
        """Log and count a refused compacted body. ``retried``: the client's own body was
        sent next and answered ``status`` (refused too: the compaction was not at fault). Not
        retried (the LiteLLM hook): the mark is set here, and the next request passes as
        sent."""
        if not retried:
            outcome = "not retried"
            self.compactor.spawn_io(self._mark_refused, refused, route)
        elif status != 400:
            outcome = "healed"
        else:
            outcome = "refused as sent too"  # (its mark was taken back: sent_as_sent)
        case = refused.record.case if refused.record else refused.case
        log.warning(
            "the upstream refused a compacted request",
            extra={
                "route": route,
                "conversation": refused.conversation,
                "case": case,
                "record": refused.record.prefix_hash if refused.record else None,
                "status": status,
                "outcome": outcome,
            },
        )
        self.metrics.observe_refusal(route, case, outcome)

    async def close(self, timeout: float = 30) -> None:
        """Wait for background compactions and queued writes; close the store if ours."""
        await self.compactor.drain(timeout=timeout)
        self.metrics.fold()  # (a worker's files in multiprocess mode outlive it)
        if self.owns_store:
            self.store.close()
        if self.tracer is not None:  # export what is queued (the exporter's timeout bounds it)
            await asyncio.to_thread(self.tracer.shutdown)


def _retriable(p: Prepared) -> bool:
    """Whether a refusal of ``p``'s forwarded body may be ours: the compaction changed it,
    and the client's own body fits the model's context window (else sending it is no way
    out either)."""
    if not p.changed or p.as_sent:
        return False
    window = context_window(p.model)
    return not (window and p.original_tokens + p.reserve_tokens > window)


def build_service(
    config: Config,
    llm: LLM,
    *,
    store: Store | None = None,
    degraded_store: bool = True,
) -> Service:
    """The service for ``config`` with ``llm`` as the detector/summarizer client.

    ``store``: use this one (tests; not closed by ``close``). Else the configured store is
    opened: one that cannot be opened becomes an always-failing stand-in when
    ``degraded_store`` (requests are then forwarded uncompacted), else the error is raised.
    Raises ``ConfigError`` for an unreadable prompt file. Metrics get their own registry.
    """
    prompts = Prompts(
        detector=load_prompt("detector", config.compaction),
        summarizer=load_prompt("summarizer", config.compaction),
    )
    owns_store = store is None
    if store is None:
        url = config.store.url
        store = open_store_or_degraded(url) if degraded_store else open_store(url)
    metrics = Metrics()
    tracer = start_tracing(config, metrics.registry)
    compactor = Compactor(
        config.compaction,
        store,
        llm if tracer is None else TracedLLM(llm, tracer),
        prompts,
        retention_s=config.retention_s,
        on_event=metrics.observe_event,
        tracer=tracer,
    )
    health = StoreHealth(store, metrics.observe_store, metrics.observe_store_write_failure)
    return Service(config, store, compactor, metrics, health, owns_store, tracer)
