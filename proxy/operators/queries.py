"""The operators' read queries: totals and the hourly series, the conversations list, and
finding a conversation by id. Synchronous store reads, shared by the admin API (which runs
them in a thread), the dashboard and ``compaction-proxy stats``.

A conversation's id here is ``{tenant}:{conversation}`` (the tenant is a hash of the client's
credential, never the key); a bare conversation id is looked up across tenants.
"""

from __future__ import annotations

import re
import time
from typing import Any

from proxy.adapters.store import Store
from proxy.core.errors import BadRequest, NotFound
from proxy.core.records import conv_key
from proxy.core.types import CompactionEvent
from proxy.operators.events import read_events, split
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


def _scan(store: Store) -> tuple[list[dict[str, Any]], list[CompactionEvent]]:
    """Every conversation's meta (with its compaction count) and every compaction event."""
    conversations: list[dict[str, Any]] = []
    events: list[CompactionEvent] = []
    for key in store.keys("conv:"):
        meta = store.get(key)
        if not isinstance(meta, dict):
            continue
        tenant, _, conv = key[len("conv:") :].partition(":")
        tenant = str(meta.get("tenant") or tenant)
        conv = str(meta.get("conversation") or conv)
        done, failed = split(read_events(store, tenant, conv))
        events.extend(done)
        row = derive(meta)
        row.update(
            id=conversation_id(tenant, conv),
            tenant=tenant,
            conversation=conv,
            compactions=len(done),
            failures=len(failed),
        )
        conversations.append(row)
    return conversations, events


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
    conversations, events = _scan(store)
    totals["compactions"] = len(events)
    totals["conversations"] = len(conversations)
    totals["tenants"] = len({c["tenant"] for c in conversations})
    totals["compaction_failures"] = sum(c["failures"] for c in conversations)
    # The loss reports, summed: facts of replaced spans still forwarded, and facts lost.
    totals["facts_kept"] = sum(e["facts_kept"] for e in events)
    totals["facts_dropped"] = sum(e["facts_dropped"] for e in events)
    by_hour: dict[str, int] = {}
    for event in events:
        by_hour[_hour_key(event["ts"])] = by_hour.get(_hour_key(event["ts"]), 0) + 1
    start = int(now // 3600 - hours + 1) * 3600
    series = []
    for i in range(hours):
        ts = start + i * 3600
        key = _hour_key(ts)
        entry = store.get(f"hour:{key}")
        row = derive(entry if isinstance(entry, dict) else {})
        row.update(hour=key, ts=ts, compactions=by_hour.get(key, 0))
        series.append(row)
    return {"totals": totals, "hourly": series, "generated_at": now}


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

    ``tenants`` and ``models`` list every value present, for filter menus.
    """
    if sort not in SORT_KEYS:
        raise BadRequest(f"sort: must be one of {sorted(SORT_KEYS)}")
    if order not in ("asc", "desc"):
        raise BadRequest("order: must be 'asc' or 'desc'")
    page, per_page = max(page, 1), max(1, min(per_page, MAX_PER_PAGE))
    rows, _ = _scan(store)
    tenants = sorted({r["tenant"] for r in rows})
    models = sorted({str(r.get("model") or "") for r in rows})
    if tenant:
        rows = [
            r
            for r in rows
            if r["tenant"] == tenant or (len(tenant) >= 4 and r["tenant"].startswith(tenant))
        ]
    if model:
        rows = [r for r in rows if str(r.get("model") or "").lower() == model.lower()]

    def sort_key(row: dict[str, Any]) -> tuple[int, Any]:
        value = row.get(sort)
        if isinstance(value, int | float):
            return (0, value)
        return (1, str(value or ""))

    rows.sort(key=sort_key, reverse=order == "desc")
    start = (page - 1) * per_page
    return {
        "items": rows[start : start + per_page],
        "total": len(rows),
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
    for key in store.keys("conv:"):
        tenant, _, conv = key[len("conv:") :].partition(":")
        if conv != raw_id:
            continue
        meta = store.get(key)
        seen = float(meta.get("last_seen", 0)) if isinstance(meta, dict) else 0.0
        if best is None or seen > best[0]:
            best = (seen, tenant, conv)
    if best is None:
        raise NotFound(f"no conversation {raw_id!r}")
    return best[1], best[2]
