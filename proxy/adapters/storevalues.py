"""What both store backends share: values as JSON bytes (orjson), read back leniently (a
corrupt value is a miss, never a crash), and a count of the writes that failed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import orjson

from proxy.core.errors import StoreError


def dump(value: Any) -> bytes:
    return orjson.dumps(value)


def load(raw: Any) -> Any:
    if raw is None:
        return None
    try:
        return orjson.loads(raw)
    except (orjson.JSONDecodeError, TypeError):
        return None


def load_items(raw: Sequence[Any]) -> list[Any]:
    return [v for v in (load(r) for r in raw) if v is not None]


class WriteFailures:
    """Counts the writes a backend could not make, and tells ``on_write_failure`` (the
    metrics) of each: a write that fails is dropped by its caller (fail open), so it must at
    least be counted. Called from worker threads; ``on_write_failure`` must be thread-safe."""

    write_failures = 0
    on_write_failure: Callable[[], None] | None = None

    def _failed_write(self, exc: StoreError) -> StoreError:
        self.write_failures += 1
        hook = self.on_write_failure
        if hook is not None:
            hook()
        return exc
