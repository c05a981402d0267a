"""A conversation's request rows in segments (#28): read back as the one list they replace.

The rows go to segments of ``reqlog.SEGMENT`` by their place in the conversation (its ledger
row's count of requests); reading gives the newest ``reqlog.KEEP`` in order, after any rows
earlier versions kept (as one list, then in segments of ``reqlog.EARLIER_SEGMENT``). Checked on
both backends (a real redis-server), with flushes of every size across segment boundaries,
that a flush rewrites only the segments its rows go to, and through the ledger
(``record_batch``) and a session's adopted first row.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.adapters.store import DiskStore, Store, get_list, open_store
from proxy.core.records import conv_key
from proxy.operators import ledger, reqlog


@pytest.fixture(params=["disk", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "disk":
        opened: Store = DiskStore(tmp_path / "s")
    else:
        opened = open_store(request.getfixturevalue("redis_url"))
        opened._redis.flushdb()  # type: ignore[attr-defined]  # the module's server is shared
    yield opened
    opened.close()


def test_rows_read_back_in_order_newest_kept(store: Store) -> None:
    rng = random.Random(7)
    written: list[dict[str, int]] = []
    n = 0
    while n < 1_234:
        size = rng.choice([1, 1, 2, 3, 49, 50, 51, 120])
        rows = [{"i": n + k} for k in range(size)]
        n += size
        reqlog.append(store, "t", "c", rows, n, None)
        written += rows
        assert reqlog.read(store, "t", "c", n) == written[-reqlog.KEEP :]
    assert reqlog.read(store, "t", "other", None) == []


def test_a_flush_writes_only_the_segments_its_rows_go_to(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "s")
    size = reqlog.SEGMENT
    reqlog.append(store, "t", "c", [{"i": i} for i in range(2 * size + 3)], 2 * size + 3, None)
    key = functools.partial(reqlog.segment_key, conv_key("req", "t", "c"))
    assert [len(get_list(store, key(k))) for k in range(4)] == [size, size, 3, 0]
    sealed = {k: store._cache.get(key(k)) for k in range(2)}
    reqlog.append(store, "t", "c", [{"i": 2 * size + 3}], 2 * size + 4, None)
    assert {k: store._cache.get(key(k)) for k in range(2)} == sealed
    assert len(get_list(store, key(2))) == 4
    store.close()


def test_rows_of_the_earlier_segments_come_before_the_new_ones(store: Store) -> None:
    """A conversation the previous version wrote (segments of ``EARLIER_SEGMENT`` rows) goes
    on in this layout: read back whole and in order, the newest ``KEEP`` of it."""
    base, earlier = conv_key("req", "t", "c"), reqlog.EARLIER_SEGMENT
    old = [{"i": i} for i in range(2 * earlier + 17)]  # its last segment part full
    for start in range(0, len(old), earlier):
        store.extend(f"{base}:{start // earlier}", old[start : start + earlier], None, earlier)
    written, total = list(old), len(old)
    for size in [1, 3, reqlog.SEGMENT, 1, 2 * reqlog.SEGMENT + 1] * 20:
        rows = [{"i": total + k} for k in range(size)]
        total += size
        reqlog.append(store, "t", "c", rows, total, None)
        written += rows
        assert reqlog.read(store, "t", "c", total) == written[-reqlog.KEEP :]
    assert total > len(old) + reqlog.KEEP  # (the earlier rows went out of the newest kept)


def test_rows_an_earlier_version_kept_as_one_list_come_first(store: Store) -> None:
    old = [{"i": i} for i in range(30)]
    store.extend(conv_key("req", "t", "c"), old, None, 500)  # as the ledger wrote them
    new = [{"i": 30 + i} for i in range(600)]
    for k in range(0, 600, 7):
        total = 30 + min(k + 7, 600)  # the ledger's count went on from the old rows
        reqlog.append(store, "t", "c", new[k : k + 7], total, None)
        assert reqlog.read(store, "t", "c", total) == (old + new[: k + 7])[-reqlog.KEEP :]


def test_the_ledger_writes_and_a_session_adopts_its_rows_in_segments(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "s")
    first = ledger.RequestEntry(**{**_ENTRY, "conversation": "first", "ts": 1.0})
    ledger.record_batch(store, [(first, None)], None)
    later = [
        ledger.RequestEntry(**{**_ENTRY, "earlier_conversation": "first", "ts": 2.0 + i})
        for i in range(130)
    ]
    for k in range(0, 130, 13):  # flushes of 13 rows
        ledger.record_batch(store, [(e, None) for e in later[k : k + 13]], None)
    meta = store.get(conv_key("conv", "t", "session"))
    rows = reqlog.read(store, "t", "session", meta["requests"])
    assert meta["requests"] == 131 and [r["ts"] for r in rows] == [1.0 + i for i in range(131)]
    assert {r["conversation"] for r in rows} == {"session"}
    key = functools.partial(reqlog.segment_key, conv_key("req", "t", "session"))
    size = reqlog.SEGMENT
    assert [len(get_list(store, key(k))) for k in range(131 // size + 2)] == [size] * (
        131 // size
    ) + [131 % size, 0]
    store.close()


_ENTRY = dict(
    ts=1.0, tenant="t", conversation="session", model="gpt-4o-mini", route="chat.completions",
    case="none", status=200, original_messages=2, forwarded_messages=2, original_tokens=100,
    forwarded_tokens=100, prompt_tokens=100, cached_tokens=0, cache_write_tokens=0,
    completion_tokens=5, latency_s=0.1, overhead_s=0.001,
)  # fmt: skip
