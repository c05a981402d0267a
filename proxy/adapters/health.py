"""Store health: start without a usable store, notice when it goes away, say so (issue #13).

The proxy never needs its store to forward traffic: without one it forwards uncompacted.
So a store that cannot be opened (a read-only or missing folder, a corrupt database) does
not stop start-up; a store deleted or broken while running is noticed by a periodic check
and by ``/readyz``. A diskcache folder or database deleted or replaced while running is
opened again (created if gone) by the next write or check (``DiskStore.reopen_if_replaced``,
issue #29): ``/readyz`` then says when and why (``recreated``). A store that stays unusable:
one error log line per change, ``compaction_proxy_store_up``
0, ``/healthz`` says ``degraded`` (the process is alive: nothing to restart for), ``/readyz``
answers 503 (readiness fails while the store is unusable), and the admin API answers 503.
The two probes are routes of the server (``proxy.server.probes``); this module has no HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from proxy.adapters.store import DiskStore, Store, open_store
from proxy.adapters.storevalues import WriteFailures
from proxy.core.errors import StoreError

log = logging.getLogger("compaction_proxy.health")

PROBE_KEY = "health:probe"
CHECK_INTERVAL_S = 10.0


class UnavailableStore(WriteFailures):
    """Stands in for a store that could not be opened: every call raises ``StoreError``,
    which every caller already treats as "forward uncompacted"; writes are counted."""

    reads_block = False

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreError(f"store unavailable: {self.reason}")

    def _fail_write(self, *args: Any, **kwargs: Any) -> Any:
        raise self._failed_write(StoreError(f"store unavailable: {self.reason}"))

    get = zrange = zcard = _fail
    set = add = delete = incr = append = extend = update = _fail_write
    zadd = zadd_many = zrem = _fail_write

    def keys(self, prefix: str) -> Iterator[str]:
        self._fail()
        return iter(())

    def close(self) -> None:
        pass


def open_store_or_degraded(url: str) -> Store:
    """The configured store, or an ``UnavailableStore`` when it cannot be opened."""
    try:
        return open_store(url)
    except (StoreError, OSError) as exc:
        log.error(
            "store cannot be opened; serving uncompacted until it is fixed and the proxy restarted",
            extra={"url": url, "error": str(exc)},
        )
        return UnavailableStore(str(exc))


def store_problem(store: Store) -> str | None:
    """Why the store cannot be used now, or None (synchronous; a write and a read)."""
    if isinstance(store, UnavailableStore):
        return store.reason
    try:
        if isinstance(store, DiskStore):
            store.reopen_if_replaced()  # deleted or replaced: open (create) them again
        store.set(PROBE_KEY, time.time(), 60)
        store.get(PROBE_KEY)
    except StoreError as exc:
        return str(exc)
    return None


class StoreHealth:
    """The store's last known state; logs and counts every change."""

    def __init__(
        self,
        store: Store,
        on_change: Callable[[bool, bool], None] | None,
        on_write_failure: Callable[[], None] | None = None,
    ) -> None:
        """``on_change(up, changed)`` after every check, ``on_write_failure()`` on every
        failed store write, from any thread (the metrics)."""
        self.store = store
        if isinstance(store, WriteFailures):
            store.on_write_failure = on_write_failure
        self.problem: str | None = store.reason if isinstance(store, UnavailableStore) else None
        self.checked_at = 0.0
        self._on_change = on_change
        self._running: asyncio.Future[str | None] | None = None

    @property
    def recreated(self) -> dict[str, Any] | None:
        """When and why the store's files were last found deleted or replaced and opened
        again (a diskcache store), or None."""
        found = getattr(self.store, "recreated", None)
        if found is None:
            return None
        at, reason = found
        return {"at": round(at, 3), "reason": reason}

    async def check(self) -> str | None:
        """Check now; callers arriving while a check runs share it (``/readyz`` is open to
        anyone, and each check writes to the store)."""
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._check())
        return await asyncio.shield(self._running)

    async def _check(self) -> str | None:
        problem = await asyncio.to_thread(store_problem, self.store)
        changed = (problem is None) != (self.problem is None)
        if changed and problem is not None:
            log.error("store unavailable; forwarding uncompacted", extra={"error": problem})
        elif changed:
            log.warning("store available again")
        self.problem, self.checked_at = problem, time.time()
        if self._on_change is not None:
            self._on_change(problem is None, changed)
        return problem

    async def watch(self, interval_s: float = CHECK_INTERVAL_S) -> None:
        while True:
            try:
                await self.check()
            except Exception:  # the watcher itself never dies
                log.exception("store check failed")
            await asyncio.sleep(interval_s)
