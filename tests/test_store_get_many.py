"""``DiskStore.get_many`` (one query for a request's lookup, #28) answers what one ``get``
per key answers: values inline and in files, lists, missing, expired and corrupt keys."""

from __future__ import annotations

import time
from pathlib import Path

from proxy.adapters.store import DiskStore, get_list, read_many


def test_get_many_answers_as_get_does(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "store")
    try:
        store.set("small", {"a": 1})
        store.set("big", {"text": "x" * 200_000})  # over diskcache's inline limit: a file
        store.set("soon", 3, ttl=0.05)
        store.set("zero", 0)
        store.append("items", {"k": 1})
        store.append("items", {"k": 2})
        store._cache.set("corrupt", b"\xff not json")
        store._cache.set(b"bytes-key", b"1")  # not a str key: never one of ours
        time.sleep(0.1)  # "soon" has expired
        keys = ["small", "big", "soon", "zero", "items", "corrupt", "absent", "bytes-key"]
        assert store.get_many(keys) == {key: store.get(key) for key in keys}
        assert store.get_many(keys)["big"] == {"text": "x" * 200_000}
        assert store.get_many(keys)["soon"] is None
        assert store.get_many([]) == {}
        got = read_many(store, ["small", "absent"], ["items", "none"])
        assert got == {
            "small": {"a": 1},
            "absent": None,
            "items": get_list(store, "items"),
            "none": [],
        }
        assert got["items"] == [{"k": 1}, {"k": 2}]
    finally:
        store.close()
