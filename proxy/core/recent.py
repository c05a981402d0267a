"""A bounded map, the least recently put out first: the memories a worker keeps of what it
read or wrote (compaction records, the ledger writer's indexes and rows). Pure: no I/O."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class Recent(Generic[K, T]):
    """A bounded map, the least recently put out first; thread-safe (flows of huge histories
    and the ledger's writer run in worker threads)."""

    def __init__(self, most: int) -> None:
        self._most = most
        self._items: OrderedDict[K, T] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> T | None:
        with self._lock:
            return self._items.get(key)

    def put(self, key: K, value: T) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self._most:
                self._items.popitem(last=False)

    def pop(self, key: K) -> None:
        with self._lock:
            self._items.pop(key, None)
