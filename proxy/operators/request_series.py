"""The per-request series of ``/metrics``, added in batches (#28).

Adding one finished request to its series (the request count, two histograms, five token and
dollar counters, each behind its own lock) cost ~5.3 us of the request path's CPU. The
request is noted instead (a tuple appended) and the noted requests are added together,
summed per kind of request (each series touched once a fold): ~2.0 us a request in all.
They are added before anything reads the registry (``Folder``, registered first, so a
scrape or a test's ``get_sample_value`` sees every request that finished before it), every
``FOLD_EVERY`` requests, and at most ``FOLD_S`` after the first one noted (bounding how
long they wait in memory). In multiprocess mode each request is added at once, as before:
a scrape there reads every worker's files, which only each worker's own adding writes.
Noted from any thread (without an event loop: added at once); the list of noted requests
is swapped under a lock.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client.registry import Collector

from proxy.core import billing
from proxy.core.modelmap import input_price
from proxy.core.types import Case

log = logging.getLogger("compaction_proxy.metrics")

# Model names come from clients: past this many distinct names a process reports "other",
# so a client cannot grow the number of series without bound.
MAX_MODEL_LABELS = 64
_MAX_CHILD_SETS = 4096
FOLD_EVERY = 256
FOLD_S = 1.0

# (route, case, status, model, latency, overhead, cached tokens,
#  (original, forwarded, reserve tokens) or None when the compaction core failed)
Noted = tuple[str, str, int, str, float, float, int, "tuple[int, int, int] | None"]


class Folder(Collector):
    """A collector of no series that adds the noted requests when the registry is read."""

    def __init__(self, fold: Callable[[], None]) -> None:
        self._fold = fold

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        self._fold()
        return []


class _Sums:
    """One kind of request's noted figures, summed for a fold."""

    __slots__ = (
        "requests", "upstream", "overhead", "cached", "counted", "original", "forwarded",
        "saved", "saved_usd", "would",
    )  # fmt: skip

    def __init__(self) -> None:
        self.requests = self.cached = self.original = self.forwarded = self.saved = 0
        self.upstream: list[float] = []
        self.overhead: list[float] = []
        self.counted = False
        self.saved_usd = 0.0
        self.would: int | None = None  # shadow mode's would-be saving


def _observe_all(histogram: Any, amounts: list[float]) -> None:
    """``histogram.observe(a)`` for each of ``amounts``: each bucket and the sum added to
    once, where the histogram is built as prometheus-client's of today (its buckets' values
    and bounds; ``tests/test_request_series.py`` checks the result against ``observe``),
    else one by one."""
    bounds: Any = getattr(histogram, "_upper_bounds", None)
    buckets: Any = getattr(histogram, "_buckets", None)
    total: Any = getattr(histogram, "_sum", None)
    shaped = isinstance(bounds, list) and isinstance(buckets, list) and total is not None
    if not shaped or len(bounds) != len(buckets):
        for amount in amounts:
            histogram.observe(amount)
        return
    histogram._raise_if_not_observable()
    counts = [0] * len(bounds)
    for amount in amounts:
        i = bisect.bisect_left(bounds, amount)  # the first bound >= amount, as ``observe``
        if i < len(counts) and amount <= bounds[i]:
            counts[i] += 1
    total.inc(sum(amounts))
    for i, n in enumerate(counts):
        if n:
            buckets[i].inc(n)


@dataclass(frozen=True)
class _RequestChildren:
    """The series one kind of request (route, case, status, model) counts in."""

    requests: Any
    upstream_latency: Any
    overhead: Any
    cached_tokens: Any
    original_tokens: Any
    forwarded_tokens: Any
    saved_tokens: Any
    saved_usd: Any


class RequestSeries:
    """The noted requests of one ``Metrics`` and the series they are added to."""

    def __init__(self, metrics: Any, *, defer: bool = True) -> None:
        self.m = metrics
        self.defer = defer  # False: each request added as it is noted
        self._pending: list[Noted] = []
        self._lock = threading.Lock()
        self._models: set[str] = set()
        # The labelled children a request touches, by its labels: ``labels()`` costs a
        # couple of microseconds a call (label checks, a lock), eight calls a request.
        self._children: dict[tuple[str, ...], _RequestChildren] = {}

    def note(
        self, prepared: Any, status: int, latency: float, overhead: float, cached: int, route: str
    ) -> None:
        """One finished request (``Metrics.observe_request``); raises nothing."""
        noted: Noted
        if prepared is None:
            noted = (route, Case.ERROR, status, "unknown", latency, overhead, cached, None)
        else:
            case = Case.SHADOW if prepared.shadow else prepared.case
            reserve = getattr(prepared, "reserve_tokens", 0) or 0
            counts = (prepared.original_tokens, prepared.forwarded_tokens, reserve)
            noted = (route, case, status, prepared.model, latency, overhead, cached, counts)
        with self._lock:
            pending = self._pending
            pending.append(noted)
            held = len(pending)
        if not self.defer:
            self.fold()
        elif held == 1:
            self._fold_later()
        elif held >= FOLD_EVERY:
            self.fold()

    def _fold_later(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a tool, a test): added at once
            self.fold()
            return
        loop.call_later(FOLD_S, self.fold)

    def fold(self) -> None:
        """Add the requests noted since the last fold to their series: summed per kind of
        request first, so a series is touched once a fold, not once a request. Never raises."""
        with self._lock:  # (a scrape may read the registry from another thread)
            pending, self._pending = self._pending, []
        sums: dict[tuple[str, str, str, str], _Sums] = {}
        for noted in pending:
            try:
                self._sum(sums, *noted)
            except Exception:  # metrics never break a request
                log.exception("metrics: observe_request failed")
        for (route, case, status, model), got in sums.items():
            try:
                c = self._children_of(route, case, status, model)
                c.requests.inc(got.requests)
                _observe_all(c.upstream_latency, got.upstream)
                _observe_all(c.overhead, got.overhead)
                # inc(0) too: every series exists from a model's first request, so queries
                # and ratios over them work before the first saving or cache hit.
                c.cached_tokens.inc(got.cached)
                if got.counted:
                    c.original_tokens.inc(got.original)
                    c.forwarded_tokens.inc(got.forwarded)
                    c.saved_tokens.inc(got.saved)
                    c.saved_usd.inc(got.saved_usd)
                if got.would is not None:
                    self.m.shadow_saved_tokens.labels(route, model).inc(got.would)
            except Exception:
                log.exception("metrics: observe_request failed")

    def _sum(
        self,
        sums: dict[tuple[str, str, str, str], _Sums],
        route: str,
        case: str,
        status: int,
        model_name: str,
        latency: float,
        overhead: float,
        cached: int,
        counts: tuple[int, int, int] | None,
    ) -> None:
        key = (route, case, str(status), self._model_label(model_name))
        got = sums.get(key)
        if got is None:
            got = sums[key] = _Sums()
        got.requests += 1
        got.upstream.append(max(latency - overhead, 0.0))
        got.overhead.append(max(overhead, 0.0))
        got.cached += max(cached, 0)
        if counts is None:
            return
        original, forwarded, reserve = counts
        got.counted = True
        if case == Case.SHADOW:
            # The upstream got the original: the would-be saving is counted aside.
            got.would = (got.would or 0) + max(original - forwarded, 0)
            forwarded = original
        saved = max(original - forwarded, 0)
        if saved and billing.over_window(model_name, original + reserve):
            saved = 0  # kept within the context window: not a saving (ledger gauges)
        got.original += original
        got.forwarded += forwarded
        got.saved += saved
        got.saved_usd += saved * input_price(model_name)

    def _model_label(self, model: str) -> str:
        if model in self._models:
            return model
        if len(self._models) >= MAX_MODEL_LABELS:
            return "other"
        self._models.add(model)
        return model

    def _children_of(self, route: str, case: str, status: str, model: str) -> _RequestChildren:
        key = (route, case, status, model)
        found = self._children.get(key)
        if found is None:
            if len(self._children) >= _MAX_CHILD_SETS:  # (statuses are the upstream's)
                self._children.clear()
            m = self.m
            found = self._children[key] = _RequestChildren(
                requests=m.requests.labels(route, case, status),
                upstream_latency=m.upstream_latency.labels(route),
                overhead=m.overhead.labels(route),
                cached_tokens=m.cached_tokens.labels(route, model),
                original_tokens=m.original_tokens.labels(route, model),
                forwarded_tokens=m.forwarded_tokens.labels(route, model),
                saved_tokens=m.saved_tokens.labels(route, model),
                saved_usd=m.saved_usd.labels(route, model),
            )
        return found
