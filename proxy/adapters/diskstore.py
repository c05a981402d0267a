"""The embedded default store: diskcache (and ``SortedSets``) in a private folder.

Its guarantees are the ``Store`` protocol's (``proxy.adapters.store``). This module adds what
a folder on disk needs and Redis does not: the folder or its databases can be deleted or
replaced under a running proxy (an operator cleaning up, a restore from backup, another
worker that recreated them). SQLite keeps writing into the files it has open, so after a
deletion every write would vanish without an error. Before each write the store therefore
checks (three ``stat`` calls, a few microseconds) that the files at its path are the ones it
has open, and if not, opens them again, creating the folder and databases when they are gone:
recording resumes without a restart, one warning is logged, and ``recreated`` says when and
why (``/readyz`` shows it). A write that still cannot be made raises ``StoreError`` and is
counted (``WriteFailures``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from proxy.adapters import diskrows
from proxy.adapters.diskrows import INLINE_BYTES, Pinned, fetch_row, put_row, select_rows
from proxy.adapters.jsonlists import appended
from proxy.adapters.readcache import ReadCache, open_epochs
from proxy.adapters.sortedsets import SortedSets
from proxy.adapters.storevalues import WriteFailures, dump, load
from proxy.core.errors import StoreError

log = logging.getLogger("compaction_proxy.store")

_ERRORS = (OSError, sqlite3.Error)
_FILES = ("cache.db", "index.db")
# diskcache removes expired values (and evicts past the size limit) on every ``set`` by
# default: a query and a check of the file's size each time, 6 us on a small value and
# 56 us on a 33 KB one (a conversation's history, written by every flush that has a request
# of it; #28). Here that is done at most this often, after a batch of the ledger's writer.
# Reads never see an expired value either way (each one checks the expiry).
CULL_INTERVAL_S = 30.0
Identity = tuple[tuple[int, int], ...]


class DiskStore(WriteFailures):
    """diskcache in a private folder, safe across worker processes.

    diskcache serialises writers through SQLite; ``transact`` makes read-modify-write atomic
    across processes. Every call is synchronous and short (tens of microseconds); SQLite waits
    at most 60 s for another process's write lock (diskcache's and ``SortedSets``' timeout).
    """

    # SQLite in WAL mode: a read never waits for a writer, and takes tens of microseconds -
    # less than handing it to a thread and back (measured: bench/, docs/benchmarks.md).
    reads_block = False

    def __init__(self, directory: str | os.PathLike[str], size_limit: int = 2**32) -> None:
        self.path = Path(directory).expanduser()
        self._size_limit = size_limit
        self._reopening = threading.Lock()
        self._batching = threading.local()  # ``on``: this thread is inside ``batch``
        # (when, why) of the last time the files were found deleted or replaced and reopened.
        self.recreated: tuple[float, str] | None = None
        self._culled_at = time.monotonic()
        self._open()

    def _open(self) -> None:
        import diskcache

        path = self.path
        try:
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(path, 0o700)  # private to the user even if the folder already existed
            self._cache = diskcache.Cache(
                str(path),
                size_limit=self._size_limit,
                eviction_policy="least-recently-stored",
                disk_min_file_size=INLINE_BYTES,
                cull_limit=0,  # culled by ``_cull_now_and_then``, not by every set
            )
            self._sets = SortedSets(path / "index.db")
            # What this worker read, answering while no process wrote it (#28).
            epochs = open_epochs(path)
            self._reads = ReadCache(epochs) if epochs is not None else None
            for name in os.listdir(path):
                if name.startswith(_FILES):
                    os.chmod(path / name, 0o600)
        except _ERRORS as exc:
            raise StoreError(f"cannot open store at {path}: {exc}") from exc
        self._identity = self._current()

    def _current(self) -> Identity | None:
        """The (device, inode) of the folder and its databases now; None if one is missing."""
        try:
            stats = [os.stat(self.path)] + [os.stat(self.path / name) for name in _FILES]
        except OSError:
            return None
        return tuple((s.st_dev, s.st_ino) for s in stats)

    def replaced(self) -> str | None:
        """Why the files at the store's path are not the ones it has open, or None."""
        if self._current() == self._identity:
            return None
        if not self.path.is_dir():
            return f"store directory {self.path} is gone"
        if not all((self.path / name).exists() for name in _FILES):
            return f"store database in {self.path} was deleted"
        return f"store files in {self.path} were replaced"

    def reopen_if_replaced(self) -> str | None:
        """Open the files at the path again if they were deleted or replaced (creating them
        if gone); the reason when it did. Raises ``StoreError`` if they cannot be opened."""
        if self._current() == self._identity:
            return None
        with self._reopening:  # one thread reopens; the others find it done
            reason = self.replaced()
            if reason is None:
                return None
            old_cache, old_sets = self._cache, self._sets
            self._open()
            self.recreated = (time.time(), reason)
            log.warning("store reopened; recording again", extra={"reason": reason})
        for old in (old_sets, old_cache):
            try:
                old.close()  # this thread's connection; the others' are let go with them
            except _ERRORS:
                pass
        return reason

    def _guard(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except _ERRORS as exc:
            raise StoreError(f"store unavailable: {exc}") from exc

    def _write(self, op: Callable[[], Any]) -> Any:
        """Run ``op`` (a write through ``self._cache`` or ``self._sets``, read when it runs)
        after making sure they are the files at the path; count a failure."""
        try:
            if not getattr(self._batching, "on", False):  # (a batch checked when it began)
                self.reopen_if_replaced()
            return self._guard(op)
        except StoreError as exc:
            raise self._failed_write(exc) from exc

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """This thread's writes inside, to the key-value database, in one SQLite transaction.

        Why: the ledger's writer makes ~5 writes per conversation and flush, each its own
        transaction before, with the files' identity checked (3 ``stat``) before each;
        200 conversations' rows cost 686-757 us of CPU each so, 548-552 us in one transaction
        (#28). The files are checked once, when the batch begins: a deletion during the batch
        is found by the next write after it. A ``StoreError`` that leaves the batch rolls
        all of it back (the writer logs the batch as lost); files that cannot be opened when
        it begins count as one failed write. What ``after_commit`` was given runs once the
        transaction is committed, and not at all when it is rolled back."""
        if getattr(self._batching, "on", False):
            yield
            return
        try:
            self.reopen_if_replaced()
        except StoreError as exc:  # the batch's writes cannot be made: counted as one
            raise self._failed_write(exc) from exc
        self._batching.on, self._batching.after = True, []
        self._batching.changed = set()
        try:
            with self._cache.transact():
                self._batching.rows = Pinned(self._cache)
                yield
        except _ERRORS as exc:  # the commit itself
            raise self._failed_write(StoreError(f"store unavailable: {exc}")) from exc
        finally:
            self._batching.on, self._batching.rows = False, None
            after, self._batching.after = self._batching.after, []
            self._bump(self._batching.changed)  # committed (or rolled back: a spare miss)
        for fn in after:
            try:
                fn()
            except Exception as exc:  # the batch is committed: not lost for this
                log.warning("write after the batch failed", extra={"error": str(exc)})
        self._cull_now_and_then()

    def after_commit(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` (writes outside the key-value database: the sorted sets) once this
        thread's batch is committed; now when it is in none. Why: the operators' indexes
        (``index.db``) cannot be in diskcache's transaction, and written inside it they were
        ahead of rows a failed commit took back."""
        if getattr(self._batching, "on", False):
            self._batching.after.append(fn)
        else:
            fn()

    def _cull_now_and_then(self) -> None:
        """Remove expired values and evict past the size limit, at most every
        ``CULL_INTERVAL_S`` (in the batching thread, the ledger's writer: off the loop)."""
        now = time.monotonic()
        if now - self._culled_at < CULL_INTERVAL_S:
            return
        self._culled_at = now
        try:
            removed = self._cache.cull()
        except _ERRORS as exc:  # the next interval tries again; nothing was lost
            log.warning("store cull failed", extra={"error": str(exc)})
            return
        if removed:  # (maybe evicted past the size limit: values no write changed)
            self._bump(None)

    def _changed(self, key: str) -> None:
        """``key`` was written (or a write of it was tried): every process's kept read of it
        goes to the store next time; in a batch, once it is committed."""
        if getattr(self._batching, "on", False):
            self._batching.changed.add(key)
        else:
            self._bump((key,))

    def _bump(self, keys: Iterable[str] | None) -> None:
        """Bump ``keys``' counters (``proxy.adapters.readcache``); None: every counter."""
        reads = self._reads
        if reads is None:
            return
        try:
            if keys is None:
                reads.epochs.bump_all()
            else:
                reads.epochs.bump(keys)
        except OSError as exc:  # other processes may keep a stale read: this one reads on
            self._reads = None
            log.warning("store read cache off", extra={"error": str(exc)})

    def _pinned(self) -> Pinned | None:
        """This thread's batch's cache (``Pinned``) while it is in one, else None."""
        pinned = getattr(self._batching, "rows", None)
        return pinned if pinned is not None and self._batching.on else None

    def _transact(self, fn: Callable[[Any], Any], key: str) -> Any:
        """``fn(cache)`` under one diskcache transaction, as a write of ``key``."""
        pinned = self._pinned()
        if pinned is not None:
            # In this thread's batch, its transaction (diskcache's nested ``transact`` only
            # checks so) on the connection it began on: ~4 us a write less (#28).
            try:
                return fn(pinned)
            except _ERRORS as exc:
                raise self._failed_write(StoreError(f"store unavailable: {exc}")) from exc
            finally:
                self._batching.changed.add(key)

        def run() -> Any:
            cache = self._cache
            with cache.transact():
                return fn(cache)

        try:
            return self._write(run)
        finally:
            self._changed(key)

    def get(self, key: str) -> Any:
        return load(self._guard(self._cache.get, key))

    def get_many(self, keys: Sequence[str]) -> dict[str, Any]:
        """Each of ``keys``' values (None when absent) in one SQL query: a request's lookup
        reads ~8 keys, and each ``get`` is a query of its own (#28)."""
        return self._guard(self._get_many, keys)

    def _get_many(self, keys: Sequence[str]) -> dict[str, Any]:
        got: dict[str, Any] = dict.fromkeys(keys)
        if not keys:
            return got
        now, reads = time.time(), self._reads
        if reads is None:
            rows, _ = select_rows(self._cache, keys, now)
        else:  # what no process wrote since this worker read it answers from memory
            kept, marks = reads.lookup(keys, now)
            rows, unkept = select_rows(self._cache, list(marks), now) if marks else ({}, set())
            reads.keep({k: v for k, v in rows.items() if k not in unkept}, marks)
            rows.update((key, (raw, None)) for key, raw in kept.items())
        for key, (raw, _) in rows.items():
            got[key] = load(raw)
        return got

    def set(self, key: str, value: Any, ttl: float | None = None) -> None:
        body = dump(value)
        try:
            self._write(lambda: put_row(self._pinned() or self._cache, key, body, ttl))
        finally:
            self._changed(key)

    def add(self, key: str, value: Any, ttl: float | None = None) -> bool:
        try:
            return bool(self._write(lambda: self._cache.add(key, dump(value), expire=ttl)))
        finally:
            self._changed(key)

    def delete(self, key: str) -> None:
        try:
            self._write(lambda: self._cache.delete(key))
        finally:
            self._changed(key)

    def incr(self, key: str, delta: float = 1, ttl: float | None = None) -> float:
        def run(cache: Any) -> float:
            current = load(fetch_row(cache, key)[0]) or 0
            value = (current if isinstance(current, int | float) else 0) + delta
            put_row(cache, key, dump(value), ttl)
            return value

        return float(self._transact(run, key))

    def append(self, key: str, item: Any, ttl: float | None = None, max_items: int = 1000) -> None:
        self.extend(key, [item], ttl, max_items)

    def extend(
        self,
        key: str,
        items: list[Any],
        ttl: float | None = None,
        max_items: int = 1000,
        *,
        new: bool = False,
    ) -> None:
        """Atomic append of several items (one transaction), keeping the newest ``max_items``.
        ``new``: the key is most likely absent, so it is inserted first (one statement, not
        three: a busy conversation's ledger flush starts many request segments, #28)."""

        def run(cache: Any) -> None:
            if new and items:
                kept = items[-max_items:]
                if diskrows.insert_row(cache, key, dump(kept), ttl, len(kept)):
                    return
            raw, count = fetch_row(cache, key)
            body = appended(raw, count, items, max_items) if items else None
            if body is None:  # absent, written by ``set`` (no count), or not a list
                current = load(raw)
                current = current if isinstance(current, list) else []
                current.extend(items)
                kept = current[-max_items:]
                body, count = dump(kept), len(kept)
            else:
                count = min(count + len(items), max_items)
            put_row(cache, key, body, ttl, count)

        self._transact(run, key)

    def update(self, key: str, fn: Callable[[Any], Any], ttl: float | None = None) -> Any:
        """Atomic read-modify-write: ``fn(old or None) -> new``, under one transaction."""

        def run(cache: Any) -> Any:
            value = fn(load(fetch_row(cache, key)[0]))
            put_row(cache, key, dump(value), ttl)
            return value

        return self._transact(run, key)

    def keys(self, prefix: str) -> Iterator[str]:
        for key in self._guard(list, self._cache.iterkeys()):
            if isinstance(key, str) and key.startswith(prefix):
                yield key

    def zadd(self, key: str, scores: Mapping[str, float]) -> None:
        if scores:
            self._write(lambda: self._sets.add(key, scores))

    def zadd_many(self, sets: Mapping[str, Mapping[str, float]]) -> None:
        if any(sets.values()):
            self._write(lambda: self._sets.add_many(sets))

    def zrem(self, key: str, members: Sequence[str]) -> None:
        if members:
            self._write(lambda: self._sets.remove(key, members))

    def zrange(
        self,
        key: str,
        offset: int = 0,
        limit: int = -1,
        *,
        desc: bool = False,
        max_score: float | None = None,
    ) -> list[tuple[str, float]]:
        found: list[tuple[str, float]] = self._guard(
            self._sets.range, key, offset, limit, desc, max_score
        )
        return found

    def zcard(self, key: str) -> int:
        return int(self._guard(self._sets.count, key))

    def close(self) -> None:
        self._sets.close()
        self._cache.close()
        reads, self._reads = self._reads, None  # (a read after this queries, as before)
        if reads is not None:
            reads.epochs.close()
