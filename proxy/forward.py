"""Forwarding to the upstream over one pooled httpx client (the only place httpx is imported
for the request path). Exceptions from the wire are mapped once, here, to our tree."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable, Mapping

import httpx

from .config import Upstream
from .errors import UpstreamTimeout, UpstreamUnavailable

# RFC 9110 §7.6.1 hop-by-hop headers, plus ones httpx or the server recompute.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
# Our own request controls: they steer the proxy and are not the upstream's business.
OWN_REQUEST_HEADERS = frozenset({"x-compaction", "x-conversation-id", "x-compaction-tenant"})


def make_client(
    upstream: Upstream, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """One pooled HTTP/1.1 client for the proxy's lifetime."""
    timeout = httpx.Timeout(upstream.timeout_s, connect=upstream.connect_timeout_s)
    limits = httpx.Limits(
        max_connections=upstream.max_connections,
        max_keepalive_connections=min(upstream.max_connections, 128),
        keepalive_expiry=30,
    )
    return httpx.AsyncClient(
        timeout=timeout, limits=limits, transport=transport, http2=False, trust_env=False
    )


def upstream_url(base_url: str, path: str, query: str) -> str:
    """Map ``/v1/<rest>`` on the proxy to ``<base_url>/<rest>`` upstream."""
    rest = path[3:] if path.startswith("/v1") else path
    url = base_url.rstrip("/") + rest
    return f"{url}?{query}" if query else url


def request_headers(
    client_headers: Iterable[tuple[str, str]],
    api_key: str | None,
    *,
    drop: frozenset[str] = frozenset(),
    key_header: str = "authorization",
) -> dict[str, str]:
    """The client's headers minus hop-by-hop and our own; the configured key if there is one,
    as ``Authorization: Bearer`` or (Anthropic's API) ``x-api-key``."""
    out: dict[str, str] = {}
    for name, value in client_headers:
        lower = name.lower()
        if lower in HOP_BY_HOP or lower in OWN_REQUEST_HEADERS or lower in drop:
            continue
        out[lower] = value
    if api_key:
        out.pop("x-api-key", None)
        out.pop("authorization", None)
        out[key_header] = api_key if key_header == "x-api-key" else f"Bearer {api_key}"
    return out


def response_headers(
    headers: Mapping[str, str] | httpx.Headers, *, drop: frozenset[str] = frozenset()
) -> dict[str, str]:
    """Upstream response headers minus hop-by-hop ones (and any named in ``drop``)."""
    return {
        k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP and k.lower() not in drop
    }


@contextlib.asynccontextmanager
async def mapped_errors() -> AsyncIterator[None]:
    """Translate httpx's exceptions to ``UpstreamTimeout`` / ``UpstreamUnavailable``."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise UpstreamTimeout(f"upstream timed out ({type(exc).__name__})") from exc
    except httpx.HTTPError as exc:
        raise UpstreamUnavailable(f"upstream unreachable ({type(exc).__name__})") from exc
