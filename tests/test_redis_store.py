"""The Redis backend against a real redis-server, and two proxy replicas sharing it."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from proxy.adapters.store import DiskStore, RedisStore, get_list, open_store, read_many
from proxy.core.errors import StoreError
from tests.checks import INLINE, assert_forwarded_faithful, summary_index
from tests.conversations import drive_conversation
from tests.proxyproc import ProxyProcess, free_port
from tests.upstream import ScriptedUpstream


def test_redis_store_operations(redis_url: str) -> None:
    store = open_store(redis_url)
    assert isinstance(store, RedisStore)
    store.set("a", {"x": 1})
    assert store.get("a") == {"x": 1}
    assert store.get("missing") is None
    assert store.add("lock", 1, ttl=5) is True
    assert store.add("lock", 2, ttl=5) is False
    store.delete("lock")
    assert store.add("lock", 3, ttl=0.2) is True
    time.sleep(0.4)
    assert store.get("lock") is None, "TTL not honoured"
    assert store.incr("n") == 1 and store.incr("n", 2.5) == 3.5
    for i in range(5):
        store.append("events", {"i": i}, max_items=3)
    assert [e["i"] for e in get_list(store, "events")] == [2, 3, 4]
    assert store.update("u", lambda v: (v or 0) + 1) == 1
    assert "events" in set(store.keys("ev"))
    store.close()


def test_sorted_sets_read_the_same_from_redis_and_disk(redis_url: str, tmp_path: Path) -> None:
    # The operators' indexes (proxy.operators.index) use these on both backends.
    stores = [open_store(redis_url), DiskStore(tmp_path / "disk")]
    for store in stores:
        store.delete("ix:test")
        store.zadd("ix:test", {"b": 2.0, "a": 2.0, "c": 3.5, "d": 1.0})
        store.zadd("ix:test", {"d": 4.0})  # a member's score is replaced, never duplicated
        store.zrem("ix:test", ["c", "missing"])
    reads = [
        (
            s.zcard("ix:test"),
            s.zrange("ix:test"),
            s.zrange("ix:test", 1, 2, desc=True),
            s.zrange("ix:test", 0, 10, max_score=2.0),
            s.zrange("ix:test", 5, 10),
        )
        for s in stores
    ]
    assert reads[0] == reads[1]
    assert reads[0] == (
        3,
        [("a", 2.0), ("b", 2.0), ("d", 4.0)],
        [("b", 2.0), ("a", 2.0)],
        [("a", 2.0), ("b", 2.0)],
        [],
    )
    for store in stores:
        store.close()


def _forbid_single_commands(store: RedisStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on a command sent on its own round trip (not in a pipeline) fails the test."""

    def no_single_commands(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a round trip of its own: {args[:1]}")

    monkeypatch.setattr(store._redis, "execute_command", no_single_commands)


def test_zadd_many_writes_as_one_zadd_per_key_in_one_round_trip(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ledger's index update (``index.add``) touches a dozen sorted sets per flush."""
    stores = [open_store(redis_url), DiskStore(tmp_path / "disk")]
    for store in stores:
        for key in ("zm:a", "zm:b", "zm:c"):
            store.delete(key)
        store.zadd("zm:a", {"old": 1.0, "kept": 5.0})
        if isinstance(store, RedisStore):
            _forbid_single_commands(store, monkeypatch)
        store.zadd_many({"zm:a": {"old": 3.0, "new": 2.0}, "zm:b": {"x": 1.5}, "zm:c": {}})
        store.zadd_many({})
        monkeypatch.undo()
    reads = [[s.zrange(k) for k in ("zm:a", "zm:b", "zm:c")] for s in stores]
    assert (
        reads[0]
        == reads[1]
        == [
            [("new", 2.0), ("old", 3.0), ("kept", 5.0)],
            [("x", 1.5)],
            [],
        ]
    )
    for store in stores:
        store.close()


def test_read_many_reads_as_single_reads_do_in_one_round_trip(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request's lookup (``engine.reads.read_store``) reads several values and lists at once:
    the same answers from both backends as ``get``/``get_list`` give, a corrupt value a miss,
    and with Redis one pipelined round trip rather than one per key."""
    stores = [open_store(redis_url), DiskStore(tmp_path / "disk")]
    answers = []
    for store in stores:
        for key in ("rm:v", "rm:gone", "rm:ck", "rm:none"):
            store.delete(key)
        store.delete("rm:ck:list")
        store.set("rm:v", {"x": [1, 2]})
        store.extend("rm:ck", [{"k": 1}, {"k": 2}])
        singles = {k: store.get(k) for k in ("rm:v", "rm:gone")}
        singles |= {k: get_list(store, k) for k in ("rm:ck", "rm:none")}
        if isinstance(store, RedisStore):
            store._redis.set("rm:bad", b"\xff not json")
            _forbid_single_commands(store, monkeypatch)
        else:
            store._cache.set("rm:bad", b"\xff not json")
        got = read_many(store, ["rm:v", "rm:gone", "rm:bad"], ["rm:ck", "rm:none"])
        assert got == singles | {"rm:bad": None}
        answers.append(got)
    assert (
        answers[0]
        == answers[1]
        == {
            "rm:v": {"x": [1, 2]},
            "rm:gone": None,
            "rm:bad": None,
            "rm:ck": [{"k": 1}, {"k": 2}],
            "rm:none": [],
        }
    )
    monkeypatch.undo()
    for store in stores:
        store.close()


def _bump(url: str, n: int) -> None:
    store = RedisStore(url)
    for _ in range(n):
        store.update("shared-counter", lambda v: (v or 0) + 1)


def test_update_is_atomic_across_processes(redis_url: str) -> None:
    RedisStore(redis_url).delete("shared-counter")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_bump, args=(redis_url, 150)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert RedisStore(redis_url).get("shared-counter") == 300


def test_unreachable_redis_is_a_store_error() -> None:
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(StoreError):
        store.get("x")


def _summary(messages: list[dict[str, Any]]) -> str:
    """The forwarded summary (pins of the replaced span may come before it)."""
    at = summary_index(messages)
    assert at is not None
    return str(messages[at]["content"])


def test_two_replicas_share_compactions_through_redis(redis_url: str, tmp_path: Path) -> None:
    """A compaction made by one replica is substituted by the other: one summary, one prefix."""
    compaction = INLINE
    with ScriptedUpstream() as up:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        store = {"url": redis_url.replace("/0", "/1")}
        with (
            ProxyProcess(tmp_path / "a", up.base_url, store=store, compaction=compaction) as a,
            ProxyProcess(tmp_path / "b", up.base_url, store=store, compaction=compaction) as b,
        ):
            clients = [
                openai.OpenAI(base_url=px.base_url, api_key="sk-shared", max_retries=0)
                for px in (a, b)
            ]
            sent: list[list[dict[str, Any]]] = []

            def send(messages: list[dict[str, Any]]) -> Any:
                sent.append(messages)
                client = clients[len(sent) % 2]  # alternate replicas, like a load balancer
                reply = client.chat.completions.create(model="gpt-4o-mini", messages=messages)
                return reply.choices[0].message.model_dump(exclude_none=True)

            drive_conversation(send, 30, "You are a coding assistant.")
        forwarded = [r.json["messages"] for r in up.chat_requests()]
        for client_msgs, fwd in zip(sent, forwarded, strict=True):
            assert_forwarded_faithful(client_msgs, fwd)
        with_summary = [f for f in forwarded if summary_index(f) is not None]
        assert len(with_summary) >= 10
        # Consecutive requests served by different replicas carry the same summary bytes.
        same = sum(
            1
            for x, y in zip(forwarded, forwarded[1:], strict=False)
            if summary_index(x) and summary_index(y) and _summary(x) == _summary(y)
        )
        assert same >= 5
        summaries = {_summary(f) for f in with_summary}
        assert len(up.chat_requests("summarizer")) == len(summaries)
