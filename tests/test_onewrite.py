"""A response's head and body leave in one write, and nothing is lost or reordered (#28).

``OneWriteTransport`` sits between uvicorn's protocol and the socket: it holds a response head
until the next write, which it joins, or until the event loop's turn ends. Checked here on a
transport that records its writes, and end to end on the proxy's own server in front of the
strict upstream: the openai client gets whole and streamed answers, and a raw HTTP/1.1
client gets two framed answers on one kept-alive connection.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import openai
import orjson

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


def _answer(sock: socket.socket, buffered: bytes) -> tuple[bytes, bytes, bytes]:
    """One whole answer read off a kept-alive connection by its Content-Length: its head, its
    body and what was read past it."""
    while b"\r\n\r\n" not in buffered:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before the head ended: {buffered!r}"
        buffered += chunk
    head, _, rest = buffered.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )  # fmt: skip
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed before the body ended"
        rest += chunk
    return head, rest[:length], rest[length:]


def test_the_server_answers_whole_and_streamed_answers_and_keeps_the_connection(
    tmp_path: Any,
) -> None:
    with ScriptedUpstream() as upstream, ProxyProcess(tmp_path, upstream.base_url) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="sk-onewrite", max_retries=0)
        messages: Any = [{"role": "user", "content": "hello"}]
        for _ in range(2):
            whole = client.chat.completions.create(model="gpt-4o-mini", messages=messages)
            assert whole.choices[0].message.role == "assistant"
            chunks = list(
                client.chat.completions.create(model="gpt-4o-mini", messages=messages, stream=True)
            )
            assert chunks and any(c.choices and c.choices[0].delta.content for c in chunks)
        # Two requests on one raw connection: each answer's head is joined to its own body,
        # never held back into the next one, and framed by the length it names.
        body = b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}'
        request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"authorization: Bearer sk-onewrite\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as sock:
            left = b""
            for _ in range(2):
                sock.sendall(request)
                head, answer, left = _answer(sock, left)
                assert head.startswith(b"HTTP/1.1 200"), head
                assert orjson.loads(answer)["choices"][0]["message"]["role"] == "assistant"
                assert left == b""
