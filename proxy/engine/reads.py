"""The store reads of the engine's flows, and what a worker holds while its writes are queued.

Small values the request path writes (the stability tracker, the agent's behaviour figures,
the loop breaker's decision) go to the store in the batched writer's next flush
(``proxy.adapters.writer``); until it lands, the client's next request can already be here,
so this worker answers those keys with what it queued (``hold``). Other workers read the
store, which has them within the writer's interval.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, TypeVar

from proxy.adapters.store import Store, read_many
from proxy.core.commands import Flow, Read

T = TypeVar("T")
HELD_KEYS = 4096
HELD_S = 10.0  # how long this worker answers for its own queued writes


def hold(recent: dict[str, tuple[Any, float]], key: str, value: Any) -> None:
    """Answer ``key`` with ``value`` in this worker (``read_store``'s ``held``) while its
    batched write is queued."""
    now = time.monotonic()
    recent.pop(key, None)  # re-inserted last: the dict stays ordered by age
    recent[key] = (value, now)
    # Only until the batched write has landed (it flushes every fraction of a second):
    # holding values longer would cost memory in proportion to the number and length of
    # conversations, for nothing the store does not have.
    while recent:
        oldest = next(iter(recent))
        if len(recent) <= HELD_KEYS and now - recent[oldest][1] < HELD_S:
            break
        del recent[oldest]


def run_reads(flow: Flow[T], store: Store) -> T:
    """Drive a flow that only reads (a lookup), synchronously, from ``store``: for tools and
    benchmarks that have no event loop."""
    reply: Any = None
    while True:
        try:
            command = flow.send(reply)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        if not isinstance(command, Read):
            raise TypeError(f"run_reads answers reads only, not {command!r}")
        reply = read_store(store, command)


def read_store(
    store: Store, command: Read, held: Mapping[str, tuple[Any, float]] | None = None
) -> dict[str, Any]:
    """``command``'s answer from ``store``: each value (None when absent) and each list (empty
    when absent), in one round trip for Redis. ``held``: values this worker queued but may
    not have written yet, with when; they answer for their keys."""
    # One ``get`` per key: with Redis this runs in a thread while the event loop may drop
    # entries from ``held``.
    queued = {key: held.get(key) for key in command.values} if held else {}
    unread = [key for key in command.values if queued.get(key) is None]
    got = read_many(store, unread, command.lists)
    got.update({key: entry[0] for key, entry in queued.items() if entry is not None})
    return got
