"""The per-request series added in batches (``proxy.operators.request_series``, #28), and the
stability tracker's item names looked up rather than formatted (``stability._ItemNames``)."""

from __future__ import annotations

import asyncio
import os
import types
from typing import Any

import pytest

from proxy.core import stability
from proxy.operators import request_series
from proxy.operators.metrics import Metrics

MODEL = "gpt-4o-mini"


def _prepared(original: int = 500, forwarded: int = 300, shadow: bool = False) -> object:
    return types.SimpleNamespace(
        case="summarize", shadow=shadow, model=MODEL, original_tokens=original,
        forwarded_tokens=forwarded, reserve_tokens=0,
    )  # fmt: skip


def _requests(m: Metrics, case: str = "summarize") -> float | None:
    labels = {"route": "chat.completions", "case": case, "status": "200"}
    return m.registry.get_sample_value("compaction_proxy_requests_total", labels)


def _held(m: Metrics) -> float:
    """What the series hold now, without reading the registry (which adds what is noted)."""
    total = 0.0
    for metric in (m.requests,):
        for child in metric._metrics.values():
            total += child._value.get()
    return total


async def test_a_read_of_the_registry_adds_what_was_noted() -> None:
    m = Metrics()
    for _ in range(3):
        m.observe_request(_prepared(), 200, 0.5, 0.001, 100)
    assert _held(m) == 0  # noted, not added yet (an event loop runs: deferred)
    assert _requests(m) == 3
    saved = {"route": "chat.completions", "model": MODEL}
    assert m.registry.get_sample_value("compaction_proxy_saved_prompt_tokens_total", saved) == 600
    cached = m.registry.get_sample_value("compaction_proxy_cached_prompt_tokens_total", saved)
    assert cached == 300
    body, _ = m.render()
    assert b'compaction_proxy_requests_total{case="summarize",route="chat.completions"' in body


async def test_noted_requests_are_added_every_fold_every(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_series, "FOLD_EVERY", 4)
    m = Metrics()
    for _ in range(3):
        m.observe_request(_prepared(), 200, 0.5, 0.001, 0)
    assert _held(m) == 0
    m.observe_request(_prepared(), 200, 0.5, 0.001, 0)
    assert _held(m) == 4  # the fourth added all four, no read needed


async def test_noted_requests_are_added_after_fold_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_series, "FOLD_S", 0.0)
    m = Metrics()
    m.observe_request(_prepared(), 200, 0.5, 0.001, 0)
    m.observe_request(None, 502, 0.5, 0.001, 0)
    assert _held(m) == 0
    for _ in range(3):  # the timer set by the first one noted runs (FOLD_S: now)
        await asyncio.sleep(0)
    assert _held(m) == 2


def test_without_an_event_loop_each_request_is_added_at_once() -> None:
    m = Metrics()
    m.observe_request(_prepared(shadow=True), 200, 0.5, 0.001, 0)
    assert _held(m) == 1
    assert _requests(m, "shadow") == 1
    would = {"route": "chat.completions", "model": MODEL}
    shadow = m.registry.get_sample_value("compaction_proxy_shadow_saved_prompt_tokens_total", would)
    assert shadow == 200
    saved = m.registry.get_sample_value("compaction_proxy_saved_prompt_tokens_total", would)
    assert saved == 0  # the upstream got the original


async def test_not_deferred_adds_each_request_as_it_is_noted() -> None:
    # (multiprocess mode: a scrape reads every worker's files, written only when added)
    m = Metrics()
    m._series = request_series.RequestSeries(m, defer=False)
    m.observe_request(_prepared(), 200, 0.5, 0.001, 0)
    assert _held(m) == 1


async def test_a_failing_request_does_not_cost_the_others_theirs() -> None:
    m = Metrics()
    bad = types.SimpleNamespace(case="summarize", shadow=False, model=MODEL)  # no token counts
    m.observe_request(bad, 200, 0.5, 0.001, 0)  # noted? no: it raised in note, logged
    m.observe_request(_prepared(), 200, 0.5, 0.001, 0)
    m._series._pending.append(("chat.completions", "none", 200, MODEL, 0.1, 0.0, 0, "x"))  # type: ignore[arg-type]
    m.observe_request(_prepared(), 200, 0.5, 0.001, 0)
    assert _requests(m) == 2


def test_item_names_are_the_formatted_ones_and_bounded() -> None:
    names = stability._ItemNames(size=4)
    fps = [os.urandom(16) for _ in range(10)]
    assert names(fps) == [f"history:{fp[:8].hex()}" for fp in fps]
    again = names(fps[-3:])
    assert again == [f"history:{fp[:8].hex()}" for fp in fps[-3:]]
    assert len(names._new) <= 4 and len(names._old) <= 4
    items = stability.prompt_items(fps[:4], 1, 2)
    assert items[0] == f"system:{fps[0][:8].hex()}"
    assert items[2] == f"summary:{fps[2][:8].hex()}"
    assert items[3] == f"history:{fps[3][:8].hex()}"
    # The names are shared, never changed in place: a second prompt's are as formatted.
    assert stability.prompt_items(fps[:4], 0, None)[0] == f"history:{fps[0][:8].hex()}"


def test_observing_many_at_once_is_observing_each() -> None:
    """``_observe_all`` reads prometheus-client's histogram as it is built today: the same
    buckets, count and sum as ``observe`` one by one (edges, zero, past the last bound)."""
    from prometheus_client import CollectorRegistry, Histogram

    amounts = [0.0, 0.0005, 0.00051, 0.001, 0.3, 2.5, 2.5000001, 29.9, 30.0, 45.0, 1e9]
    amounts += [i / 997 for i in range(400)]
    made = []
    for _ in range(2):
        registry = CollectorRegistry()
        h = Histogram(
            "h", "h", ["route"], buckets=(0.0005, 0.001, 0.25, 2.5, 30.0), registry=registry
        )
        made.append((registry, h.labels("r")))
    for amount in amounts:
        made[0][1].observe(amount)
    request_series._observe_all(made[1][1], amounts)

    def samples(registry: Any) -> list[tuple[str, dict[str, str], float]]:
        return [
            (s.name, s.labels, round(s.value, 9))
            for metric in registry.collect()
            for s in metric.samples
            if not s.name.endswith("_created")
        ]

    assert samples(made[0][0]) == samples(made[1][0])
    assert ("h_count", {"route": "r"}, float(len(amounts))) in samples(made[1][0])


async def test_a_fold_adds_what_each_request_added_alone() -> None:
    kinds = [
        (_prepared(500, 300), 200), (_prepared(500, 300, shadow=True), 200),
        (_prepared(800, 800), 502), (None, 502), (_prepared(90, 40), 200),
    ]  # fmt: skip
    batched, alone = Metrics(), Metrics()
    alone._series = request_series.RequestSeries(alone, defer=False)
    for i in range(60):
        prepared, status = kinds[i % len(kinds)]
        for m in (batched, alone):
            m.observe_request(prepared, status, 0.1 + i / 100, i / 10_000, i)
    assert _held(batched) == 0 and _held(alone) == 60
    text = [m.render()[0].decode().splitlines() for m in (batched, alone)]

    def value(line: str) -> str:  # (a sum added in another order: the last digits differ)
        if line.startswith("#"):
            return line
        name, _, number = line.rpartition(" ")
        return f"{name} {round(float(number), 9)}"

    lines = [[value(line) for line in t if "_created" not in line] for t in text]
    assert lines[0] == lines[1]
    assert any(
        line.startswith("compaction_proxy_shadow_saved_prompt_tokens_total") for line in lines[0]
    )
