"""An httpx transport over aiohttp's connection pool (``upstream.transport: aiohttp``).

The proxy keeps httpx as its client interface everywhere (requests, responses, streams,
exceptions); only the wire underneath changes. aiohttp's pool and HTTP/1.1 parser cost less
CPU per request than httpcore's (docs/benchmarks.md: 0.2-0.8 ms less per forwarded
request on the benchmark machine), the largest single part of what the proxy adds to a small
request.

What stays as with httpx's own transport, on purpose:

- the URL goes out exactly as built (``encoded=True``: no re-normalising of the path that
  ``forward.upstream_url`` checked);
- headers are the request's, and aiohttp adds none of its own (no default User-Agent,
  Accept or Content-Type); values that are UTF-8 go out as the same bytes;
- per-read and connect timeouts come from the request's httpx timeout; a whole-request
  deadline stays ``forward.mapped_errors``'s business;
- aiohttp's exceptions become httpx's (connect errors ``ConnectError`` with the OS error
  kept as the cause, timeouts ``ConnectTimeout``/``ReadTimeout``, a connection broken
  mid-answer ``ReadError``/``RemoteProtocolError``), so ``mapped_errors`` maps them the same;
- no cookies are kept (``forward.no_cookie_jar``);
- closing a response before its end closes its connection: a client that goes away cancels
  the upstream request rather than returning a half-read connection to the pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import aiohttp
import httpx
from yarl import URL

# aiohttp would otherwise add its own values for these when the request has none.
NO_AUTO_HEADERS = ("user-agent", "accept", "accept-encoding", "content-type")
CHUNK = 64 * 1024


@contextlib.contextmanager
def httpx_errors(request: httpx.Request) -> Iterator[None]:
    """aiohttp's exceptions as httpx's (the original kept as ``__cause__``)."""
    try:
        yield
    except httpx.HTTPError:
        raise
    except aiohttp.ConnectionTimeoutError as exc:  # before ServerTimeoutError: a subclass
        raise httpx.ConnectTimeout(str(exc) or "connect timeout", request=request) from exc
    except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise httpx.ReadTimeout(str(exc) or "read timeout", request=request) from exc
    except aiohttp.ClientConnectorError as exc:
        # The OS error (refused, DNS) is what proxy.reach.classify reads.
        raise httpx.ConnectError(str(exc), request=request) from exc.os_error
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
        raise httpx.RemoteProtocolError(str(exc) or type(exc).__name__, request=request) from exc
    except aiohttp.ClientResponseError as exc:  # a malformed response
        raise httpx.RemoteProtocolError(str(exc), request=request) from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise httpx.ReadError(str(exc) or type(exc).__name__, request=request) from exc


def _header_text(value: bytes) -> str:
    # aiohttp writes header values as UTF-8: a UTF-8 value goes out as the bytes it came in.
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value.decode("latin-1")


class _Body(httpx.AsyncByteStream):
    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with httpx_errors(self._request):
            # As the bytes arrive (an SSE event is relayed as soon as it is complete).
            async for chunk in self._response.content.iter_chunked(CHUNK):
                yield chunk

    async def aclose(self) -> None:
        if self._response.content.at_eof():
            self._response.release()  # whole: the connection goes back to the pool
        else:
            self._response.close()  # cut short: the connection (and upstream work) ends


class AiohttpTransport(httpx.AsyncBaseTransport):
    """One ``aiohttp.ClientSession`` (created on first use, inside the running loop)."""

    def __init__(self, limits: httpx.Limits) -> None:
        self._limits = limits
        self._session: aiohttp.ClientSession | None = None
        self._ssl = httpx.create_ssl_context()  # the CA bundle httpx would use

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self._limits.max_connections or 0,
                limit_per_host=0,
                keepalive_timeout=self._limits.keepalive_expiry or 30,
                ssl=self._ssl,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                skip_auto_headers=NO_AUTO_HEADERS,
                auto_decompress=False,  # httpx decodes, as with its own transport
                trust_env=False,
                cookie_jar=aiohttp.DummyCookieJar(),  # shared by every tenant: keeps none
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        session = self._open()
        timeout = request.extensions.get("timeout", {})
        try:
            data: bytes | None = request.content
        except httpx.RequestNotRead:
            data = await request.aread()
        headers = [(k.decode("latin-1"), _header_text(v)) for k, v in request.headers.raw]
        url = request.url
        if url.userinfo:
            # httpx already turned any user:password@ in the URL into an Authorization
            # header; aiohttp refuses both at once (a ValueError, so a 500), so it gets the
            # URL without them.
            url = url.copy_with(username=None, password=None)
        with httpx_errors(request):
            response = await session.request(
                request.method,
                URL(str(url), encoded=True),
                headers=headers,
                data=data or None,
                allow_redirects=False,
                compress=None,
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=timeout.get("pool"),
                    sock_connect=timeout.get("connect"),
                    sock_read=timeout.get("read"),
                ),
            )
        return httpx.Response(
            status_code=response.status,
            headers=response.raw_headers,
            stream=_Body(response, request),
            request=request,
            extensions={
                "http_version": b"HTTP/1.1",
                "reason_phrase": (response.reason or "").encode("latin-1", "replace"),
            },
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
