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
from proxy.operators.ledger import TOTALS_KEY

SORT_KEYS = frozenset(
    {
        "last_seen", "first_seen", "requests", "messages", "original_tokens",
        "forwarded_tokens", "saved_tokens", "saved_pct", "saved_usd", "compactions",
        "cached_tokens", "model", "tenant",
    }
)  # fmt: skip
MAX_PER_PAGE = 500
MAX_HOURS = 24 * 31
_TENANT_ID = re.compile(r"^([0-9a-f]{32}):(.+)$", re.S)


def conversation_id(tenant: str, conversation: str) -> str:
    return f"{tenant}:{conversation}"


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def derive(totals: dict[str, Any]) -> dict[str, Any]:
    """Percentages from the raw sums: % saved (of original tokens) and cache-hit rate."""
    out = dict(totals)
    for key in (
        "requests", "original_tokens", "forwarded_tokens", "saved_tokens", "prompt_tokens",
        "cached_tokens", "cache_write_tokens", "completion_tokens", "errors", "cancelled",
        "unpriced_requests",
    ):  # fmt: skip
        out.setdefault(key, 0)
    out.setdefault("saved_usd", 0.0)
    out["saved_pct"] = round(100 * _ratio(out["saved_tokens"], out["original_tokens"]), 2)
    out["cache_hit_rate"] = round(_ratio(out["cached_tokens"], out["prompt_tokens"]), 4)
    if "counterfactual_usd" in out:
        # Net of cache misses, cache writes and detector/summarizer calls (ledger.net_usd).
        out["net_saved_usd"] = (
            out["counterfactual_usd"] - out.get("actual_usd", 0.0) - out.get("llm_usd", 0.0)
        )
    shadow = out.get("shadow")
    if isinstance(shadow, dict):
        # Shadow mode: what compaction would have saved; its detector/summarizer calls were
        # really made, so they are charged against it.
        shadow = {k: v for k, v in shadow.items() if not k.startswith("last_")}
        shadow.setdefault("saved_tokens", 0)
        shadow["saved_pct"] = round(
            100 * _ratio(shadow["saved_tokens"], shadow.get("original_tokens", 0)), 2
        )
        if "counterfactual_usd" in shadow:
            shadow["net_saved_usd"] = (
                shadow["counterfactual_usd"]
                - shadow.get("actual_usd", 0.0)
                - out.get("llm_usd", 0.0)
            )
        out["shadow"] = shadow
    return out


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
    for key in ("compactions", "compaction_failures", "facts_kept", "facts_dropped"):
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
    return {"totals": totals, "hourly": series, "generated_at": now}


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
    of an index and one row per item listed; other sorts and both filters at once read every
    row in the filter's scope (never the whole store).
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
    start = (page - 1) * per_page
    if sort == "last_seen" and len(keys) == 1 and not (tenant and model):
        total = store.zcard(keys[0])
        members = store.zrange(keys[0], start, per_page, desc=order == "desc")
        items = [r for r in (_row(store, name) for name, _ in members) if r is not None]
    else:
        names = {name for key in keys for name, _ in store.zrange(key)}
        rows = [r for r in (_row(store, name) for name in sorted(names)) if r is not None]
        if model:
            rows = [r for r in rows if str(r.get("model") or "").lower() == model.lower()]
        rows.sort(key=_sort_key(sort), reverse=order == "desc")
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
