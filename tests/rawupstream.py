"""A raw-socket HTTP/1.1 upstream for fault runs: it records the request line exactly as the
proxy sent it (no framework normalises the path) and can break a body half-way, drip one
byte at a time, or frame server-sent events with CRLF.

Behaviour is chosen by the request: the path (``/truncate``), the proxy's own calls
(``x-compaction-purpose``, answered according to ``llm_mode``) or the body (``stream``).
"""

from __future__ import annotations

import json
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TRUNCATED_TOTAL = 5269  # the length the broken body promises
TRUNCATED_SENT = 2000  # what it sends before the connection resets
BIG_ANSWER_CHARS = 20 * 1024 * 1024


@dataclass
class Seen:
    method: str
    target: str
    headers: list[tuple[str, bytes]]
    body: bytes
    at: float = field(default_factory=time.monotonic)

    def header(self, name: str) -> bytes | None:
        return next((v for k, v in self.headers if k == name.lower()), None)

    def names(self) -> set[str]:
        return {k for k, _ in self.headers}

    @property
    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


def completion(text: str = "ok") -> dict[str, Any]:
    return {
        "id": "chatcmpl-raw",
        "object": "chat.completion",
        "created": 1,
        "model": "raw",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
    }


def sse_crlf_events() -> list[bytes]:
    """A chat stream framed with CRLF line ends, as some servers send it."""
    chunk = {
        "id": "chatcmpl-raw",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "raw",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}}],
    }
    done = dict(chunk, choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}])
    usage = dict(
        chunk, choices=[], usage={"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    )
    return [
        b": keep-alive\r\n\r\n",
        b"data: " + json.dumps(chunk).encode() + b"\r\n\r\n",
        b"data: " + json.dumps(done).encode() + b"\r\n\r\n",
        b"data: " + json.dumps(usage).encode() + b"\r\n\r\n",
        b"data: [DONE]\r\n\r\n",
    ]


def tcp_server(handle: Callable[[socket.socket], None]) -> socketserver.ThreadingTCPServer:
    """A threaded TCP server on a free loopback port calling ``handle(connection)``
    (not yet serving: the caller starts ``serve_forever`` and shuts it down)."""

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            handle(self.request)

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True

    return Server(("127.0.0.1", 0), Handler)


def read_request(reader: Any) -> Seen | None:
    """One HTTP/1.1 request off a connection's reader (a body framed by content-length), or
    None once the peer has closed."""
    line = reader.readline()
    if not line:
        return None
    method, target, _ = line.decode("latin-1").split(" ", 2)
    headers: list[tuple[str, bytes]] = []
    while True:
        raw = reader.readline()
        if raw in (b"\r\n", b"\n", b""):
            break
        name, _, value = raw.partition(b":")
        headers.append((name.decode("latin-1").strip().lower(), value.strip()))
    length = int(next((v for k, v in headers if k == "content-length"), b"0"))
    body = reader.read(length) if length else b""
    return Seen(method, target, headers, body)


class SocketUpstream:
    """A threaded raw-socket upstream on a free loopback port, as a context manager; a
    subclass answers each request in ``_serve_one`` (False when the connection is done)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._server = tcp_server(self._handle)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> SocketUpstream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handle(self, sock: socket.socket) -> None:
        reader = sock.makefile("rb")
        while (seen := read_request(reader)) is not None:
            if not self._serve_one(sock, seen):
                return

    def _serve_one(self, sock: socket.socket, seen: Seen) -> bool:
        raise NotImplementedError


class RawUpstream(SocketUpstream):
    """``with RawUpstream() as up: up.url(...)`` - every request lands in ``up.seen``.

    With ``llm_mode="drip"`` the proxy's own calls, and any request under a ``/drip/`` path,
    get an answer dripped over ``drip_s`` seconds.
    """

    def __init__(self, llm_mode: str = "ok", drip_s: float = 60.0) -> None:
        self.seen: list[Seen] = []
        self.llm_mode = llm_mode  # "ok" | "drip"
        self.drip_s = drip_s
        self.drips_finished = 0
        super().__init__()

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> RawUpstream:
        super().__enter__()
        return self

    # ---- one connection ---------------------------------------------------------------

    def _serve_one(self, sock: socket.socket, seen: Seen) -> bool:
        with self.lock:
            self.seen.append(seen)
        return self._answer(sock, seen)

    def _send(self, sock: socket.socket, status: int, body: bytes, ctype: str) -> None:
        head = (
            f"HTTP/1.1 {status} X\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode()
        sock.sendall(head + body)

    def _answer(self, sock: socket.socket, seen: Seen) -> bool:
        """Answer one request; False when the connection is finished with."""
        path = seen.target.split("?")[0]
        if path.endswith("/truncate"):
            head = (
                "HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
                f"content-length: {TRUNCATED_TOTAL}\r\n\r\n"
            ).encode()
            sock.sendall(head + b"x" * TRUNCATED_SENT)
            # A reset, not a clean close: what a crashed upstream looks like.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
            return False
        marked = seen.header("x-compaction-purpose") is not None or "/drip/" in path
        if marked and self.llm_mode == "drip":
            return self._drip(sock)
        if seen.method == "POST" and b'"big please"' in seen.body:
            # A 20 MB answer (think many choices with log-probabilities), usage at its end.
            answer = completion("x" * BIG_ANSWER_CHARS)
            self._send(sock, 200, json.dumps(answer).encode(), "application/json")
            return True
        if path.endswith("/chat/completions") and seen.method == "POST":
            data = seen.json or {}
            if data.get("stream") is True:
                sock.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                for event in sse_crlf_events():
                    sock.sendall(b"%x\r\n%s\r\n" % (len(event), event))
                sock.sendall(b"0\r\n\r\n")
                return True
            self._send(sock, 200, json.dumps(completion()).encode(), "application/json")
            return True
        body = json.dumps({"object": "list", "data": [], "path": seen.target}).encode()
        self._send(sock, 200, body, "application/json")
        return True

    def _drip(self, sock: socket.socket) -> bool:
        """A completion sent one byte every 50 ms, taking ``drip_s`` in all."""
        payload = json.dumps(completion('{"boundary_index": null}')).encode()
        head = (
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n\r\n"
        ).encode()
        try:
            sock.sendall(head)
            started = time.monotonic()
            sent = 0
            while sent < len(payload) - 1:
                if time.monotonic() - started >= self.drip_s * (sent + 1) / len(payload):
                    sock.sendall(payload[sent : sent + 1])
                    sent += 1
                time.sleep(0.05)
            sock.sendall(payload[sent:])
        except OSError:
            return False  # the proxy gave up and closed: what a deadline does
        with self.lock:
            self.drips_finished += 1
        return False


def raw_request(
    port: int, method: str, target: str, headers: dict[str, bytes] | None = None, body: bytes = b""
) -> tuple[int, dict[str, str], bytes]:
    """Send one request with ``target`` byte for byte (no client normalises it)."""
    lines = [f"{method} {target} HTTP/1.1".encode(), f"host: 127.0.0.1:{port}".encode()]
    for name, value in (headers or {}).items():
        lines.append(name.encode() + b": " + value)
    lines += [b"connection: close", f"content-length: {len(body)}".encode()]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    parsed = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        parsed[name.strip().lower()] = value.strip()
    if parsed.get("transfer-encoding") == "chunked":
        out = b""
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            out += rest[:size]
            rest = rest[size + 2 :]
        rest = out
    return int(status_line.split(" ")[1]), parsed, rest
