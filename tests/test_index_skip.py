"""The ledger's sort indexes hold every conversation's row figures though a flush writes only
the columns that changed (#28: ``index._Indexed``).

Of a conversation's 16 index rows, ~6 do not move while it stays below the trigger, and each
equal score rewritten cost the writer's CPU. A worker now leaves out a column whose score it
wrote last time, when no other ledger write came between. These tests hold the indexes to
the rows whatever comes between: two workers (two stores on one directory, each with its
own memory) writing one conversation in turn, compactions charged outside the ledger's
flush, a flush rolled back after its index write, an index write that fails, a member lost
from an index, the memory's age.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from proxy.adapters.store import DiskStore, Store, open_store
from proxy.core.errors import StoreError
from proxy.core.records import conv_key
from proxy.operators import index, ledger

GPT = "gpt-4o"
CONVERSATIONS = ("a", "b", "c", "d")


def entry(conversation: str, ts: float, rng: random.Random) -> ledger.RequestEntry:
    compacted = rng.random() < 0.3
    original = rng.randrange(2_000, 60_000)
    forwarded = original // 3 if compacted else original
    return ledger.RequestEntry(
        ts=ts, tenant="t", conversation=conversation, model=GPT, route="chat.completions",
        case="summarize" if compacted else "none", status=200,
        original_messages=rng.choice((30, 40)),
        forwarded_messages=12 if compacted else 40, original_tokens=original,
        forwarded_tokens=forwarded, prompt_tokens=forwarded,
        cached_tokens=rng.choice((0, forwarded // 2)), cache_write_tokens=0,
        completion_tokens=40, latency_s=1.0, overhead_s=0.001,
        record="r1" if compacted else None,
    )  # fmt: skip


def flush(store: Store, entries: list[ledger.RequestEntry]) -> None:
    """As the batched writer writes: on disk one batch, rolled back whole on a ``StoreError``."""
    batch = getattr(store, "batch", None)
    with batch() if batch is not None else contextlib.nullcontext():
        ledger.record_batch(store, [(e, None) for e in entries], None)


def rows(store: Store) -> dict[str, dict[str, float]]:
    out = {}
    for c in CONVERSATIONS:
        meta = store.get(conv_key("conv", "t", c))
        if isinstance(meta, dict):
            out[index.member("t", c)] = index.sort_scores(meta)
    return out


def indexed(store: Store) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for column in index.SORTED:
        for name, score in store.zrange(index.by_sort(column)):
            out.setdefault(name, {})[column] = score
    return out


def assert_indexed(store: Store, skip: set[str] | None = None) -> None:
    """Every conversation's sort scores are its row's (but ``skip``'s: lagging)."""
    skip = skip or set()
    want = {name: s for name, s in rows(store).items() if name not in skip}
    got = {name: s for name, s in indexed(store).items() if name not in skip}
    assert got == want


class Counting:
    """The score rows each ``zadd_many`` of a store writes into the sort indexes."""

    def __init__(self, store: Store) -> None:
        self.written: list[int] = []
        real = store.zadd_many

        def zadd_many(sets: Any) -> None:
            self.written.append(sum(len(v) for k, v in sets.items() if k.startswith("ix:by:")))
            real(sets)

        store.zadd_many = zadd_many  # type: ignore[method-assign]


def test_a_conversation_below_the_trigger_writes_only_what_moved(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    counting = Counting(store)
    moved, before = [], {column: None for column in index.SORTED}
    for n in range(5):
        e = ledger.RequestEntry(
            ts=1000.0 + n, tenant="t", conversation="a", model=GPT, route="chat.completions",
            case="none", status=200, original_messages=10 + n, forwarded_messages=10 + n,
            original_tokens=5_000 + n, forwarded_tokens=5_000 + n, prompt_tokens=5_000 + n,
            cached_tokens=0, cache_write_tokens=0, completion_tokens=40, latency_s=1.0,
            overhead_s=0.001,
        )  # fmt: skip
        flush(store, [e])
        assert_indexed(store)
        after = rows(store)[index.member("t", "a")]
        moved.append(sum(after[column] != before[column] for column in index.SORTED))
        before = dict(after)
    assert counting.written == moved
    # The first write: every column; then only some (requests, messages, tokens, net $).
    assert moved[0] == len(index.SORTED) and all(0 < n <= 6 for n in moved[1:]), moved


@pytest.mark.parametrize("backend", ["diskcache", "redis"])
def test_two_workers_in_turn_charges_and_failures_keep_the_indexes_right(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    rng = random.Random(28)
    if backend == "redis":  # (a real redis-server, its own for this module)
        url = request.getfixturevalue("redis_url")
        workers = [open_store(url), open_store(url)]
        workers[0]._redis.flushall()  # type: ignore[attr-defined]
    else:
        workers = [DiskStore(tmp_path), DiskStore(tmp_path)]  # one directory, two memories
    counts = [Counting(w) for w in workers]
    rolls_back = backend == "diskcache"  # Redis keeps the rows written before a failure
    # Charged since their last ledger write (or, on Redis, in a batch that failed after its
    # rows): their index lags (as it did before any column was left out) until that write.
    lagging: set[str] = set()
    ts = 1000.0
    for step in range(300):
        store = rng.choice(workers)
        roll = rng.random()
        ts += 1.0
        if roll < 0.12:  # a compaction charged outside the ledger's flush
            c = rng.choice(CONVERSATIONS)
            ledger.record_compaction(
                store, "t", c, record=f"r{step}", case="summarize", llm_tokens=900,
                llm_usd=0.001 * rng.randrange(1, 9), retention_s=None,
            )  # fmt: skip
            lagging.add(index.member("t", c))
            continue
        batch = [entry(rng.choice(CONVERSATIONS), ts, rng) for _ in range(rng.randrange(1, 4))]
        if roll < 0.2:  # a batch rolled back: its rows go back, its index rows were not written
            real = store.update

            def failing(key: str, fn: Any, ttl: Any = None, real: Any = real) -> Any:
                if key.startswith("hour:"):
                    raise StoreError("disk full")
                return real(key, fn, ttl)

            store.update = failing  # type: ignore[method-assign]
            with pytest.raises(StoreError):
                flush(store, batch)
            del store.update
            if not rolls_back:
                lagging |= {index.member("t", e.conversation) for e in batch}
            continue
        if roll < 0.25:  # the index write itself fails: the rows are kept, the index lags
            real_z = store.zadd_many
            store.zadd_many = _raise  # type: ignore[method-assign]
            if rolls_back:  # written once the batch committed: not a reason to lose it
                flush(store, batch)
            else:
                with pytest.raises(StoreError):
                    flush(store, batch)
            store.zadd_many = real_z  # type: ignore[method-assign]
            lagging |= {index.member("t", e.conversation) for e in batch}
            continue
        flush(store, batch)
        lagging -= {index.member("t", e.conversation) for e in batch}
        assert_indexed(store, lagging)
    # It did leave columns out (else this tests nothing of the skipping).
    assert any(0 < n < len(index.SORTED) for c in counts for n in c.written)


def _raise(sets: Any) -> None:
    raise StoreError("index unavailable")


def test_a_commit_that_fails_writes_no_index_row(tmp_path: Path) -> None:
    """The indexes are written once the batch is committed: a commit that fails (its rows
    taken back) writes none, so no worker's memory trusts a score no row has. Written inside
    the batch, the failed worker's scores stayed in the index and the other worker, whose
    next scores equal those it wrote before, left them there."""
    a, b = DiskStore(tmp_path), DiskStore(tmp_path)  # two workers on one directory
    rng = random.Random(7)
    first = entry("a", 1000.0, rng)
    flush(b, [first])
    real = a._cache.transact
    depth = 0

    @contextlib.contextmanager
    def failing_commit(*args: Any, **kwargs: Any) -> Any:
        nonlocal depth
        outer, depth = depth == 0, depth + 1
        try:
            with real(*args, **kwargs):
                yield
                if outer:  # the whole batch's commit: diskcache rolls it back
                    raise sqlite3.OperationalError("disk I/O error")
        finally:
            depth -= 1

    a._cache.transact = failing_commit
    with pytest.raises(StoreError):
        flush(a, [dataclasses.replace(first, ts=1001.0, original_tokens=90_000)])
    del a._cache.transact
    assert_indexed(b)  # the index has the rows' scores, not the failed batch's
    flush(b, [dataclasses.replace(first, ts=1002.0)])  # b's memory: only what moved
    assert_indexed(b)


def test_a_member_lost_from_an_index_comes_back_when_the_memory_is_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DiskStore(tmp_path)
    rng = random.Random(5)
    flush(store, [entry("a", 1.0, rng)])
    name = index.member("t", "a")
    store.zrem(index.by_sort("first_seen"), [name])  # lost by other means
    flush(store, [entry("a", 2.0, rng)])
    assert name not in dict(store.zrange(index.by_sort("first_seen")))  # trusted: not written
    monkeypatch.setattr(index, "TRUSTED_S", 0.0)  # as when it is that old
    flush(store, [entry("a", 3.0, rng)])
    assert_indexed(store)
