"""``/dashboard``: the operators' page, server-rendered by the proxy (DESIGN §8).

Plain HTML from package templates (``templates/``) with its CSS and one small script
(auto-refresh) inlined from ``static/``: no CDN, nothing fetched from elsewhere, so it works
offline. Every value that came from a client (messages, model names, conversation ids) is
HTML-escaped, and a strict Content-Security-Policy allows only the page's own nonce-tagged
script.

Pages: the overview (``overview_page``) and a conversation (``conversation_page``). With
``admin.token`` set, both need the token: a login form sets an HttpOnly cookie, or send
``Authorization: Bearer``. This module holds the routes, the login and the data loading.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from proxy.core.errors import NotFound
from proxy.operators import admin, details, queries, reindex
from proxy.operators.conversation_page import conversation_body
from proxy.operators.html import REFRESH_MS, esc, page, render, short
from proxy.operators.overview_page import CHART_HOURS, PER_PAGE, overview_body

COOKIE_MAX_AGE = 7 * 86400


def refresh_ms(request: Request) -> int:
    """Auto-refresh period: ``?refresh=SECONDS`` (1 to 3600), else every 10 s."""
    try:
        seconds = float(request.query_params.get("refresh") or REFRESH_MS / 1000)
    except ValueError:
        seconds = REFRESH_MS / 1000
    return int(min(max(seconds, 1.0), 3600.0) * 1000)


# ---- login -------------------------------------------------------------------------------


def _safe_next(target: str | None) -> str:
    if target and target.startswith("/dashboard") and not target.startswith("//"):
        return target
    return "/dashboard"


def login_page(next_url: str, error: str = "", status: int = 401) -> HTMLResponse:
    message = f'<p class="error-text">{esc(error)}</p>' if error else ""
    body = render("login", message=message, next=esc(_safe_next(next_url)))
    return page("Login", body, logout=False, status=status)


def _gate(request: Request) -> HTMLResponse | None:
    """None when the request may see the dashboard; else the login page (401)."""
    token = request.app.state.res.config.admin.token
    if admin.is_authorized(request, token):
        return None
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return login_page(target)


async def login_form(request: Request) -> Response:
    if not request.app.state.res.config.admin.token:
        return RedirectResponse("/dashboard", status_code=303)
    return login_page(request.query_params.get("next") or "/dashboard", status=200)


async def login_submit(request: Request) -> Response:
    token = request.app.state.res.config.admin.token
    raw = await request.body()
    fields = parse_qs(raw[:8192].decode("utf-8", "replace"))
    next_url = _safe_next((fields.get("next") or [""])[0])
    if not token:
        return RedirectResponse(next_url, status_code=303)
    given = (fields.get("token") or [""])[0]
    if not secrets.compare_digest(given.encode(), token.encode()):
        return login_page(next_url, "That is not the admin token.")
    response = RedirectResponse(next_url, status_code=303)
    response.set_cookie(
        admin.COOKIE_NAME,
        admin.session_cookie_value(token),
        max_age=COOKIE_MAX_AGE,
        path="/",
        httponly=True,
        secure=request.url.scheme == "https",
        samesite="strict",
    )
    return response


async def logout(request: Request) -> Response:
    response = RedirectResponse("/dashboard/login", status_code=303)
    response.delete_cookie(admin.COOKIE_NAME, path="/")
    return response


# ---- pages -------------------------------------------------------------------------------


def _logout_shown(request: Request) -> bool:
    return bool(request.app.state.res.config.admin.token)


async def overview(request: Request) -> Response:
    refused = _gate(request)
    if refused is not None:
        return refused
    q = request.query_params
    sort, order = q.get("sort") or "last_seen", q.get("order") or "desc"
    params = {
        "tenant": q.get("tenant") or "",
        "model": q.get("model") or "",
        "sort": sort if sort in queries.SORT_KEYS else "last_seen",
        "order": order if order in ("asc", "desc") else "desc",
    }
    try:
        page_no = max(1, int(q.get("page") or 1))
    except ValueError:
        page_no = 1
    store = request.app.state.res.store

    retention = request.app.state.res.config.retention_s

    def load() -> tuple[dict[str, Any], dict[str, Any]]:
        reindex.ensure(store, retention)
        data = queries.stats(store, hours=CHART_HOURS)
        listing = queries.list_conversations(
            store,
            tenant=params["tenant"] or None,
            model=params["model"] or None,
            sort=params["sort"],
            order=params["order"],
            page=page_no,
            per_page=PER_PAGE,
        )
        return data, listing

    await request.app.state.res.compactor.writer.flush()
    data, listing = await asyncio.to_thread(load)
    body = overview_body(data, listing, params)
    return page("Overview", body, logout=_logout_shown(request), refresh=refresh_ms(request))


async def conversation(request: Request) -> Response:
    refused = _gate(request)
    if refused is not None:
        return refused
    res = request.app.state.res

    def load() -> tuple[dict[str, Any], dict[str, Any]]:
        reindex.ensure(res.store, res.config.retention_s)
        tenant, conv = queries.resolve(res.store, request.path_params["id"])
        detail = details.conversation_detail(res.store, tenant, conv)
        return detail, details.histories(res.store, res.compactor.counter, tenant, conv)

    try:
        await res.compactor.writer.flush()
        detail, hist = await asyncio.to_thread(load)
    except NotFound as exc:
        body = f'<h1>Not found</h1><p class="mute">{esc(exc)}</p>'
        return page("Not found", body, logout=_logout_shown(request), status=404)
    title = f"Conversation {short(detail['conversation'], 12)}"
    body = conversation_body(detail, hist)
    return page(title, body, logout=_logout_shown(request), refresh=refresh_ms(request))


def routes() -> list[Route]:
    """``/dashboard`` and its pages; add them before any catch-all route."""
    return [
        Route("/dashboard", overview, methods=["GET"]),
        Route("/dashboard/", overview, methods=["GET"]),
        Route("/dashboard/login", login_form, methods=["GET"]),
        Route("/dashboard/login", login_submit, methods=["POST"]),
        Route("/dashboard/logout", logout, methods=["POST"]),
        Route("/dashboard/conversations/{id:path}", conversation, methods=["GET"]),
    ]
