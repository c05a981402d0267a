"""``DiskStore``'s one-statement writes and reads (``proxy.adapters.diskrows``) leave
diskcache exactly as its own ``set`` and ``get`` would: the same rows, its count and size
consistent (``Cache.check``), values in files handled by diskcache itself."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from proxy.adapters import diskrows, diskstore
from proxy.adapters.diskstore import DiskStore

ROW = (
    "SELECT key, raw, tag, size, mode, filename IS NULL, value, expire_time IS NULL, "
    "access_count FROM Cache"
)


def _rows(store: DiskStore) -> list[tuple[Any, ...]]:
    return sorted(store._cache._sql(ROW).fetchall())


def _problems(store: DiskStore) -> list[str]:
    """``Cache.check``'s findings (the sorted sets' own database beside it is ours)."""
    found = [str(w.message) for w in store._cache.check()]
    return [m for m in found if "index.db" not in m]


def _operations(seed: int) -> list[tuple[str, str, Any]]:
    rng = random.Random(seed)
    ops: list[tuple[str, str, Any]] = []
    for i in range(400):
        key = f"k{rng.randrange(12)}"
        kind = rng.choice(("set", "set", "update", "extend", "extend-new", "incr", "delete"))
        big = rng.random() < 0.15  # over the inline bound below: a file of its own
        ops.append((kind, key, "x" * (300 if big else rng.randrange(1, 60)) + str(i)))
    return ops


def _apply(store: DiskStore, ops: list[tuple[str, str, Any]], into_batch: bool) -> None:
    def run() -> None:
        for kind, key, value in ops:
            if kind == "set":
                store.set(key, {"v": value}, None if len(value) % 3 else 3600)
            elif kind == "update":
                store.update(key, lambda old, v=value: {"old": bool(old), "v": v}, 3600)
            elif kind == "extend":
                store.extend(f"list-{key}", [value, len(value)], 3600, 5)
            elif kind == "extend-new":  # (said new, whether or not it is)
                store.extend(f"list-{key}", [value, len(value)], 3600, 5, new=True)
            elif kind == "incr":
                store.incr(f"n-{key}", len(value), None)
            else:
                store.delete(key)

    if into_batch:
        with store.batch():
            run()
    else:
        run()


@pytest.mark.parametrize("into_batch", [False, True])
def test_the_same_rows_as_diskcache_and_a_consistent_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, into_batch: bool
) -> None:
    # A small inline bound, so some values go to files (the store's own is 8 MiB).
    monkeypatch.setattr(diskstore, "INLINE_BYTES", 256)
    monkeypatch.setattr(diskrows, "INLINE_BYTES", 256)
    lean, plain = DiskStore(tmp_path / "lean"), DiskStore(tmp_path / "plain")
    fetched: list[int] = []
    real_fetch = diskrows.fetch_row

    def counted(cache: Any, key: str) -> Any:
        fetched.append(1)
        return real_fetch(cache, key)

    monkeypatch.setattr(diskstore, "fetch_row", counted)
    real_insert, inserts = diskrows.insert_row, []

    def inserted(*args: Any) -> bool:
        done = real_insert(*args)
        inserts.append(done)
        return done

    monkeypatch.setattr(diskrows, "insert_row", inserted)
    for seed in range(3):
        ops = _operations(seed)
        _apply(lean, ops, into_batch)
        monkeypatch.setattr(diskstore, "put_row", _diskcache_set)
        monkeypatch.setattr(diskstore, "fetch_row", _diskcache_get)
        monkeypatch.setattr(diskrows, "insert_row", lambda *_: False)
        _apply(plain, ops, into_batch)  # the reference: diskcache's own set and get
        monkeypatch.setattr(diskstore, "put_row", diskrows.put_row)
        monkeypatch.setattr(diskstore, "fetch_row", counted)
        monkeypatch.setattr(diskrows, "insert_row", inserted)
    assert fetched  # the lean reads were the ones used
    assert True in inserts and False in inserts  # new keys inserted; others found there
    assert _rows(lean) == _rows(plain)
    for store in (lean, plain):
        assert _problems(store) == []
    files = [r for r in _rows(lean) if not r[5]]
    assert files  # some values were in files, and moved in and out of them
    for key in {k for _, k, _ in _operations(0)}:
        assert lean.get(key) == plain.get(key)


def _diskcache_set(cache: Any, key: str, body: bytes, ttl: float | None, tag: Any = None) -> None:
    cache.set(key, body, expire=ttl, tag=tag)


def _diskcache_get(cache: Any, key: str) -> tuple[Any, Any]:
    return cache.get(key, tag=True)  # type: ignore[no-any-return]


def test_an_expired_value_reads_as_absent_and_is_written_over(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "s")
    store.set("k", {"a": 1}, ttl=0.0)  # expired at once (diskcache's meaning of 0)
    time.sleep(0.001)  # (the clock must move past the expiry, not a timing dependence)
    assert store.get("k") is None
    assert store.update("k", lambda old: {"was": old}, None) == {"was": None}
    assert store.get("k") == {"was": None}
    store.extend("l", [1], 0.0, 10)
    time.sleep(0.001)
    store.extend("l", [2], None, 10)
    assert store.get("l") == [2]
    assert _problems(store) == []
