"""A worker that found a session's row does not ask the store for it again on every flush
(#28: every request after a session's first reply names its earlier id, and each flush read
the session's row to decide whether to adopt that id's row).

What must hold: the first request's row is still adopted by the session that continues it,
also after another session was remembered; the read is skipped only while the memory is
trusted.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from proxy.adapters.store import DiskStore
from proxy.core.records import conv_key
from proxy.operators import adopt, ledger, queries
from tests.test_operators_reads import TENANT, entry


def continuing(conversation: str, earlier: str, ts: float) -> ledger.RequestEntry:
    return replace(entry(conversation, ts), earlier_conversation=earlier)


class Reads:
    """``store.get`` of each key, counted."""

    def __init__(self, store: DiskStore) -> None:
        self.keys: list[str] = []
        real = store.get

        def get(key: str) -> Any:
            self.keys.append(key)
            return real(key)

        store.get = get  # type: ignore[method-assign]

    def of(self, conversation: str) -> int:
        return self.keys.count(conv_key("conv", TENANT, conversation))


def test_a_found_row_is_not_read_again_while_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DiskStore(tmp_path)
    reads = Reads(store)
    now = time.time()
    ledger.record_batch(store, [(entry("first", now), None)], None)
    ledger.record_batch(store, [(continuing("session", "first", now + 1), None)], None)
    assert [r["conversation"] for r in queries.list_conversations(store)["items"]] == ["session"]
    for n in range(2, 6):
        reads.keys.clear()
        ledger.record_batch(store, [(continuing("session", "first", now + n), None)], None)
        # Read once (found, remembered), then not again.
        assert reads.of("session") == (1 if n == 2 else 0), (n, reads.keys)
    # Another session opening the same way still takes its own first row.
    ledger.record_batch(store, [(entry("first", now + 10), None)], None)
    ledger.record_batch(store, [(continuing("other", "first", now + 11), None)], None)
    listing = queries.list_conversations(store)
    assert sorted(r["conversation"] for r in listing["items"]) == ["other", "session"]
    assert store.get(conv_key("conv", TENANT, "other"))["requests"] == 2
    # Past the memory's trust the row is read again.
    monkeypatch.setattr(adopt, "KNOWN_S", 0.0)
    reads.keys.clear()
    ledger.record_batch(store, [(continuing("session", "first", now + 20), None)], None)
    assert reads.of("session") == 1
    assert store.get(conv_key("conv", TENANT, "session"))["requests"] == 7  # first row too


def test_a_short_retention_shortens_the_trust(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DiskStore(tmp_path)
    reads = Reads(store)
    clock = [time.time()]
    monkeypatch.setattr(adopt, "time", SimpleNamespace(time=lambda: clock[0]))
    retention = 100.0  # trusted for half of it: a row lives its retention after its last write
    ledger.record_batch(store, [(entry("first", clock[0]), None)], retention)
    ledger.record_batch(store, [(continuing("session", "first", clock[0]), None)], retention)
    seen = []
    for step in (1.0, 10.0, 30.0, 20.0):
        clock[0] += step
        reads.keys.clear()
        ledger.record_batch(store, [(continuing("session", "first", clock[0]), None)], retention)
        seen.append(reads.of("session"))
    # Found (and remembered) at the first, trusted 10 and 40 s after, read again at 60 s.
    assert seen == [1, 0, 0, 1]


def test_an_adopting_batch_rolled_back_keeps_the_earlier_row_listed(tmp_path: Path) -> None:
    """The earlier id leaves the indexes once the batch that adopted its row is committed: a
    batch rolled back (diskcache) puts the row back and it stays in the list, then the next
    flush adopts it."""
    from proxy.core.errors import StoreError

    store = DiskStore(tmp_path)
    now = time.time()
    ledger.record_batch(store, [(entry("first", now), None)], None)
    real = store.update

    def failing(key: str, fn: Any, ttl: Any = None) -> Any:
        if key.startswith("hour:"):  # after the adopt, before the commit
            raise StoreError("disk full")
        return real(key, fn, ttl)

    store.update = failing  # type: ignore[method-assign]
    with pytest.raises(StoreError), store.batch():
        ledger.record_batch(store, [(continuing("session", "first", now + 1), None)], None)
    del store.update
    listed = [r["conversation"] for r in queries.list_conversations(store)["items"]]
    assert listed == ["first"] and store.get(conv_key("conv", TENANT, "first"))["requests"] == 1
    with store.batch():
        ledger.record_batch(store, [(continuing("session", "first", now + 2), None)], None)
    listed = [r["conversation"] for r in queries.list_conversations(store)["items"]]
    assert listed == ["session"] and store.get(conv_key("conv", TENANT, "session"))["requests"] == 2
