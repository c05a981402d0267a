"""Both upstream transports (``upstream.transport: aiohttp | httpx``) behave the same on the
wire: SSE relayed event by event, a client that goes away closes the upstream connection,
a stalled stream ends with an error event, no answer in time is a 504, a refused connection
a 502 ``upstream_unreachable``. Real proxy processes; a raw-socket upstream whose every step
waits on the test (never on a clock), so the checks hold on a busy machine.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from proxy.adapters.aiotransport import httpx_errors
from proxy.adapters.reach import classify
from tests.proxyproc import ProxyProcess, free_port
from tests.rawupstream import tcp_server
from tests.upstream import ScriptedUpstream

TRANSPORTS = ("h1", "aiohttp", "httpx")
WAIT_S = 60.0  # only ever reached when something is broken
# ``x-test-flood``: more than the sockets between the upstream and a stalled client can
# buffer (loopback's receive buffers grow to 32 MiB here: tcp_rmem), in events of 64 KiB.
FLOOD_EVENTS, FLOOD_PAD = 2048, 64 * 1024


def _event(text: str) -> bytes:
    chunk = {
        "id": "chatcmpl-gated",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gated",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class GatedUpstream:
    """Streams one event, then waits: for ``go`` (the rest follows), for the proxy to close
    the connection (``closed`` is set), or for nothing (a stall). The scenario is the first
    user message's text: ``gate``, ``hangup`` or ``stall``; ``nohead`` never answers."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.closed = threading.Event()
        self.release = threading.Event()  # ends stalls when the tests are done
        self._server = tcp_server(self._handle)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()

    def _handle(self, sock: socket.socket) -> None:
        reader = sock.makefile("rb")
        if not reader.readline():
            return
        length = 0
        while (line := reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body = json.loads(reader.read(length))
        scenario = body["messages"][0]["content"]
        if scenario == "nohead":
            self.release.wait(WAIT_S)
            return
        sock.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + _chunked(_event("first"))
        )
        if scenario == "gate":
            self.go.wait(WAIT_S)
            rest = _event("second") + b"data: [DONE]\n\n"
            sock.sendall(_chunked(rest) + b"0\r\n\r\n")
        elif scenario == "hangup":
            sock.settimeout(WAIT_S)
            try:
                while sock.recv(4096):
                    pass
                self.closed.set()  # the proxy closed its side
            except OSError:
                self.closed.set()
        else:  # stall
            self.release.wait(WAIT_S)


def _chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


@pytest.fixture(scope="module")
def upstream() -> Iterator[GatedUpstream]:
    up = GatedUpstream()
    try:
        yield up
    finally:
        up.stop()


@pytest.fixture(scope="module", params=TRANSPORTS)
def proxy(
    request: pytest.FixtureRequest, upstream: GatedUpstream, tmp_path_factory: Any
) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp(f"transport-{request.param}")
    upstream_settings = {"transport": request.param, "timeout_s": 3}
    with ProxyProcess(tmp, upstream.base_url, upstream=upstream_settings) as px:
        yield px


def _body(scenario: str, stream: bool = True) -> dict[str, Any]:
    return {
        "model": "gpt-4o-mini",
        "stream": stream,
        "messages": [{"role": "user", "content": scenario}],
        "stream_options": {"include_usage": True},
    }


def test_events_are_relayed_one_by_one(proxy: ProxyProcess, upstream: GatedUpstream) -> None:
    upstream.go.clear()
    url = f"{proxy.base_url}/chat/completions"
    with httpx.stream("POST", url, json=_body("gate"), timeout=WAIT_S) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        # The first event arrives while the upstream still holds back the rest: it is not
        # waiting for more bytes anywhere on the way.
        first = next(line for line in lines if line.startswith("data: "))
        assert '"first"' in first
        upstream.go.set()
        rest = [line for line in lines if line.startswith("data: ")]
    assert '"second"' in rest[0] and rest[-1] == "data: [DONE]"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_slow_client_holds_the_upstream_back_and_gets_every_event(
    tmp_path: Path, transport: str
) -> None:
    """The official client stops reading a stream: the proxy stops reading the upstream (its
    answer is not piled up in the proxy's memory), and once the client reads on, every event
    arrives, in order, once (the h1 transport pushes a stream from its callbacks and holds
    it, #28). The strict upstream floods the answer (``x-test-flood``) as fast as it is
    read."""
    with (
        ScriptedUpstream() as up,
        ProxyProcess(tmp_path, up.base_url, upstream={"transport": transport}) as px,
    ):
        client = openai.OpenAI(
            base_url=px.base_url, api_key="sk-slow", max_retries=0,
            default_headers={"x-test-flood": f"{FLOOD_EVENTS}:{FLOOD_PAD}"},
        )  # fmt: skip
        messages = [{"role": "user", "content": "tell me everything"}]
        stream = client.chat.completions.create(
            model="gpt-4o-mini", messages=messages, stream=True, timeout=WAIT_S
        )
        contents = (c.choices[0].delta.content for c in stream if c.choices)
        texts = (text for text in contents if text)
        assert next(texts).startswith("0:")
        # Nothing more is read for a while: were the proxy reading on, the upstream would
        # have sent its whole answer (more than the sockets between hold; a busy machine can
        # only make this pass, never fail).
        assert not up.flooded.wait(3.0), "the proxy read the answer ahead of its client"
        rest = list(texts)
        assert up.flooded.is_set()
    assert [t.partition(":")[0] for t in rest] == [str(i) for i in range(1, FLOOD_EVENTS)]
    assert all(len(t.partition(":")[2]) == FLOOD_PAD for t in rest)


def test_a_client_gone_closes_the_upstream_connection(
    proxy: ProxyProcess, upstream: GatedUpstream
) -> None:
    upstream.closed.clear()
    url = f"{proxy.base_url}/chat/completions"
    with httpx.stream("POST", url, json=_body("hangup"), timeout=WAIT_S) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    assert upstream.closed.wait(WAIT_S), "the upstream connection stayed open"
    assert httpx.get(f"{proxy.root}/healthz").status_code == 200
    # Recorded as the client going away (499), and no traceback for it.
    deadline = time.monotonic() + WAIT_S
    while '"upstream_status":499' not in proxy.log_path.read_text():
        assert time.monotonic() < deadline, "no 499 request line in the proxy's log"
        time.sleep(0.05)
    assert "Traceback" not in proxy.log_path.read_text()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_compressed_answer_reaches_the_official_client_decoded(
    tmp_path: Path, transport: str
) -> None:
    # The strict upstream gzips its answer (the client's default Accept-Encoding goes
    # upstream, so a provider may): the relay reads it decoded, and the client gets it plain,
    # streamed event by event or whole, with no Content-Encoding claiming otherwise.
    with (
        ScriptedUpstream() as up,
        ProxyProcess(tmp_path, up.base_url, upstream={"transport": transport}) as px,
    ):
        client = openai.OpenAI(
            base_url=px.base_url, api_key="sk-gzip", max_retries=0,
            default_headers={"x-test-gzip": "1"},
        )  # fmt: skip
        messages = [{"role": "user", "content": "say something"}]
        with client.chat.completions.with_streaming_response.create(
            model="gpt-4o-mini", messages=messages, stream=True
        ) as raw:
            assert "content-encoding" not in raw.headers
            text = "".join(
                chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices
            )
        whole = client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=messages
        )
        assert "content-encoding" not in whole.headers
        assert text and text == whole.parse().choices[0].message.content
        asked = [r for r in up.chat_requests()]
        assert len(asked) == 2 and all("gzip" in r.headers["accept-encoding"] for r in asked)


def test_a_stream_ended_at_its_last_event_keeps_its_upstream_connection(tmp_path: Path) -> None:
    """The strict upstream sends a stream's last HTTP chunk a while after ``[DONE]``
    (``x-test-close-delay``): the proxy ends the client's answer at ``[DONE]`` and still
    keeps the connection once that chunk came, so with a pool of one connection every
    request of the official client goes on the same one (#28: closing it cost each next
    request a new connection; with TLS, a handshake)."""
    with (
        ScriptedUpstream() as up,
        ProxyProcess(tmp_path, up.base_url, upstream={"max_connections": 1}) as px,
    ):
        client = openai.OpenAI(
            base_url=px.base_url, api_key="sk-kept", max_retries=0,
            default_headers={"x-test-close-delay": "0.01"},
        )  # fmt: skip
        texts = []
        for i in range(4):
            messages = [{"role": "user", "content": f"say something {i}"}]
            stream = client.chat.completions.create(
                model="gpt-4o-mini", messages=messages, stream=True
            )
            texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
        assert all(texts)
        peers = [r.peer for r in up.chat_requests()]
        assert len(peers) == 4 and len(set(peers)) == 1, peers


def test_a_stalled_stream_ends_with_an_error_event(proxy: ProxyProcess) -> None:
    url = f"{proxy.base_url}/chat/completions"
    with httpx.stream("POST", url, json=_body("stall"), timeout=WAIT_S) as r:
        text = "".join(r.iter_text())
    assert '"first"' in text
    assert "event: error" in text and "upstream_error" in text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_no_answer_in_time_is_a_504(proxy: ProxyProcess, stream: bool) -> None:
    url = f"{proxy.base_url}/chat/completions"
    r = httpx.post(url, json=_body("nohead", stream), timeout=WAIT_S)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "upstream_timeout"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_refused_connection_is_a_502_unreachable(tmp_path: Path, transport: str) -> None:
    closed = free_port()
    with ProxyProcess(
        tmp_path, f"http://127.0.0.1:{closed}/v1", upstream={"transport": transport}
    ) as px:
        r = httpx.post(f"{px.base_url}/chat/completions", json=_body("x", False), timeout=WAIT_S)
        assert r.status_code == 502, r.text
        error = r.json()["error"]
        assert error["code"] == "upstream_unreachable"
        assert "connection refused" in error["message"]


def test_aiohttp_errors_map_to_the_httpx_classes_the_proxy_maps() -> None:
    import aiohttp
    from aiohttp.client_reqrep import ConnectionKey

    request = httpx.Request("POST", "http://127.0.0.1:1/v1/chat/completions")
    key = ConnectionKey("127.0.0.1", 1, False, True, None, None, None)
    refused = ConnectionRefusedError(111, "Connection refused")
    cases: list[tuple[BaseException, type[httpx.HTTPError]]] = [
        (aiohttp.ClientConnectorError(key, refused), httpx.ConnectError),
        (aiohttp.ConnectionTimeoutError("connect"), httpx.ConnectTimeout),
        (aiohttp.SocketTimeoutError("read"), httpx.ReadTimeout),
        (aiohttp.ServerDisconnectedError(), httpx.RemoteProtocolError),
        (aiohttp.ClientPayloadError("cut"), httpx.RemoteProtocolError),
        (aiohttp.ClientOSError(104, "reset"), httpx.ReadError),
    ]
    for raised, expected in cases:
        with pytest.raises(expected) as caught, httpx_errors(request):
            raise raised
        assert type(caught.value) is expected, (raised, caught.value)
    with pytest.raises(httpx.ConnectError) as caught, httpx_errors(request):
        raise aiohttp.ClientConnectorError(key, refused)
    assert caught.value.__cause__ is refused  # what proxy.reach.classify reads
    unresolved = socket.gaierror(-2, "Name or service not known")
    with pytest.raises(httpx.ConnectError) as caught, httpx_errors(request):
        raise aiohttp.ClientConnectorDNSError(key, unresolved)
    assert caught.value.__cause__ is unresolved
    assert classify(caught.value, str(request.url)).permanent
