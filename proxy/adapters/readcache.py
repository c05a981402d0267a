"""What a worker read from its disk store, kept in memory while no process has written it (#28).

Why: a request of a known conversation reads ~8 keys (its compaction record, checkpoints,
cooldown, tracker...); the SQLite query and decoding were ~40 us of the ~430 us of CPU a
request took (docs/benchmarks.md), and nearly always nothing wrote those keys since the last
request of the conversation.

How the store stays the source of truth across worker processes: beside the databases lies
``cache.db-epochs``, a file of ``SLOTS`` counters that every process opening the store reads
and writes. Each key has one counter (``slot``: CRC-32, the same in every process), and every
write through ``DiskStore`` adds one to its key's counter *after* its transaction committed
(``Epochs.bump``, under an exclusive ``lockf`` so two processes never lose an increment). A
read takes the key's counter *before* its query and keeps the value with it; the value
answers again only while the counter is unchanged, so a write by any process, committed
before or during that query, makes the next read go to the store. Keys that share a counter
only cost each other a query. A cull that may have evicted values nobody wrote bumps every
counter (``bump_all``); an expired value is never answered (its expiry is kept with it). A
counters' file cut short (a restore, a corrupted folder) is read as no counter, and a write
then starts the counter past any value it had, never from 0.
The keys of one conversation (``kind:tenant:conversation``) have their counters side by side,
``BLOCK`` of them, so a request's lookup reads them in one ``pread``.

Kept as the bytes read and decoded on each answer, so no caller can change what the next one
gets. Bounded: ``max_entries`` keys and ``max_bytes`` of values, the longest-kept dropped
first; a value over ``MAX_VALUE_BYTES`` is not kept. Without ``fcntl`` (Windows) there is no
cache: every read queries, as before.
"""

from __future__ import annotations

import os
import struct
import threading
import time
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - not on the platforms CI runs
    fcntl = None  # type: ignore[assignment]

# Beside the database as SQLite's own "-wal" and "-shm" are: diskcache's ``check`` takes a
# file whose name holds "cache.db" for its own (any other it reports, and with ``fix`` removes).
FILE = "cache.db-epochs"
SLOTS = 1 << 16
BLOCK = 32  # counters per block: a conversation's keys' (their kinds hash apart within it)
SIZE = SLOTS * 8
_COUNTER = struct.Struct("<Q")
_BLOCK_BYTES = BLOCK * 8
# One added to each 8-byte little-endian counter of the file at once: counters never reach
# 2**64, so no carry crosses from one to the next.
_ONE_EACH = int.from_bytes(_COUNTER.pack(1) * SLOTS, "little")
MAX_VALUE_BYTES = 256 * 1024

# (the key's counter, its value when read, expiry or None, the value's bytes or None: absent)
Entry = tuple[int, int, float | None, bytes | None]


def slot(key: str) -> int:
    """The counter of ``key``: the same in every process (``hash`` is not). A conversation's
    keys (``kind:tenant:conversation``) fall in one block, a place in it for each kind."""
    kind, _, rest = key.partition(":")
    block = zlib.crc32(rest.encode()) % (SLOTS // BLOCK)
    return block * BLOCK + (zlib.crc32(kind.encode()) & (BLOCK - 1))


class Epochs:
    """The counters of one store folder, shared by every process that opens the file.

    Read and written with ``pread``/``pwrite`` (~1 us each), not mapped: a mapped file that
    someone truncates (an operator's restore, a corrupted folder) kills the process on its
    next read (SIGBUS); a short read here is a counter that matches nothing kept."""

    def __init__(self, directory: Path) -> None:
        fd = os.open(directory / FILE, os.O_RDWR | os.O_CREAT, 0o600)
        # A file object: closed when dropped (a store reopened after its folder was deleted
        # lets the old one go while another thread may still read it).
        self._file = os.fdopen(fd, "r+b", buffering=0)
        self._fd = fd
        if os.fstat(fd).st_size < SIZE:  # new: zeros (a process racing here sets the same size)
            os.ftruncate(fd, SIZE)

    def read(self, index: int) -> int:
        """The counter now; -1 (which no read keeps) when the file was cut short."""
        return counter(self.block(index // BLOCK), index)

    def block(self, number: int) -> bytes:
        """The counters of block ``number`` as stored (short when the file was cut short)."""
        return os.pread(self._fd, _BLOCK_BYTES, number * _BLOCK_BYTES)

    def bump(self, keys: Iterable[str]) -> None:
        """One more on each of ``keys``' counters: call it after the write committed.
        Serialised across processes: a read-add-write of a counter that two processes
        interleaved could move it back to a value a reader holds."""
        slots = {slot(key) for key in keys}
        if not slots:
            return
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            for index in slots:
                now = self.read(index)
                after = now + 1 if now >= 0 else _afresh()
                os.pwrite(self._fd, _COUNTER.pack(after), index * 8)
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def bump_all(self) -> None:
        """One more on every counter (values may be gone that no write removed)."""
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            now = os.pread(self._fd, SIZE, 0)
            if len(now) < SIZE:
                after = _COUNTER.pack(_afresh()) * SLOTS
            else:
                after = (int.from_bytes(now, "little") + _ONE_EACH).to_bytes(SIZE, "little")
            os.pwrite(self._fd, after, 0)
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self._file.close()


def _afresh() -> int:
    """A counter's value after its file was cut short: past any it had before (which readers
    may hold), so not counted again from 0. The clock in nanoseconds: ~1.8e18, far from 2**64."""
    return time.time_ns()


def counter(block: bytes, index: int) -> int:
    """Counter ``index`` in its ``block``'s bytes; -1 when they were cut short."""
    at = (index % BLOCK) * 8
    return int(_COUNTER.unpack_from(block, at)[0]) if len(block) >= at + 8 else -1


def open_epochs(directory: Path) -> Epochs | None:
    """The folder's counters, or None where they cannot be shared (no ``fcntl``)."""
    return Epochs(directory) if fcntl is not None else None


class ReadCache:
    """Values read from one store, each answering while its counters are unchanged."""

    def __init__(
        self, epochs: Epochs, max_entries: int = 4096, max_bytes: int = 8 * 1024 * 1024
    ) -> None:
        self.epochs = epochs
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: dict[str, Entry] = {}
        self._bytes = 0
        self._lock = threading.Lock()  # the loop's thread and worker threads read

    def lookup(
        self, keys: Iterable[str], now: float
    ) -> tuple[dict[str, bytes | None], dict[str, tuple[int, int]]]:
        """The kept bytes of the keys still valid, and for the others their counters now
        (read before the caller's query: ``keep`` takes them)."""
        blocks: dict[int, bytes] = {}  # read once per lookup: usually one for all the keys
        found: dict[str, bytes | None] = {}
        marks: dict[str, tuple[int, int]] = {}
        entries = self._entries
        for key in keys:
            entry = entries.get(key)
            index = entry[0] if entry is not None else slot(key)
            number = index // BLOCK
            block = blocks.get(number)
            if block is None:
                block = blocks[number] = self.epochs.block(number)
            now_at = counter(block, index)
            if entry is not None and entry[1] == now_at and (entry[2] is None or entry[2] > now):
                found[key] = entry[3]
            else:
                marks[key] = (index, now_at)
        return found, marks

    def keep(
        self,
        rows: dict[str, tuple[bytes | None, float | None]],
        marks: dict[str, tuple[int, int]],
    ) -> None:
        """Keep what the query found (``rows``: key -> bytes or None when absent, expiry)
        with the counters ``lookup`` read before it."""
        with self._lock:
            entries = self._entries
            for key, (raw, expires) in rows.items():
                size = len(raw) if raw is not None else 0
                mark = marks.get(key)
                if size > MAX_VALUE_BYTES or mark is None or mark[1] < 0:
                    continue  # (a counter of a file cut short: kept, it would match again)
                old = entries.pop(key, None)
                if old is not None:
                    self._bytes -= len(old[3] or b"")
                entries[key] = (*mark, expires, raw)
                self._bytes += size
            while entries and (len(entries) > self.max_entries or self._bytes > self.max_bytes):
                dropped = entries.pop(next(iter(entries)))
                self._bytes -= len(dropped[3] or b"")

    def stats(self) -> dict[str, Any]:
        return {"entries": len(self._entries), "bytes": self._bytes}
