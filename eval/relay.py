"""A recording relay between the proxy and the model server.

It records the body of every request the proxy forwards, so the evaluation measures the
forwarded text itself. The proxy's own detector and summarizer calls (marked by the
``x-compaction-purpose`` header) go on to the model; the conversation's main requests are
answered with a short canned reply unless ``forward_main`` is set (the conversations are
scripted: the model's answers to them are never used, and on a real endpoint they would only
cost money).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx


class Relay:
    """``with Relay(upstream) as relay:`` serves on ``relay.url`` in a background thread."""

    def __init__(self, upstream: str, api_key: str | None = None, forward_main: bool = False):
        self.upstream = upstream.rstrip("/")
        self.api_key = api_key
        self.forward_main = forward_main
        self.main: list[dict[str, Any]] = []  # forwarded conversation requests, in order
        self.llm: list[dict[str, Any]] = []  # {"purpose", "request", "reply", "seconds"}
        self._lock = threading.Lock()
        self._client = httpx.Client(timeout=600)
        relay = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:  # /v1/models and the like
                relay._pass(self, None)

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                relay._pass(self, body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> Relay:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._client.close()

    def _headers(self, handler: BaseHTTPRequestHandler) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        auth = handler.headers.get("authorization")
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        elif auth:
            headers["authorization"] = auth
        return headers

    def _pass(self, handler: BaseHTTPRequestHandler, body: dict[str, Any] | None) -> None:
        path = handler.path.removeprefix("/v1")
        purpose = handler.headers.get("x-compaction-purpose")
        if body is not None and purpose is None:
            with self._lock:
                self.main.append(body)
            if not self.forward_main:
                return _reply(handler, 200, canned(body))
        started = time.monotonic()
        try:
            if body is None:
                response = self._client.get(self.upstream + path, headers=self._headers(handler))
            else:
                response = self._client.post(
                    self.upstream + path, json=body, headers=self._headers(handler)
                )
            status, payload = response.status_code, response.content
        except httpx.HTTPError as exc:
            status = 502
            payload = json.dumps({"error": {"message": type(exc).__name__}}).encode()
        if body is not None and purpose is not None:
            try:
                reply = json.loads(payload)
            except ValueError:
                reply = None
            with self._lock:
                self.llm.append(
                    {
                        "purpose": purpose,
                        "request": body,
                        "reply": reply,
                        "status": status,
                        "seconds": time.monotonic() - started,
                    }
                )
        _reply(handler, status, payload)


def canned(body: dict[str, Any]) -> bytes:
    """A minimal, valid chat completion."""
    return json.dumps(
        {
            "id": "chatcmpl-eval",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "eval"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "OK."},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1},
        }
    ).encode()


def _reply(handler: BaseHTTPRequestHandler, status: int, payload: bytes) -> None:
    handler.send_response(status)
    handler.send_header("content-type", "application/json")
    handler.send_header("content-length", str(len(payload)))
    handler.end_headers()
    handler.wfile.write(payload)
