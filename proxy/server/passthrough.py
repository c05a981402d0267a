"""Every other ``/v1/*`` path and method, and the reachability probes (``GET``/``HEAD`` of
``/`` and ``/v1``): relayed unchanged (bar hop-by-hop headers). Traced when traces are on
(``proxy.engine.relayspans``): the upstream gets the ``traceparent`` of the relay's span."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from proxy.adapters.forward import (
    mapped_errors,
    request_headers,
    response_headers,
    upstream_root,
    upstream_url,
)
from proxy.core.fingerprint import tenant_id
from proxy.engine.chat import credential_of
from proxy.engine.relayspans import RelayTrace
from proxy.engine.service import Service
from proxy.operators import ledger
from proxy.server.abort import BodyBroken
from proxy.server.incoming import read_body
from proxy.server.relay import SERVER_SET

log = logging.getLogger("compaction_proxy.server")


def raw_path(request: Request) -> str:
    """The path as the client sent it, still percent-encoded (``/v1/%2e%2e`` stays so)."""
    raw = request.scope.get("raw_path")
    return raw.decode("latin-1") if isinstance(raw, bytes) else request.url.path


def is_client_compaction(request: Request) -> bool:
    """OpenAI's compaction endpoint: the client compacts its own history (relayed as is)."""
    return request.method == "POST" and request.url.path.rstrip("/").endswith("/responses/compact")


async def passthrough(request: Request) -> Response:
    """Relay the request and stream the answer back as its raw bytes."""
    service: Service = request.app.state.res
    if service.tracer is None:
        return await _relay(request, service, None)
    headers = request.headers
    tenant = tenant_id(credential_of(request), headers.get("x-compaction-tenant"))
    trace = service.tracer.relay(
        request.method, request.url.path, tenant, headers.get("traceparent"),
        headers.get("tracestate"),
    )  # fmt: skip
    try:
        return await _relay(request, service, trace)
    except BaseException as exc:  # answered by the error handlers (or the client left)
        if trace is not None:
            gone = isinstance(exc, asyncio.CancelledError)
            status = 499 if gone else getattr(exc, "status", 500)
            trace.finish(status, "client_closed" if gone else type(exc).__name__)
        raise


async def _relay(request: Request, service: Service, trace: RelayTrace | None) -> Response:
    client: httpx.AsyncClient = request.app.state.client
    config = service.config
    raw = await read_body(request, config.max_body_bytes)
    path = raw_path(request)
    if path == "/":
        url = upstream_root(config.upstream.base_url, request.url.query)
    else:
        url = upstream_url(config.upstream.base_url, path, request.url.query)
    headers = request_headers(request.scope["headers"], config.upstream.api_key)
    if trace is not None:
        trace.described(raw)
        headers.update(trace.upstream_headers())  # in place of the client's, in its trace
    upstream_request = client.build_request(request.method, url, content=raw, headers=headers)
    async with mapped_errors():
        upstream = await client.send(upstream_request, stream=True)
    if upstream.status_code < 400 and is_client_compaction(request):
        service.compactor.spawn_io(ledger.count_client_compaction, service.store)

    async def body() -> AsyncIterator[bytes]:
        error: str | None = "client_closed"  # unless the body ends (or breaks) below
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
            error = None
        except httpx.HTTPError as exc:
            error = type(exc).__name__
            log.warning("upstream passthrough broke", extra={"error": error})
            # Ending the body normally would tell the client it got everything: raising
            # makes the server drop the connection, which is what a broken upstream did.
            raise BodyBroken from exc
        finally:
            await upstream.aclose()
            if trace is not None:
                trace.finish(upstream.status_code, error)

    relayed = response_headers(upstream.headers, drop=SERVER_SET)
    length = upstream.headers.get("content-length")
    if length is not None and length.isdigit():
        # The raw bytes are relayed, so the upstream's length is ours; the client can tell
        # a short body from a whole one.
        relayed["content-length"] = length
    return StreamingResponse(body(), status_code=upstream.status_code, headers=relayed)
