"""``Forwarder.request`` builds the request ``AsyncClient.build_request`` would (#28).

For a body of bytes it gives httpx the framing headers itself (``Host`` first,
``Content-Length`` last) and the body as a stream, which is cheaper than letting httpx derive
them; the request must stay the same in every byte the transport reads: method, URL, each
header pair in order, the body, the timeouts. Checked against httpx's own build on fixed and
generated header lists, bodies and URLs (default and explicit ports).
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
    ours = forwarder.request("POST", httpx.URL(url), content, headers)
    theirs = c.build_request("POST", httpx.URL(url), content=content, headers=headers)
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
