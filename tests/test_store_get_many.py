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


def test_extend_keeps_what_decoding_the_whole_list_would(tmp_path: Path) -> None:
    """``DiskStore.extend`` appends to the stored bytes and cuts only the oldest items (#28):
    after every step the list reads back as the model of it does, whatever the items hold
    (strings with commas, brackets, quotes and escapes, non-ASCII text, nested values)."""
    import random

    rng = random.Random(28)
    odd = ["a,b", "]", "[", '"q"', "\\", "é漢🙂", "{}", "x" * 300]

    def item(n: int) -> object:
        kind = n % 5
        if kind == 0:
            return {"n": n, "text": rng.choice(odd), "nested": [{"k": [n, None, True]}]}
        if kind == 1:
            return rng.choice(odd) + str(n)
        if kind == 2:
            return [n, {"a": rng.choice(odd)}]
        if kind == 3:
            return n * 1.5
        return {"n": n, "deep": {"a": {"b": [rng.choice(odd)]}}}

    store = DiskStore(tmp_path / "store")
    try:
        for max_items in (1, 3, 50):
            key = f"list:{max_items}"
            model: list[object] = []
            for step in range(120):
                batch = [item(step * 10 + i) for i in range(rng.choice((1, 1, 2, 5)))]
                store.extend(key, batch, None, max_items)
                model = (model + batch)[-max_items:]
                assert get_list(store, key) == model, (max_items, step)
        # Items that end past the first 64 KiB (looked for there first), one of them
        # straddling it with a two-byte character.
        model = []
        for n in range(6):
            big = [{"n": n, "text": ("é" if n % 2 else "x") * 40_000}]
            store.extend("big", big, None, 2)
            model = (model + big)[-2:]
            assert get_list(store, "big") == model
        # A list written whole by ``set`` (no count kept) is extended as before.
        store.set("legacy", [1, 2, 3])
        store.extend("legacy", [4], None, 3)
        assert get_list(store, "legacy") == [2, 3, 4]
        store.extend("legacy", [5, 6], None, 3)
        assert get_list(store, "legacy") == [4, 5, 6]
        # Not a list: replaced by the new items, as before.
        store.set("scalar", {"a": 1})
        store.extend("scalar", [7], None, 10)
        assert get_list(store, "scalar") == [7]
        # More items than the list keeps, at once.
        store.extend("many", list(range(40)), None, 10)
        store.extend("many", list(range(40, 70)), None, 10)
        assert get_list(store, "many") == list(range(60, 70))
        store.extend("many", [], None, 5)
        assert get_list(store, "many") == list(range(65, 70))
    finally:
        store.close()


def test_a_batch_writes_all_or_nothing(tmp_path: Path) -> None:
    """``DiskStore.batch`` (the ledger writer's flush, #28): its writes land together; one
    that fails out of it takes the batch's other writes back with it."""
    import pytest

    from proxy.core.errors import StoreError

    store = DiskStore(tmp_path / "store")
    try:
        with store.batch():
            store.set("a", 1)
            store.extend("l", [1, 2], None, 10)
            store.update("u", lambda old: (old or 0) + 1)
            with store.batch():  # nested: the same transaction
                store.set("b", 2)
        assert [store.get(k) for k in ("a", "b", "u")] == [1, 2, 1]
        assert get_list(store, "l") == [1, 2]
        with pytest.raises(StoreError), store.batch():
            store.set("c", 3)
            store.extend("l", [3], None, 10)
            raise StoreError("the store went away")
        assert store.get("c") is None
        assert get_list(store, "l") == [1, 2]
        store.set("after", 4)  # the store still writes
        assert store.get("after") == 4
    finally:
        store.close()
