"""``H1Reply.push`` (#28): an answer's body handed to a sink from the connection's callbacks
(the stream relay's way, ``proxy.server.push``), against the raw-socket server of
``test_h1_transport``: every byte once and in order, the connection kept after a whole body;
a sink that stops ends it; a sink that holds gets nothing more until its reader drained; the
read timeout bounds each wait between reads, not the whole body; a sink's error is raised.
"""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from proxy.adapters.h1 import H1Reply, H1Transport
from proxy.adapters.h1conn import GO, HOLD, STOP
from proxy.adapters.upstreamcall import UpstreamRequest
from tests.test_h1_transport import Scripted, read_request

HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
WAIT_S = 30.0  # only ever reached when something is broken


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def request(port: int, read_s: float = 10) -> UpstreamRequest:
    url = httpx.URL(f"http://127.0.0.1:{port}/v1/chat/completions")
    timeout = {"connect": 5, "read": read_s, "pool": 5, "write": 5}
    return UpstreamRequest("POST", url, [(b"Host", b"127.0.0.1")], b"{}", timeout)


async def nothing() -> None:
    return None


def test_every_read_reaches_the_sink_once_in_order_and_the_connection_is_kept() -> None:
    pieces = [b"piece %d;" % i for i in range(200)]

    def answers(sock: socket.socket) -> None:
        read_request(sock)
        sock.sendall(HEAD + chunk(pieces[0]))
        for piece in pieces[1:]:  # (many sends: the proxy reads them in any grouping)
            sock.sendall(chunk(piece))
        sock.sendall(b"0\r\n\r\n")
        read_request(sock)
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nagain")
        while sock.recv(65536):
            pass

    async def run(port: int) -> tuple[list[bytes], bool, bytes]:
        t = H1Transport(httpx.Limits(max_connections=4, max_keepalive_connections=4))
        got: list[bytes] = []

        def sink(data: bytes) -> int:
            got.append(data)
            return GO

        reply = await t.exchange(request(port))
        assert isinstance(reply, H1Reply) and reply.pushable
        stopped = await reply.push(sink, nothing)
        await reply.aclose()
        second = await t.exchange(request(port))
        return got, stopped, await second.aread()

    with Scripted([answers]) as up:
        got, stopped, again = asyncio.run(run(up.port))
        assert not stopped and b"".join(got) == b"".join(pieces)
        assert again == b"again" and up.connections == 1  # read to its end: kept


def test_a_sink_that_stops_gets_no_more_and_its_connection_is_not_kept() -> None:
    def answers(sock: socket.socket) -> None:
        read_request(sock)
        sock.sendall(HEAD + chunk(b"one;"))
        time.sleep(0.05)
        sock.sendall(chunk(b"stop;"))
        time.sleep(0.05)
        sock.sendall(chunk(b"after;") + b"0\r\n\r\n")
        while sock.recv(65536):
            pass

    async def run(port: int) -> tuple[list[bytes], bool]:
        t = H1Transport(httpx.Limits(max_connections=4, max_keepalive_connections=4))
        got: list[bytes] = []

        def sink(data: bytes) -> int:
            got.append(data)
            return STOP if b"stop;" in data else GO

        reply = await t.exchange(request(port))
        stopped = await reply.push(sink, nothing)
        await reply.aclose()
        await (await t.exchange(request(port))).aread()
        return got, stopped

    with Scripted([answers, answers]) as up:
        got, stopped = asyncio.run(run(up.port))
        assert stopped and b"".join(got).endswith(b"stop;") and b"after;" not in b"".join(got)
        assert up.connections == 2  # not read to its end by the sink: closed, not kept


def test_a_held_sink_gets_nothing_more_until_its_reader_drained() -> None:
    go, sent_more = threading.Event(), threading.Event()

    def answers(sock: socket.socket) -> None:
        read_request(sock)
        sock.sendall(HEAD + chunk(b"first;"))
        go.wait(WAIT_S)  # (once the sink holds)
        sock.sendall(chunk(b"second;") + chunk(b"third;") + b"0\r\n\r\n")
        sent_more.set()
        while sock.recv(65536):
            pass

    async def run(port: int) -> tuple[list[bytes], list[bytes], bool]:
        t = H1Transport(httpx.Limits(max_connections=4, max_keepalive_connections=4))
        got: list[bytes] = []
        drained = asyncio.Event()
        draining = asyncio.Event()

        def sink(data: bytes) -> int:
            got.append(data)
            return HOLD if len(got) == 1 else GO

        async def drain() -> None:
            draining.set()
            await drained.wait()

        reply = await t.exchange(request(port))
        pushing = asyncio.ensure_future(reply.push(sink, drain))
        await asyncio.wait_for(draining.wait(), WAIT_S)
        go.set()
        # The rest is sent while held: the loop runs on, and the sink is not called.
        while not sent_more.is_set():
            await asyncio.sleep(0.01)
        for _ in range(20):
            await asyncio.sleep(0.01)
        while_held = list(got)
        drained.set()
        stopped = await asyncio.wait_for(pushing, WAIT_S)
        await reply.aclose()
        return while_held, got, stopped

    with Scripted([answers]) as up:
        while_held, got, stopped = asyncio.run(run(up.port))
        assert b"".join(while_held) == b"first;"
        assert not stopped and b"".join(got) == b"first;second;third;"


def test_the_read_timeout_bounds_each_wait_of_a_pushed_body_not_the_whole() -> None:
    """A body that keeps coming for longer than the read timeout in all is pushed whole (the
    one wait's deadline moves with every read); one that stops times out. (Each gap here is
    ~0.05 s against a 2 s timeout: a busy machine does not make it fail.)"""
    pieces = 60
    release = threading.Event()

    def steady(sock: socket.socket) -> None:
        read_request(sock)
        sock.sendall(HEAD)
        for _ in range(pieces):
            time.sleep(0.05)
            sock.sendall(chunk(b"ok"))
        sock.sendall(b"0\r\n\r\n")
        while sock.recv(65536):
            pass

    def stalls(sock: socket.socket) -> None:
        read_request(sock)
        sock.sendall(HEAD + chunk(b"ok"))
        release.wait(WAIT_S)

    async def push_all(port: int, read_s: float) -> bytes:
        t = H1Transport(httpx.Limits(max_connections=4, max_keepalive_connections=4))
        got: list[bytes] = []
        reply = await t.exchange(request(port, read_s))
        try:
            await reply.push(lambda data: got.append(data) or GO, nothing)
        finally:
            await reply.aclose()
        return b"".join(got)

    with Scripted([steady, stalls]) as up:
        started = time.monotonic()
        assert asyncio.run(push_all(up.port, 2.0)) == b"ok" * pieces
        assert time.monotonic() - started > 2.0  # (longer than the timeout in all)
        try:
            with pytest.raises(httpx.ReadTimeout):
                asyncio.run(push_all(up.port, 0.2))
        finally:
            release.set()


def test_a_sink_that_raises_has_its_error_raised_by_push() -> None:
    def answers(sock: socket.socket) -> None:
        read_request(sock)
        sock.sendall(HEAD + chunk(b"one;"))
        time.sleep(0.05)
        sock.sendall(chunk(b"two;") + b"0\r\n\r\n")
        while sock.recv(65536):
            pass

    async def run(port: int) -> None:
        t = H1Transport(httpx.Limits(max_connections=4, max_keepalive_connections=4))

        def sink(data: bytes) -> int:
            raise ValueError("the sink's own bug")

        reply = await t.exchange(request(port))
        try:
            await reply.push(sink, nothing)
        finally:
            await reply.aclose()

    with Scripted([answers]) as up:
        with pytest.raises(ValueError, match="the sink's own bug"):
            asyncio.run(run(up.port))


def test_a_connection_whose_reader_had_the_whole_answer_waits_for_its_last_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream's reader stops at its terminal event; the body's last HTTP chunk comes a
    read later. With ``aclose(ended=True)`` the connection is kept once that chunk came (the
    next request reuses it); more body instead, or a plain ``aclose``, closes it (#28).
    (The wait is made long here: the chunk comes on the test's signal, however slowly a
    busy machine passes it on.)"""
    monkeypatch.setattr("proxy.adapters.h1.END_WAIT_S", WAIT_S)
    go = threading.Event()

    def answers(after_done: bytes) -> Callable[[socket.socket], None]:
        def run(sock: socket.socket) -> None:
            try:
                while read_request(sock):
                    sock.sendall(HEAD + chunk(b"data: [DONE]\n\n"))
                    go.wait(WAIT_S)  # (once the reader closed its answer)
                    go.clear()
                    sock.sendall(after_done)
            except OSError:
                pass  # (the client closed the connection: reset)

        return run

    async def twice(port: int, ended: bool) -> None:
        t = H1Transport(httpx.Limits(max_connections=1, max_keepalive_connections=1))
        for _ in range(2):
            reply = await t.exchange(request(port))
            got = b"".join(await _until_done(reply))
            assert got == b"data: [DONE]\n\n"
            await reply.aclose(ended=ended)
            go.set()
        await t.aclose()

    for after_done, ended, connections in (
        (b"0\r\n\r\n", True, 1),  # the last chunk: kept, the next request reuses it
        (b"0\r\n\r\n", False, 2),  # closed at once, as before
        (chunk(b"data: more\n\n") + b"0\r\n\r\n", True, 2),  # more body: not kept
    ):
        with Scripted([answers(after_done), answers(after_done)]) as up:
            asyncio.run(twice(up.port, ended))
            assert up.connections == connections, (after_done, ended)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_loop_held_up_past_the_wait_still_keeps_a_connection_whose_chunk_came(
    monkeypatch: pytest.MonkeyPatch, loop: str
) -> None:
    """The last chunk came in time but the event loop was busy past ``END_WAIT_S``: when it
    runs again the wait's timer and the chunk are both due; the read must go first, or the
    connection is closed (a busy worker would then reconnect, with TLS a handshake, for
    nothing). asyncio and today's uvloop poll before they run timers; libuv before 1.45
    ran timers first, which ``Conn._expire`` allows for."""
    import uvloop

    monkeypatch.setattr("proxy.adapters.h1.END_WAIT_S", 0.05)
    go, sent = threading.Event(), threading.Event()

    def answers(sock: socket.socket) -> None:
        try:
            read_request(sock)
            sock.sendall(HEAD + chunk(b"data: [DONE]\n\n"))
            go.wait(WAIT_S)
            sock.sendall(b"0\r\n\r\n")
            sent.set()
            while read_request(sock):
                sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nnext")
        except OSError:
            pass

    async def run(port: int) -> bytes:
        t = H1Transport(httpx.Limits(max_connections=1, max_keepalive_connections=1))
        reply = await t.exchange(request(port))
        raw = reply._conn.transport.get_extra_info("socket")
        await _until_done(reply)
        await reply.aclose(ended=True)  # waits END_WAIT_S for the last chunk
        started = time.monotonic()
        # The loop held up (no await): the chunk arrives and the wait's time passes.
        go.set()
        assert sent.wait(WAIT_S)
        readable, _, _ = select.select([raw], [], [], WAIT_S)
        assert readable
        while time.monotonic() - started < 0.2:  # (4x the wait: its timer is due)
            time.sleep(0.05)
        second = await asyncio.wait_for(t.exchange(request(port)), WAIT_S)
        try:
            return await second.aread()
        finally:
            await second.aclose()
            await t.aclose()

    runner = uvloop.run if loop == "uvloop" else asyncio.run
    with Scripted([answers, answers]) as up:
        assert runner(run(up.port)) == b"next"
        assert up.connections == 1


def test_a_last_chunk_that_never_comes_frees_the_connection_in_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No last chunk: the connection is closed after ``END_WAIT_S`` and its pool slot
    freed, so a pool of one serves the next request on a new connection."""
    monkeypatch.setattr("proxy.adapters.h1.END_WAIT_S", 0.2)
    release = threading.Event()

    def stalls(sock: socket.socket) -> None:
        read_request(sock)
        sock.sendall(HEAD + chunk(b"data: [DONE]\n\n"))
        release.wait(WAIT_S)

    def answers(sock: socket.socket) -> None:
        read_request(sock)
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nnext")
        release.wait(WAIT_S)

    async def run(port: int) -> bytes:
        t = H1Transport(httpx.Limits(max_connections=1, max_keepalive_connections=1))
        reply = await t.exchange(request(port))
        await _until_done(reply)
        await reply.aclose(ended=True)
        second = await asyncio.wait_for(t.exchange(request(port)), WAIT_S)
        return await second.aread()

    with Scripted([stalls, answers]) as up:
        try:
            assert asyncio.run(run(up.port)) == b"next"
            assert up.connections == 2
        finally:
            release.set()


async def _until_done(reply: H1Reply) -> list[bytes]:
    """The body pushed up to its ``[DONE]`` event (where a stream's reader stops)."""
    got: list[bytes] = []

    def sink(data: bytes) -> int:
        got.append(data)
        return STOP if b"[DONE]" in b"".join(got) else GO

    await reply.push(sink, nothing)
    return got


def test_a_stream_the_server_cannot_take_pushed_is_pulled_with_the_same_events() -> None:
    """``relay.PushedEvents`` with a ``send`` that is not uvicorn's httptools cycle (another
    ASGI server): the stream is pulled as before, the same events sent as ASGI messages, the
    usage read, the terminal event ending it (and the connection kept, #28)."""
    from proxy.core.surfaces import OPENAI_CHAT
    from proxy.server.relay import Ending, PushedEvents

    usage = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}\n\n'
    events = [b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n', usage, b"data: [DONE]\n\n"]

    def answers(sock: socket.socket) -> None:
        try:
            while read_request(sock):
                sock.sendall(HEAD + chunk(events[0]))
                time.sleep(0.05)
                sock.sendall(chunk(events[1] + events[2]))
                time.sleep(0.05)
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass

    async def run(port: int) -> tuple[list[dict], Ending]:
        t = H1Transport(httpx.Limits(max_connections=1, max_keepalive_connections=1))
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        ending = Ending()
        pushed = PushedEvents(OPENAI_CHAT, await t.exchange(request(port)), True, ending)
        await pushed(send)
        await pushed.aclose()
        await (await t.exchange(request(port))).aclose()  # (waits for the one connection)
        return sent, ending

    with Scripted([answers, answers]) as up:
        sent, ending = asyncio.run(run(up.port))
        body = b"".join(m["body"] for m in sent)
        assert all(m["type"] == "http.response.body" and m["more_body"] for m in sent)
        assert body == events[0] + events[2]  # the usage-only event dropped (not asked for)
        assert ending.status == 200 and ending.usage == {"prompt_tokens": 7, "completion_tokens": 2}
        assert up.connections == 1


def test_the_chunk_writer_is_made_only_for_a_started_chunked_response_of_uvicorns_cycle() -> None:
    """``ChunkWriter.of`` writes straight only on uvicorn's httptools cycle as it keeps its
    state today: a started, incomplete, chunked response whose client is there; anything
    else (another server's ``send``, a whole or finished response, a cycle missing what it
    reads) gets its stream pulled."""
    import logging

    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    from proxy.server.front import Tracked
    from proxy.server.push import ChunkWriter

    class Transport:
        def __init__(self) -> None:
            self.written: list[bytes] = []

        def write(self, data: bytes) -> None:
            self.written.append(data)

        def pause_reading(self) -> None:
            pass

        def resume_reading(self) -> None:
            pass

    async def run() -> None:
        def cycle(**state: Any) -> RequestResponseCycle:
            transport = Transport()
            made = RequestResponseCycle(
                scope={"type": "http", "method": "POST"}, transport=transport,  # type: ignore[arg-type]
                flow=FlowControl(transport), logger=logging.getLogger("t"),  # type: ignore[arg-type]
                access_logger=logging.getLogger("t"), access_log=False, default_headers=[],
                message_event=asyncio.Event(), expect_100_continue=False, keep_alive=True,
                on_response=lambda: None,
            )  # fmt: skip
            made.response_started, made.chunked_encoding = True, True
            for name, value in state.items():
                if value is None:
                    delattr(made, name)
                else:
                    setattr(made, name, value)
            return made

        async def plain(message: Any) -> None:
            return None

        ok = cycle()
        writer = ChunkWriter.of(Tracked(ok.send))
        assert writer is not None and writer.write(b"data: x\n\n") == GO
        assert ok.transport.written == [b"9\r\ndata: x\n\n\r\n"]  # type: ignore[attr-defined]
        ok.disconnected = True
        assert writer.write(b"data: y\n\n") == STOP and len(ok.transport.written) == 1  # type: ignore[attr-defined]
        assert ChunkWriter.of(plain) is None
        assert ChunkWriter.of(Tracked(plain)) is None
        for state in (
            {"response_started": False},
            {"response_complete": True},
            {"disconnected": True},
            {"chunked_encoding": False},  # (a Content-Length response)
            {"chunked_encoding": None},  # (a cycle without the attribute)
            {"flow": None},
            {"scope": {"type": "http", "method": "HEAD"}},
        ):
            assert ChunkWriter.of(Tracked(cycle(**state).send)) is None, state

    asyncio.run(run())
