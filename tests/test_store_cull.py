"""Expired values leave a diskcache store after a batch, not on every ``set`` (#28).

``DiskStore`` opens diskcache with automatic culling off (it cost a query and a size check on
every write) and culls after a batch of the ledger's writer at most every
``CULL_INTERVAL_S``. Checked: an expired value is never read in between; a batch past the
interval removes expired rows and keeps live ones; a batch within it leaves them; and the
size limit is enforced by the same cull."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.adapters import diskstore
from proxy.adapters.store import DiskStore


def rows(store: DiskStore) -> set[str]:
    return {key for (key,) in store._cache._sql("SELECT key FROM Cache").fetchall()}


def test_a_batch_past_the_interval_culls_expired_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DiskStore(tmp_path / "store")
    try:
        store.set("live", {"a": 1}, ttl=3600)
        store.set("forever", 2)
        for i in range(5):
            store.set(f"gone-{i}", {"i": i}, ttl=-1)  # expired when written
        assert all(store.get(f"gone-{i}") is None for i in range(5))  # never read expired
        assert {f"gone-{i}" for i in range(5)} <= rows(store)  # but still on disk
        with store.batch():  # within the interval: no cull
            store.set("during", 3)
        assert "gone-0" in rows(store)
        monkeypatch.setattr(diskstore, "CULL_INTERVAL_S", 0.0)
        with store.batch():
            store.set("after", 4)
        assert rows(store) == {"live", "forever", "during", "after"}
        assert store.get_many(["live", "forever", "after"]) == {"live": {"a": 1}, "forever": 2,
                                                               "after": 4}  # fmt: skip
    finally:
        store.close()


def test_the_size_limit_is_enforced_by_the_cull(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DiskStore(tmp_path / "store", size_limit=256 * 1024)
    try:
        monkeypatch.setattr(diskstore, "CULL_INTERVAL_S", 0.0)
        with store.batch():
            for i in range(40):
                store.set(f"k{i}", {"text": "x" * 20_000})  # ~800 KB, past the limit
        assert store._cache.volume() <= 256 * 1024 + 128 * 1024  # (diskcache's own slack)
        assert store.get("k39") == {"text": "x" * 20_000}  # the newest stored kept
        assert store.get("k0") is None  # least recently stored: evicted
    finally:
        store.close()
