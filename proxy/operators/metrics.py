"""Prometheus metrics (DESIGN §8): one ``Metrics`` object per app, owned by its lifespan.

Each app gets its own ``CollectorRegistry`` (never the global one), so building two apps in
one process never raises "Duplicated timeseries".

Several worker processes (``serve --workers N``) each count their own requests. To expose
one correct total, start the proxy with ``PROMETHEUS_MULTIPROC_DIR`` set to an empty folder
private to this proxy: every worker then writes its counters to files there and /metrics sums
them all (prometheus-client's multiprocess mode). The variable must be set before the
workers start (it is read when prometheus-client is imported); wipe the folder between runs.
Without it, /metrics shows the counts of whichever worker answered the scrape.

Token numbers are counted exactly as the ledger counts them (the proxy's own count of the
original and forwarded histories of every request it prepared), so /metrics and the stats API
agree.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    values,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

from proxy.core.modelmap import input_price  # noqa: F401 (named here too: the tests')
from proxy.core.types import COMPACTION_CASES, Case, Failure
from proxy.operators.events import as_event
from proxy.operators.quality_metrics import QualityMetrics
from proxy.operators.request_series import Folder, RequestSeries

log = logging.getLogger("compaction_proxy.metrics")

PREFIX = "compaction_proxy"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = CONTENT_TYPE_LATEST
FAILURE_PURPOSES = ("detector", "summarizer")

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_OVERHEAD_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0,
)  # fmt: skip
_COMPACTION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


def multiprocess_enabled() -> bool:
    """True when prometheus-client was imported with ``PROMETHEUS_MULTIPROC_DIR`` set."""
    return bool(getattr(values.ValueClass, "_multiprocess", False))


class Metrics:
    """The proxy's counters and histograms. Every ``observe_*`` method is cheap and never raises."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.multiprocess = multiprocess_enabled()
        if os.environ.get(MULTIPROC_ENV) and not self.multiprocess:
            log.warning(
                "PROMETHEUS_MULTIPROC_DIR was set after prometheus-client was imported; "
                "/metrics shows this worker only"
            )
        # First in the registry: whatever reads it has the noted requests added before.
        self.registry.register(Folder(self.fold))
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Requests through the proxy, by route, compaction case and upstream status.",
            ["route", "case", "status"],
            registry=r,
        )
        tokens = ["route", "model"]
        self.original_tokens = Counter(
            f"{PREFIX}_original_prompt_tokens",
            "Prompt tokens of the histories clients sent (the proxy's count).",
            tokens,
            registry=r,
        )
        self.forwarded_tokens = Counter(
            f"{PREFIX}_forwarded_prompt_tokens",
            "Prompt tokens of the histories forwarded upstream (the proxy's count).",
            tokens,
            registry=r,
        )
        self.saved_tokens = Counter(
            f"{PREFIX}_saved_prompt_tokens",
            "Prompt tokens saved by compaction (original minus forwarded).",
            tokens,
            registry=r,
        )
        self.saved_usd = Counter(
            f"{PREFIX}_saved_usd",
            "Gross dollars saved: saved tokens x the model's input price (LiteLLM map); the "
            "net figure is compaction_proxy_net_saved_usd.",
            tokens,
            registry=r,
        )
        self.shadow_saved_tokens = Counter(
            f"{PREFIX}_shadow_saved_prompt_tokens",
            "Shadow mode: prompt tokens compaction would have saved (nothing was changed).",
            tokens,
            registry=r,
        )
        self.cached_tokens = Counter(
            f"{PREFIX}_cached_prompt_tokens",
            "Prompt tokens the upstream reported as read from its prompt cache.",
            tokens,
            registry=r,
        )
        self.compactions = Counter(
            f"{PREFIX}_compactions",
            "Compactions by case (prune, truncate, summarize, emergency; failed when none "
            "resulted).",
            ["case"],
            registry=r,
        )
        self.compaction_duration = Histogram(
            f"{PREFIX}_compaction_duration_seconds",
            "Wall time of one compaction (detector plus summarizer).",
            ["case"],
            buckets=_COMPACTION_BUCKETS,
            registry=r,
        )
        self.failures = Counter(
            f"{PREFIX}_llm_failures",
            "Failed detector or summarizer calls (the request still went through).",
            ["purpose"],
            registry=r,
        )
        # The loss reports: key facts of replaced spans still in the forwarded context (the
        # summary, its key references, pins or the verbatim part), and facts gone from it.
        self.facts_kept = Counter(
            f"{PREFIX}_facts_kept",
            "Key facts of replaced spans that the forwarded context still holds.",
            ["case"],
            registry=r,
        )
        self.facts_dropped = Counter(
            f"{PREFIX}_facts_dropped",
            "Key facts of replaced spans that no longer appear in the forwarded context.",
            ["case"],
            registry=r,
        )
        self.upstream_latency = Histogram(
            f"{PREFIX}_upstream_latency_seconds",
            "Time from forwarding to the end of the upstream response (streams included).",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            f"{PREFIX}_overhead_seconds",
            "Time spent in the proxy before forwarding (inline compactions included).",
            ["route"],
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.store_up = Gauge(
            f"{PREFIX}_store_up",
            "1 while the store answers reads and writes; 0 while it is unavailable (the proxy "
            "then forwards uncompacted).",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.store_up.set(1)
        self.store_failures = Counter(
            f"{PREFIX}_store_failures",
            "Times the store was found unavailable (unwritable, deleted, corrupt, unreachable).",
            registry=r,
        )
        self.store_write_failures = Counter(
            f"{PREFIX}_store_write_failures",
            "Store writes that failed and were dropped (a ledger flush, a record, a lock, "
            "state): each one is counted here, none is lost silently.",
            registry=r,
        )
        self.rejected = Counter(
            f"{PREFIX}_rejected_requests",
            "Requests the proxy itself answered with a 4xx (never forwarded), by route and "
            "reason (the error code).",
            ["route", "reason"],
            registry=r,
        )
        self.refused = Counter(
            f"{PREFIX}_upstream_refused_compactions",
            "Compacted requests the upstream refused (400) and the proxy sent again as the "
            "client sent them, by route, the refused record's case and outcome: 'healed' (the "
            "client's body was accepted; the conversation is not compacted again), 'refused "
            "as sent too' (the request's own fault) or 'not retried' (the LiteLLM hook: the "
            "client got the refusal; the conversation's next request passes as sent).",
            ["route", "case", "outcome"],
            registry=r,
        )
        self.quality = QualityMetrics(r)  # #26: anchors, repeated work, loop breaker
        self._series = RequestSeries(self, defer=not self.multiprocess)
        # Known label values start at zero, so every series exists before its first event.
        self.compactions.labels(Failure.FAILED)
        for case in sorted(COMPACTION_CASES):
            self.compactions.labels(case)
            self.compaction_duration.labels(case)
            self.facts_kept.labels(case)
            self.facts_dropped.labels(case)
        for purpose in FAILURE_PURPOSES:
            self.failures.labels(purpose)

    def observe_request(
        self,
        prepared: Any,
        status: int,
        latency: float,
        overhead: float,
        cached: int,
        *,
        route: str = "chat.completions",
    ) -> None:
        """One finished request. ``prepared`` is None when the compaction core failed.

        Tokens are counted for every prepared request whatever its status, like the ledger.
        Noted, and added to the series in batches (``proxy.operators.request_series``).
        """
        try:
            self._series.note(prepared, status, latency, overhead, cached, route)
        except Exception:  # metrics never break a request
            log.exception("metrics: observe_request failed")

    def fold(self) -> None:
        """Add the requests noted so far to the series (``render`` and any read of the
        registry do this first)."""
        series = getattr(self, "_series", None)  # (None while the series are being made)
        if series is not None:
            series.fold()

    def observe_rejection(self, route: str, reason: str) -> None:
        """One request the proxy refused itself (bad body, unknown route, ...)."""
        try:
            self.rejected.labels(route, reason).inc()
        except Exception:
            log.exception("metrics: observe_rejection failed")

    def observe_refusal(self, route: str, case: str, outcome: str) -> None:
        """One compacted request the upstream refused, sent again as the client sent it."""
        try:
            self.refused.labels(route, case, outcome).inc()
        except Exception:
            log.exception("metrics: observe_refusal failed")

    def observe_compaction(
        self, case: str, duration_s: float | None, failed_purpose: str | None = None
    ) -> None:
        """One compaction attempt's outcome, or one failed detector/summarizer call."""
        try:
            if failed_purpose is not None:
                self.failures.labels(failed_purpose).inc()
            if case in COMPACTION_CASES:
                self.compactions.labels(case).inc()
                if duration_s is not None:
                    self.compaction_duration.labels(case).observe(max(duration_s, 0.0))
            elif case == Failure.FAILED:
                self.compactions.labels(Failure.FAILED).inc()
        except Exception:
            log.exception("metrics: observe_compaction failed")

    def observe_event(self, event: Mapping[str, object]) -> None:
        """The compactor's ``on_event`` callback: its events (``proxy.core.types.Event``) as
        metrics. A stored compaction counts by case with its duration and loss report; a
        failed summarizer counts as ``failed``; a failed detector only as a detector failure
        (the summarizer still ran). Anything else is ignored."""
        self.quality.observe(event)
        parsed = as_event(event)
        if parsed is None:
            return
        if parsed["case"] == Failure.DETECTOR_FAILED:
            self.observe_compaction(Case.NONE, None, "detector")
        elif parsed["case"] == Failure.FAILED:
            self.observe_compaction(Failure.FAILED, None, "summarizer")
        else:
            self.observe_compaction(parsed["case"], parsed["duration_s"])
            self.observe_facts(parsed["case"], parsed["facts_kept"], parsed["facts_dropped"])

    def observe_facts(self, case: str, kept: int, dropped: int) -> None:
        """One compaction's loss report, as counts."""
        try:
            if case in COMPACTION_CASES:
                if kept > 0:
                    self.facts_kept.labels(case).inc(kept)
                if dropped > 0:
                    self.facts_dropped.labels(case).inc(dropped)
        except Exception:
            log.exception("metrics: observe_facts failed")

    def observe_store(self, up: bool, changed: bool) -> None:
        """The store's state after a check; ``changed`` when it just went down or up."""
        self.store_up.set(1 if up else 0)
        if changed and not up:
            self.store_failures.inc()

    def observe_store_write_failure(self) -> None:
        """One store write failed (called from the store, in any thread)."""
        self.store_write_failures.inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type; all workers' sum in multiprocess mode."""
        if self.multiprocess:
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            return generate_latest(registry), CONTENT_TYPE
        return generate_latest(self.registry), CONTENT_TYPE
