"""Nothing is lost to one bad entry, and store faults are reported, not fatal (issue #13)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from proxy import ledger
from proxy.records import conv_key
from proxy.store import DiskStore
from proxy.writer import BatchWriter


def _entry(conversation: str, ts: float) -> ledger.RequestEntry:
    return ledger.RequestEntry(
        ts=ts, tenant="t" * 32, conversation=conversation, model="gpt-4o-mini",
        route="chat", case="none", status=200, original_messages=1, forwarded_messages=1,
        original_tokens=100, forwarded_tokens=100, prompt_tokens=100, cached_tokens=0,
        cache_write_tokens=0, completion_tokens=5, latency_s=0.1, overhead_s=0.001,
    )  # fmt: skip


def _deep(levels: int) -> Any:
    value: Any = "deep"
    for _ in range(levels):
        value = [value]
    return value


def test_one_bad_entry_never_loses_the_others(tmp_path: Path) -> None:
    """A mixed batch: good entries, one whose history the encoder cannot write (nested past
    orjson's 254 levels), and latest-value state, one of it bad too."""
    store = DiskStore(tmp_path / "store")
    good = [{"role": "user", "content": "fine"}]
    bad = [{"role": "user", "content": _deep(300)}]
    now = time.time()

    async def run() -> None:
        writer = BatchWriter(store, retention_s=None, interval_s=60)
        writer.record(_entry("a", now), good)
        writer.record(_entry("bad", now), bad)
        writer.record(_entry("b", now), good)
        writer.put("st:a", {"ok": 1}, None)
        writer.put("st:bad", _deep(300), None)
        writer.put("st:b", {"ok": 2}, None)
        await writer.flush()

    asyncio.run(run())
    tenant = "t" * 32
    for conv in ("a", "b"):
        assert store.get(conv_key("conv", tenant, conv))["requests"] == 1
        assert store.get(conv_key("orig", tenant, conv)) == good
        assert len(store.get(conv_key("req", tenant, conv))) == 1
    # The bad entry still counts (its numbers are fine); only its history is not kept.
    assert store.get(conv_key("conv", tenant, "bad"))["requests"] == 1
    assert store.get(conv_key("orig", tenant, "bad")) is None
    assert store.get(ledger.TOTALS_KEY)["requests"] == 3
    assert store.get("st:a") == {"ok": 1} and store.get("st:b") == {"ok": 2}
    store.close()
