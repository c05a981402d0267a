"""A conversation's last history kept in segments (``proxy.operators.history``, #28).

What the operators' page reads back is exactly the newest history written, whichever worker
wrote it and whatever changed in it (or nothing, when a segment is gone: never a wrong
history); a flush writes only the segments whose messages changed; no segment is left that
the head does not name. The end-to-end check through a real proxy and the official client,
and the one on a real Redis, come last.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from proxy.adapters.store import DiskStore, open_store
from proxy.core.fingerprint import fingerprints
from proxy.core.prepared import Sent
from proxy.core.records import conv_key
from proxy.operators import adopt, history, ledger
from proxy.operators.history import REFRESH_S, SEGMENT
from tests.proxyproc import ProxyProcess
from tests.upstream import ScriptedUpstream

TENANT, CONV = "t" * 32, "c1"
BASE = conv_key("orig", TENANT, CONV)


def _messages(n: int, tag: str = "") -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for i in range(1, n):
        role = "user" if i % 2 else "assistant"
        out.append({"role": role, "content": f"message {i}{tag} " + "x" * (i % 7)})
    return out


class CountingStore(DiskStore):
    """A DiskStore that counts the keys written and deleted."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.written: list[str] = []
        self.deleted: list[str] = []

    def set(self, key: str, value: Any, ttl: float | None = None) -> None:
        self.written.append(key)
        super().set(key, value, ttl)

    def delete(self, key: str) -> None:
        self.deleted.append(key)
        super().delete(key)


def _segment_keys(store: DiskStore) -> set[str]:
    return {k for k in store.keys(BASE + ":")}


def test_a_long_history_reads_back_and_a_new_turn_writes_only_the_head(
    tmp_path: Path,
) -> None:
    store = CountingStore(tmp_path / "s")
    first = _messages(3 * SEGMENT + 10)
    history.write(store, TENANT, CONV, first, 3600)
    head = store.get(BASE)
    assert head["n"] == len(first) and len(head["segments"]) == 3 and len(head["tail"]) == 10
    assert history.read(store, TENANT, CONV) == first
    # The next request: the same messages parsed afresh (equal, not the same objects), and
    # a turn more: the head alone is written (it holds the messages after the last segment).
    store.written.clear()
    grown = copy.deepcopy(first) + [{"role": "user", "content": "and now?"}]
    history.write(store, TENANT, CONV, grown, 3600)
    assert store.written == [BASE] and store.deleted == []
    assert store.get(BASE)["segments"] == head["segments"]
    assert history.read(store, TENANT, CONV) == grown
    # Up to the next full segment: that segment is written, once, and the head.
    store.written.clear()
    grown = grown + _messages(SEGMENT, tag="-more")[1:]
    history.write(store, TENANT, CONV, grown, 3600)
    after = store.get(BASE)
    assert after["segments"][:3] == head["segments"] and len(after["segments"]) == 4
    assert store.written == [f"{BASE}:{after['segments'][3]}", BASE]
    assert history.read(store, TENANT, CONV) == grown
    assert _segment_keys(store) == {f"{BASE}:{i}" for i in after["segments"]}


def test_an_edited_early_message_rewrites_its_segment(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "s")
    first = _messages(2 * SEGMENT + 5)
    history.write(store, TENANT, CONV, first, None)
    edited = copy.deepcopy(first)
    edited[3]["content"] = "changed by the client"
    store.written.clear()
    history.write(store, TENANT, CONV, edited, None)
    assert len(store.written) == 2  # the first segment and the head
    assert len(store.deleted) == 1 and store.deleted[0] not in store.written  # the old one
    assert history.read(store, TENANT, CONV) == edited


def test_shrinking_below_a_segment_goes_back_to_one_value_and_drops_the_segments(
    tmp_path: Path,
) -> None:
    store = DiskStore(tmp_path / "s")
    history.write(store, TENANT, CONV, _messages(3 * SEGMENT), None)
    short = _messages(5, tag="-compacted by the client")
    history.write(store, TENANT, CONV, short, None)
    assert store.get(BASE) == short and _segment_keys(store) == set()
    assert history.read(store, TENANT, CONV) == short


def test_two_workers_share_the_segments_of_one_conversation(tmp_path: Path) -> None:
    """Two workers (two store objects on one directory, each with its memory) serving one
    conversation in turn, its history growing and once edited: each read is the newest, and
    no segment is left that the head does not name (a segment's id is its content's hash)."""
    a, b = CountingStore(tmp_path / "s"), CountingStore(tmp_path / "s")
    messages = _messages(4 * SEGMENT)
    for step in range(12):
        messages = copy.deepcopy(messages) + _messages(5, tag=f"-{step}")[1:]
        if step == 7:
            messages[1]["content"] = "edited"
        history.write(a if step % 2 else b, TENANT, CONV, messages, None)
        assert history.read(a, TENANT, CONV) == messages
        assert history.read(b, TENANT, CONV) == messages
        named = {f"{BASE}:{i}" for i in a.get(BASE)["segments"]}
        assert _segment_keys(a) == named
    # Each worker wrote each segment once, when it first had it (not again each request).
    for worker in (a, b):
        writes = [k for k in worker.written if k != BASE]
        assert writes and len(writes) == len(set(writes))


def test_a_history_going_back_to_deleted_content_reads_as_none_never_wrong(
    tmp_path: Path,
) -> None:
    """Two clients alternating on one history through two workers (X, Y, X): the worker that
    remembers X names its segment, which the other deleted with Y. The page shows no history
    until that worker's memory is refreshed, never a wrong one."""
    a, b = DiskStore(tmp_path / "s"), DiskStore(tmp_path / "s")
    x = _messages(2 * SEGMENT + 1, tag="-x")
    y = copy.deepcopy(x)
    y[1]["content"] = "y"
    now = time.time()
    history.write(a, TENANT, CONV, x, None, now=now)
    history.write(b, TENANT, CONV, x, None, now=now)
    history.write(b, TENANT, CONV, y, None, now=now)  # deletes x's first segment
    history.write(a, TENANT, CONV, x, None, now=now + 1)  # remembers it: not written
    assert history.read(a, TENANT, CONV) == []
    history.write(a, TENANT, CONV, x, None, now=now + REFRESH_S + 1)
    assert history.read(b, TENANT, CONV) == x


def test_a_lost_segment_reads_as_no_history_until_the_refresh_writes_it_again(
    tmp_path: Path,
) -> None:
    store = DiskStore(tmp_path / "s")
    messages = _messages(2 * SEGMENT + 1)
    now = time.time()
    history.write(store, TENANT, CONV, messages, None, now=now)
    store.delete(f"{BASE}:{store.get(BASE)['segments'][0]}")  # the store's size limit, say
    assert history.read(store, TENANT, CONV) == []  # never a wrong or partial history
    history.write(store, TENANT, CONV, messages, None, now=now + 1)  # remembered: not yet
    assert history.read(store, TENANT, CONV) == []
    history.write(store, TENANT, CONV, messages, None, now=now + REFRESH_S + 1)
    assert history.read(store, TENANT, CONV) == messages


def test_segments_are_written_again_within_half_a_short_retention(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "s")
    messages = _messages(2 * SEGMENT + 1)
    now = time.time()
    history.write(store, TENANT, CONV, messages, 100, now=now)
    store.written.clear()
    history.write(store, TENANT, CONV, messages, 100, now=now + 40)
    assert store.written == [BASE]
    history.write(store, TENANT, CONV, messages, 100, now=now + 51)  # past half of 100 s
    assert len(store.written) == 1 + 3  # both segments again and the head


def test_a_worker_that_does_not_remember_writes_only_what_the_stored_head_lacks(
    tmp_path: Path,
) -> None:
    """Another worker (or one that forgot: more long conversations than its memory holds)
    takes the segments the stored head names as stored: its content is its id's."""
    a, b = CountingStore(tmp_path / "s"), CountingStore(tmp_path / "s")
    first = _messages(3 * SEGMENT + 10)
    now = time.time()
    history.write(a, TENANT, CONV, first, 3600, now=now)
    named = a.get(BASE)["segments"]
    grown = copy.deepcopy(first) + _messages(SEGMENT, tag="-more")[1:]
    history.write(b, TENANT, CONV, grown, 3600, now=now + 1)
    after = b.get(BASE)
    assert after["segments"][:3] == named and len(after["segments"]) == 4
    assert b.written == [f"{BASE}:{after['segments'][3]}", BASE] and b.deleted == []
    assert after["since"] == now  # its oldest segment's writing, not b's
    assert history.read(a, TENANT, CONV) == grown
    # An edit: b no longer remembers (a third worker, c), and the segment it replaces goes.
    c = CountingStore(tmp_path / "s")
    edited = copy.deepcopy(grown)
    edited[2]["content"] = "changed by the client"
    history.write(c, TENANT, CONV, edited, 3600, now=now + 2)
    assert len(c.written) == 2 and c.deleted == [f"{BASE}:{named[0]}"]
    assert history.read(b, TENANT, CONV) == edited
    assert _segment_keys(c) == {f"{BASE}:{i}" for i in c.get(BASE)["segments"]}


def test_a_stored_head_too_old_or_from_an_earlier_version_has_its_segments_written_again(
    tmp_path: Path,
) -> None:
    a = CountingStore(tmp_path / "s")
    messages = _messages(2 * SEGMENT + 1)
    now = time.time()
    history.write(a, TENANT, CONV, messages, None, now=now)
    late = CountingStore(tmp_path / "s")  # past the trusted time: both segments again
    history.write(late, TENANT, CONV, messages, None, now=now + REFRESH_S + 1)
    assert len(late.written) == 1 + 2 and late.get(BASE)["since"] == now + REFRESH_S + 1
    head = late.get(BASE)
    del head["since"]  # as an earlier version wrote it
    late.set(BASE, head)
    again = CountingStore(tmp_path / "s")
    history.write(again, TENANT, CONV, messages, None, now=now + REFRESH_S + 2)
    assert len(again.written) == 1 + 2 and again.deleted == []
    assert history.read(again, TENANT, CONV) == messages
    # A lost segment, named by a fresh head: no history (never a wrong one) until the head's
    # segments are too old to trust, then they are written again.
    a.delete(f"{BASE}:{head['segments'][0]}")
    written_at = again.get(BASE)["since"]
    history.write(DiskStore(tmp_path / "s"), TENANT, CONV, messages, None, now=written_at + 1)
    assert history.read(a, TENANT, CONV) == []
    later = written_at + REFRESH_S + 1
    history.write(DiskStore(tmp_path / "s"), TENANT, CONV, messages, None, now=later)
    assert history.read(a, TENANT, CONV) == messages


def test_a_whole_list_from_an_earlier_version_is_read_as_it_is(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "s")
    old = _messages(3 * SEGMENT)
    store.set(BASE, old)
    assert history.read(store, TENANT, CONV) == old
    history.write(store, TENANT, CONV, old + [{"role": "user", "content": "more"}], None)
    assert len(history.read(store, TENANT, CONV)) == len(old) + 1


def test_memory_beyond_its_bound_is_forgotten_and_nothing_is_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    histories = {f"c{i}": _messages(2 * SEGMENT + i, tag=str(i)) for i in range(4)}
    one = len(orjson.dumps(histories["c0"][: 2 * SEGMENT]))  # one conversation's segments
    monkeypatch.setattr(history, "MAX_BYTES", int(2.5 * one))  # room for two
    store = DiskStore(tmp_path / "s")
    for _ in range(2):
        for conv, messages in histories.items():
            history.write(store, TENANT, conv, messages, None)
    for conv, messages in histories.items():
        assert history.read(store, TENANT, conv) == messages
    memory = history._memory(store)
    assert 0 < memory.held <= 2.5 * one and len(memory.by_conv) == 2


def _sent(messages: list[dict[str, Any]]) -> Sent:
    """``messages`` with their exact digests, as the engine hands them to the ledger."""
    exact: list[bytes | None] = []
    fingerprints(messages, None, exact)
    return Sent(messages, exact)


class _Encodes:
    """``history``'s ``orjson``, counting the segments it encodes to name them."""

    def __init__(self) -> None:
        self.count = 0

    def dumps(self, value: Any) -> bytes:
        self.count += 1
        return orjson.dumps(value)


def test_segments_named_by_digest_are_written_once_by_any_worker_without_encoding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the request's exact digests, a worker that does not remember the conversation
    names its segments without writing their JSON: only what the stored head lacks is
    written, and its memory holds ids, not messages."""
    encodes = _Encodes()
    monkeypatch.setattr(history, "orjson", encodes)
    a, b = CountingStore(tmp_path / "s"), CountingStore(tmp_path / "s")
    first = _messages(3 * SEGMENT + 10)
    now = time.time()
    history.write(a, TENANT, CONV, _sent(first), 3600, now=now)
    named = a.get(BASE)["segments"]
    assert len(named) == 3 and all(i.startswith("d") for i in named)
    assert len(a.written) == 1 + 3 and history.read(b, TENANT, CONV) == first
    grown = copy.deepcopy(first) + _messages(SEGMENT, tag="-more")[1:]
    history.write(b, TENANT, CONV, _sent(grown), 3600, now=now + 1)
    after = b.get(BASE)
    assert after["segments"][:3] == named and len(after["segments"]) == 4
    assert b.written == [f"{BASE}:{after['segments'][3]}", BASE] and b.deleted == []
    assert history.read(a, TENANT, CONV) == grown
    assert encodes.count == 0  # no segment's JSON written to name it
    assert history._memory(b).by_conv[(TENANT, CONV)].segments == ()
    # b remembers: the next turn writes the head alone; an edit, its segment and the head.
    b.written.clear()
    history.write(b, TENANT, CONV, _sent(grown + [{"role": "user", "content": "?"}]), 3600)
    assert b.written == [BASE]
    edited = copy.deepcopy(grown)
    edited[2]["content"] = "changed by the client"
    b.written.clear()
    history.write(b, TENANT, CONV, _sent(edited), 3600, now=now + 2)
    assert len(b.written) == 2 and b.deleted == [f"{BASE}:{named[0]}"]
    assert history.read(a, TENANT, CONV) == edited
    assert _segment_keys(b) == {f"{BASE}:{i}" for i in b.get(BASE)["segments"]}


def test_equal_values_written_otherwise_or_without_digests_are_named_by_their_json(
    tmp_path: Path,
) -> None:
    """Digests name what was sent: a message written with its keys in another order is
    another digest (its segment written again as now sent); a message with no digest (not
    JSON to the engine) has its segments named by their JSON, as before; switching between
    the two names rewrites the segments once and drops the others."""
    store = CountingStore(tmp_path / "s")
    messages = _messages(2 * SEGMENT + 1)
    messages[1] = {"role": "user", "content": "hello", "name": "ana"}
    history.write(store, TENANT, CONV, _sent(messages), None)
    by_digest = store.get(BASE)["segments"]
    reordered = copy.deepcopy(messages)
    reordered[1] = {"name": "ana", "content": "hello", "role": "user"}  # equal, written otherwise
    assert reordered == messages
    store.written.clear()
    history.write(store, TENANT, CONV, _sent(reordered), None)
    assert len(store.written) == 2 and store.get(BASE)["segments"][1] == by_digest[1]
    assert history.read(store, TENANT, CONV) == reordered
    partial = _sent(messages)
    no_digest = Sent(partial.messages, [None, *partial.exact[1:]])
    store.written.clear()
    history.write(store, TENANT, CONV, no_digest, None)
    by_json = store.get(BASE)["segments"]
    assert len(store.written) == 3 and not any(i.startswith("d") for i in by_json)
    assert history.read(store, TENANT, CONV) == messages
    assert _segment_keys(store) == {f"{BASE}:{i}" for i in by_json}


def test_the_ledger_stores_a_long_history_in_segments_and_adopt_removes_them(
    tmp_path: Path,
) -> None:
    store = DiskStore(tmp_path / "s")
    messages = _messages(2 * SEGMENT + 3)
    entry = ledger.RequestEntry(
        ts=time.time(), tenant=TENANT, conversation=CONV, model="gpt-4o-mini",
        route="chat", case="none", status=200, original_messages=len(messages),
        forwarded_messages=len(messages), original_tokens=100, forwarded_tokens=100,
        prompt_tokens=100, cached_tokens=0, cache_write_tokens=0, completion_tokens=5,
        latency_s=0.1, overhead_s=0.001,
    )  # fmt: skip
    ledger.record_request(store, entry, messages, None)
    assert isinstance(store.get(BASE), dict) and history.read(store, TENANT, CONV) == messages
    assert adopt.adopt(store, TENANT, CONV, "c2", None)
    assert store.get(BASE) is None and _segment_keys(store) == set()


def test_the_conversation_page_shows_a_long_history_through_a_real_proxy(
    tmp_path: Path,
) -> None:
    """The official client sends a conversation past ``SEGMENT`` messages turn by turn, then
    one with an early message edited: the admin API's original side is each time exactly the
    last history sent, and the store holds no segment its head does not name."""
    token = "admin-secret-for-tests"
    auth = {"authorization": f"Bearer {token}"}
    with ScriptedUpstream() as upstream:
        proxy = ProxyProcess(tmp_path, upstream.base_url, admin={"token": token})
        with proxy:
            client = openai.OpenAI(base_url=proxy.base_url, api_key="sk-segments", max_retries=0)
            messages = _messages(SEGMENT + 20)
            sent = 0
            for step in range(4):
                if step == 3:
                    messages = copy.deepcopy(messages)
                    messages[2]["content"] = "an early message the client edited"
                client.chat.completions.create(
                    model="gpt-4o-mini",
                    messages=messages,  # type: ignore[arg-type]
                )
                sent += 1
                original = _original_when_written(proxy.root, auth, sent)
                assert original["messages"] == messages
                messages = messages + [
                    {"role": "assistant", "content": f"answer {step}"},
                    {"role": "user", "content": f"next question {step}"},
                ]
    store = DiskStore(tmp_path / "store")
    # (The edited history is a conversation of its own: its prefix is another.)
    heads = [k for k in store.keys("orig:") if k.count(":") == 2]
    assert len(heads) == 2
    named = {f"{h}:{i}" for h in heads for i in store.get(h)["segments"]}
    assert {k for k in store.keys("orig:") if k.count(":") == 3} == named
    # Named by the request's exact digests (the engine hands them to the ledger).
    assert named and all(name.rsplit(":", 1)[1].startswith("d") for name in named)


def _original_when_written(root: str, auth: dict[str, str], requests: int) -> Any:
    """The conversation's original side once the ledger holds ``requests`` requests (it is
    written after the answer)."""
    deadline = time.monotonic() + 30
    while True:
        stats = httpx.get(f"{root}/admin/api/stats", headers=auth, timeout=10).json()
        if stats["totals"]["requests"] >= requests or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    items = httpx.get(f"{root}/admin/api/conversations", headers=auth, timeout=10).json()
    conv = items["items"][0]["id"]
    r = httpx.get(f"{root}/admin/api/conversations/{conv}/original", headers=auth, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_segments_on_redis_read_back_the_same(redis_url: str) -> None:
    """The Redis backend (a real server): two workers in turn, as on diskcache."""
    a, b = open_store(redis_url), open_store(redis_url)
    conv = f"redis-{time.time_ns()}"
    messages = _messages(2 * SEGMENT + 7)
    for step in range(4):
        messages = copy.deepcopy(messages) + _messages(3, tag=f"-{step}")[1:]
        history.write(a if step % 2 else b, TENANT, conv, messages, 60)
        assert history.read(b, TENANT, conv) == messages
    assert isinstance(a.get(conv_key("orig", TENANT, conv)), dict)
    history.delete(a, TENANT, conv)
    assert history.read(b, TENANT, conv) == []
