"""A session's first ledger row joins the session (one dashboard row per session).

A session's first request is recorded under the id it had before its first reply
(``fingerprint.conversation_id``); when its second request names the session, that row is
merged into the session's own and goes (``ledger.record_batch`` asks, per conversation).

Every request after a session's first reply names its earlier id, so each flush asked the
store whether the session's row exists: a read per conversation and flush (~1 % of a
worker's CPU under 200 conversations, #28). A worker that has found the row remembers it
(``KNOWN_S``, or half the retention: a row lives at least its retention after its last
write) and asks again only after that.
"""

from __future__ import annotations

import time
from typing import Any

from proxy.adapters.store import Store, after_commit, get_list
from proxy.core.recent import Recent
from proxy.core.records import conv_key
from proxy.operators import history, index, reqlog
from proxy.operators.perstore import PerStore, trusted_for

KNOWN_S = 600.0  # a row this worker found is taken to exist this long (or retention / 2)
REMEMBERED = 4096  # conversations whose row a worker remembers finding


# Conversations whose row this worker found, with when.
_known: PerStore[Recent[tuple[str, str], float]] = PerStore(lambda: Recent(REMEMBERED))


def adopt(
    store: Store, tenant: str, earlier: str, conversation: str, retention_s: float | None
) -> bool:
    """A session's first request was recorded under the id it had before its first reply:
    when its second request names the session for the first time, that row becomes this
    session's (one dashboard row per session). Sessions whose first requests were identical
    share that first row; the first of them to continue takes it. True when it took it."""
    known, now = _known.of(store), time.time()
    found = known.get((tenant, conversation))
    if found is not None and now - found < trusted_for(KNOWN_S, retention_s):
        return False
    current = store.get(conv_key("conv", tenant, conversation))
    if isinstance(current, dict) and current.get("requests"):
        known.put((tenant, conversation), now)
        return False  # this session's row exists already
    old = store.get(conv_key("conv", tenant, earlier))
    if not isinstance(old, dict):
        return False

    def merge(meta: Any) -> dict[str, Any]:
        # A compaction may have been charged to the new id before its first request landed.
        merged = {**old, "conversation": conversation}
        for key, value in (meta if isinstance(meta, dict) else {}).items():
            before = merged.get(key)
            if isinstance(value, int | float) and isinstance(before, int | float):
                merged[key] = before + value
            elif isinstance(value, dict) and isinstance(before, dict):
                merged[key] = {**before, **value}
            else:
                merged[key] = value
        return merged

    merged = store.update(conv_key("conv", tenant, conversation), merge, retention_s)
    rows = reqlog.read(store, tenant, earlier, old.get("requests"))
    rows = [{**r, "conversation": conversation} for r in rows]
    reqlog.append(store, tenant, conversation, rows, merged.get("requests", 0), retention_s)
    events = get_list(store, conv_key("ev", tenant, earlier))
    if events:
        store.extend(conv_key("ev", tenant, conversation), events, retention_s, 500)
    # The row goes (its lists expire with their retention).
    store.delete(conv_key("conv", tenant, earlier))
    history.delete(store, tenant, earlier)
    # Out of the indexes once the batch is committed (a rolled-back one keeps the row).
    model = str(old.get("model") or "")
    after_commit(store, lambda: index.remove(store, tenant, earlier, model))
    return True
