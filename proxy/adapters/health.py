"""Store health: start without a usable store, notice when it goes away, say so (issue #13).

The proxy never needs its store to forward traffic: without one it forwards uncompacted.
So a store that cannot be opened (a read-only or missing folder, a corrupt database) does
not stop start-up; a store deleted or broken while running is noticed by a periodic check
and by ``/readyz``. Either way: one error log line per change, ``compaction_proxy_store_up``
0, ``/healthz`` says ``degraded`` (the process is alive: nothing to restart for), ``/readyz``
answers 503 (readiness fails while the store is unusable), and the admin API answers 503.
The two probes are routes of the server (``proxy.server.probes``); this module has no HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from proxy.adapters.store import DiskStore, Store, open_store
from proxy.core.errors import StoreError

log = logging.getLogger("compaction_proxy.health")

PROBE_KEY = "health:probe"
CHECK_INTERVAL_S = 10.0


class UnavailableStore:
    """Stands in for a store that could not be opened: every call raises ``StoreError``,
    which every caller already treats as "forward uncompacted"."""

    reads_block = False

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreError(f"store unavailable: {self.reason}")

    get = set = add = delete = incr = append = extend = update = _fail
    zadd = zadd_many = zrem = zrange = zcard = _fail

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
    if isinstance(store, DiskStore):
        path = Path(store.path)
        if not path.is_dir():
            return f"store directory {path} is gone"
        if not (path / "cache.db").exists():
            return f"store database {path / 'cache.db'} was deleted"
    try:
        store.set(PROBE_KEY, time.time(), 60)
        store.get(PROBE_KEY)
    except StoreError as exc:
        return str(exc)
    return None


class StoreHealth:
    """The store's last known state; logs and counts every change."""

    def __init__(self, store: Store, on_change: Callable[[bool, bool], None] | None) -> None:
        self.store = store
        self.problem: str | None = store.reason if isinstance(store, UnavailableStore) else None
        self.checked_at = 0.0
        self._on_change = on_change
        self._running: asyncio.Future[str | None] | None = None

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
