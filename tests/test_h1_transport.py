"""The lean HTTP/1.1 transport (``proxy.adapters.h1``, the default ``upstream.transport``) on
the wire cases its parser and pool must get right, against a raw-socket server whose every
answer is scripted byte for byte: keep-alive reuse, chunked and close-delimited bodies, a HEAD
answer, an interim 103, a kept connection the server closed meanwhile, malformed and cut
answers, a body bigger than the read buffer. The relay-level behaviour (events one by one, a
client gone, 502/504) is checked for all transports by ``test_upstream_transport.py``.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from bench import tlscert
from proxy.adapters.h1 import H1Transport
from proxy.adapters.upstreamcall import UpstreamRequest
from tests.rawupstream import tcp_server

Script = Callable[[socket.socket], None]


def read_request(sock: socket.socket) -> bytes:
    """One request's bytes (head and a Content-Length body); b"" when the peer closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


class Scripted:
    """Each accepted connection runs the next script; requests are recorded."""

    def __init__(self, scripts: list[Script]) -> None:
        self.scripts = list(scripts)
        self.connections = 0
        self.requests: list[bytes] = []
        self.lock = threading.Lock()
        self.server = tcp_server(self._handle)
        self.port = self.server.server_address[1]

    def _handle(self, sock: socket.socket) -> None:
        with self.lock:
            self.connections += 1
            script = self.scripts.pop(0)
        script(sock)

    def __enter__(self) -> Scripted:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answers(self, *replies: bytes) -> Script:
        """A connection answering each request in turn with the given bytes, then waiting
        for the client to close."""

        def run(sock: socket.socket) -> None:
            for reply in replies:
                request = read_request(sock)
                if not request:
                    return
                self.requests.append(request)
                sock.sendall(reply)
            while sock.recv(65536):
                pass

        return run


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n" % (len(body), extra) + body


def call(
    port: int,
    transport: H1Transport,
    method: str = "POST",
    body: bytes = b'{"a": 1}',
    read_s: float = 10,
) -> tuple[int, dict[str, str], bytes]:
    """One request through the transport, the whole body read and the answer closed."""

    async def run() -> tuple[int, dict[str, str], bytes]:
        request = httpx.Request(
            method,
            f"http://127.0.0.1:{port}/v1/chat/completions?x=1",
            content=body if method != "HEAD" else b"",
            headers={"authorization": "Bearer sk-test", "x-custom": "é".encode()},
            extensions={"timeout": {"connect": 5, "read": read_s, "pool": 5, "write": 5}},
        )
        response = await transport.handle_async_request(request)
        try:
            data = b"".join([chunk async for chunk in response.stream])
        finally:
            await response.aclose()
        return response.status_code, dict(response.headers), data

    return asyncio_run(run())


_LOOP: asyncio.AbstractEventLoop | None = None


def asyncio_run(coro):  # type: ignore[no-untyped-def]
    # One loop for the module: the transport's pool (and its connections) live in it.
    assert _LOOP is not None
    return _LOOP.run_until_complete(coro)


@pytest.fixture(autouse=True)
def loop() -> Iterator[None]:
    global _LOOP
    _LOOP = asyncio.new_event_loop()
    try:
        yield
    finally:
        _LOOP.close()
        _LOOP = None


def transport() -> H1Transport:
    return H1Transport(httpx.Limits(max_connections=8, max_keepalive_connections=8))


def test_a_kept_connection_serves_the_next_request_and_the_request_goes_out_as_built() -> None:
    with Scripted([]) as up:
        up.scripts.append(up.answers(ok(b"one"), ok(b"two")))
        t = transport()
        assert call(up.port, t, body=b'{"first": 1}')[2] == b"one"
        status, headers, data = call(up.port, t)
        assert (status, data) == (200, b"two")
        assert up.connections == 1
        first = up.requests[0]
        assert first.startswith(b"POST /v1/chat/completions?x=1 HTTP/1.1\r\n")
        assert b"\r\nhost: 127.0.0.1:%d\r\n" % up.port in first.lower()
        assert b"\r\ncontent-length: 12\r\n" in first.lower()
        assert "é".encode() in first  # a UTF-8 header value goes out as its bytes
        assert first.endswith(b'\r\n\r\n{"first": 1}')


def test_a_chunked_body_is_read_whole_and_the_connection_kept() -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    )
    with Scripted([]) as up:
        up.scripts.append(up.answers(chunked, ok(b"again")))
        t = transport()
        assert call(up.port, t)[2] == b"hello world"
        assert call(up.port, t)[2] == b"again"
        assert up.connections == 1


def test_a_body_ended_by_closing_the_connection_is_read_to_its_end() -> None:
    def close_delimited(sock: socket.socket) -> None:
        read_request(sock)
        sock.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\npart one, ")
        sock.sendall(b"part two")
        sock.close()

    with Scripted([close_delimited]) as up, Scripted([]) as other:
        t = transport()
        assert call(up.port, t)[2] == b"part one, part two"
        other.scripts.append(other.answers(ok(b"fresh")))
        assert call(other.port, t)[2] == b"fresh"


def test_a_head_answer_has_no_body_and_its_connection_is_not_reused() -> None:
    with Scripted([]) as up:
        up.scripts.append(up.answers(b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n"))
        up.scripts.append(up.answers(ok(b"next")))
        t = transport()
        status, headers, data = call(up.port, t, method="HEAD")
        assert (status, data, headers["content-length"]) == (200, b"", "1234")
        assert call(up.port, t)[2] == b"next"
        assert up.connections == 2


def test_an_interim_103_is_skipped_for_the_real_answer() -> None:
    early = b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n"
    with Scripted([]) as up:
        up.scripts.append(up.answers(early + ok(b"real", b"X-Real: yes\r\n")))
        status, headers, data = call(up.port, transport())
        assert (status, data, headers.get("x-real")) == (200, b"real", "yes")
        assert "link" not in headers


def test_a_kept_connection_the_server_closed_is_not_reused() -> None:
    closed = threading.Event()

    def answer_then_close(sock: socket.socket) -> None:
        up.requests.append(read_request(sock))
        sock.sendall(ok(b"first"))
        sock.close()  # as a server closing an idle keep-alive connection does
        closed.set()

    with Scripted([answer_then_close]) as up:
        up.scripts.append(up.answers(ok(b"second")))
        t = transport()
        assert call(up.port, t)[2] == b"first"
        assert closed.wait(30)
        # Until the client's loop has read the close (in a server it runs all the time; here
        # it runs only inside ``call``). Waits on the condition, never on a clock.
        pooled = [c for idle in t._idle.values() for c in idle]
        assert len(pooled) == 1
        deadline = time.monotonic() + 30  # only ever reached when something is broken
        while not pooled[0].closed:
            assert time.monotonic() < deadline, "the client never saw the close"
            asyncio_run(asyncio.sleep(0.01))
        assert call(up.port, t)[2] == b"second"  # a POST: sent on a new connection
        assert up.connections == 2


def test_a_malformed_answer_is_a_protocol_error() -> None:
    with Scripted([]) as up:
        up.scripts.append(up.answers(b"HTTP/1.1 2xx nonsense\r\n\r\n"))
        with pytest.raises(httpx.RemoteProtocolError):
            call(up.port, transport())


def test_a_body_cut_short_is_an_error_not_a_short_answer() -> None:
    def cut(sock: socket.socket) -> None:
        read_request(sock)
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        sock.close()

    with Scripted([cut]) as up:
        with pytest.raises(httpx.RemoteProtocolError):
            call(up.port, transport())


def test_a_new_connection_closed_without_an_answer_is_an_error() -> None:
    def hang_up(sock: socket.socket) -> None:
        read_request(sock)
        sock.close()

    with Scripted([hang_up]) as up:
        with pytest.raises(httpx.RemoteProtocolError):
            call(up.port, transport())
        assert up.connections == 1  # a new connection is not retried: it was never kept


def test_no_answer_within_the_read_timeout_is_a_read_timeout() -> None:
    release = threading.Event()

    def silent(sock: socket.socket) -> None:
        read_request(sock)
        release.wait(30)

    with Scripted([silent]) as up:
        try:
            with pytest.raises(httpx.ReadTimeout):
                call(up.port, transport(), read_s=0.2)
        finally:
            release.set()


def test_the_read_timeout_bounds_each_wait_not_the_whole_answer() -> None:
    """A stream that keeps sending is never cut by the read timeout, however long it runs in
    all (here 1.5x the timeout), and one that stops is: the connection's one timer follows
    each wait's deadline (#28), as a timer per wait did. (Each wait here is ~0.05 s against
    a 2 s timeout: a busy machine does not make it fail.)"""
    pieces = 60
    release = threading.Event()

    def steady(sock: socket.socket) -> None:
        read_request(sock)
        sock.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(pieces):
            time.sleep(0.05)
            sock.sendall(b"2\r\nok\r\n")
        sock.sendall(b"0\r\n\r\n")
        while sock.recv(65536):
            pass

    def stalls(sock: socket.socket) -> None:
        read_request(sock)
        sock.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n")
        release.wait(30)

    with Scripted([steady, stalls]) as up:
        started = time.monotonic()
        assert call(up.port, transport(), read_s=2.0)[2] == b"ok" * pieces
        assert time.monotonic() - started > 2.0  # (longer than the timeout in all)
        try:
            with pytest.raises(httpx.ReadTimeout):
                call(up.port, transport(), read_s=0.2)
        finally:
            release.set()


def test_a_refused_connection_is_a_connect_error_with_the_os_error() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with pytest.raises(httpx.ConnectError) as caught:
        call(port, transport())
    assert isinstance(caught.value.__cause__, ConnectionRefusedError)


def test_a_body_bigger_than_the_read_buffer_arrives_whole() -> None:
    big = bytes(range(256)) * (3 * 1024 * 1024 // 256)  # 3 MiB: reading pauses and resumes
    with Scripted([]) as up:
        up.scripts.append(up.answers(ok(big), ok(b"after")))
        t = transport()
        assert call(up.port, t)[2] == big
        assert call(up.port, t)[2] == b"after"
        assert up.connections == 1


def test_an_answer_closed_before_its_end_closes_its_connection() -> None:
    closed = threading.Event()

    def long_answer(sock: socket.socket) -> None:
        read_request(sock)
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\nstart")
        sock.settimeout(30)
        try:
            while sock.recv(65536):
                pass
            closed.set()  # the client closed the connection: the upstream's work ends
        except OSError:
            closed.set()

    async def run(port: int, t: H1Transport) -> bytes:
        request = httpx.Request(
            "POST", f"http://127.0.0.1:{port}/v1/x", content=b"{}",
            extensions={"timeout": {"connect": 5, "read": 10, "pool": 5}},
        )  # fmt: skip
        response = await t.handle_async_request(request)
        first = b""
        async for chunk in response.stream:
            first = chunk
            break
        await response.aclose()
        return first

    with Scripted([long_answer]) as up:
        t = transport()
        assert asyncio_run(run(up.port, t)) == b"start"
        assert closed.wait(30)


def answer_then_drop_the_next(up: Scripted) -> Script:
    def run(sock: socket.socket) -> None:
        up.requests.append(read_request(sock))
        sock.sendall(ok(b"first"))
        read_request(sock)  # the next request arrives as the server gives up on the connection
        sock.close()

    return run


def test_an_idempotent_request_on_a_kept_connection_closed_meanwhile_is_retried_once() -> None:
    with Scripted([]) as up:
        up.scripts += [answer_then_drop_the_next(up), up.answers(ok(b"second"))]
        t = transport()
        assert call(up.port, t, method="GET", body=b"")[2] == b"first"
        assert call(up.port, t, method="GET", body=b"")[2] == b"second"
        assert up.connections == 2


def test_a_post_is_never_sent_twice() -> None:
    # The upstream may have acted on it before closing: a chat request must not be billed twice.
    with Scripted([]) as up:
        up.scripts += [answer_then_drop_the_next(up), up.answers(ok(b"second"))]
        t = transport()
        assert call(up.port, t)[2] == b"first"
        with pytest.raises(httpx.RemoteProtocolError):
            call(up.port, t)
        assert up.connections == 1


class TlsScripted(Scripted):
    """``Scripted`` behind TLS with the given certificate."""

    def __init__(self, scripts: list[Script], cert: Path, key: Path) -> None:
        super().__init__(scripts)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.context = context

    def _handle(self, sock: socket.socket) -> None:
        try:
            wrapped = self.context.wrap_socket(sock, server_side=True)
        except (ssl.SSLError, OSError):
            return  # the client refused the certificate
        super()._handle(wrapped)


def https_call(port: int, transport: H1Transport) -> bytes:
    async def run() -> bytes:
        request = httpx.Request(
            "POST", f"https://localhost:{port}/v1/chat/completions", content=b"{}",
            extensions={"timeout": {"connect": 5, "read": 10, "pool": 5}},
        )  # fmt: skip
        response = await transport.handle_async_request(request)
        try:
            return b"".join([chunk async for chunk in response.stream])
        finally:
            await response.aclose()

    return asyncio_run(run())  # type: ignore[no-any-return]


def test_https_verifies_the_certificate_and_keeps_the_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = tlscert.self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trusted as httpx would trust it
    with TlsScripted([], cert, key) as up:
        up.scripts.append(up.answers(ok(b"secure"), ok(b"again")))
        t = transport()
        assert https_call(up.port, t) == b"secure"
        assert https_call(up.port, t) == b"again"
        assert up.connections == 1
        assert b"\r\nhost: localhost:%d\r\n" % up.port in up.requests[0].lower()


def test_an_untrusted_certificate_is_a_connect_error(tmp_path: Path) -> None:
    cert, key = tlscert.self_signed(tmp_path)
    with TlsScripted([], cert, key) as up:
        up.scripts.append(up.answers(ok(b"never")))
        with pytest.raises(httpx.ConnectError) as caught:
            https_call(up.port, transport())
        assert isinstance(caught.value.__cause__, ssl.SSLCertVerificationError)


def test_the_pool_waits_for_a_slot_and_a_freed_slot_is_taken_again() -> None:
    # One connection at most: while an answer is open the next request waits for its slot
    # (a PoolTimeout once "pool" has passed); closing the answer frees it at once.
    with Scripted([]) as up:
        up.scripts.append(up.answers(ok(b"one"), ok(b"two")))
        t = H1Transport(httpx.Limits(max_connections=1, max_keepalive_connections=1))
        url = f"http://127.0.0.1:{up.port}/v1/chat/completions"
        timeout = {"connect": 5, "read": 10, "pool": 0.2, "write": 5}

        async def run() -> bytes:
            first = await t.handle_async_request(
                httpx.Request("POST", url, content=b"{}", extensions={"timeout": timeout})
            )
            assert b"".join([c async for c in first.stream]) == b"one"
            with pytest.raises(httpx.PoolTimeout):
                await t.handle_async_request(
                    httpx.Request("POST", url, content=b"{}", extensions={"timeout": timeout})
                )
            await first.aclose()
            second = await t.handle_async_request(
                httpx.Request("POST", url, content=b"{}", extensions={"timeout": timeout})
            )
            try:
                return b"".join([c async for c in second.stream])
            finally:
                await second.aclose()

        assert asyncio_run(run()) == b"two"
        assert up.connections == 1


def test_the_chat_routes_exchange_gives_httpx_errors_that_name_their_request() -> None:
    """``exchange`` (the chat routes' way, no httpx objects) fails as the httpx path does,
    and each error carries the request (``mapped_errors`` names its URL)."""
    url = "http://127.0.0.1:{}/v1/chat/completions"

    def fails(port: int) -> httpx.HTTPError:
        request = UpstreamRequest(
            "POST", httpx.URL(url.format(port)), [(b"Host", b"127.0.0.1")], b"{}",
            {"connect": 5, "read": 10, "pool": 5, "write": 5},
        )  # fmt: skip

        async def run() -> None:
            reply = await transport().exchange(request)
            await reply.aread()

        with pytest.raises(httpx.HTTPError) as caught:
            asyncio_run(run())
        assert str(caught.value.request.url) == url.format(port)
        return caught.value

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    assert isinstance(fails(port), httpx.ConnectError)

    def cut(sock: socket.socket) -> None:
        read_request(sock)
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        sock.close()

    for script, error in ((cut, httpx.RemoteProtocolError), (None, httpx.RemoteProtocolError)):
        with Scripted([]) as up:
            up.scripts.append(script or up.answers(b"HTTP/1.1 2xx nonsense\r\n\r\n"))
            assert isinstance(fails(up.port), error)
