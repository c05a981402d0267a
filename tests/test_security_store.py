"""Nothing is lost to one bad entry, and store faults are reported, not fatal (issue #13)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import subprocess
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from proxy.adapters.store import DiskStore
from proxy.adapters.writer import BatchWriter
from proxy.core.records import conv_key
from proxy.operators import ledger, reqlog
from tests.proxyproc import ProxyProcess
from tests.rawupstream import RawUpstream


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
        writer = BatchWriter(
            store, retention_s=None, write_entries=ledger.record_batch, interval_s=60
        )
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
        assert len(reqlog.read(store, tenant, conv, 1)) == 1
    # The bad entry still counts (its numbers are fine); only its history is not kept.
    assert store.get(conv_key("conv", tenant, "bad"))["requests"] == 1
    assert store.get(conv_key("orig", tenant, "bad")) is None
    assert store.get(ledger.TOTALS_KEY)["requests"] == 3
    assert store.get("st:a") == {"ok": 1} and store.get("st:b") == {"ok": 2}
    store.close()


def test_a_queued_history_is_let_go_once_a_newer_one_is_queued(tmp_path: Path) -> None:
    """Only a conversation's newest history is stored, so the writer does not hold the
    older ones until its flush (memory: docs/benchmarks.md); every request still counts."""

    class History(list[dict[str, str]]):  # a list that can be weakly referenced
        pass

    store = DiskStore(tmp_path / "store")
    now = time.time()
    first = {"role": "user", "content": "first"}
    newer = [first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "2"}]
    other = [{"role": "user", "content": "another conversation"}]

    async def run() -> None:
        writer = BatchWriter(
            store, retention_s=None, write_entries=ledger.record_batch, interval_s=60
        )
        older = History([first])
        gone = weakref.ref(older)
        writer.record(_entry("a", now), older)
        del older
        writer.record(_entry("b", now), other)
        gc.collect()
        assert gone() is not None  # still the newest history of its conversation
        writer.record(_entry("a", now + 1), newer)
        gc.collect()
        assert gone() is None  # let go before the flush
        await writer.flush()

    asyncio.run(run())
    tenant = "t" * 32
    assert store.get(conv_key("conv", tenant, "a"))["requests"] == 2
    assert len(reqlog.read(store, tenant, "a", 2)) == 2
    assert store.get(conv_key("orig", tenant, "a")) == newer
    assert store.get(conv_key("orig", tenant, "b")) == other
    assert store.get(ledger.TOTALS_KEY)["requests"] == 3
    store.close()


# ---- store faults through a real proxy process -------------------------------------------

ADMIN_TOKEN = "test-admin-token"
AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _store_up(px: ProxyProcess) -> float:
    text = httpx.get(f"{px.root}/metrics", headers=AUTH, timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith("compaction_proxy_store_up "))
    return float(line.split()[1])


@contextlib.contextmanager
def read_only_dir(tmp: Path) -> Iterator[Path]:
    """A store folder nobody may write in, not even its owner or root: an immutable folder
    (``chattr +i``). Without that (an unprivileged run) a folder the user does not own."""
    store = tmp / "ro-store"
    store.mkdir()
    if subprocess.run(["chattr", "+i", str(store)], capture_output=True).returncode != 0:
        yield Path("/")
        return
    try:
        yield store
    finally:
        subprocess.run(["chattr", "-i", str(store)], check=True)


def test_a_read_only_store_does_not_stop_start_up(tmp_path: Path) -> None:
    with RawUpstream() as upstream, read_only_dir(tmp_path) as store:
        px = ProxyProcess(
            tmp_path, upstream.url("/v1"), store={"url": f"diskcache://{store}"},
            admin={"token": ADMIN_TOKEN},
        )  # fmt: skip
        with px:
            health = httpx.get(f"{px.root}/healthz", timeout=10).json()
            assert health["status"] == "degraded" and health["store"]
            ready = httpx.get(f"{px.root}/readyz", timeout=10)
            assert ready.status_code == 503 and ready.json()["status"] == "unavailable"
            # Traffic still flows, uncompacted.
            chat = httpx.post(f"{px.base_url}/chat/completions", json=CHAT, timeout=20)
            assert chat.status_code == 200, chat.text
            # The operator's API says what is wrong, in the API's shape.
            stats = httpx.get(f"{px.root}/admin/api/stats", headers=AUTH, timeout=10)
            assert stats.status_code == 503, stats.text
            assert stats.json()["error"]["code"] == "store_unavailable"
            assert _store_up(px) == 0
            assert "store cannot be opened" in px.logs()


def test_the_admin_api_answers_503_while_the_store_is_corrupt(tmp_path: Path) -> None:
    with RawUpstream() as upstream:
        with ProxyProcess(tmp_path, upstream.url("/v1"), admin={"token": ADMIN_TOKEN}) as px:
            assert httpx.post(f"{px.base_url}/chat/completions", json=CHAT).status_code == 200
            assert httpx.get(f"{px.root}/admin/api/stats", headers=AUTH).status_code == 200
            for name in os.listdir(tmp_path / "store"):
                if name.startswith("cache.db"):
                    (tmp_path / "store" / name).write_bytes(b"not a database " * 4096)
            r = httpx.get(f"{px.root}/admin/api/conversations", headers=AUTH, timeout=10)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "store_unavailable"
            assert httpx.post(f"{px.base_url}/chat/completions", json=CHAT).status_code == 200
