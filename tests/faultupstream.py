"""An upstream that fails on cue, for the fault run of the real client path (issue #29 item
4): each client call names, in its ``x-fault`` header, what the upstream does on each of its
attempts (``reset,429,ok``), and the official clients' ``x-stainless-retry-count`` header
says which attempt a request is. So the script holds however the proxy pools connections,
and every request the upstream receives is recorded by (call, attempt): a request the proxy
sent twice for one attempt shows up as a duplicate.

Faults: ``reset`` (the request is read, then the connection reset), ``hang`` (read, never
answered), ``drip`` (the head and a few bytes, then silence), ``garbage`` (bytes that are not
HTTP), ``429`` (with ``retry-after``), ``500``, and ``ok`` (an answer in the route's shape,
streamed when asked).
"""

from __future__ import annotations

import json
import socket
import struct
from collections import Counter
from typing import Any

from tests.rawupstream import Seen, SocketUpstream, completion, sse_crlf_events

UPSTREAM_500 = b'{"error": {"message": "the upstream itself failed", "type": "server_error"}}'
HANG_S = 120.0  # a backstop: the proxy gives up long before


def anthropic_message() -> dict[str, Any]:
    return {
        "id": "msg_fault", "type": "message", "role": "assistant", "model": "claude-fault",
        "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
        "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": 1},
    }  # fmt: skip


def anthropic_events() -> list[bytes]:
    message = dict(anthropic_message(), content=[], stop_reason=None)
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", {"type": "message_start", "message": message}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "ok"}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "usage": {"output_tokens": 1},
                           "delta": {"stop_reason": "end_turn", "stop_sequence": None}}),
        ("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip
    return [f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events]


class FaultUpstream(SocketUpstream):
    """``with FaultUpstream() as up``: ``up.attempts[(call, attempt)]`` counts the requests
    received for each attempt of each call (``x-test-call``, ``x-stainless-retry-count``)."""

    def __init__(self) -> None:
        self.attempts: Counter[tuple[str, int]] = Counter()
        self.faults: Counter[str] = Counter()
        super().__init__()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> FaultUpstream:
        super().__enter__()
        return self

    def _serve_one(self, sock: socket.socket, seen: Seen) -> bool:
        return self._answer(sock, seen, self._fault(seen))

    def _fault(self, seen: Seen) -> str:
        call = (seen.header("x-test-call") or b"?").decode()
        attempt = int(seen.header("x-stainless-retry-count") or b"0")
        script = (seen.header("x-fault") or b"ok").decode().split(",")
        fault = script[min(attempt, len(script) - 1)]
        with self.lock:
            self.attempts[(call, attempt)] += 1
            self.faults[fault] += 1
        return fault

    def _answer(self, sock: socket.socket, seen: Seen, fault: str) -> bool:
        """Answer (or fail) one request; False when the connection is finished with."""
        if fault == "reset":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
            return False
        if fault in ("hang", "drip"):
            if fault == "drip":
                sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: 500\r\n\r\n{\"id\": ")  # fmt: skip
            sock.settimeout(HANG_S)
            try:
                while sock.recv(65536):  # until the proxy gives up and closes
                    pass
            except OSError:
                pass
            return False
        if fault == "garbage":
            sock.sendall(b"\x16\x03\x01\x00 this is not HTTP at all \x00\xff\r\n\r\n")
            sock.close()
            return False
        if fault == "429":
            body = b'{"error": {"message": "slow down", "type": "rate_limit_error"}}'
            self._send(sock, 429, body, "retry-after: 0\r\nretry-after-ms: 20\r\n")
            return True
        if fault == "500":
            self._send(sock, 500, UPSTREAM_500)
            return True
        return self._ok(sock, seen)

    def _ok(self, sock: socket.socket, seen: Seen) -> bool:
        anthropic = seen.target.split("?")[0].endswith("/messages")
        if (seen.json or {}).get("stream") is True:
            events = anthropic_events() if anthropic else sse_crlf_events()
            sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
            for event in events:
                sock.sendall(b"%x\r\n%s\r\n" % (len(event), event))
            sock.sendall(b"0\r\n\r\n")
            return True
        answer = anthropic_message() if anthropic else completion()
        self._send(sock, 200, json.dumps(answer).encode())
        return True

    @staticmethod
    def _send(sock: socket.socket, status: int, body: bytes, extra: str = "") -> None:
        head = (
            f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n{extra}"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        sock.sendall(head + body)
