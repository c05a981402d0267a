"""diskcache rows written and read in one statement each (``DiskStore``'s hot writes and its
lookups, #28).

What ``Cache.set`` and ``Cache.get`` do for this store's values (bytes under ``INLINE_BYTES``
and ``str`` keys, kept in the row), in one statement each: the ledger's writer makes ~3 of
each per conversation and flush, and diskcache's general path (a SELECT before the UPDATE,
its retry and cleanup machinery) was most of each write's cost (docs/benchmarks.md). A key
that is absent, or whose value is in a file, goes through diskcache's own ``set``. The
columns are those ``Cache._row_update`` writes; diskcache's triggers keep its count and
size (``Cache.check`` agrees: tests/test_diskrows.py).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from typing import Any

from diskcache.core import MODE_RAW  # what ``Disk.store`` writes for bytes kept in the row

# Values up to this size are kept in the database rather than in a file of their own
# (diskcache's default: from 32 KiB). The ledger rewrites a conversation's request list and
# history on every flush; as files each write cost 0.5-0.7 ms of CPU and 4-6 ms of wall time
# (a new file and directory, the old ones removed), inline 0.1 ms (#28, docs/benchmarks.md).
INLINE_BYTES = 8 * 1024 * 1024

_UPDATE = (
    "UPDATE Cache SET store_time = ?, expire_time = ?, access_time = ?, access_count = 0, "
    f"tag = ?, size = 0, mode = {MODE_RAW}, filename = NULL, value = ? "
    "WHERE key = ? AND raw = 1 AND filename IS NULL"
)
_INSERT = (
    "INSERT INTO Cache (key, raw, store_time, expire_time, access_time, access_count, tag, "
    f"size, mode, filename, value) VALUES (?, 1, ?, ?, ?, 0, ?, 0, {MODE_RAW}, NULL, ?)"
)
_SELECT = (
    "SELECT mode, filename, value, tag FROM Cache WHERE key = ? AND raw = 1 "
    "AND (expire_time IS NULL OR expire_time > ?)"
)


def put_row(cache: Any, key: str, body: bytes, ttl: float | None, tag: Any = None) -> None:
    """``cache.set(key, body, expire=ttl, tag=tag)``: an UPDATE of the key's row in place, or
    the INSERT of a new one (the ledger starts request segments as conversations grow:
    ``Cache.set``'s general path cost ~20 us more)."""
    if len(body) < INLINE_BYTES:
        now = time.time()
        expire = None if ttl is None else now + ttl
        value = sqlite3.Binary(body)
        if cache._sql(_UPDATE, (now, expire, now, tag, value, key)).rowcount == 1:
            return
        if _inserted(cache, key, now, expire, tag, value):
            return
    cache.set(key, body, expire=ttl, tag=tag)  # (there, its value in a file: diskcache moves it)


def insert_row(cache: Any, key: str, body: bytes, ttl: float | None, tag: Any = None) -> bool:
    """``put_row`` of a key not there yet, in one statement; False (nothing written) when it
    is there or the value is for a file."""
    if len(body) >= INLINE_BYTES:
        return False
    now = time.time()
    expire = None if ttl is None else now + ttl
    return _inserted(cache, key, now, expire, tag, sqlite3.Binary(body))


def _inserted(cache: Any, key: str, now: float, expire: float | None, tag: Any, value: Any) -> bool:
    try:
        cache._sql(_INSERT, (key, now, expire, now, tag, value))
    except sqlite3.IntegrityError:  # there already
        return False
    return True


def fetch_row(cache: Any, key: str) -> tuple[Any, Any]:
    """The value (bytes, or None when absent or expired) and its tag."""
    row = cache._sql(_SELECT, (key, time.time())).fetchone()
    if row is None:
        return None, None
    mode, filename, value, tag = row
    try:
        return cache._disk.fetch(mode, filename, value, False), tag
    except OSError:  # its file was removed meanwhile: a miss, as for ``Cache.get``
        return None, None


def select_rows(
    cache: Any, keys: Sequence[str], now: float
) -> tuple[dict[str, tuple[Any, float | None]], set[str]]:
    """Each of ``keys``' stored bytes in ``cache`` (None when absent or expired) and expiry,
    and the keys whose value is not bytes kept in the row (in a file, or not written by this
    store: not for the read cache)."""
    # What ``Cache.get`` does on its fast path, which is this cache's (no statistics, an
    # eviction policy that writes nothing on a read): one indexed SELECT for all keys, and
    # the value decoded by diskcache's ``Disk.fetch`` (small values inline, big ones in
    # files). Keys are ``str``, which diskcache stores as they are (``raw = 1``).
    marks = ",".join("?" * len(keys))
    found = cache._sql(
        "SELECT key, mode, filename, value, expire_time FROM Cache WHERE raw = 1 AND key IN "
        f"({marks}) AND (expire_time IS NULL OR expire_time > ?)",
        (*keys, now),
    ).fetchall()
    rows: dict[str, tuple[Any, float | None]] = dict.fromkeys(keys, (None, None))
    unkept: set[str] = set()
    for key, mode, filename, value, expires in found:
        if filename is not None or not isinstance(value, bytes):
            unkept.add(key)
        try:
            rows[key] = (cache._disk.fetch(mode, filename, value, False), expires)
        except OSError:  # its file was removed meanwhile: a miss, as for ``Cache.get``
            unkept.add(key)
    return rows, unkept


class Pinned:
    """A diskcache ``Cache`` for one batch: its connection's ``execute`` (``_sql``, what
    ``fetch_row`` and ``put_row`` run) taken once (``Cache._sql`` looks up the process's
    and thread's connection at every statement); everything else the cache's own."""

    __slots__ = ("_cache", "_sql")

    def __init__(self, cache: Any) -> None:
        self._cache = cache
        self._sql = cache._sql

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)
