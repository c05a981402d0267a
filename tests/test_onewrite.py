"""What a response writes in one turn leaves in one write, nothing lost or reordered (#28).

``OneWriteTransport`` sits between uvicorn's protocol and the socket: it holds what is written
until the response is complete or the event loop's turn ends, and sends it in one write.
Checked here on a transport that records its writes, and end to end on the proxy's own
server in front of the strict upstream: the openai client gets whole and streamed answers,
and a raw HTTP/1.1 client gets two framed answers on one kept-alive connection.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import openai
import orjson

from proxy.server.onewrite import DIRECT_BYTES, OneWriteTransport
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


async def test_what_one_turn_writes_goes_in_one_write_at_its_end() -> None:
    real = Recording()
    t = OneWriteTransport(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(HEAD)
    t.write(b"ok")
    t.write(bytearray(b"more"))
    assert real.writes == []
    await asyncio.sleep(0)  # the turn's end
    assert real.writes == [HEAD + b"okmore"]
    t.write(b"2\r\nok\r\n")  # a stream's next chunk, a turn later: on its own
    await asyncio.sleep(0)
    assert real.writes == [HEAD + b"okmore", b"2\r\nok\r\n"]
    await asyncio.sleep(0)  # nothing held: nothing more sent
    assert len(real.writes) == 2
    assert t.get_extra_info("peername") == ("127.0.0.1", 1)  # the rest is the real one's


async def test_flush_sends_at_once_and_a_big_write_is_not_copied() -> None:
    real = Recording()
    t = OneWriteTransport(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(HEAD)
    t.write(b"ok")
    t.flush()  # what the protocol does when the response is complete
    assert real.writes == [HEAD + b"ok"]
    big = b"x" * DIRECT_BYTES
    t.write(HEAD)
    t.write(big)  # what is held goes first, then the big write as it is
    assert real.writes == [HEAD + b"ok", HEAD, big]
    assert real.writes[2] is big
    await asyncio.sleep(0)
    assert len(real.writes) == 3


async def test_close_sends_what_is_held_first_and_abort_drops_it() -> None:
    loop = asyncio.get_running_loop()
    real = Recording()
    t = OneWriteTransport(real, loop)  # type: ignore[arg-type]
    t.write(HEAD)
    t.write(b"ok")
    t.close()
    assert real.writes == [HEAD + b"ok"] and real.closed
    await asyncio.sleep(0)
    assert real.writes == [HEAD + b"ok"]  # the scheduled flush finds it sent
    other = Recording()
    t = OneWriteTransport(other, loop)  # type: ignore[arg-type]
    t.write(HEAD)
    t.abort()
    await asyncio.sleep(0)
    assert other.writes == [] and other.aborted
    closing = Recording()
    t = OneWriteTransport(closing, loop)  # type: ignore[arg-type]
    t.write(HEAD)
    closing.closed = True  # the connection went meanwhile: nothing is written to it
    await asyncio.sleep(0)
    assert closing.writes == []


async def test_writes_keep_their_order() -> None:
    real = Recording()
    t = OneWriteTransport(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(HEAD)
    t.write(b"HTTP/1.1 is what this body says")
    t.write(b"HTTP/1.0 so does the next write")
    t.write(b"y" * DIRECT_BYTES)
    t.write(b"tail")
    await asyncio.sleep(0)
    assert b"".join(real.writes) == (
        HEAD + b"HTTP/1.1 is what this body says" + b"HTTP/1.0 so does the next write"
        + b"y" * DIRECT_BYTES + b"tail"
    )  # fmt: skip


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
