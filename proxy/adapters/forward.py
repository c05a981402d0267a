"""Forwarding to the upstream over one pooled httpx client (the only place httpx is imported
for the request path). Exceptions from the wire are mapped once, here, to our tree."""

from __future__ import annotations

import functools
import http.cookiejar
import logging
from collections.abc import Iterable, Mapping
from types import TracebackType
from urllib.parse import unquote

import httpx

from proxy.adapters.aiotransport import AiohttpTransport
from proxy.adapters.deadline import Deadline
from proxy.adapters.h1 import H1Transport
from proxy.adapters.reach import classify, safe_url
from proxy.adapters.upstreamcall import HttpxReply, RawHeaders, Reply, UpstreamRequest
from proxy.config import Upstream
from proxy.core.errors import BadRequest, UpstreamTimeout, UpstreamUnavailable, UpstreamUnreachable

log = logging.getLogger("compaction_proxy.forward")

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
# Our own request controls: they steer the proxy and are not the upstream's business. Any
# ``x-compaction-*`` header goes too: ``x-compaction-purpose`` marks the proxy's own calls,
# and a client must not be able to pass for them.
OWN_REQUEST_HEADERS = frozenset({"x-compaction", "x-conversation-id"})
OWN_PREFIX = "x-compaction-"
# What a client says about itself or the path it came by: the upstream hears about the
# proxy's hop from the proxy (if at all), never a client's claim; and the dashboard's session
# cookie (or any other) is nobody's business upstream.
CLIENT_CLAIMS = frozenset({"forwarded", "via", "cookie", "x-real-ip"})
CLAIM_PREFIX = "x-forwarded-"
# Every header a provider reads a key from: all replaced when a key is configured.
CREDENTIAL_HEADERS = frozenset({"authorization", "x-api-key", "api-key", "x-goog-api-key"})
# Headers that frame a request: named by the caller, httpx builds the request itself.
_FRAMING = frozenset({b"host", b"content-length", b"transfer-encoding"})


def _limits(upstream: Upstream) -> httpx.Limits:
    return httpx.Limits(
        max_connections=upstream.max_connections,
        max_keepalive_connections=min(upstream.max_connections, 128),
        keepalive_expiry=30,
    )


def make_transport(upstream: Upstream) -> httpx.AsyncBaseTransport:
    """The wire per ``upstream.transport``: aiohttp's pool (``proxy.aiotransport``) or
    httpx's own, built as ``httpx.AsyncClient`` would build it for ``make_client``."""
    if upstream.transport == "h1":
        return H1Transport(_limits(upstream))
    if upstream.transport == "aiohttp":
        return AiohttpTransport(_limits(upstream))
    return httpx.AsyncHTTPTransport(limits=_limits(upstream), http2=False, trust_env=False)


def make_client(
    upstream: Upstream, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """One pooled HTTP/1.1 client for the proxy's lifetime over ``transport`` (by default
    ``make_transport``'s; tests pass their own)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(upstream.timeout_s, connect=upstream.connect_timeout_s),
        limits=_limits(upstream),
        transport=transport if transport is not None else make_transport(upstream),
        http2=False,
        trust_env=False,
        cookies=no_cookie_jar(),
    )


class Forwarder:
    """The chat routes' way upstream: the client's transport, called directly.

    ``AsyncClient.send`` wraps every request in layers these routes never use: auth (none),
    redirect following (off: a redirect is relayed), a cookie jar that keeps nothing, event
    hooks, timers. They cost ~35 us a request, a tenth of what the proxy adds to a small one
    (docs/benchmarks.md, #16). Requests are built as ``AsyncClient.build_request`` builds
    them (the client's default headers under the request's own, the client's timeouts), and
    errors carry their request as the client's would, so ``mapped_errors`` names the URL.
    Over the ``h1`` transport neither is an httpx object (``upstreamcall``, #28).
    """

    def __init__(self, client: httpx.AsyncClient, transport: httpx.AsyncBaseTransport) -> None:
        self.client = client
        self._transport = transport
        self._h1 = transport if isinstance(transport, H1Transport) else None
        self._defaults = client.headers
        self._timeout = client.timeout.as_dict()

    def request(
        self,
        method: str,
        url: httpx.URL,
        content: bytes,
        headers: list[tuple[bytes, bytes]],
    ) -> UpstreamRequest:
        """The request as ``AsyncClient.build_request`` builds it: the client's default
        headers (those ``headers`` does not name) first, then ``headers``."""
        names = {name.lower() for name, _ in headers}
        merged = [pair for pair in self._defaults.raw if pair[0].lower() not in names]
        merged += headers
        if not content or not names.isdisjoint(_FRAMING):
            built = httpx.Request(
                method, url, content=content, headers=merged, extensions={"timeout": self._timeout}
            )
            return UpstreamRequest(
                method, url, built.headers.raw, built.content, self._timeout, built
            )
        # What httpx's own encoding adds to a body of bytes (``Host`` first, ``Content-Length``
        # last): the same request, without httpx deriving and re-checking them
        # (test_forward_request).
        merged = [(b"Host", url.netloc), *merged, (b"Content-Length", b"%d" % len(content))]
        return UpstreamRequest(method, url, merged, content, self._timeout)

    async def send(self, request: UpstreamRequest) -> Reply:
        """The answer with its body still to read (``chunks``, then ``aclose``); errors are
        httpx's, carrying their request as the client's would."""
        if self._h1 is not None:
            return await self._h1.exchange(request)  # (its errors name their request)
        built = request.httpx()
        try:
            response = await self._transport.handle_async_request(built)
        except httpx.HTTPError as exc:
            exc.request = built
            raise
        response.request = built
        return HttpxReply(response)


def no_cookie_jar() -> http.cookiejar.CookieJar:
    """A jar that keeps nothing. The one client serves every tenant: a cookie an upstream
    sets on one client's answer (relayed to that client) must not go upstream with the next
    request, whoever's it is, as clients' own cookies do not (``CLIENT_CLAIMS``)."""
    return http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))


@functools.lru_cache(maxsize=256)  # pure; the chat routes ask the same every request
def upstream_root(base_url: str, query: str) -> httpx.URL:
    """The provider's own root for the proxy's ``/``: the base URL without its ``/v1``
    (``https://api.openai.com/v1`` -> ``https://api.openai.com/``), else the base itself.
    Clients probe it (Claude Code sends ``HEAD /``) to see whether the endpoint answers."""
    base = httpx.URL(base_url.rstrip("/"))
    path = base.path[: -len("/v1")] if base.path.endswith("/v1") else base.path
    return base.copy_with(path=path.rstrip("/") + "/", query=query.encode() or None)


def upstream_url(base_url: str, path: str, query: str) -> httpx.URL:
    """Map ``/v1/<rest>`` on the proxy to ``<base_url>/<rest>`` upstream.

    Parsed once (an ``httpx.URL``, immutable): given a string, ``build_request`` parsed it
    again on every request (~18 us of its ~35).

    ``path`` is the path as the client sent it (still percent-encoded, ASGI ``raw_path``):
    a dot segment (``..``, ``%2e%2e``, ``..%2f``) could climb out of the base's path once
    the upstream decodes it, so it is refused with a 400 (``check_path``), and the final URL
    is checked to lie under the base.
    """
    rest = path[3:] if path.startswith("/v1") else path
    check_path(rest)
    base = httpx.URL(base_url.rstrip("/"))
    url = base_url.rstrip("/") + rest
    target = httpx.URL(url)
    # httpx removes dot segments as it parses: whatever it sends must be exactly the base's
    # path plus the client's, on the base's host.
    expected = base.raw_path.rstrip(b"/") + rest.encode()
    if target.raw_path != expected or target.netloc != base.netloc:
        raise BadRequest("request path does not map to a path under the upstream base URL")
    return httpx.URL(f"{url}?{query}" if query else url)


def check_path(path: str) -> None:
    """Refuse a path that could climb out of the base (``BadRequest``).

    Encoded slashes stay allowed as data (the official clients send ``org%2Fmodel`` for a
    model named ``org/model``) and are relayed encoded; but the path is also read as a server
    that decodes them would read it - every percent-decoding, ``/`` and ``\\`` as separators -
    and a ``.`` or ``..`` segment in any reading is refused.
    """
    if any(ord(c) < 0x21 or ord(c) > 0x7E for c in path):
        raise BadRequest("request path must be percent-encoded ASCII")
    reading = path
    for _ in range(3):  # as sent, decoded once, decoded twice
        for segment in reading.replace("\\", "/").split("/"):
            if segment in (".", ".."):
                raise BadRequest("request path must not contain dot segments ('.' or '..')")
        decoded = unquote(reading)
        if decoded == reading:
            break
        reading = decoded


def request_headers(
    client_headers: Iterable[tuple[bytes, bytes]],
    api_key: str | None,
    *,
    drop: frozenset[str] = frozenset(),
    key_header: str = "authorization",
) -> httpx.Headers:
    """``upstream_pairs`` as ``httpx.Headers``."""
    return httpx.Headers(upstream_pairs(client_headers, api_key, drop=drop, key_header=key_header))


def upstream_pairs(
    client_headers: Iterable[tuple[bytes, bytes]],
    api_key: str | None,
    *,
    drop: frozenset[str] = frozenset(),
    key_header: str = "authorization",
) -> list[tuple[bytes, bytes]]:
    """What goes upstream of the client's headers (ASGI raw bytes): not hop-by-hop ones or
    those the ``Connection`` header names, not our own controls, not the client's claims
    about its route or its cookies; with a configured key, none of the client's credentials
    but the key, as ``Authorization: Bearer`` or (Anthropic's API) ``x-api-key``.

    Values are relayed as the bytes the client sent: a header that is not ASCII is never
    decoded and re-encoded (which is where a 500 came from). Plain pairs, not
    ``httpx.Headers``: the chat routes build their request's headers in one list (#28).
    """
    pairs = [(name.lower(), value) for name, value in client_headers]
    named = {
        token.strip().decode("latin-1")
        for name, value in pairs
        if name == b"connection"
        for token in value.lower().split(b",")
    }
    out: list[tuple[bytes, bytes]] = []
    for raw_name, value in pairs:
        name = raw_name.decode("latin-1")
        if (
            name in HOP_BY_HOP
            or name in named
            or name in OWN_REQUEST_HEADERS
            or name.startswith(OWN_PREFIX)
            or name in CLIENT_CLAIMS
            or name.startswith(CLAIM_PREFIX)
            or name in drop
            or (api_key and name in CREDENTIAL_HEADERS)
        ):
            continue
        out.append((raw_name, value))
    if api_key:
        set_pair(out, key_header, api_key if key_header == "x-api-key" else f"Bearer {api_key}")
    return out


def set_pair(pairs: list[tuple[bytes, bytes]], name: str, value: str) -> None:
    """``httpx.Headers.__setitem__`` on plain pairs: the first ``name`` (any case) takes the
    value in its place and the others go; else it is added last."""
    key = name.lower().encode("latin-1")
    found = [i for i, (n, _) in enumerate(pairs) if n.lower() == key]
    for i in reversed(found[1:]):
        del pairs[i]
    pair = (name.encode("latin-1"), value.encode("latin-1"))
    if found:
        pairs[found[0]] = pair
    else:
        pairs.append(pair)


def response_headers(
    headers: Mapping[str, str] | httpx.Headers | RawHeaders, *, drop: frozenset[str] = frozenset()
) -> dict[str, str]:
    """Upstream response headers minus hop-by-hop ones (and any named in ``drop``)."""
    return {
        k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP and k.lower() not in drop
    }


class mapped_errors:  # (lower case: used as ``async with mapped_errors(...)``, as before)
    """Translate httpx's exceptions to ``UpstreamTimeout`` / ``UpstreamUnavailable`` /
    ``UpstreamUnreachable``; each wire error names the upstream URL (without credentials).

    ``deadline_s`` bounds the whole block (httpx's read timeout bounds each read only, so an
    upstream dripping bytes would never time out a non-streaming request), within
    ``deadline.TICK_S``. A class, not a generator over ``asyncio.timeout``: this wraps every
    request, and the two cost ~7 us of it (#28)."""

    __slots__ = ("_deadline_s", "_deadline")

    def __init__(self, deadline_s: float | None = None) -> None:
        self._deadline_s = deadline_s
        self._deadline = Deadline(deadline_s)  # (None: none, and nothing registered)

    async def __aenter__(self) -> None:
        await self._deadline.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        try:
            await self._deadline.__aexit__(exc_type, exc, tb)
        except TimeoutError as timed_out:
            exc = timed_out
        if isinstance(exc, TimeoutError):
            raise UpstreamTimeout(
                f"upstream did not answer within {self._deadline_s or 0:g} s"
            ) from exc
        if isinstance(exc, httpx.HTTPError):
            url = _url_of(exc)
            found = classify(exc, url)
            if isinstance(exc, httpx.TimeoutException):
                raise UpstreamTimeout(
                    f"upstream {safe_url(url)} timed out ({type(exc).__name__})"
                ) from exc
            kind = UpstreamUnreachable if found.permanent else UpstreamUnavailable
            raise kind(f"upstream {safe_url(url)} unreachable: {found.reason}") from exc
        return False


def _url_of(exc: httpx.HTTPError) -> str:
    try:
        return str(exc.request.url)
    except RuntimeError:  # an error raised without a request attached
        return "<unknown url>"
