"""Indexes the ledger keeps on write, so the operators' reads cost O(page), not O(store).

Conversations are members ``{tenant}:{conversation}`` of sorted sets (``Store.zadd``)
scored by the time they were last seen:

- ``ix:seen``: every conversation; ``ix:seen:t:{tenant}`` and ``ix:seen:m:{model}``: one
  tenant's or one model's (the dashboard's filters);
- ``ix:tenants`` and ``ix:models``: the filter menus, scored by the last request of each;
- ``ix:by:{column}``: every conversation scored by one numeric column of the list
  (``SORTED``: requests, tokens, % saved...), so any sort of the unfiltered list is a page.

The overview's counters (requests and tokens, compactions, failures, key facts, per hour)
are summed on write in ``totals`` and ``hour:`` by the ledger, so a render reads a fixed
number of keys plus one row per listed conversation.

Expiry: a conversation's row expires ``retention_s`` after its last write. Each ledger flush
drops the members not seen for that long (``sweep``); a page skips a member whose row has
already gone.

Stores written before these indexes existed: ``reindex.ensure`` builds them once.

A flush writes only the sort columns that changed (``_Indexed``): of a conversation's 14
index rows, 5-6 (its savings, compactions, first seen) do not move while it stays below the
trigger, and an upsert that rewrites an equal score costs about what one that moves it does
(on disk, in process: a conversation's 14 upserts ~105 us, its 9 moved ones ~62; #28,
docs/benchmarks.md).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.adapters.store import Store, after_commit
from proxy.core.recent import Recent
from proxy.operators.figures import derive
from proxy.operators.perstore import PerStore, trusted_for

SEEN = "ix:seen"
TENANTS = "ix:tenants"
MODELS = "ix:models"
# The list's numeric columns besides last_seen (the ``ix:seen`` score), each with an index.
SORTED = (
    "first_seen", "requests", "messages", "original_tokens", "forwarded_tokens",
    "saved_tokens", "saved_pct", "saved_usd", "compactions", "cached_tokens", "net_saved_usd",
)  # fmt: skip
SWEEP_BATCH = 200  # members dropped per flush at most (the rest go on the next ones)
TRUSTED_S = 600.0  # what a worker remembers writing is trusted this long (or retention / 2)
REMEMBERED = 4096  # conversations whose indexed scores a worker remembers


def member(tenant: str, conversation: str) -> str:
    return f"{tenant}:{conversation}"


def split_member(value: str) -> tuple[str, str]:
    """``(tenant, conversation)``: tenants are hex hashes, so the first ``:`` separates them."""
    tenant, _, conversation = value.partition(":")
    return tenant, conversation


def by_tenant(tenant: str) -> str:
    return f"{SEEN}:t:{tenant}"


def by_model(model: str) -> str:
    return f"{SEEN}:m:{model}"


def by_sort(column: str) -> str:
    return f"ix:by:{column}"


def sort_scores(meta: Mapping[str, Any]) -> dict[str, float]:
    """A conversation row's numeric columns, as the list shows and sorts them."""
    row = derive(dict(meta))
    out = {}
    for column in SORTED:
        value = row.get(column)
        if isinstance(value, bool) or not isinstance(value, int | float):
            value = 0.0
        out[column] = float(value)
    return out


@dataclass(frozen=True)
class Seen:
    """One conversation as just written: where it belongs in the indexes."""

    tenant: str
    conversation: str
    model: str
    last_seen: float
    previous_model: str | None = None  # its model before this write, if it changed
    scores: Mapping[str, float] = field(default_factory=dict)  # ``sort_scores`` of its row
    requests_before: Any = None  # its row's ``requests`` before this write (None: a new row)


class _Indexed:
    """The sort scores this worker last wrote per conversation, and its row's ``requests``
    then. A column is left out when its score is the one written then and the row's
    ``requests`` before this write is the one after that write: no other ledger write came
    between (each adds requests), so the index still holds that score. Whatever else writes
    the row (a compaction's charge, a mark) changes scores, which the next ledger write
    compares with what was indexed, not with the row. Every column is written again once the
    memory is ``TRUSTED_S`` old (or half the retention), so an index that lost a member by
    other means (a sweep while its row lived on) gets it back."""

    def __init__(self) -> None:
        # member -> (since: when every column was last written, requests after, scores)
        self.by_member: Recent[str, tuple[float, float, Mapping[str, float]]] = Recent(REMEMBERED)

    def known(self, s: Seen, trusted: float, now: float) -> tuple[float, Mapping[str, float]]:
        """Since when, and which scores of ``s``, the index is known to hold (``now``, {}
        when not known: every column is written)."""
        last = self.by_member.get(member(s.tenant, s.conversation))
        before = s.requests_before
        if last is None or not isinstance(before, int | float) or now - last[0] >= trusted:
            return now, {}
        since, requests, scores = last
        return (since, scores) if requests == float(before) else (now, {})

    def remember(self, written: list[tuple[Seen, float]]) -> None:
        for s, since in written:
            scores = (since, s.scores.get("requests", -1.0), s.scores)
            self.by_member.put(member(s.tenant, s.conversation), scores)

    def forget(self, names: Iterable[str]) -> None:
        for name in names:
            self.by_member.pop(name)


_indexed: PerStore[_Indexed] = PerStore(_Indexed)


def write(store: Store, seen: Iterable[Seen], retention_s: float | None) -> None:
    """``add``, and ``sweep`` past a retention, once the store's batch is committed: written
    inside it, a commit that failed took the rows back and left these ahead of them (other
    workers' memories then trusted scores no row had, for up to ``TRUSTED_S``)."""
    seen = list(seen)

    def run() -> None:
        add(store, seen, retention_s)
        if retention_s:
            sweep(store, time.time() - retention_s)

    after_commit(store, run)


def add(store: Store, seen: Iterable[Seen], retention_s: float | None = None) -> None:
    """Index conversations just written: every index touched in one ``zadd_many``; a sort
    column whose score this worker wrote last time is left out (``_Indexed``)."""
    seen = list(seen)
    written: list[tuple[Seen, float]] = []
    memory, now = _indexed.of(store), time.time()
    trusted = trusted_for(TRUSTED_S, retention_s)
    scores: dict[str, dict[str, float]] = {}

    def put(key: str, name: str, score: float) -> None:
        values = scores.setdefault(key, {})
        values[name] = max(score, values.get(name, score))

    for s in seen:
        name = member(s.tenant, s.conversation)
        for key in (SEEN, by_tenant(s.tenant), by_model(s.model)):
            put(key, name, s.last_seen)
        put(TENANTS, s.tenant, s.last_seen)
        put(MODELS, s.model, s.last_seen)
        since, known = memory.known(s, trusted, now)
        written.append((s, since))
        for column, value in s.scores.items():
            if known.get(column) != value:
                scores.setdefault(by_sort(column), {})[name] = value  # the newest row's figure
        if s.previous_model is not None and s.previous_model != s.model:
            store.zrem(by_model(s.previous_model), [name])
    try:
        store.zadd_many(scores)
    except BaseException:  # written in part or not at all: each is written whole next time
        memory.forget(member(s.tenant, s.conversation) for s in seen)
        raise
    memory.remember(written)


def remove(store: Store, tenant: str, conversation: str, model: str) -> None:
    """Take a conversation whose row was deleted out of the indexes."""
    name = member(tenant, conversation)
    _indexed.of(store).forget([name])
    for key in (SEEN, by_tenant(tenant), by_model(model), *map(by_sort, SORTED)):
        store.zrem(key, [name])


def sweep(store: Store, cutoff: float) -> None:
    """Drop what was last seen before ``cutoff``: its rows have expired. Three reads when
    nothing is that old (the usual case)."""
    old = [name for name, _ in store.zrange(SEEN, 0, SWEEP_BATCH, max_score=cutoff)]
    if old:
        store.zrem(SEEN, old)
        tenants: dict[str, list[str]] = {}
        for name in old:
            tenants.setdefault(split_member(name)[0], []).append(name)
        for tenant, names in tenants.items():
            store.zrem(by_tenant(tenant), names)
        for model, _ in store.zrange(MODELS):
            store.zrem(by_model(model), old)
        for column in SORTED:
            store.zrem(by_sort(column), old)
    if len(old) < SWEEP_BATCH:  # every old member is gone: the menus may lose their entries
        for key in (TENANTS, MODELS):
            gone = [name for name, _ in store.zrange(key, 0, SWEEP_BATCH, max_score=cutoff)]
            if gone:
                store.zrem(key, gone)
