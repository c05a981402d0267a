"""The chat routes' upstream request and its answer, without httpx's objects on the h1 path.

``Forwarder.request`` builds an ``UpstreamRequest``: the method, the URL, every header pair
in the order httpx would send them (``Host`` first, ``Content-Length`` last), the body and
the client's timeouts, exactly what ``AsyncClient.build_request`` would build
(``tests/test_forward_request.py``). The ``h1`` transport writes those bytes as they are; the
other transports get the ``httpx.Request`` (``UpstreamRequest.httpx``, built on demand, as is
each error's ``request``). The answer is a ``Reply``: its status, its headers as
``httpx.Headers`` reads them (``items`` lowercased, a repeated name's values joined), its body
as it arrives (``chunks``, decoded as ``aiter_bytes`` decodes it) or whole (``aread``), and
``aclose``. Why: httpx's request, response, headers and body-stream objects cost ~50 us of
CPU a request around two socket calls (docs/benchmarks.md, #28).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol

import httpx


class UpstreamRequest:
    """One request to the upstream, as ``AsyncClient.build_request`` would build it."""

    __slots__ = ("method", "url", "pairs", "content", "timeout", "_built")

    def __init__(
        self,
        method: str,
        url: httpx.URL,
        pairs: list[tuple[bytes, bytes]],
        content: bytes,
        timeout: dict[str, Any],
        built: httpx.Request | None = None,
    ) -> None:
        self.method = method
        self.url = url
        self.pairs = pairs  # every header, in the order sent (``Headers.raw``'s)
        self.content = content
        self.timeout = timeout  # the client's (``Timeout.as_dict``)
        self._built = built

    def httpx(self) -> httpx.Request:
        """The same request as httpx's object (for the other transports, and errors)."""
        if self._built is None:
            request = httpx.Request(
                self.method,
                self.url,
                headers=self.pairs,
                stream=httpx.ByteStream(self.content),
                extensions={"timeout": self.timeout},
            )
            request.read()  # its content known, as for a body given as ``content``
            self._built = request
        return self._built

    def head(self) -> bytes:
        """The request line and headers, as written on the wire."""
        return wire_head(self.method, self.url, self.pairs)


def wire_head(method: str, url: httpx.URL, pairs: list[tuple[bytes, bytes]]) -> bytes:
    """An HTTP/1.1 request's line and headers: each pair as given, in order."""
    head = bytearray(method.encode("ascii"))
    head += b" " + url.raw_path + b" HTTP/1.1\r\n"
    for name, value in pairs:
        head += name + b": " + value + b"\r\n"
    head += b"\r\n"
    return bytes(head)


class Reply(Protocol):
    """An upstream's answer, its body still to read (then ``aclose``)."""

    @property
    def status_code(self) -> int: ...
    @property
    def headers(self) -> Any: ...  # ``items``, ``get`` and ``in`` as ``httpx.Headers``
    def chunks(self) -> AsyncIterator[bytes]: ...
    async def aread(self) -> bytes: ...
    async def aclose(self, ended: bool = False) -> None: ...


class HttpxReply:
    """An ``httpx.Response`` as a ``Reply`` (the ``aiohttp`` and ``httpx`` transports)."""

    __slots__ = ("response",)

    def __init__(self, response: httpx.Response) -> None:
        self.response = response

    @property
    def status_code(self) -> int:
        return self.response.status_code

    @property
    def headers(self) -> httpx.Headers:
        return self.response.headers

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, decoded (``aiter_bytes``). One with no
        ``Content-Encoding`` is read straight from the transport, without httpx's
        per-response decoder and chunker set-up (~30 us a request)."""
        if "content-encoding" in self.response.headers:
            return self.response.aiter_bytes()
        return _raw(self.response)

    async def aread(self) -> bytes:
        return await self.response.aread()

    async def aclose(self, ended: bool = False) -> None:
        await self.response.aclose()


async def _raw(response: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in response.stream:  # type: ignore[union-attr]
            yield chunk
    except httpx.HTTPError as exc:
        exc.request = response.request  # as ``Response.aiter_raw`` attaches it
        raise


class RawHeaders:
    """An answer's header pairs read as ``httpx.Headers`` reads them (what the relay uses):
    names compared lowercased, a repeated name's values joined by ``", "``, bytes decoded
    as ASCII, else UTF-8, else Latin-1 (httpx's ``Headers.encoding``)."""

    __slots__ = ("raw", "_merged")

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw
        self._merged: dict[str, str] | None = None

    def _values(self) -> dict[str, str]:
        if self._merged is None:
            encoding = _encoding(self.raw)
            merged: dict[str, str] = {}
            for name, value in self.raw:
                key, text = name.lower().decode(encoding), value.decode(encoding)
                merged[key] = f"{merged[key]}, {text}" if key in merged else text
            self._merged = merged
        return self._merged

    def items(self) -> Iterator[tuple[str, str]]:
        return iter(self._values().items())

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._values().get(name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._values()


def _encoding(raw: list[tuple[bytes, bytes]]) -> str:
    for encoding in ("ascii", "utf-8"):
        try:
            for name, value in raw:
                name.decode(encoding)
                value.decode(encoding)
        except UnicodeDecodeError:
            continue
        return encoding
    return "iso-8859-1"


def httpx_of(request: httpx.Request | UpstreamRequest) -> httpx.Request:
    """The request an httpx error carries."""
    return request if isinstance(request, httpx.Request) else request.httpx()
