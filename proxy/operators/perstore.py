"""One object per store and worker process: what the ledger's writer remembers writing.

The ledger's helpers (``history``, ``index``, ``adopt``) keep a bounded memory of what this
worker last wrote, so a flush can leave out what it knows the store already holds. Each store
object has its own (tests and tools open several stores in one process); it goes with the
store (weak keys).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

from proxy.adapters.store import Store

T = TypeVar("T")


def trusted_for(limit_s: float, retention_s: float | None) -> float:
    """How long a worker trusts its memory of a write: ``limit_s``, or half a shorter
    retention (what it wrote lives at least its retention after the write)."""
    return min(limit_s, retention_s / 2) if retention_s else limit_s


class PerStore(Generic[T]):
    """``of(store)``: this store's ``T``, made by ``factory`` on first use; thread-safe."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._by_store: weakref.WeakKeyDictionary[Store, T] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def of(self, store: Store) -> T:
        with self._lock:
            found = self._by_store.get(store)
            if found is None:
                found = self._by_store[store] = self._factory()
            return found
