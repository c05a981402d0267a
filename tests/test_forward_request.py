"""``Forwarder.request`` builds the request ``AsyncClient.build_request`` would (#28).

For a body of bytes it gives the framing headers itself (``Host`` first, ``Content-Length``
last), which is cheaper than letting httpx derive them; the request must stay the same in
every byte a transport reads: method, URL, each header pair in order, the body, the
timeouts, both as the ``h1`` transport writes it (``UpstreamRequest.head``, no httpx object)
and as httpx's request the other transports get (``UpstreamRequest.httpx``). Checked against
httpx's own build on fixed and generated header lists, bodies and URLs (default and explicit
ports).
"""

from __future__ import annotations

import asyncio

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.adapters.forward import Forwarder

URLS = (
    "http://127.0.0.1:8000/v1/chat/completions",
    "https://api.openai.com/v1/chat/completions?x=1",
    "http://upstream.internal/v1/messages",
)


def same(url: str, content: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(200))
    c = httpx.AsyncClient(timeout=httpx.Timeout(30, connect=5), transport=transport)
    forwarder = Forwarder(c, transport)
    call = forwarder.request("POST", httpx.URL(url), content, headers)
    theirs = c.build_request("POST", httpx.URL(url), content=content, headers=headers)
    # What the h1 transport writes: the request line and httpx's header pairs, then the body.
    wire = b"POST " + theirs.url.raw_path + b" HTTP/1.1\r\n"
    wire += b"".join(name + b": " + value + b"\r\n" for name, value in theirs.headers.raw)
    assert call.head() == wire + b"\r\n"
    assert call.content == theirs.content == content
    assert call.timeout == theirs.extensions["timeout"]
    ours = call.httpx()  # what the other transports get
    assert ours.method == theirs.method
    assert ours.url == theirs.url
    assert ours.headers.raw == theirs.headers.raw
    assert ours.content == theirs.content == content
    assert ours.extensions["timeout"] == theirs.extensions["timeout"]
    asyncio.run(c.aclose())


def test_a_chat_request_is_built_as_httpx_builds_it() -> None:
    headers = [
        (b"authorization", b"Bearer sk-test"),
        (b"content-type", b"application/json"),
        (b"User-Agent", b"OpenAI/Python 1.50"),  # replaces the client's default
        (b"x-custom", "é".encode()),
    ]
    for url in URLS:
        same(url, b'{"model": "gpt-4o-mini"}', headers)
        same(url, b'{"model": "gpt-4o-mini"}', [])


def test_framing_headers_given_by_the_caller_and_empty_bodies_are_httpx_s_to_build() -> None:
    same(URLS[0], b"{}", [(b"Host", b"elsewhere.example")])
    same(URLS[0], b"{}", [(b"content-length", b"2")])
    same(URLS[0], b"", [(b"authorization", b"Bearer sk-test")])


NAME = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12).map(str.encode)
VALUE = st.binary(max_size=20).filter(lambda v: b"\r" not in v and b"\n" not in v)


@settings(max_examples=200, deadline=None)
@given(
    url=st.sampled_from(URLS),
    content=st.binary(max_size=200),
    headers=st.lists(st.tuples(NAME, VALUE), max_size=8),
)
def test_any_header_list_and_body_give_httpx_s_request(
    url: str, content: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    same(url, content, headers)
