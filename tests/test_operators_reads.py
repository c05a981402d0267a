"""The operators' reads over a real DiskStore written through the real ledger: every stored
compaction case counts (prune included), and the admin side shows what the core recorded
rather than re-reading the summary's text."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench.admin_render import CountingStore
from proxy.adapters.store import DiskStore
from proxy.core.records import CompactionRecord, conv_key
from proxy.core.types import COMPACTION_CASES, Case
from proxy.operators import details, index, ledger, queries, reindex
from proxy.operators.metrics import Metrics

TENANT = "a" * 32


def entry(
    conversation: str, ts: float, case: str = Case.NONE, tenant: str = TENANT, model: str = "m"
) -> ledger.RequestEntry:
    return ledger.RequestEntry(
        ts=ts, tenant=tenant, conversation=conversation, model=model,
        route="chat.completions", case=case, status=200, original_messages=12,
        forwarded_messages=6, original_tokens=5000, forwarded_tokens=2000, prompt_tokens=2000,
        cached_tokens=0, cache_write_tokens=0, completion_tokens=20, latency_s=0.1,
        overhead_s=0.001,
    )  # fmt: skip


def store_compaction(
    store: DiskStore, conversation: str, record: CompactionRecord, tenant: str = TENANT
) -> None:
    """What the core writes for one stored compaction: the record, the ledger's charge and the
    event (``proxy.core.types.CompactionEvent``)."""
    store.set(conv_key("rec", tenant, conversation) + ":" + record.prefix_hash, record.to_json())
    ledger.record_compaction(
        store, tenant, conversation, record=record.prefix_hash, case=record.case,
        llm_tokens=record.llm_tokens, llm_usd=record.llm_usd, retention_s=None,
    )  # fmt: skip
    event: dict[str, Any] = {
        "case": record.case, "ts": record.created_at, "model": record.model, "k": record.k,
        "covered": record.covered, "tokens_before": record.tokens_before,
        "tokens_after": record.tokens_after, "reason": record.boundary_reason,
        "confidence": record.confidence, "duration_s": record.duration_s,
        "llm_tokens": record.llm_tokens, "prefix_hash": record.prefix_hash,
        "facts_kept": len(record.facts_kept) + len(record.facts_appended),
        "facts_dropped": len(record.facts_dropped),
    }  # fmt: skip
    ledger.record_events(store, tenant, conversation, [event], None)


def record(case: str, prefix_hash: str, **kw: Any) -> CompactionRecord:
    base: dict[str, Any] = {
        "k": 8, "prefix_hash": prefix_hash, "head_len": 1, "summary": None, "case": case,
        "covered": 7, "created_at": time.time(), "tokens_before": 5000, "tokens_after": 2000,
        "model": "gpt-4o-mini",
    }  # fmt: skip
    return CompactionRecord(**(base | kw | {"case": str(case)}))


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = DiskStore(tmp_path / "store")
    yield s
    s.close()


def test_prune_is_a_compaction_everywhere(store: DiskStore) -> None:
    # Before types.COMPACTION_CASES, the admin side and the metrics knew only summarize,
    # truncate and emergency: a prune was stored, charged, and then shown nowhere.
    assert Case.PRUNE in COMPACTION_CASES
    ledger.record_batch(store, [(entry("agent", time.time()), None)], None)
    pruned = ["tool result #3 (read_file)", "tool result #5 (grep)"]
    store_compaction(store, "agent", record(Case.PRUNE, "ab" * 16, pruned=pruned))

    detail = details.conversation_detail(store, TENANT, "agent")
    assert [c["case"] for c in detail["compactions"]] == [Case.PRUNE]
    assert detail["compactions"][0]["pruned"] == pruned
    assert detail["meta"]["compactions"] == 1
    totals = queries.stats(store, hours=2)["totals"]
    assert totals["compactions"] == 1
    listing = queries.list_conversations(store)
    assert listing["items"][0]["compactions"] == 1

    metrics = Metrics()
    event = {"case": "prune", "ts": 1.0, "model": "m", "duration_s": 0.2, "facts_kept": 3}
    metrics.observe_event(event)
    body = metrics.render()[0].decode()
    assert 'compaction_proxy_compactions_total{case="prune"} 1.0' in body
    assert 'compaction_proxy_facts_kept_total{case="prune"} 3.0' in body
    assert 'compaction_proxy_compaction_duration_seconds_count{case="prune"} 1.0' in body


def test_the_loss_report_is_what_the_core_recorded_not_the_summary_text(
    store: DiskStore,
) -> None:
    # The summary's text has a "Key references:" line that disagrees with the record: the
    # admin API reports the record's lists (the core computed them against what it forwarded).
    summary = {
        "role": "system",
        "content": "[History Summary - 1] We fixed the bug.\n\nKey references: NOT-FROM-TEXT",
    }
    rec = record(
        Case.SUMMARIZE, "cd" * 16, summary=summary, facts_kept=["the bug"],
        facts_appended=["OPS-4821"], facts_elsewhere=["billing.py"], facts_dropped=["port 8443"],
        pinned=["message 1: the task"],
    )  # fmt: skip
    ledger.record_batch(store, [(entry("chat", time.time()), None)], None)
    store_compaction(store, "chat", rec)

    (c,) = details.conversation_detail(store, TENANT, "chat")["compactions"]
    assert c["summary"] == summary["content"] and c["summary_role"] == "system"
    assert c["facts_kept"] == ["the bug"]
    assert c["facts_appended"] == ["OPS-4821"]
    assert c["facts_elsewhere"] == ["billing.py"]
    assert c["facts_dropped"] == ["port 8443"]
    assert c["pinned"] == ["message 1: the task"] and c["record_available"] is True


def test_failures_and_odd_stored_items_read_as_typed_events(store: DiskStore) -> None:
    ledger.record_batch(store, [(entry("flaky", time.time()), None)], None)
    key = conv_key("ev", TENANT, "flaky")
    store.append(key, {"case": "failed", "ts": 2.0, "model": "m", "error": "timeout", "soft": 1})
    store.append(key, {"case": "detector_failed", "ts": 1.0, "model": "m", "error": "bad json"})
    store.append(key, "not an event")
    store.append(key, {"case": "summarize"})  # written before most fields existed
    detail = details.conversation_detail(store, TENANT, "flaky")
    assert [f["case"] for f in detail["failures"]] == ["detector_failed", "failed"]
    assert detail["failures"][1]["soft"] is False  # only a real true is "soft"
    (old,) = detail["compactions"]
    assert old["record_available"] is False and old["k"] == 0 and old["facts_kept"] == []


def fill(store: DiskStore, start: int, n: int) -> None:
    """``n`` more conversations, of 3 tenants and 2 models, through the ledger's batches."""
    now = time.time()
    batch = [
        (
            replace(
                entry(f"c{i}", now - 600 + i, tenant=str(i % 3) * 32, model=f"model-{i % 2}"),
                original_tokens=3000 + (i * 7919) % 5000,  # varied, for the sorts
                original_messages=4 + i % 11,
            ),
            None,
        )
        for i in range(start, start + n)
    ]
    ledger.record_batch(store, batch, 86400.0)


def overview_operations(store: DiskStore, **filters: Any) -> int:
    """Store operations of one overview render's reads (``/dashboard``'s ``load``)."""
    counting = CountingStore(store)
    reindex.ensure(counting, 86400.0)  # type: ignore[arg-type]
    queries.stats(counting, hours=24)  # type: ignore[arg-type]
    listing = queries.list_conversations(counting, per_page=25, **filters)  # type: ignore[arg-type]
    assert len(listing["items"]) == 25
    return counting.operations


def test_the_overviews_store_operations_do_not_grow_with_the_conversations(
    store: DiskStore,
) -> None:
    fill(store, 0, 90)  # a full page in each filter's scope
    reindex.ensure(store, 86400.0)  # once per store (nothing to rebuild: written indexed)
    small = overview_operations(store)
    small_by_tenant = overview_operations(store, tenant="1" * 32)
    small_by_model = overview_operations(store, model="MODEL-1")
    small_by_saving = overview_operations(store, sort="saved_tokens")
    small_by_tenant_name = overview_operations(store, sort="tenant", order="asc")
    fill(store, 90, 210)
    assert overview_operations(store) == small
    assert overview_operations(store, tenant="1" * 32) == small_by_tenant
    assert overview_operations(store, model="MODEL-1") == small_by_model
    assert overview_operations(store, sort="saved_tokens") == small_by_saving
    assert overview_operations(store, sort="tenant", order="asc") == small_by_tenant_name
    totals = queries.stats(store, hours=24)["totals"]
    assert totals["conversations"] == 300 and totals["tenants"] == 3
    # No render lists every key of the store.
    counting = CountingStore(store)
    queries.stats(counting, hours=24)  # type: ignore[arg-type]
    queries.list_conversations(counting)  # type: ignore[arg-type]
    assert counting.calls["keys"] == 0


def test_pages_of_the_index_are_the_newest_first_and_filters_narrow_them(
    store: DiskStore,
) -> None:
    fill(store, 0, 30)
    first = queries.list_conversations(store, per_page=10)
    second = queries.list_conversations(store, per_page=10, page=2)
    assert first["total"] == 30 and len(first["tenants"]) == 3
    assert first["models"] == ["model-0", "model-1"]
    seen = [r["last_seen"] for r in first["items"] + second["items"]]
    assert seen == sorted(seen, reverse=True) and len(set(seen)) == 20
    oldest = queries.list_conversations(store, per_page=5, order="asc")["items"]
    assert [r["conversation"] for r in oldest] == ["c0", "c1", "c2", "c3", "c4"]
    tenant = "2" * 32
    mine = queries.list_conversations(store, tenant=tenant[:6])
    assert mine["total"] == 10 and {r["tenant"] for r in mine["items"]} == {tenant}
    both = queries.list_conversations(store, tenant=tenant, model="model-0")
    assert {(r["tenant"], r["model"]) for r in both["items"]} == {(tenant, "model-0")}
    assert both["total"] == 5
    assert queries.list_conversations(store, tenant="ffff")["total"] == 0
    # A bare id is found across tenants through the tenants index.
    assert queries.resolve(store, "c7") == ("1" * 32, "c7")


def test_a_conversation_moving_model_or_adopted_leaves_no_stale_row(store: DiskStore) -> None:
    now = time.time()
    ledger.record_batch(store, [(entry("first", now - 10, model="a"), None)], None)
    ledger.record_batch(store, [(entry("first", now - 5, model="b"), None)], None)
    assert queries.list_conversations(store, model="a")["total"] == 0
    assert queries.list_conversations(store, model="b")["total"] == 1
    adopted = entry("session", now)
    object.__setattr__(adopted, "earlier_conversation", "first")
    ledger.record_batch(store, [(adopted, None)], None)
    listing = queries.list_conversations(store)
    assert [r["conversation"] for r in listing["items"]] == ["session"]
    assert listing["total"] == 1
    # Both requests in one batch of the writer: the first row is adopted within the batch.
    later = entry("session-2", now + 2)
    object.__setattr__(later, "earlier_conversation", "first-2")
    ledger.record_batch(store, [(entry("first-2", now + 1), None), (later, None)], None)
    listing = queries.list_conversations(store)
    assert [r["conversation"] for r in listing["items"]] == ["session-2", "session"]
    assert listing["total"] == queries.stats(store)["totals"]["conversations"] == 2


def test_expired_conversations_leave_the_index_on_the_next_write(store: DiskStore) -> None:
    now = time.time()
    ledger.record_batch(store, [(entry("old", now - 7200), None)], None)
    assert queries.stats(store)["totals"]["conversations"] == 1
    ledger.record_batch(store, [(entry("new", now), None)], 3600.0)
    assert queries.stats(store)["totals"]["conversations"] == 1
    assert [r["conversation"] for r in queries.list_conversations(store)["items"]] == ["new"]
    assert store.zrange(index.by_tenant(TENANT)) == [(index.member(TENANT, "new"), now)]


def test_a_store_written_before_the_indexes_is_indexed_once(store: DiskStore) -> None:
    # What an older version left: rows, events and totals, no index.
    now = time.time()
    for conv in ("x", "y"):
        meta = {"tenant": TENANT, "conversation": conv, "model": "m", "requests": 2,
                "last_seen": now - 60, "first_seen": now - 600, "compactions": 1}  # fmt: skip
        store.set(conv_key("conv", TENANT, conv), meta)
        store.append(conv_key("ev", TENANT, conv), {"case": "failed", "ts": now, "error": "x"})
        store.append(
            conv_key("ev", TENANT, conv),
            {"case": "summarize", "ts": now - 120, "facts_kept": 3, "facts_dropped": 1},
        )
    store.set(ledger.TOTALS_KEY, {"requests": 4, "compactions": 2})
    assert queries.list_conversations(store)["total"] == 0  # not indexed yet
    reindex.ensure(store, 86400.0)
    listing = queries.list_conversations(store)
    assert listing["total"] == 2 and listing["items"][0]["failures"] == 1
    totals = queries.stats(store, hours=3)
    assert totals["totals"]["compaction_failures"] == 2
    assert (totals["totals"]["facts_kept"], totals["totals"]["facts_dropped"]) == (6, 2)
    assert sum(h["compactions"] for h in totals["hourly"]) == 2
    counting = CountingStore(store)
    reindex.ensure(counting, 86400.0)  # type: ignore[arg-type]
    assert counting.operations == 1  # built once: afterwards one read of the marker


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_every_sort_pages_through_every_conversation_in_order(store: DiskStore, order: str) -> None:
    fill(store, 0, 30)
    store_compaction(store, "c4", record(Case.SUMMARIZE, "ef" * 16), tenant="1" * 32)
    everything = {r["id"] for r in queries.list_conversations(store, per_page=100)["items"]}
    for sort in sorted(queries.SORT_KEYS):
        pages = [
            queries.list_conversations(store, sort=sort, order=order, per_page=7, page=n)
            for n in range(1, 6)
        ]
        rows = [r for p in pages for r in p["items"]]
        assert all(p["total"] == 30 for p in pages), sort
        assert [r["id"] for r in rows] and {r["id"] for r in rows} == everything, sort
        values = [r[sort] for r in rows]
        assert values == sorted(values, reverse=order == "desc"), sort
    top = queries.list_conversations(store, sort="compactions", order="desc", per_page=1)
    assert top["items"][0]["conversation"] == "c4" and top["items"][0]["compactions"] == 1
