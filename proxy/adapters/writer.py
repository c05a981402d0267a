"""Batched writes after the response: the ledger and other latest-value state.

Writing the ledger one request at a time cost several SQLite transactions per request
(milliseconds at a time, on the worker threads the request path also uses). The writer
collects entries and flushes them every ``interval_s`` in one thread hop: one update per
conversation, hour and the totals. Readers in this process (the admin API) call ``flush``
first, so they see every request; other processes see them within ``interval_s``.

A request's net dollars depend on its conversation's previous request, which the ledger reads
as it writes: whoever needs them (the request's trace span) passes a ``Priced`` and hears
them after the flush, on the event loop; the request never waits for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Protocol

from proxy.adapters.store import Store
from proxy.core.errors import StoreError
from proxy.core.prepared import Sent

log = logging.getLogger("compaction_proxy.writer")


class Entry(Protocol):
    """What the writer needs of a queued entry (``operators.ledger.RequestEntry``)."""

    @property
    def tenant(self) -> str: ...

    @property
    def conversation(self) -> str: ...


# A request's history as sent (with each message's exact digest: ``Sent``), or None.
History = list[dict[str, Any]] | Sent | None
# Writes one batch of entries and answers each one's net dollars
# (``operators.ledger.record_batch``): handed in by the engine, so this adapter does not
# import the operators' layer above it.
WriteEntries = Callable[[Store, list[tuple[Any, History]], float | None], list[float | None]]


class Priced(Protocol):
    """Told a queued request's net dollars once the ledger priced it."""

    def pricing(self) -> None:
        """Called when the request is queued: ``priced`` follows (after the next flush)."""

    def priced(self, net_usd: float | None) -> None:
        """The request's net (``ledger.request_net``); None when it was not priced or its
        write failed."""


class BatchWriter:
    """Collects ledger entries and latest values; flushes them in the background."""

    def __init__(
        self,
        store: Store,
        retention_s: float | None,
        write_entries: WriteEntries,
        interval_s: float = 0.2,
    ) -> None:
        self._store = store
        self._retention = retention_s
        self._write_entries = write_entries
        self._interval = interval_s
        self._entries: list[tuple[Entry, History]] = []
        self._priced: list[Priced | None] = []  # in step with ``_entries``
        # Per (tenant, conversation): where in ``_entries`` its queued history is.
        self._history_at: dict[tuple[str, str], int] = {}
        self._latest: dict[str, tuple[Any, float | None]] = {}
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    def record(self, entry: Entry, original: History, priced: Priced | None = None) -> None:
        """Queue one request for the ledger (never blocks); ``priced`` hears its net dollars.

        Only the newest history of a conversation is stored (``ledger.record_batch``), so a
        history queued earlier in the same batch is let go here rather than at the flush:
        held until then, every request's whole history stayed in memory for ``interval_s``
        (50-message requests at 500/s: ~20 MiB more resident memory, docs/benchmarks.md).
        A newest history the encoder cannot write is therefore not replaced by an older one
        of the same batch: the conversation keeps the history stored by an earlier flush.
        """
        if original is not None:
            key = (entry.tenant, entry.conversation)
            earlier = self._history_at.get(key)
            if earlier is not None:
                self._entries[earlier] = (self._entries[earlier][0], None)
            self._history_at[key] = len(self._entries)
        self._entries.append((entry, original))
        self._priced.append(priced)
        if priced is not None:
            priced.pricing()
        self._wake()

    def put(self, key: str, value: Any, ttl: float | None) -> None:
        """Queue ``store.set(key, value, ttl)``; only the newest value per key is written.

        ``value`` may be a function of no arguments (of immutable data): it is called in the
        writer's thread, so building a big value never holds up the event loop."""
        self._latest[key] = (value, ttl)
        self._wake()

    def _wake(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self._entries or self._latest:
            await asyncio.sleep(self._interval)
            await self.flush()

    async def flush(self) -> None:
        """Write everything queued so far; failures are logged and dropped (fail open)."""
        async with self._lock:
            entries, self._entries = self._entries, []
            priced, self._priced = self._priced, []
            self._history_at = {}
            latest, self._latest = self._latest, {}
            if not entries and not latest:
                return
            nets: list[float | None] = [None] * len(entries)
            try:
                nets = await asyncio.to_thread(self._write, entries, latest)
            except StoreError as exc:
                log.warning("ledger write failed", extra={"error": str(exc), "n": len(entries)})
            except Exception:
                log.exception("ledger write crashed")
            finally:
                _tell(priced, nets)

    def _write(
        self,
        entries: list[tuple[Entry, History]],
        latest: dict[str, tuple[Any, float | None]],
    ) -> list[float | None]:
        # One transaction for the whole flush where the store offers it (diskcache, #28).
        batch = getattr(self._store, "batch", None)
        with batch() if batch is not None else contextlib.nullcontext():
            return self._write_all(entries, latest)

    def _write_all(
        self,
        entries: list[tuple[Entry, History]],
        latest: dict[str, tuple[Any, float | None]],
    ) -> list[float | None]:
        for key, (value, ttl) in latest.items():
            try:
                self._store.set(key, value() if callable(value) else value, ttl)
            except StoreError:
                raise
            except Exception as exc:  # one value that cannot be written costs only itself
                log.warning("state not stored", extra={"key": key, "error": str(exc)})
        if entries:
            # record_batch writes each conversation on its own: an entry whose values cannot
            # be written costs only its own conversation's rows, never the batch's others.
            return self._write_entries(self._store, entries, self._retention)
        return []

    async def close(self) -> None:
        """Flush what is left; the background task ends once nothing is queued."""
        await self.flush()
        if self._task is not None:
            await self._task


def _tell(priced: list[Priced | None], nets: list[float | None]) -> None:
    """Each waiting ``Priced`` its request's net (None for all when the write failed)."""
    if len(nets) != len(priced):
        nets = [None] * len(priced)
    for who, net in zip(priced, nets, strict=True):
        if who is not None:
            try:
                who.priced(net)
            except Exception:
                log.exception("a priced request's listener failed")
