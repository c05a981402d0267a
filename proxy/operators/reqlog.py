"""A conversation's request rows (its page's table of requests), kept in segments.

Kept as one list of the newest 500 rows, a coding agent's (~600 bytes a row, ~300 KB) was
rewritten whole by every ledger flush holding a request of it: ~0.2 ms of the writer's CPU
and ~300 KB written per request of one busy agent (#28, docs/benchmarks.md). The rows now go,
in order, into segments of ``SEGMENT`` (``req:<tenant>:<conversation>:<n>``): a row's place is
its number in the conversation (the ledger row's ``requests``, which counts them, updated in
the same flush before they are written), its segment that place // ``SEGMENT``; a flush
extends the last segment or two. Reading takes the newest ``KEEP`` rows from the segments
that hold them, after the rows an earlier version kept as one list
(``req:<tenant>:<conversation>``), read as they are. A segment expires with the retention
after its last write, as the list did.
"""

from __future__ import annotations

from typing import Any

from proxy.adapters.store import Store, read_many
from proxy.core.records import conv_key

SEGMENT = 50  # rows a segment holds
KEEP = 500  # the newest rows a conversation's page shows


def append(
    store: Store,
    tenant: str,
    conversation: str,
    rows: list[Any],
    total: int,
    retention_s: float | None,
) -> None:
    """``rows`` after the conversation's others, in their order; ``total``: how many rows the
    conversation has with them (its ledger row's ``requests``)."""
    base = conv_key("req", tenant, conversation)
    place = max(total - len(rows), 0)
    while rows:
        room = SEGMENT - place % SEGMENT
        store.extend(f"{base}:{place // SEGMENT}", rows[:room], retention_s, SEGMENT)
        rows, place = rows[room:], place + room


def read(store: Store, tenant: str, conversation: str, total: Any) -> list[Any]:
    """The conversation's newest ``KEEP`` rows, oldest first, in one round trip with Redis;
    ``total``: its ledger row's ``requests``."""
    base = conv_key("req", tenant, conversation)
    segments: list[str] = []
    if isinstance(total, int) and total >= 1:
        last = (total - 1) // SEGMENT
        segments = [f"{base}:{n}" for n in range(max(0, last - KEEP // SEGMENT), last + 1)]
    got = read_many(store, (), (base, *segments))
    rows = [row for key in (base, *segments) for row in got[key]]
    return rows[-KEEP:]
