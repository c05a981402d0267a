"""A client that stops sending its body half-way is answered 408 once ``limits.body_timeout_s``
has passed, in the route's own error shape, and nothing reaches the upstream (issue #29
item 3: every wait has a bound)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.proxyproc import ProxyProcess
from tests.rawupstream import RawUpstream


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ProxyProcess, RawUpstream]]:
    tmp = Path(tmp_path_factory.mktemp("body-timeout"))
    with RawUpstream() as upstream:
        with ProxyProcess(tmp, upstream.url("/v1"), limits={"body_timeout_s": 1}) as px:
            yield px, upstream


def half_a_body(port: int, path: str) -> tuple[int, dict[str, str], Any]:
    """Promise 1,000 bytes, send 10, wait for the answer (the proxy must not wait forever:
    the socket's own timeout is a backstop far beyond the bound under test)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            "content-length: 1000\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"model": ')
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/models"])
def test_a_body_that_stops_half_way_is_a_408(
    setup: tuple[ProxyProcess, RawUpstream], path: str
) -> None:
    px, upstream = setup
    before = len(upstream.seen)
    status, headers, answer = half_a_body(px.port, path)
    assert status == 408
    assert headers["x-should-retry"] == "true"  # nothing was forwarded: safe to send again
    if path == "/v1/messages":
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    else:
        assert answer["error"]["code"] == "request_timeout"
    assert len(upstream.seen) == before  # nothing was forwarded


def test_a_client_that_asks_to_continue_and_sends_nothing_is_a_408(
    setup: tuple[ProxyProcess, RawUpstream],
) -> None:
    """``Expect: 100-continue``: the proxy says continue when it reads the body; a client
    that then sends nothing is timed like one that stops half-way (the body is read without
    a timer only when it came whole with its head, #28)."""
    px, upstream = setup
    before = len(upstream.seen)
    with socket.create_connection(("127.0.0.1", px.port), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            b"\r\ncontent-length: 100\r\nexpect: 100-continue\r\n\r\n"
        )
        data = b""
        while b'"request_timeout"' not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    assert data.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 408 "), data[:80]
    assert len(upstream.seen) == before
