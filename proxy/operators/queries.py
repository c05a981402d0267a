"""The operators' read queries: totals and the hourly series, the conversations list, and
finding a conversation by id. Synchronous store reads, shared by the admin API (which runs
them in a thread), the dashboard and ``compaction-proxy stats``.

A conversation's id here is ``{tenant}:{conversation}`` (the tenant is a hash of the client's
credential, never the key); a bare conversation id is looked up across tenants.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from proxy.adapters.store import Store
from proxy.core.errors import BadRequest, NotFound
from proxy.core.records import conv_key
from proxy.operators import index
from proxy.operators.figures import derive
from proxy.operators.ledger import TOTALS_KEY
from proxy.operators.phantom import phantom

SORT_KEYS = frozenset(
    {
        "last_seen", "first_seen", "requests", "messages", "original_tokens",
        "forwarded_tokens", "saved_tokens", "saved_pct", "saved_usd", "net_saved_usd",
        "compactions", "cached_tokens", "model", "tenant",
    }
)  # fmt: skip
MAX_PER_PAGE = 500
MAX_HOURS = 24 * 31
_TENANT_ID = re.compile(r"^([0-9a-f]{32}):(.+)$", re.S)


def conversation_id(tenant: str, conversation: str) -> str:
    return f"{tenant}:{conversation}"


def _hour_key(ts: float) -> str:
    return time.strftime("%Y%m%d%H", time.gmtime(ts))


def stats(store: Store, hours: int = 48, now: float | None = None) -> dict[str, Any]:
    """Totals (with compactions, % saved, cache-hit rate) and an hourly series, oldest first.

    Every hour of the window is present (zeros when nothing happened), so charts are even.
    """
    now = time.time() if now is None else now
    hours = max(1, min(hours, MAX_HOURS))
    raw = store.get(TOTALS_KEY)
    totals = derive(raw if isinstance(raw, dict) else {})
    # Counted on write (ledger): compactions, failed attempts, and the loss reports summed
    # (facts of replaced spans still forwarded, and facts lost).
    for key in ("compactions", "compaction_failures", "facts_kept", "facts_dropped", "healed"):
        totals.setdefault(key, 0)
    totals["conversations"] = store.zcard(index.SEEN)
    totals["tenants"] = store.zcard(index.TENANTS)
    start = int(now // 3600 - hours + 1) * 3600
    series = []
    for i in range(hours):
        ts = start + i * 3600
        key = _hour_key(ts)
        entry = store.get(f"hour:{key}")
        row = derive(entry if isinstance(entry, dict) else {})
        row.setdefault("compactions", 0)
        row.update(hour=key, ts=ts)
        series.append(row)
    return {"headline": headline(totals), "totals": totals, "hourly": series, "generated_at": now}


def headline(totals: dict[str, Any]) -> dict[str, Any]:
    """What every operators' view leads with: net dollars saved (after cache misses, cache
    writes and the detector/summarizer calls), then the gross figure, the requests kept
    within the context window (not savings), and the phantom-savings message if any."""
    return {
        "net_saved_usd": totals["net_saved_usd"],
        "gross_saved_usd": totals["saved_usd"],
        "kept_within_window": totals["kept_within_window"],
        "phantom": phantom(totals),
    }


def _row(store: Store, name: str) -> dict[str, Any] | None:
    """A conversation's row in the list, or None when its row has expired."""
    tenant, conv = index.split_member(name)
    meta = store.get(conv_key("conv", tenant, conv))
    if not isinstance(meta, dict):
        return None
    row = derive(meta)
    row.update(
        id=conversation_id(tenant, conv),
        tenant=tenant,
        conversation=conv,
        compactions=int(meta.get("compactions") or 0),
        failures=int(meta.get("compaction_failures") or 0),
    )
    return row


def _sort_key(sort: str) -> Callable[[dict[str, Any]], tuple[int, Any]]:
    def key(row: dict[str, Any]) -> tuple[int, Any]:
        value = row.get(sort)
        if isinstance(value, int | float):
            return (0, value)
        return (1, str(value or ""))

    return key


def _indexed_page(
    store: Store,
    keys: list[str],
    tenant: bool,
    model: bool,
    sort: str,
    desc: bool,
    start: int,
    per_page: int,
) -> tuple[int, list[str]] | None:
    """The total and one page of members when an index answers the query, else None.

    ``keys`` are the newest-first indexes of the filter's scope (one, unless a tenant prefix
    or a model name's case matches several)."""

    def page_of(key: str) -> tuple[int, list[str]]:
        names = [name for name, _ in store.zrange(key, start, per_page, desc=desc)]
        return store.zcard(key), names

    if sort == "last_seen" and len(keys) == 1 and not (tenant and model):
        return page_of(keys[0])
    if tenant or model:
        return None
    if sort in index.SORTED:
        return page_of(index.by_sort(sort))
    # By tenant or model: each one's newest-first index in turn, in name order.
    menu: str = index.TENANTS
    group: Callable[[str], str] = index.by_tenant
    if sort == "model":
        menu, group = (index.MODELS, index.by_model)
    groups = sorted((name for name, _ in store.zrange(menu)), reverse=desc)
    names: list[str] = []
    total, skip = 0, start
    for name in groups:
        n = store.zcard(group(name))
        total += n
        if len(names) < per_page and skip < n:
            got = store.zrange(group(name), skip, per_page - len(names), desc=True)
            names += [member for member, _ in got]
        skip = max(skip - n, 0)
    return total, names


def list_conversations(
    store: Store,
    *,
    tenant: str | None = None,
    model: str | None = None,
    sort: str = "last_seen",
    order: str = "desc",
    page: int = 1,
    per_page: int = 50,
) -> dict[str, Any]:
    """One page of conversations, filtered by tenant (or a prefix of at least 4 characters
    of its hash) and model (exact, case-insensitive), sorted by ``sort``.

    ``tenants`` and ``models`` list every value present, for filter menus. Newest first (the
    dashboard's default), filtered by one tenant or one model or not at all, reads one page
    of an index and one row per item listed, and so does any sort of the unfiltered list; a
    sort other than newest first of a filtered list reads every row in the filter's scope
    (never the whole store).
    """
    if sort not in SORT_KEYS:
        raise BadRequest(f"sort: must be one of {sorted(SORT_KEYS)}")
    if order not in ("asc", "desc"):
        raise BadRequest("order: must be 'asc' or 'desc'")
    page, per_page = max(page, 1), max(1, min(per_page, MAX_PER_PAGE))
    tenants = sorted(name for name, _ in store.zrange(index.TENANTS))
    models = sorted(name for name, _ in store.zrange(index.MODELS))
    keys = [index.SEEN]
    if tenant:
        keys = [
            index.by_tenant(t)
            for t in tenants
            if t == tenant or (len(tenant) >= 4 and t.startswith(tenant))
        ]
    if model:
        by_model = [index.by_model(m) for m in models if m.lower() == model.lower()]
        keys = by_model if not tenant else keys
    start, desc = (page - 1) * per_page, order == "desc"
    found = _indexed_page(store, keys, bool(tenant), bool(model), sort, desc, start, per_page)
    if found is not None:
        total, names = found
        items = [r for r in (_row(store, name) for name in names) if r is not None]
    else:
        names = sorted({name for key in keys for name, _ in store.zrange(key)})
        rows = [r for r in (_row(store, name) for name in names) if r is not None]
        if model:
            rows = [r for r in rows if str(r.get("model") or "").lower() == model.lower()]
        rows.sort(key=_sort_key(sort), reverse=desc)
        total, items = len(rows), rows[start : start + per_page]
    return {
        "items": items,
        "total": total,
        "page": page,
        "per_page": per_page,
        "sort": sort,
        "order": order,
        "tenants": tenants,
        "models": models,
    }


def resolve(store: Store, raw_id: str) -> tuple[str, str]:
    """``(tenant, conversation)`` for ``tenant:conversation``, or for a bare conversation id
    (the most recently seen one, if several tenants have it). Raises ``NotFound``."""
    match = _TENANT_ID.match(raw_id)
    if match and store.get(conv_key("conv", match.group(1), match.group(2))) is not None:
        return match.group(1), match.group(2)
    best: tuple[float, str, str] | None = None
    for tenant, _ in store.zrange(index.TENANTS):  # a few tenants, not every conversation
        meta = store.get(conv_key("conv", tenant, raw_id))
        if not isinstance(meta, dict):
            continue
        seen = float(meta.get("last_seen") or 0)
        if best is None or seen > best[0]:
            best = (seen, tenant, raw_id)
    if best is None:
        raise NotFound(f"no conversation {raw_id!r}")
    return best[1], best[2]
