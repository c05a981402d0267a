"""The operators' JSON API under ``/admin/api/``, ``/metrics``, and the admin-token check.

Read side only (and the operator's pause switch): the queries live in ``queries`` (totals,
the conversations list) and ``details`` (one conversation); nothing on the request path
depends on them.

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
from collections.abc import Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.adapters.store import Store
from proxy.core.errors import BadRequest, NotFound, StoreError, Unauthorized
from proxy.operators import reindex
from proxy.operators.details import conversation_detail, histories, set_paused
from proxy.operators.netmetrics import ledger_exposition
from proxy.operators.queries import conversation_id, list_conversations, resolve, stats

COOKIE_NAME = "compaction_proxy_admin"
_NO_STORE = {"cache-control": "no-store"}

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
    queued ledger writes (so a request that was answered is always counted) and, once per
    store, the build of the indexes the queries read (``reindex``)."""
    require_admin(request)
    res = request.app.state.res
    await res.compactor.writer.flush()

    def run() -> T:
        reindex.ensure(res.store, res.config.retention_s)
        return fn(*args, **kwargs)

    return await asyncio.to_thread(run)


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
    # The queued ledger writes first: a traced request's spans go to the exporter when the
    # writer has priced it, so the spans-dropped counter below includes every answered request.
    await res.compactor.writer.flush()
    body, content_type = await asyncio.to_thread(res.metrics.render)
    try:
        data = await asyncio.to_thread(stats, res.store, 1)
        totals = data["totals"]
        body = ledger_exposition(totals, data["headline"]["phantom"] is not None) + body
    except StoreError:
        pass  # the counters still answer while the store is down (store_up says so)
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
