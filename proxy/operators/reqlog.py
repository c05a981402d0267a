"""A conversation's request rows (its page's table of requests), kept in segments.

Kept as one list of the newest 500 rows, a coding agent's (~600 bytes a row, ~300 KB) was
rewritten whole by every ledger flush holding a request of it: ~0.2 ms of the writer's CPU
and ~300 KB written per request of one busy agent (#28, docs/benchmarks.md). The rows go, in
order, into segments of ``SEGMENT`` (``req:<tenant>:<conversation>:s<n>``): a row's place is
its number in the conversation (the ledger row's ``requests``, which counts them, updated in
the same flush before they are written), its segment that place // ``SEGMENT``; a flush
extends the last segment or two.

Why 25 rows: an agent's requests land one a flush (each a few seconds apart, the writer
flushing every fraction of a second), so each flush rewrites the segment its row joins, on
average half of it. Segments of 50 rows rewrote ~12 KB a request (three of SQLite's pages and
their copies in the write-ahead log); 25 rewrite half that. Smaller still costs the other
shape: one conversation sending hundreds of requests a flush (a load test) starts a segment
every ``SEGMENT`` of them, each a row inserted; at ten rows that cost more than it saved
(docs/benchmarks.md, #28, twenty-sixth stop). A segment's first row inserts it without
looking it up (``Store.extend(new=True)``).

Reading takes the newest ``KEEP`` rows: first what earlier versions wrote, read as they are
(all of it older than any row of this layout): the rows kept as one list
(``req:<tenant>:<conversation>``), then segments of ``EARLIER_SEGMENT`` rows
(``req:<tenant>:<conversation>:<n>``); then this layout's. A segment expires with the
retention after its last write, as the list did.
"""

from __future__ import annotations

from typing import Any

from proxy.adapters.store import Store, read_many
from proxy.core.records import conv_key

SEGMENT = 25  # rows a segment holds
EARLIER_SEGMENT = 50  # rows a segment of the previous layout held (read, never written)
KEEP = 500  # the newest rows a conversation's page shows


def segment_key(base: str, number: int) -> str:
    """Segment ``number`` of this layout (``base``: the conversation's ``req`` key)."""
    return f"{base}:s{number}"


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
        key = segment_key(base, place // SEGMENT)
        # (A segment's first row starts it: inserted, not looked up first.)
        store.extend(key, rows[:room], retention_s, SEGMENT, new=room == SEGMENT)
        rows, place = rows[room:], place + room


def read(store: Store, tenant: str, conversation: str, total: Any) -> list[Any]:
    """The conversation's newest ``KEEP`` rows, oldest first, in one round trip with Redis;
    ``total``: its ledger row's ``requests``."""
    base = conv_key("req", tenant, conversation)
    keys = [base]
    if isinstance(total, int) and total >= 1:
        first, last = max(0, total - KEEP), total - 1
        # Earlier layouts' rows sit at places below any of this one's: a place's segment in
        # each is read, and the rows beyond the newest KEEP cut off below.
        earlier = range(first // EARLIER_SEGMENT, last // EARLIER_SEGMENT + 1)
        keys += [f"{base}:{n}" for n in earlier]
        keys += [segment_key(base, n) for n in range(first // SEGMENT, last // SEGMENT + 1)]
    got = read_many(store, (), keys)
    rows = [row for key in keys for row in got[key]]
    return rows[-KEEP:]
