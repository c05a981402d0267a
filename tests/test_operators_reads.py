"""The operators' reads over a real DiskStore written through the real ledger: every stored
compaction case counts (prune included), and the admin side shows what the core recorded
rather than re-reading the summary's text."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from proxy.adapters.store import DiskStore
from proxy.core.records import CompactionRecord, conv_key
from proxy.core.types import COMPACTION_CASES, Case
from proxy.operators import details, ledger, queries
from proxy.operators.metrics import Metrics

TENANT = "a" * 32


def entry(conversation: str, ts: float, case: str = Case.NONE) -> ledger.RequestEntry:
    return ledger.RequestEntry(
        ts=ts, tenant=TENANT, conversation=conversation, model="gpt-4o-mini",
        route="chat.completions", case=case, status=200, original_messages=12,
        forwarded_messages=6, original_tokens=5000, forwarded_tokens=2000, prompt_tokens=2000,
        cached_tokens=0, cache_write_tokens=0, completion_tokens=20, latency_s=0.1,
        overhead_s=0.001,
    )  # fmt: skip


def store_compaction(store: DiskStore, conversation: str, record: CompactionRecord) -> None:
    """What the core writes for one stored compaction: the record, the ledger's charge and the
    event (``proxy.core.types.CompactionEvent``)."""
    store.set(conv_key("rec", TENANT, conversation) + ":" + record.prefix_hash, record.to_json())
    ledger.record_compaction(
        store, TENANT, conversation, record=record.prefix_hash, case=record.case,
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
    store.append(conv_key("ev", TENANT, conversation), event, None, 500)


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
