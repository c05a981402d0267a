"""A response's head and body leave in one write, and nothing is lost or reordered (#28).

``OneWriteTransport`` sits between uvicorn's protocol and the socket: it holds a response head
until the next write, which it joins, or until the event loop's turn ends. Checked here on a
transport that records its writes, and end to end on the proxy's own server: a real client
gets whole answers, streamed or not, over one kept-alive connection.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx

from proxy.server.onewrite import OneWriteTransport
from tests.proxyproc import ProxyProcess
from tests.upstream import ScriptedUpstream

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


class Recording:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else default


async def test_a_head_and_its_body_go_in_one_write() -> None:
    real = Recording()
    t = OneWriteTransport(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(HEAD)
    assert real.writes == []
    t.write(b"ok")
    assert real.writes == [HEAD + b"ok"]
    t.write(b"more")  # not a head: straight through
    assert real.writes == [HEAD + b"ok", b"more"]
    await asyncio.sleep(0)  # the turn's end finds nothing held
    assert real.writes == [HEAD + b"ok", b"more"]
    assert t.get_extra_info("peername") == ("127.0.0.1", 1)  # the rest is the real one's


async def test_a_head_nothing_follows_goes_at_the_end_of_the_turn() -> None:
    real = Recording()
    t = OneWriteTransport(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(HEAD)
    await asyncio.sleep(0)
    assert real.writes == [HEAD]
    t.write(b"2\r\nok\r\n")  # a stream's first chunk, later: on its own
    assert real.writes == [HEAD, b"2\r\nok\r\n"]


async def test_close_sends_what_is_held_first_and_abort_drops_it() -> None:
    loop = asyncio.get_running_loop()
    real = Recording()
    t = OneWriteTransport(real, loop)  # type: ignore[arg-type]
    t.write(HEAD)
    t.close()
    assert real.writes == [HEAD] and real.closed
    await asyncio.sleep(0)
    assert real.writes == [HEAD]  # the scheduled flush finds it sent
    other = Recording()
    t = OneWriteTransport(other, loop)  # type: ignore[arg-type]
    t.write(HEAD)
    t.abort()
    await asyncio.sleep(0)
    assert other.writes == [] and other.aborted


async def test_a_body_that_looks_like_a_head_is_kept_in_order() -> None:
    real = Recording()
    t = OneWriteTransport(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(HEAD)
    t.write(b"HTTP/1.1 is what this body says")
    t.write(b"HTTP/1.0 so does the next write")
    t.write(b"tail")
    await asyncio.sleep(0)
    assert b"".join(real.writes) == (
        HEAD + b"HTTP/1.1 is what this body says" + b"HTTP/1.0 so does the next write" + b"tail"
    )


def test_the_server_answers_whole_and_streamed_on_one_connection(tmp_path: Any) -> None:
    with ScriptedUpstream() as upstream, ProxyProcess(tmp_path, upstream.base_url) as proxy:
        with httpx.Client(base_url=proxy.base_url, timeout=30) as client:
            for stream in (False, True, False, True):
                body = {
                    "model": "gpt-4o-mini",
                    "messages": [{"role": "user", "content": "hello"}],
                    "stream": stream,
                }
                key = {"authorization": "Bearer k"}
                r = client.post("/chat/completions", json=body, headers=key)
                assert r.status_code == 200, r.text
                if stream:
                    assert "data: [DONE]" in r.text
                else:
                    assert r.json()["choices"][0]["message"]["role"] == "assistant"
        # A raw HTTP/1.1 client: the head and the body, complete, with the length they name.
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            got = b""
            while chunk := sock.recv(65536):
                got += chunk
        head, _, rest = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )  # fmt: skip
        assert len(rest) == length
