"""proxy.records (checkpoints, records, substitution) and proxy.store (DiskStore, open_store)."""

from __future__ import annotations

import multiprocessing
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from proxy.adapters.store import DiskStore, RedisStore, get_list, open_store
from proxy.core.fingerprint import fingerprints, prefix_chain
from proxy.core.records import (
    Checkpoint,
    CompactionRecord,
    body_start,
    conv_key,
    find_checkpoint,
    llm_since,
    parse_checkpoints,
    substitute,
)

# ---- records ---------------------------------------------------------------------------------


def msgs(n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "sys"}]
    for i in range(n):
        out.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"})
    return out


def record(
    k: int, chain: list[bytes], summary: str | None = "S", head_len: int = 1
) -> CompactionRecord:
    return CompactionRecord(
        k=k,
        prefix_hash=chain[k].hex(),
        head_len=head_len,
        summary=None if summary is None else {"role": "system", "content": summary},
        case="summarize",
        covered=k - head_len,
        created_at=0.0,
    )


def test_conv_key_is_namespaced_by_tenant() -> None:
    assert conv_key("rec", "t1", "c") != conv_key("rec", "t2", "c")
    assert conv_key("rec", "t1", "c") == "rec:t1:c"


def test_find_checkpoint_takes_the_largest_exact_match() -> None:
    m = msgs(10)
    chain = prefix_chain("t", fingerprints(m))
    cps = [
        Checkpoint(3, chain[3].hex()),
        Checkpoint(7, chain[7].hex()),
        Checkpoint(5, chain[5].hex()),
    ]
    assert find_checkpoint(cps, chain) == cps[1]
    # A shorter history (k beyond its end) cannot match k=7.
    short = prefix_chain("t", fingerprints(m[:6]))
    assert find_checkpoint(cps, short) == cps[2]
    # An edit in message 4 breaks 5 and 7 but not 3.
    edited = [dict(x) for x in m]
    edited[4]["content"] = "edited"
    assert find_checkpoint(cps, prefix_chain("t", fingerprints(edited))) == cps[0]
    # Another tenant matches nothing; nor do k=0 or a wrong hash.
    assert find_checkpoint(cps, prefix_chain("u", fingerprints(m))) is None
    assert find_checkpoint([Checkpoint(0, chain[0].hex())], chain) is None
    assert find_checkpoint([Checkpoint(4, chain[5].hex())], chain) is None
    # The same prefix stored twice: the latest checkpoint, which names the latest record.
    again = [*cps, Checkpoint(7, chain[7].hex(), 2.0), Checkpoint(3, chain[3].hex(), 3.0)]
    assert find_checkpoint(again, chain) == again[3]


def test_parse_checkpoints_skips_malformed_items() -> None:
    raw = [{"k": 3, "h": "ab"}, {"k": "3", "h": "ab"}, {"k": 4}, "x", None, {"k": 5, "h": 7}]
    assert parse_checkpoints(raw) == [Checkpoint(3, "ab")]
    # The record it names, when written since (#28); anything else there names none.
    timed = [
        {"k": 3, "h": "ab", "t": 5},
        {"k": 3, "h": "ab", "t": "5"},
        {"k": 3, "h": "ab", "t": 1.5},
    ]
    assert parse_checkpoints(timed) == [
        Checkpoint(3, "ab", 5.0),
        Checkpoint(3, "ab"),
        Checkpoint(3, "ab", 1.5),
    ]
    assert parse_checkpoints(None) == [] and parse_checkpoints({"k": 1}) == []


def test_the_last_llm_compaction_is_found_when_its_record_no_longer_matches() -> None:
    # Checkpoints carry their record's llm_request_len ("n", #25); malformed ones read 0.
    raw = [{"k": 3, "h": "ab", "t": 1.0, "n": 40}, {"k": 3, "h": "ab", "n": True},
           {"k": 3, "h": "ab", "n": -2}]  # fmt: skip
    assert [cp.llm_len for cp in parse_checkpoints(raw)] == [40, 0, 0]
    record = CompactionRecord(k=5, prefix_hash="x", head_len=1, summary=None, case="summarize",
                              covered=4, created_at=0.0, request_len=20)  # fmt: skip
    # The record in effect carries its own; the conversation's newest, when later and within
    # this history (the client edited before that one's cut); a history shorter than it is a
    # new start, measured from the record alone.
    assert llm_since(record, 0, 60) == 20
    assert llm_since(record, 45, 60) == 45
    assert llm_since(record, 10, 60) == 20
    assert llm_since(record, 80, 60) == 20
    assert llm_since(None, 45, 60) == 45 and llm_since(None, 80, 60) == 0


def test_substitute_keeps_head_then_summary_then_tail() -> None:
    m = msgs(10)
    chain = prefix_chain("t", fingerprints(m))
    r = record(6, chain)
    out = substitute(m, r)
    assert out[0] is m[0]
    assert out[1] == {"role": "system", "content": "S"}
    assert out[2:] == m[6:]
    assert body_start(r) == 2
    r2 = record(6, chain, summary=None)
    assert substitute(m, r2) == [m[0], *m[6:]]
    assert body_start(r2) == 1 and body_start(None) == 0


def test_record_json_roundtrip_and_malformed() -> None:
    chain = prefix_chain("t", fingerprints(msgs(4)))
    r = record(3, chain)
    assert CompactionRecord.from_json(r.to_json()) == r
    assert CompactionRecord.from_json({**r.to_json(), "unknown_field": 1}) == r
    assert CompactionRecord.from_json(None) is None
    assert CompactionRecord.from_json([1, 2]) is None
    assert CompactionRecord.from_json({"k": 3}) is None  # missing required fields
    assert CompactionRecord.from_json({**r.to_json(), "k": "3"}) is None
    assert CompactionRecord.from_json({**r.to_json(), "summary": "not a message"}) is None
    assert CompactionRecord.from_json({**r.to_json(), "summary": {"content": 5}}) is None


# ---- DiskStore -------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = DiskStore(tmp_path / "store")
    yield s
    s.close()


def test_get_set_delete(store: DiskStore) -> None:
    assert store.get("missing") is None
    store.set("k", {"a": [1, 2, "x"], "b": None})
    assert store.get("k") == {"a": [1, 2, "x"], "b": None}
    store.set("k", 5)
    assert store.get("k") == 5
    store.delete("k")
    assert store.get("k") is None
    store.delete("k")  # deleting a missing key is fine


def test_ttl_expiry(store: DiskStore) -> None:
    store.set("short", "v", ttl=0.2)
    store.set("long", "v", ttl=60)
    store.set("forever", "v")
    assert store.get("short") == "v"
    time.sleep(0.4)
    assert store.get("short") is None
    assert store.get("long") == "v"
    assert store.get("forever") == "v"


def test_add_is_set_if_absent(store: DiskStore) -> None:
    assert store.add("lock", 1) is True
    assert store.add("lock", 2) is False
    assert store.get("lock") == 1
    store.delete("lock")
    assert store.add("lock", 3) is True
    assert store.get("lock") == 3
    assert store.add("ttl-lock", 1, ttl=0.2) is True
    assert store.add("ttl-lock", 2, ttl=0.2) is False
    time.sleep(0.4)
    assert store.add("ttl-lock", 3) is True  # an expired lock is absent


def test_incr(store: DiskStore) -> None:
    assert store.incr("n") == 1
    assert store.incr("n") == 2
    assert store.incr("n", 2.5) == 4.5
    assert store.get("n") == 4.5
    store.set("s", "not a number")
    assert store.incr("s", 3) == 3


def test_append_keeps_the_newest_max_items(store: DiskStore) -> None:
    for i in range(10):
        store.append("list", {"i": i}, max_items=4)
    assert get_list(store, "list") == [{"i": 6}, {"i": 7}, {"i": 8}, {"i": 9}]
    store.set("notalist", {"x": 1})
    store.append("notalist", 1)
    assert get_list(store, "notalist") == [1]
    assert get_list(store, "missing") == []


def test_update_and_keys(store: DiskStore) -> None:
    assert store.update("u", lambda old: (old or 0) + 1) == 1
    assert store.update("u", lambda old: (old or 0) + 1) == 2
    store.set("ev:t1:a", 1)
    store.set("ev:t1:b", 1)
    store.set("ev:t2:a", 1)
    assert sorted(store.keys("ev:t1:")) == ["ev:t1:a", "ev:t1:b"]


def _increment_many(directory: str, n: int) -> None:
    s = DiskStore(directory)
    for _ in range(n):
        s.update("counter", lambda old: (old or 0) + 1)
    s.close()


def test_update_is_atomic_across_processes(tmp_path: Path) -> None:
    directory = str(tmp_path / "shared")
    DiskStore(directory).close()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_increment_many, args=(directory, 200)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    s = DiskStore(directory)
    try:
        assert s.get("counter") == 400
    finally:
        s.close()


def test_store_files_are_private(tmp_path: Path) -> None:
    path = tmp_path / "private"
    s = DiskStore(path)
    s.set("k", "v")
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path / "cache.db").st_mode) == 0o600
    finally:
        s.close()


def test_existing_open_folder_is_made_private(tmp_path: Path) -> None:
    path = tmp_path / "was-open"
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    DiskStore(path).close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700


def test_corrupt_value_reads_as_none(store: DiskStore) -> None:
    # Written through the underlying diskcache, bypassing the JSON encoding.
    store._cache.set("raw-bytes", b"\xff\xfe not json \x00")
    store._cache.set("raw-int", 12345)
    store._cache.set("raw-str", "{truncated")
    assert store.get("raw-bytes") is None
    assert store.get("raw-int") is None
    assert store.get("raw-str") is None
    # Read-modify-write over a corrupt value starts from None instead of crashing.
    assert store.incr("raw-bytes") == 1
    store.append("raw-str", "x")
    assert get_list(store, "raw-str") == ["x"]


# ---- open_store ------------------------------------------------------------------------------


def test_open_store_diskcache_url(tmp_path: Path) -> None:
    s = open_store(f"diskcache://{tmp_path}/a/b")
    try:
        assert isinstance(s, DiskStore)
        assert s.path == tmp_path / "a" / "b"
        s.set("k", 1)
        assert s.get("k") == 1
    finally:
        s.close()


def test_open_store_expands_the_home_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    s = open_store("diskcache://~/proxy-state")
    try:
        assert isinstance(s, DiskStore) and s.path == tmp_path / "proxy-state"
    finally:
        s.close()
    default = open_store("diskcache://")
    try:
        assert isinstance(default, DiskStore)
        assert default.path == tmp_path / ".cache" / "compaction-proxy"
    finally:
        default.close()


@pytest.mark.parametrize("url", ["redis://localhost:6379/0", "rediss://cache.example:6380/1"])
def test_open_store_redis_url(url: str) -> None:
    s = open_store(url)  # no connection is made until the first command
    assert isinstance(s, RedisStore)
    s.close()


@pytest.mark.parametrize("url", ["memcached://localhost", "sqlite:///tmp/x.db", "/tmp/plain", ""])
def test_open_store_unknown_scheme_is_a_clear_error(url: str) -> None:
    with pytest.raises(ValueError, match="unsupported scheme.*diskcache://.*redis://"):
        open_store(url)
