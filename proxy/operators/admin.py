"""The operators' JSON API under ``/admin/api/``, ``/metrics``, and the admin-token check.

Read side only: everything here reads what the ledger (``conv:``, ``req:``, ``orig:``,
``totals``, ``hour:``) and the compactor (``ev:``, ``ck:``, ``rec:``) wrote; nothing on the
request path depends on it. The query functions are synchronous store reads (the endpoints
run them in a thread) and are shared with the dashboard and ``compaction-proxy stats``.

A conversation's id here is ``{tenant}:{conversation}`` (the tenant is a hash of the client's
credential, never the key); a bare conversation id is looked up across tenants.

The API and the dashboard always require the admin token (``admin.token``, or the one
``proxy.admintoken`` generates on first start), as ``Authorization: Bearer <token>`` or the
HttpOnly cookie the dashboard's login form sets; ``/metrics`` too unless
``admin.protect_metrics`` is false. A client's API key never opens them: the operator sees
every tenant, so no tenant does.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.adapters.store import Store, get_list
from proxy.core.errors import BadRequest, NotFound, Unauthorized
from proxy.core.fingerprint import fingerprints, prefix_chain
from proxy.core.records import (
    CompactionRecord,
    body_start,
    conv_key,
    find_checkpoint,
    parse_checkpoints,
    substitute,
)
from proxy.core.tokens import TokenCounter
from proxy.operators.ledger import TOTALS_KEY

COOKIE_NAME = "compaction_proxy_admin"
COMPACTION_CASES = frozenset({"summarize", "truncate", "emergency"})
FAILURE_CASES = frozenset({"failed", "detector_failed"})
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
_NO_STORE = {"cache-control": "no-store"}
KEY_REFERENCES = "\n\nKey references: "  # how proxy.keyfacts.guard appends lost facts

T = TypeVar("T")


# ---- auth --------------------------------------------------------------------------------


def session_cookie_value(token: str) -> str:
    """What the login cookie holds: derived from the token (not the token itself), so the
    cookie stops working as soon as the token changes."""
    return hmac.new(token.encode(), b"compaction-proxy admin session", hashlib.sha256).hexdigest()


def is_authorized(request: Request, token: str | None) -> bool:
    """True when no token is configured, or the request carries it (Bearer or cookie)."""
    if not token:
        return True
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer " and hmac.compare_digest(
        auth[7:].strip().encode(), token.encode()
    ):
        return True
    cookie = request.cookies.get(COOKIE_NAME, "")
    return bool(cookie) and hmac.compare_digest(
        cookie.encode(), session_cookie_value(token).encode()
    )


def require_admin(request: Request) -> None:
    """Raise ``Unauthorized`` (a 401 OpenAI-style error) unless the request may see admin data."""
    if not is_authorized(request, request.app.state.res.config.admin.token):
        raise Unauthorized("admin token required: send 'Authorization: Bearer <admin.token>'")


# ---- queries (synchronous store reads) ---------------------------------------------------


def conversation_id(tenant: str, conversation: str) -> str:
    return f"{tenant}:{conversation}"


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def _derive(totals: dict[str, Any]) -> dict[str, Any]:
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


def _scan(store: Store) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every conversation's meta (with its compaction count) and every compaction event."""
    conversations: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    for key in store.keys("conv:"):
        meta = store.get(key)
        if not isinstance(meta, dict):
            continue
        tenant, _, conv = key[len("conv:") :].partition(":")
        tenant = str(meta.get("tenant") or tenant)
        conv = str(meta.get("conversation") or conv)
        evs = [e for e in get_list(store, conv_key("ev", tenant, conv)) if isinstance(e, dict)]
        done = [e for e in evs if e.get("case") in COMPACTION_CASES]
        events.extend(done)
        row = _derive(meta)
        row.update(
            id=conversation_id(tenant, conv),
            tenant=tenant,
            conversation=conv,
            compactions=len(done),
            failures=sum(1 for e in evs if e.get("case") in FAILURE_CASES),
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
    totals = _derive(raw if isinstance(raw, dict) else {})
    conversations, events = _scan(store)
    totals["compactions"] = len(events)
    totals["conversations"] = len(conversations)
    totals["tenants"] = len({c["tenant"] for c in conversations})
    totals["compaction_failures"] = sum(c["failures"] for c in conversations)
    # The loss reports, summed: facts of replaced spans still forwarded, and facts lost.
    totals["facts_kept"] = sum(int(e.get("facts_kept") or 0) for e in events)
    totals["facts_dropped"] = sum(int(e.get("facts_dropped") or 0) for e in events)
    by_hour: dict[str, int] = {}
    for event in events:
        ts = event.get("ts")
        if isinstance(ts, int | float):
            by_hour[_hour_key(ts)] = by_hour.get(_hour_key(ts), 0) + 1
    start = int(now // 3600 - hours + 1) * 3600
    series = []
    for i in range(hours):
        ts = start + i * 3600
        key = _hour_key(ts)
        entry = store.get(f"hour:{key}")
        row = _derive(entry if isinstance(entry, dict) else {})
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


def _current_record(
    store: Store, tenant: str, conv: str, original: list[dict[str, Any]]
) -> CompactionRecord | None:
    """The record the proxy would apply to ``original`` now (the same lookup as the core)."""
    chain = prefix_chain(tenant, fingerprints(original))
    checkpoint = find_checkpoint(
        parse_checkpoints(get_list(store, conv_key("ck", tenant, conv))), chain
    )
    if checkpoint is None:
        return None
    record = CompactionRecord.from_json(
        store.get(conv_key("rec", tenant, conv) + ":" + checkpoint.prefix_hash)
    )
    if record is None or record.k != checkpoint.k or record.prefix_hash != checkpoint.prefix_hash:
        return None
    return record


def histories(store: Store, counter: TokenCounter, tenant: str, conv: str) -> dict[str, Any]:
    """The history the client last sent and what the proxy forwards for it now, side by side,
    with per-message token counts (counted as the proxy counts them)."""
    raw = store.get(conv_key("orig", tenant, conv))
    original: list[dict[str, Any]] = (
        [m for m in raw if isinstance(m, dict)] if isinstance(raw, list) else []
    )
    meta = store.get(conv_key("conv", tenant, conv))
    model = str(meta.get("model") or "") if isinstance(meta, dict) else ""
    record = _current_record(store, tenant, conv, original) if original else None
    forwarded = substitute(original, record) if record else list(original)

    def side(messages: list[dict[str, Any]]) -> dict[str, Any]:
        counts = counter.count_messages(messages, model, fingerprints(messages))
        return {
            "messages": messages,
            "tokens": counts,
            "total_tokens": sum(counts) + 3 if messages else 0,
            "count": len(messages),
        }

    return {
        "id": conversation_id(tenant, conv),
        "model": model,
        "original": side(original),
        "forwarded": side(forwarded),
        "record": None
        if record is None
        else {
            "k": record.k,
            "head_len": record.head_len,
            "has_summary": record.summary is not None,
            # Where the client's own tail begins in the forwarded list (after the head, pins,
            # the summary and pruned placeholders).
            "body_start": body_start(record),
            "case": record.case,
            "prefix_hash": record.prefix_hash,
        },
    }


def key_references(summary: str) -> list[str]:
    """The facts the key-facts guard appended to a summary (its ``Key references:`` line)."""
    at = summary.rfind(KEY_REFERENCES)
    if at < 0:
        return []
    return [f for f in summary[at + len(KEY_REFERENCES) :].strip().split("; ") if f]


def loss_report(
    summary: str | None,
    kept: list[str],
    dropped: list[str],
    elsewhere: list[str] | None = None,
) -> dict[str, Any]:
    """Key facts of the replaced span: kept by the summary in its own words, appended to it as
    key references, still in the rest of the forwarded context (head, pins, verbatim part),
    and dropped (found nowhere in what was forwarded when the compaction was made)."""
    text = summary or ""
    appended = key_references(text)
    return {
        "facts_kept": kept,
        "facts_appended": appended,
        "facts_elsewhere": list(elsewhere or []),
        "facts_dropped": [f for f in dropped if f not in text],
    }


def _compaction(store: Store, tenant: str, conv: str, event: dict[str, Any]) -> dict[str, Any]:
    record: dict[str, Any] = {}
    prefix_hash = event.get("prefix_hash")
    if isinstance(prefix_hash, str):
        raw = store.get(conv_key("rec", tenant, conv) + ":" + prefix_hash)
        record = raw if isinstance(raw, dict) else {}
    summary = record.get("summary")
    text = summary.get("content") if isinstance(summary, dict) else None
    return {
        "ts": event.get("ts"),
        "case": event.get("case"),
        "model": event.get("model"),
        "k": event.get("k"),
        "covered": event.get("covered"),
        "tokens_before": event.get("tokens_before"),
        "tokens_after": event.get("tokens_after"),
        "duration_s": event.get("duration_s"),
        "llm_tokens": event.get("llm_tokens"),
        "reason": event.get("reason"),
        "boundary_reason": record.get("boundary_reason", ""),
        "confidence": record.get("confidence", event.get("confidence")),
        "summary": text,
        "summary_role": summary.get("role") if isinstance(summary, dict) else None,
        **loss_report(
            text,
            list(record.get("facts_kept") or []),
            list(record.get("facts_dropped") or []),
            list(record.get("facts_elsewhere") or []),
        ),
        # Agent sessions: what pruning cleared, what stayed pinned, what was too large to pin.
        "pruned": list(record.get("pruned") or []),
        "pinned": list(record.get("pinned") or []),
        "unpinned": list(record.get("unpinned") or []),
        "record_available": bool(record),
        "prefix_hash": prefix_hash,
    }


def conversation_detail(store: Store, tenant: str, conv: str) -> dict[str, Any]:
    """A conversation's totals, its requests (original vs forwarded messages and tokens), its
    compactions with their summaries and loss reports (facts kept and dropped), and its
    failures. Raises ``NotFound``."""
    meta = store.get(conv_key("conv", tenant, conv))
    if not isinstance(meta, dict):
        raise NotFound(f"no conversation {conversation_id(tenant, conv)!r}")
    # Ledger writes run after each response and may land out of order: sort by time.
    requests = [r for r in get_list(store, conv_key("req", tenant, conv)) if isinstance(r, dict)]
    requests.sort(key=lambda r: r.get("ts") or 0)
    events = [e for e in get_list(store, conv_key("ev", tenant, conv)) if isinstance(e, dict)]
    events.sort(key=lambda e: e.get("ts") or 0)
    compactions = [
        _compaction(store, tenant, conv, e) for e in events if e.get("case") in COMPACTION_CASES
    ]
    failures = [
        {
            "ts": e.get("ts"),
            "case": e.get("case"),
            "error": e.get("error"),
            "soft": bool(e.get("soft")),
            "model": e.get("model"),
        }
        for e in events
        if e.get("case") in FAILURE_CASES
    ]
    summary = _derive(meta)
    summary.update(compactions=len(compactions), failures=len(failures))
    summary["paused"] = store.get(conv_key("pause", tenant, conv)) is not None
    return {
        "id": conversation_id(tenant, conv),
        "tenant": tenant,
        "conversation": conv,
        "meta": summary,
        "requests": [
            {
                k: r.get(k)
                for k in (
                    "ts",
                    "case",
                    "status",
                    "model",
                    "route",
                    "original_messages",
                    "forwarded_messages",
                    "original_tokens",
                    "forwarded_tokens",
                    "saved_tokens",
                    "prompt_tokens",
                    "cached_tokens",
                    "completion_tokens",
                    "latency_s",
                    "overhead_s",
                    "shadow",
                )
            }  # fmt: skip
            for r in requests
        ],
        "compactions": compactions,
        "failures": failures,
    }


# ---- endpoints ---------------------------------------------------------------------------


def _int_param(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise BadRequest(f"{name}: must be an integer") from exc


async def _read(request: Request, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Check the token, then run a store query off the event loop, after this worker's
    queued ledger writes (so a request that was answered is always counted)."""
    require_admin(request)
    await request.app.state.res.compactor.writer.flush()
    return await asyncio.to_thread(fn, *args, **kwargs)


def _store(request: Request) -> Store:
    store: Store = request.app.state.res.store
    return store


async def api_stats(request: Request) -> Response:
    data = await _read(request, stats, _store(request), _int_param(request, "hours", 48))
    return JSONResponse(data, headers=_NO_STORE)


async def api_conversations(request: Request) -> Response:
    q = request.query_params
    data = await _read(
        request,
        list_conversations,
        _store(request),
        tenant=q.get("tenant") or None,
        model=q.get("model") or None,
        sort=q.get("sort") or "last_seen",
        order=q.get("order") or "desc",
        page=_int_param(request, "page", 1),
        per_page=_int_param(request, "per_page", 50),
    )
    return JSONResponse(data, headers=_NO_STORE)


async def api_conversation(request: Request) -> Response:
    store = _store(request)
    tenant, conv = await _read(request, resolve, store, request.path_params["id"])
    data = await asyncio.to_thread(conversation_detail, store, tenant, conv)
    return JSONResponse(data, headers=_NO_STORE)


async def _histories(request: Request) -> dict[str, Any]:
    store = _store(request)
    tenant, conv = await _read(request, resolve, store, request.path_params["id"])
    counter = request.app.state.res.compactor.counter
    return await asyncio.to_thread(histories, store, counter, tenant, conv)


async def api_original(request: Request) -> Response:
    """The full history the client last sent, as sent (message for message)."""
    data = await _histories(request)
    side = data["original"]
    body = {"id": data["id"], "model": data["model"], **side}
    return JSONResponse(body, headers=_NO_STORE)


async def api_forwarded(request: Request) -> Response:
    """What the proxy forwards for that history now (the current compaction applied)."""
    data = await _histories(request)
    body = {"id": data["id"], "model": data["model"], "record": data["record"], **data["forwarded"]}
    return JSONResponse(body, headers=_NO_STORE)


def set_paused(store: Store, tenant: str, conv: str, paused: bool, ttl: float | None) -> None:
    """Pause (or resume) compaction of one conversation: its requests then pass as sent."""
    key = conv_key("pause", tenant, conv)
    if paused:
        store.set(key, time.time(), ttl)
    else:
        store.delete(key)

    def mark(meta: Any) -> Any:
        if isinstance(meta, dict):
            meta["paused"] = paused
        return meta

    store.update(conv_key("conv", tenant, conv), mark, ttl)


async def api_pause(request: Request) -> Response:
    """``POST .../{id}/pause`` or ``.../{id}/resume``: the operator's per-conversation opt-out."""
    store = _store(request)
    tenant, conv = await _read(request, resolve, store, request.path_params["id"])
    paused = request.url.path.endswith("/pause")
    ttl = request.app.state.res.config.retention_s
    await asyncio.to_thread(set_paused, store, tenant, conv, paused, ttl)
    return JSONResponse({"id": conversation_id(tenant, conv), "paused": paused}, headers=_NO_STORE)


async def metrics_endpoint(request: Request) -> Response:
    res = request.app.state.res
    if res.config.admin.protect_metrics:
        require_admin(request)
    if res.metrics is None:
        raise NotFound("metrics are not enabled")
    body, content_type = await asyncio.to_thread(res.metrics.render)
    return Response(body, media_type=content_type)


def routes() -> list[Route]:
    """``/metrics`` and ``/admin/api/*``; add them before any catch-all route."""
    base = "/admin/api/conversations"
    return [
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/admin/api/stats", api_stats, methods=["GET"]),
        Route(base, api_conversations, methods=["GET"]),
        Route(base + "/{id:path}/pause", api_pause, methods=["POST"]),
        Route(base + "/{id:path}/resume", api_pause, methods=["POST"]),
        Route(base + "/{id:path}/original", api_original, methods=["GET"]),
        Route(base + "/{id:path}/forwarded", api_forwarded, methods=["GET"]),
        Route(base + "/{id:path}", api_conversation, methods=["GET"]),
    ]
