"""``DiskStore.get_many`` answers from memory while no process wrote the keys (#28,
``proxy.adapters.readcache``), and never answers what the store no longer holds: a write by
another process (a real one), in a batch, a deletion, an expiry, an eviction by the cull, a
counters' file cut short. Checked on what the store answers, and on the SQL queries it made."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from proxy.adapters import diskstore, readcache
from proxy.adapters.store import DiskStore

CONV = "conv-0123456789abcdef"
KEYS = [f"{kind}:tenant-a:{CONV}" for kind in ("cool", "pause", "refused", "conv", "ck")]


def in_another_process(directory: Path, code: str) -> None:
    """``code`` run by a new interpreter with ``store``: a DiskStore on ``directory``."""
    script = textwrap.dedent(
        f"""
        from proxy.adapters.store import DiskStore
        store = DiskStore({str(directory)!r})
        """
    ) + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.fixture
def queries(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The keys of each SQL query ``get_many`` made."""
    made: list[list[str]] = []
    real = diskstore.select_rows

    def counted(cache: Any, keys: Any, now: float) -> Any:
        made.append(list(keys))
        return real(cache, keys, now)

    monkeypatch.setattr(diskstore, "select_rows", counted)
    return made


def test_unchanged_keys_answer_without_a_query(tmp_path: Path, queries: list[list[str]]) -> None:
    store = DiskStore(tmp_path / "store")
    try:
        store.set(KEYS[3], {"model": "gpt-4o", "requests": 3})
        first = store.get_many(KEYS)
        assert first == {**dict.fromkeys(KEYS), KEYS[3]: {"model": "gpt-4o", "requests": 3}}
        assert store.get_many(KEYS) == first
        assert store.get_many(KEYS[::-1]) == first
        assert queries == [KEYS]  # absent keys are kept as absent too
        first[KEYS[3]]["requests"] = 99  # a caller changing what it got changes nothing kept
        assert store.get_many(KEYS)[KEYS[3]] == {"model": "gpt-4o", "requests": 3}
        store.set(KEYS[0], 60)  # one key written: only it is read again
        assert store.get_many(KEYS)[KEYS[0]] == 60
        assert queries[1:] == [[KEYS[0]]]
    finally:
        store.close()


def test_a_write_by_another_process_is_read(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "store")
    try:
        store.set(KEYS[3], {"requests": 1})
        store.set(KEYS[1], "paused")
        assert store.get_many(KEYS)[KEYS[3]] == {"requests": 1}
        in_another_process(
            tmp_path / "store",
            f"""
            store.update({KEYS[3]!r}, lambda m: {{"requests": m["requests"] + 1}})
            store.delete({KEYS[1]!r})
            store.set({KEYS[0]!r}, 30)
            with store.batch():
                store.extend({KEYS[4]!r}, [{{"k": 4}}])
            """,
        )
        assert store.get_many(KEYS) == {
            KEYS[0]: 30,
            KEYS[1]: None,
            KEYS[2]: None,
            KEYS[3]: {"requests": 2},
            KEYS[4]: [{"k": 4}],
        }
    finally:
        store.close()


def test_a_batch_is_read_once_committed(tmp_path: Path, queries: list[list[str]]) -> None:
    store = DiskStore(tmp_path / "store")
    try:
        assert store.get_many(KEYS[:1]) == {KEYS[0]: None}
        with store.batch():
            store.set(KEYS[0], 1)
        assert store.get_many(KEYS[:1]) == {KEYS[0]: 1}
        assert len(queries) == 2
    finally:
        store.close()


def test_an_expired_value_is_not_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, queries: list[list[str]]
) -> None:
    store = DiskStore(tmp_path / "store")
    try:
        store.set(KEYS[0], "soon", ttl=60)
        assert store.get_many(KEYS[:1]) == {KEYS[0]: "soon"}
        assert store.get_many(KEYS[:1]) == {KEYS[0]: "soon"}
        assert len(queries) == 1
        later = time.time() + 120  # (no sleep: the clock the store reads moves on)
        monkeypatch.setattr(diskstore.time, "time", lambda: later)
        assert store.get_many(KEYS[:1]) == {KEYS[0]: None}
    finally:
        store.close()


def test_a_value_the_cull_evicted_is_not_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DiskStore(tmp_path / "store", size_limit=256 * 1024)
    kept, others = KEYS[0], [f"hist:tenant-b:conv-{i}" for i in range(1, 40)]
    assert readcache.slot(kept) not in {readcache.slot(k) for k in others}  # no write bumps it
    try:
        store.set(kept, {"text": "x" * 20_000})
        assert store.get_many([kept]) == {kept: {"text": "x" * 20_000}}
        monkeypatch.setattr(diskstore, "CULL_INTERVAL_S", 0.0)
        with store.batch():  # other keys only, past the limit: the cull evicts the first
            for key in others:
                store.set(key, {"text": "x" * 20_000})
        assert store.get(kept) is None
        assert store.get_many([kept]) == {kept: None}
    finally:
        store.close()


def test_a_counters_file_cut_short_keeps_nothing_and_counts_on_past_it(
    tmp_path: Path, queries: list[list[str]]
) -> None:
    store, other = DiskStore(tmp_path / "store"), DiskStore(tmp_path / "store")
    try:
        store.set(KEYS[0], 1)  # its counter: 1
        assert store.get_many(KEYS[:1]) == {KEYS[0]: 1}  # kept at 1
        (tmp_path / "store" / readcache.FILE).write_bytes(b"")  # (what a restore may do)
        other.set(KEYS[0], 2)  # counted again from 0 it would be 1: the value kept would match
        assert store.get_many(KEYS[:1]) == {KEYS[0]: 2}
        (tmp_path / "store" / readcache.FILE).write_bytes(b"")
        assert store.get_many(KEYS[:1]) == {KEYS[0]: 2}
        assert store.get_many(KEYS[:1]) == {KEYS[0]: 2}
        assert len(queries) == 4  # no counter to check it against: read each time
        other.set(KEYS[0], 3)  # a write makes the counter again
        assert store.get_many(KEYS[:1]) == {KEYS[0]: 3}
        assert store.get_many(KEYS[:1]) == {KEYS[0]: 3}
        assert len(queries) == 5
        other.set(KEYS[1], "evicted")  # its counter: 1
        assert store.get_many(KEYS[1:2]) == {KEYS[1]: "evicted"}  # kept at 1
        (tmp_path / "store" / readcache.FILE).write_bytes(b"")
        other._cache.delete(KEYS[1])  # gone with no write of ours: as the cull evicts
        assert other._reads is not None
        other._reads.epochs.bump_all()  # what the cull then does: from 0, all would be 1
        assert store.get_many(KEYS[1:2]) == {KEYS[1]: None}
    finally:
        store.close()
        other.close()


def test_two_processes_never_lose_a_bump(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    epochs = readcache.Epochs(tmp_path / "store")
    try:
        code = f"""
            from pathlib import Path
            from proxy.adapters.readcache import Epochs
            epochs = Epochs(Path({str(tmp_path / "store")!r}))
            for _ in range(400):
                epochs.bump([{KEYS[0]!r}])
            """
        script = textwrap.dedent(code)
        runs = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(2)]
        assert [run.wait() for run in runs] == [0, 0]
        assert epochs.read(readcache.slot(KEYS[0])) == 800
        epochs.bump_all()
        assert epochs.read(readcache.slot(KEYS[0])) == 801
        assert epochs.read(readcache.slot("another")) == 1
    finally:
        epochs.close()


def test_a_conversations_keys_share_a_block_and_not_a_counter() -> None:
    slots = [readcache.slot(key) for key in KEYS]
    assert len({s // readcache.BLOCK for s in slots}) == 1  # one pread for a lookup
    assert len(set(slots)) == len(KEYS)  # a write of one never sends the others to the store
    assert readcache.slot(KEYS[0]) == readcache.slot(KEYS[0])
    assert 0 <= readcache.slot("totals") < readcache.SLOTS


def test_memory_is_bounded(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "store")
    try:
        assert store._reads is not None
        store._reads.max_entries, store._reads.max_bytes = 50, 4096
        for i in range(200):
            store.set(f"k{i}", "x" * 100)
            assert store.get_many([f"k{i}"]) == {f"k{i}": "x" * 100}
        assert store._reads.stats()["entries"] <= 50
        assert store._reads.stats()["bytes"] <= 4096
        big = "y" * (readcache.MAX_VALUE_BYTES + 1)
        store.set("big", big)
        assert store.get_many(["big"]) == {"big": big}
        assert "big" not in store._reads._entries
    finally:
        store.close()


def test_a_store_folder_deleted_and_made_again_forgets_what_it_read(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "store")
    try:
        store.set(KEYS[0], "before")
        assert store.get_many(KEYS[:1]) == {KEYS[0]: "before"}
        shutil.rmtree(tmp_path / "store")  # an operator cleaning up under a running proxy
        store.set("another", 1)  # the next write opens the store again, empty
        assert store.recreated is not None
        assert store.get_many(KEYS[:1]) == {KEYS[0]: None}
    finally:
        store.close()
