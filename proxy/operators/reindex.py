"""Building the operators' indexes (``index``) for a store written before they existed.

``ensure`` runs at the first operator's read (API, dashboard, ``stats``): one ``get`` of the
``ix:built`` marker when the indexes exist. Otherwise it scans the store once - every
conversation row and its events, what every dashboard render used to cost - indexes every
conversation, and sets the event counters (failures, key facts, compactions per hour) from
the stored events. Those counts replace the running ones, which is right because the events
counted on write since the upgrade are in the stored lists too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from proxy.adapters.store import Store
from proxy.operators import index
from proxy.operators.events import read_events, split
from proxy.operators.ledger import TOTALS_KEY

log = logging.getLogger("compaction_proxy.index")

BUILT = "ix:built"
_BUILDING = "ix:building"
_BUILD_LOCK_S = 600


def ensure(store: Store, retention_s: float | None) -> None:
    """Build the indexes once for a store written before they existed (one ``get`` when
    they are built). Another process building them meanwhile: this read sees them partial."""
    if store.get(BUILT) is not None:
        return
    if not store.add(_BUILDING, time.time(), _BUILD_LOCK_S):
        return
    started = time.monotonic()
    n = rebuild(store, retention_s)
    store.set(BUILT, time.time())
    log.info(
        "operators' indexes built", extra={"conversations": n, "s": time.monotonic() - started}
    )


def rebuild(store: Store, retention_s: float | None) -> int:
    """Index every conversation and recount the event counters from the stored events (the
    counts replace the running ones: events recorded since are in the lists too). Returns
    the number of conversations."""
    seen: list[index.Seen] = []
    failures = kept = dropped = 0
    hours: dict[str, int] = {}
    for key in store.keys("conv:"):
        meta = store.get(key)
        if not isinstance(meta, dict):
            continue
        tenant, conv = index.split_member(key[len("conv:") :])
        tenant = str(meta.get("tenant") or tenant)
        conv = str(meta.get("conversation") or conv)
        last_seen = meta.get("last_seen") or meta.get("first_seen") or 0.0
        model = str(meta.get("model") or "")
        scores = index.sort_scores(meta)
        seen.append(index.Seen(tenant, conv, model, float(last_seen), None, scores))
        done, failed = split(read_events(store, tenant, conv))
        failures += len(failed)
        kept += sum(e["facts_kept"] for e in done)
        dropped += sum(e["facts_dropped"] for e in done)
        for event in done:
            hour = time.strftime("%Y%m%d%H", time.gmtime(event["ts"]))
            hours[hour] = hours.get(hour, 0) + 1
        if failed and meta.get("compaction_failures") != len(failed):
            store.update(key, _put(compaction_failures=len(failed)), retention_s)
    index.add(store, seen)
    totals = {"compaction_failures": failures, "facts_kept": kept, "facts_dropped": dropped}
    store.update(TOTALS_KEY, _put(**totals), None)
    for hour, n in hours.items():
        store.update(f"hour:{hour}", _put(hour=hour, compactions=n), retention_s)
    return len(seen)


def _put(**values: Any) -> Callable[[Any], dict[str, Any]]:
    """An update that sets ``values`` in a stored dict (a new one if there is none)."""

    def update(meta: Any) -> dict[str, Any]:
        out = meta if isinstance(meta, dict) else {}
        out.update(values)
        return out

    return update
