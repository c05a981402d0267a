"""Errors in the route's own shape, mapped in one place (the app's exception handlers).

A ``ProxyError`` becomes the error JSON the route's clients parse (Anthropic's on
``/v1/messages``, OpenAI's elsewhere) with ``x-should-retry``; every 4xx the proxy answers
itself is logged and counted by route and reason, never by content.
"""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from proxy.core.errors import ProxyError, StoreError
from proxy.core.surfaces import (
    ANTHROPIC_MESSAGES,
    OPENAI_CHAT,
    OPENAI_RESPONSES,
    anthropic_error,
    openai_error,
)
from proxy.engine.service import record_rejection

log = logging.getLogger("compaction_proxy.server")

_ROUTE_LABELS = {s.path: s.name for s in (OPENAI_CHAT, ANTHROPIC_MESSAGES, OPENAI_RESPONSES)}


def error_response(exc: ProxyError, path: str = "") -> JSONResponse:
    """The error in the shape the route's clients parse (Anthropic's on /v1/messages)."""
    shape = anthropic_error if path == ANTHROPIC_MESSAGES.path else openai_error
    retry = exc.retry if exc.retry is not None else exc.status >= 500
    headers = {"x-should-retry": "true" if retry else "false"}
    return JSONResponse(
        shape(str(exc), exc.type, exc.code), status_code=exc.status, headers=headers
    )


def route_label(path: str, known: bool = True) -> str:
    """A bounded label for a request path (client paths never become metric labels)."""
    if path in _ROUTE_LABELS:
        return _ROUTE_LABELS[path]
    if not known:
        return "unknown"
    if path.startswith(("/admin", "/dashboard", "/metrics")):
        return "admin"
    return "passthrough" if path.startswith("/v1/") else "other"


def rejected(request: Request, status: int, reason: str, known: bool = True) -> None:
    """Log and count one 4xx the proxy answered itself (route and reason, never content)."""
    metrics = getattr(getattr(request.app.state, "res", None), "metrics", None)
    route = route_label(request.url.path, known)
    record_rejection(log, metrics, route, status, reason, method=request.method)


async def proxy_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ProxyError)
    if exc.status >= 500:
        log.warning("upstream failure", extra={"error": str(exc), "status": exc.status})
    else:
        rejected(request, exc.status, exc.code or exc.type)
    return error_response(exc, request.url.path)


async def store_error(request: Request, exc: Exception) -> Response:
    """The store failed under an operator's read (the request path fails open on its own)."""
    log.error("store unavailable", extra={"error": str(exc), "path": request.url.path})
    return JSONResponse(
        openai_error(
            "the proxy's store is unavailable; its data cannot be shown until it is fixed "
            "(requests are still forwarded, uncompacted)",
            "server_error",
            "store_unavailable",
        ),
        status_code=503,
        headers={"retry-after": "10"},
    )


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    no_retry = {"x-should-retry": "false"}
    if exc.status_code == 404:
        rejected(request, 404, "not_found", known=False)
        message = f"unknown route: {request.method} {request.url.path}"
        return JSONResponse(
            openai_error(message, "invalid_request_error", "not_found"),
            status_code=404,
            headers=no_retry,
        )
    if exc.status_code == 405:
        rejected(request, 405, "method_not_allowed")
        message = f"method {request.method} not allowed on {request.url.path}"
        return JSONResponse(
            openai_error(message, "invalid_request_error", "method_not_allowed"),
            status_code=405,
            headers=no_retry,
        )
    if exc.status_code < 500:
        rejected(request, exc.status_code, "http_error")
    return JSONResponse(
        openai_error(str(exc.detail), "invalid_request_error", None),
        status_code=exc.status_code,
        headers=no_retry if exc.status_code < 500 else None,
    )


async def unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error", exc_info=exc)
    return JSONResponse(
        openai_error("internal proxy error", "server_error", "internal_error"), status_code=500
    )


# The app's exception handlers, most specific first.
HANDLERS = {
    ProxyError: proxy_error,
    StoreError: store_error,
    HTTPException: http_error,
    Exception: unexpected,
}
