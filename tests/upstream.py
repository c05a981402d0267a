"""A scripted, recording OpenAI-compatible upstream for integration tests.

The proxy under test forwards client traffic here and also makes its own internal
calls (tagged with ``x-compaction-purpose: detector|summarizer``).  Every request is
recorded so tests can assert on exactly what the proxy sent upstream.

Failure injection is per request through headers (the proxy passes client headers
through), or per server through the ``*_mode`` attributes for internal calls that a
test cannot attach headers to.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import hashlib
import random
import re
import socket
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from proxy.core.sharedcall import MARK as SHARED_MARK
from tests.strict import check_chat, check_messages, check_responses

PURPOSE_HEADER = "x-compaction-purpose"
MODEL_IDS = ("scripted-large", "scripted-small")
DEFAULT_DETECTOR_REPLY = (
    '{"boundary_index": null, "boundary_reason": "", "confidence": 0.0, "summary": ""}'
)
TOOL_MARKER = re.compile(r"\[\[tool:([A-Za-z_][\w.-]*):(.*?)\]\]", re.S)
CACHE_MIN_TOKENS = 1024  # OpenAI only caches prompts of >= 1024 tokens ...
CACHE_GRANULE = 128  # ... in increments of 128 tokens.
MODES = ("ok", "error500", "garbage", "slow", "empty")

_FILLER_WORDS = (
    "the refactor keeps the invoice pipeline stable while we trace each failing path through "
    "parser cache retry queue handler schema migration logging config worker and test fixture "
    "so that later changes stay small reviewable reversible and easy to verify against staging"
).split()


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    json: Any
    purpose: str | None
    query: str = ""
    at: float = field(default_factory=time.monotonic)
    peer: str = ""  # the proxy's end of the connection it came on (host:port)


def default_count_tokens(messages: Any) -> int:
    return len(orjson.dumps(messages)) // 4


def message_text(message: dict) -> str:
    """Text of a message whose content is a string or a list of content parts."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def all_text(message: dict) -> str:
    """Every text of a message, an Anthropic tool result's and a Responses item's too."""
    content = message.get("content", message.get("output"))
    if isinstance(content, list):
        return "\n".join(all_text(p) if "content" in p else str(p.get("text", ""))
                         for p in content if isinstance(p, dict))  # fmt: skip
    return content if isinstance(content, str) else ""


def filler_sentence(n: int, words: int = 40) -> str:
    rng = random.Random(f"filler:{n}")
    return " ".join(rng.choice(_FILLER_WORDS) for _ in range(words)).capitalize() + "."


def default_reply(request_json: dict) -> dict:
    messages = request_json.get("messages") or []
    last = messages[-1] if messages else {}
    if last.get("role") == "user":
        match = TOOL_MARKER.search(message_text(last))
        if match:
            name, args = match.group(1), match.group(2)
            digest = hashlib.sha1(f"{len(messages)}:{name}".encode()).hexdigest()[:12]
            call = {
                "id": f"call_{digest}",
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            return {"role": "assistant", "content": None, "tool_calls": [call]}
    turn = sum(1 for m in messages if m.get("role") == "user")
    return {"role": "assistant", "content": f"Acknowledged turn {turn}. {filler_sentence(turn)}"}


def default_detector(request_json: dict) -> str:
    return DEFAULT_DETECTOR_REPLY


def default_summarizer(request_json: dict) -> str:
    """Extractive: keep only the FACT lines/sentences of the transcript, so a test can
    check which facts survive successive compactions without a real model."""
    messages = request_json.get("messages") or []
    users = [m for m in messages if m.get("role") == "user"]
    transcript = message_text(users[-1]) if users else ""
    if SHARED_MARK in transcript:
        # The summarizer call in the client's shape: the conversation itself, then the ask.
        whole = "\n".join(all_text(m) for m in messages)
        transcript = whole.partition(SHARED_MARK)[0]
    facts: list[str] = []
    for line in transcript.splitlines():
        for sentence in re.split(r"(?<=[.!?])\s+", line):
            sentence = sentence.strip()
            if "FACT" in sentence and sentence not in facts:
                facts.append(sentence)
    return "\n".join(facts) if facts else transcript[:200]


def strip_marks(value: Any) -> Any:
    """``value`` without any ``cache_control``, at any depth."""
    if isinstance(value, dict):
        return {k: strip_marks(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [strip_marks(v) for v in value]
    return value


def cache_view(messages: Any) -> Any:
    """What a provider's prompt cache keys on: the content, not where the breakpoints sit
    (Anthropic's ``cache_control`` moves from request to request and reads the cache the
    last one wrote), and a string content as the one text block it stands for."""
    if not isinstance(messages, list):
        return messages
    out = []
    for m in strip_marks(messages):
        if isinstance(m, dict) and isinstance(m.get("content"), str):
            m = {**m, "content": [{"type": "text", "text": m["content"]}]}
        out.append(m)
    return out


def common_prefix_len(a: bytes, b: bytes) -> int:
    # Binary search over slice equality: memcmp-fast, unlike a per-byte Python loop.
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def error_body(status: int, message: str | None = None) -> dict:
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        429: "rate_limit_error",
    }.get(status, "server_error" if status >= 500 else "api_error")
    return {
        "error": {
            "message": message or f"scripted upstream error {status}",
            "type": kind,
            "code": f"scripted_{status}",
            "param": None,
        }
    }


class ScriptedUpstream:
    def __init__(
        self,
        *,
        reply: Callable[[dict], dict] = default_reply,
        detector: Callable[[dict], str] = default_detector,
        summarizer: Callable[[dict], str] = default_summarizer,
        count_tokens: Callable[[Any], int] = default_count_tokens,
        detector_mode: str = "ok",
        summarizer_mode: str = "ok",
        error_mode: str = "ok",
        cache_simulation: bool = True,
        slow_seconds: float = 30.0,
        host: str = "127.0.0.1",
        strict: bool = True,
        alternation: bool = True,
        expect_rejections: bool = False,
        refuse: Callable[[dict], str | None] | None = None,
    ) -> None:
        """``strict``: answer 400, as the real provider would, to what it rejects (see
        tests/strict.py) and record it in ``rejections``; leaving the ``with`` block then
        fails the test unless ``expect_rejections``. ``alternation=False`` lets a test send
        consecutive same-role Anthropic turns on purpose (the real API merges them).
        ``refuse``: one more rule of the provider's, for a test (the reason for a 400, or
        None), applied to the chat routes' bodies after the strict checks."""
        self.reply, self.detector, self.summarizer = reply, detector, summarizer
        self.count_tokens = count_tokens
        self.detector_mode, self.summarizer_mode = detector_mode, summarizer_mode
        self.error_mode = error_mode
        self.cache_simulation = cache_simulation
        self.slow_seconds = slow_seconds
        self.host, self.port = host, 0
        self.strict, self.alternation = strict, alternation
        self.expect_rejections = expect_rejections
        self.refuse = refuse
        self.requests: list[Recorded] = []
        # ``x-test-flood: N:PAD``: set once a flooded stream's last byte went to the socket.
        self.flooded = threading.Event()
        # Set when a stream's reader went away before its last event (the proxy ended the
        # upstream request: its client left).
        self.stream_cut = threading.Event()
        self.rejections: list[dict[str, Any]] = []
        self.cached_log: list[tuple[int, int]] = []
        self._history: deque[bytes] = deque(maxlen=64)
        self._lock = threading.Lock()
        self._ids = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._wrap(self._chat), methods=["POST"]),
                Route("/v1/messages", self._wrap(self._messages), methods=["POST"]),
                Route(
                    "/v1/messages/count_tokens", self._wrap(self._count_tokens), methods=["POST"]
                ),
                Route("/v1/responses", self._wrap(self._responses), methods=["POST"]),
                Route("/v1/models", self._wrap(self._models), methods=["GET"]),
                Route("/v1/embeddings", self._wrap(self._embeddings), methods=["POST"]),
                Route("/v1/slow", self._wrap(self._slow), methods=["GET"]),
                Route(
                    "/{path:path}",
                    self._wrap(self._echo),
                    methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"],
                ),
            ]
        )

    # ----------------------------------------------------------------- lifecycle
    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> ScriptedUpstream:
        # Bind ourselves so the port is known (and reserved) before uvicorn starts.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [sock]},
            name=f"scripted-upstream-{self.port}",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("scripted upstream failed to start")
            time.sleep(0.01)
        with socket.create_connection((self.host, self.port), timeout=5):
            pass
        return self

    def stop(self) -> None:
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout=5)
        if self._thread.is_alive():  # a "slow" handler is still sleeping
            self._server.force_exit = True
            self._thread.join(timeout=5)
        self._server = self._thread = None

    def __enter__(self) -> ScriptedUpstream:
        return self.start()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.stop()
        if exc_type is None and self.rejections and not self.expect_rejections:
            raise AssertionError(f"the strict upstream rejected requests: {self.rejections}")

    # ------------------------------------------------------------------- records
    def chat_requests(self, purpose: str | None = None) -> list[Recorded]:
        with self._lock:
            return [
                r
                for r in self.requests
                if r.path == "/v1/chat/completions" and r.purpose == purpose
            ]

    def summarizer_calls(self) -> list[Recorded]:
        """The proxy's summarizer calls on any route: the standalone ones (chat completions)
        and those in the client's own shape (``proxy.core.sharedcall``)."""
        with self._lock:
            return [r for r in self.requests if r.purpose == "summarizer"]

    def clear(self) -> None:
        self.stream_cut.clear()
        with self._lock:
            self.requests.clear()
            self.rejections.clear()
            self.cached_log.clear()
            self._history.clear()

    def reset(self) -> None:
        """clear() plus all run-time switches back to healthy, for module-scoped servers."""
        self.clear()
        self.detector_mode = self.summarizer_mode = self.error_mode = "ok"

    # ------------------------------------------------------------------ plumbing
    def _wrap(self, handler: Callable[[Request, Recorded], Any]) -> Callable[[Request], Any]:
        """Record the request, then apply header-driven failure injection."""

        async def endpoint(request: Request) -> Response:
            body = await request.body()
            try:
                parsed = orjson.loads(body) if body else None
            except orjson.JSONDecodeError:
                parsed = None
            headers = {k.lower(): v for k, v in request.headers.items()}
            rec = Recorded(
                request.method,
                request.url.path,
                headers,
                body,
                parsed,
                headers.get(PURPOSE_HEADER),
                request.url.query,
                peer=f"{request.client.host}:{request.client.port}" if request.client else "",
            )
            with self._lock:
                self.requests.append(rec)
            delay = _float(headers.get("x-test-delay"))
            if delay:
                await self._sleep(delay)
            status = _float(headers.get("x-test-status"))
            if status and int(status) != 200:
                return JSONResponse(error_body(int(status)), status_code=int(status))
            return await handler(request, rec)

        return endpoint

    def _rejected(
        self, rec: Recorded, reason: str | None, anthropic: bool = False
    ) -> Response | None:
        """The provider's 400 for what it would reject, recorded; None when acceptable."""
        if not self.strict or reason is None:
            return None
        with self._lock:
            self.rejections.append({"path": rec.path, "purpose": rec.purpose, "reason": reason})
        if anthropic:
            return JSONResponse(
                {"type": "error", "error": {"type": "invalid_request_error", "message": reason}},
                status_code=400,
            )
        return JSONResponse(error_body(400, reason), status_code=400)

    def _check(self, reason: str | None, body: dict) -> str | None:
        if reason is None and self.refuse is not None:
            return self.refuse(body)
        return reason

    async def _sleep(self, seconds: float) -> None:
        # Sleep in slices so stop() never waits on (or has to cancel) a scripted delay.
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self._server is None or self._server.should_exit:
                return
            await asyncio.sleep(min(left, 0.05))

    def _next_id(self) -> str:
        with self._lock:
            self._ids += 1
            return f"chatcmpl-scripted{self._ids:06d}"

    def _cached_tokens(self, messages: Any, prompt_tokens: int) -> int:
        serial = orjson.dumps(cache_view(messages))
        with self._lock:
            best = max((common_prefix_len(serial, old) for old in self._history), default=0)
            self._history.append(serial)
        if not self.cache_simulation or not serial:
            return 0
        tokens = int(best / len(serial) * prompt_tokens)
        return 0 if tokens < CACHE_MIN_TOKENS else tokens // CACHE_GRANULE * CACHE_GRANULE

    async def _scripted(self, rec: Recorded, chat_body: dict) -> str | Response:
        """The detector's or summarizer's text for a call of the proxy's own (its mode
        applied), or the error response the mode asks for."""
        assert rec.purpose is not None
        mode = self.detector_mode if rec.purpose == "detector" else self.summarizer_mode
        if mode == "error500":
            return JSONResponse(error_body(500, f"{rec.purpose} exploded"), status_code=500)
        if mode == "slow":
            await self._sleep(self.slow_seconds)
        if mode == "garbage":
            return "lol not json at all"
        if mode == "empty":
            return ""
        fn = self.detector if rec.purpose == "detector" else self.summarizer
        return fn(chat_body)

    async def _reply(self, rec: Recorded, chat_body: dict) -> dict | Response:
        """The scripted reply to a Messages or Responses request: the client's, or the
        summarizer's to a call in the client's shape (``proxy.core.sharedcall``)."""
        if rec.purpose not in ("detector", "summarizer"):
            return self.reply(chat_body)
        text = await self._scripted(rec, chat_body)
        return text if isinstance(text, Response) else {"role": "assistant", "content": text}

    # ------------------------------------------------------------------ handlers
    async def _chat(self, request: Request, rec: Recorded) -> Response:
        body = rec.json
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return JSONResponse(error_body(400, "'messages' is required"), status_code=400)
        messages = body["messages"]
        if (rejected := self._rejected(rec, self._check(check_chat(body), body))) is not None:
            return rejected
        if rec.purpose in ("detector", "summarizer"):
            text = await self._scripted(rec, body)
            if isinstance(text, Response):
                return text
            message: dict = {"role": "assistant", "content": text}
            # The summarizer call in the client's shape reads the conversation's cache.
            cached = None if SHARED_MARK in orjson.dumps(messages[-1:]).decode() else 0
        else:
            if self.error_mode == "malformed":
                return Response(
                    b"<html>upstream hiccup, definitely not json",
                    status_code=200,
                    media_type="application/json",
                )
            message = self.reply(body)
            cached = None  # computed below once prompt_tokens is known
        prompt_tokens = self.count_tokens(messages)
        if cached is None:
            cached = self._cached_tokens(messages, prompt_tokens)
            if rec.purpose is None:  # (the log is the client's requests')
                with self._lock:
                    self.cached_log.append((prompt_tokens, cached))
        completion_tokens = max(1, self.count_tokens([message]))
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        model = body.get("model") or MODEL_IDS[0]
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            delay = _float(rec.headers.get("x-test-stream-delay"))
            chunks = _stream_chunks(
                self._next_id(), model, message, finish, usage if include_usage else None
            )
            # x-test-close-delay: keep the connection open that long after [DONE].
            linger = _float(rec.headers.get("x-test-close-delay"))
            events = _cut_watched(_sse(chunks, delay, linger, self._sleep), self.stream_cut)
            if flood := rec.headers.get("x-test-flood"):
                n, pad = (int(x) for x in flood.split(":"))
                events = _flooded(_sse(_flood_chunks(chunks, n, pad), 0.0), self.flooded)
            if _gzip_asked(rec):
                return StreamingResponse(
                    _gzip_stream(events),
                    media_type="text/event-stream",
                    headers={"content-encoding": "gzip"},
                )
            return StreamingResponse(events, media_type="text/event-stream")
        answer = {
            "id": self._next_id(),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": "fp_scripted",
            "choices": [
                {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            ],
            "usage": usage,
        }
        if _gzip_asked(rec):
            return Response(
                gzip.compress(orjson.dumps(answer)),
                media_type="application/json",
                headers={"content-encoding": "gzip"},
            )
        return JSONResponse(answer)

    async def _messages(self, request: Request, rec: Recorded) -> Response:
        """Anthropic's Messages API, scripted like the chat route (same reply rules)."""
        body = rec.json
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return JSONResponse(
                {
                    "type": "error",
                    "error": {
                        "type": "invalid_request_error",
                        "message": "messages: Field required",
                    },
                },
                status_code=400,
            )
        reason = self._check(check_messages(body, alternation=self.alternation), body)
        if (rejected := self._rejected(rec, reason, anthropic=True)) is not None:
            return rejected
        as_openai = [{"role": m.get("role"), "content": m.get("content")} for m in body["messages"]]
        reply = await self._reply(rec, {"messages": as_openai})
        if isinstance(reply, Response):
            return reply
        blocks: list[dict] = []
        if reply.get("reasoning"):
            blocks.append(
                {
                    "type": "thinking",
                    "thinking": reply["reasoning"],
                    "signature": opaque_blob(f"{len(self.requests)}:{reply['reasoning']}"),
                }
            )
        if reply.get("content"):
            blocks.append({"type": "text", "text": reply["content"]})
        for call in reply.get("tool_calls") or []:
            blocks.append(
                {
                    "type": "tool_use",
                    "id": "toolu_" + call["id"][5:],
                    "name": call["function"]["name"],
                    "input": orjson.loads(call["function"]["arguments"] or "{}"),
                }
            )
        counted = (
            [{"role": "system", "content": body["system"]}] if body.get("system") else []
        ) + body["messages"]
        prompt_tokens = self.count_tokens(counted)
        cached = self._cached_tokens(counted, prompt_tokens)
        if rec.purpose is None:  # (the log is the client's requests')
            with self._lock:
                self.cached_log.append((prompt_tokens, cached))
        usage = {
            "input_tokens": prompt_tokens - cached,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
            "output_tokens": max(1, self.count_tokens([reply])),
        }
        stop = "tool_use" if reply.get("tool_calls") else "end_turn"
        message = {
            "id": self._next_id().replace("chatcmpl", "msg"),
            "type": "message",
            "role": "assistant",
            "model": body.get("model"),
            "content": blocks,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": usage,
        }
        if not body.get("stream"):
            return JSONResponse(message)
        return StreamingResponse(_anthropic_sse(message), media_type="text/event-stream")

    async def _count_tokens(self, request: Request, rec: Recorded) -> Response:
        """Anthropic's /v1/messages/count_tokens, counted like the prompt of a request."""
        body = rec.json if isinstance(rec.json, dict) else {}
        if not isinstance(body.get("messages"), list):
            return JSONResponse(
                {
                    "type": "error",
                    "error": {
                        "type": "invalid_request_error",
                        "message": "messages: Field required",
                    },
                },
                status_code=400,
            )
        counted = (
            [{"role": "system", "content": body["system"]}] if body.get("system") else []
        ) + body["messages"]
        return JSONResponse({"input_tokens": self.count_tokens(counted)})

    async def _responses(self, request: Request, rec: Recorded) -> Response:
        """OpenAI's Responses API, scripted like the chat route (same reply rules)."""
        body = rec.json
        if not isinstance(body, dict) or not isinstance(body.get("input"), str | list):
            return JSONResponse(error_body(400, "'input' is required"), status_code=400)
        if (rejected := self._rejected(rec, self._check(check_responses(body), body))) is not None:
            return rejected
        items = body["input"]
        items = [{"role": "user", "content": items}] if isinstance(items, str) else items
        as_chat = []
        for item in items:
            if item.get("type") == "function_call_output":
                as_chat.append({"role": "tool", "content": item.get("output")})
            elif item.get("type") == "function_call":
                as_chat.append({"role": "assistant", "content": None})
            else:
                as_chat.append({"role": item.get("role"), "content": item.get("content")})
        reply = await self._reply(rec, {"messages": as_chat})
        if isinstance(reply, Response):
            return reply
        n = self._next_id()[-6:]
        output: list[dict] = []
        if reply.get("reasoning"):
            output.append(
                reasoning_item(
                    n,
                    reply["reasoning"],
                    "reasoning.encrypted_content" in (body.get("include") or []),
                )
            )
        if reply.get("content"):
            output.append(
                {
                    "type": "message",
                    "id": f"msg_{n}",
                    "status": "completed",
                    "role": "assistant",
                    "content": [
                        {"type": "output_text", "text": reply["content"], "annotations": []}
                    ],
                }
            )
        for i, call in enumerate(reply.get("tool_calls") or []):
            output.append(
                {
                    "type": "function_call",
                    "id": f"fc_{n}_{i}",
                    "call_id": call["id"],
                    "name": call["function"]["name"],
                    "arguments": call["function"]["arguments"],
                    "status": "completed",
                }
            )
        counted = (
            [{"role": "system", "content": body["instructions"]}]
            if body.get("instructions")
            else []
        ) + items
        prompt_tokens = self.count_tokens(counted)
        cached = self._cached_tokens(counted, prompt_tokens)
        if rec.purpose is None:  # (the log is the client's requests')
            with self._lock:
                self.cached_log.append((prompt_tokens, cached))
        completion = max(1, self.count_tokens([reply]))
        response = {
            "id": f"resp_{n}",
            "object": "response",
            "created_at": int(time.time()),
            "status": "completed",
            "model": body.get("model"),
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": {
                "input_tokens": prompt_tokens,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt_tokens + completion,
            },
        }
        if not body.get("stream"):
            return JSONResponse(response)

        return StreamingResponse(_responses_sse(response), media_type="text/event-stream")

    async def _models(self, request: Request, rec: Recorded) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"id": m, "object": "model", "created": 1700000000, "owned_by": "scripted"}
                    for m in MODEL_IDS
                ],
            }
        )

    async def _embeddings(self, request: Request, rec: Recorded) -> Response:
        body = rec.json if isinstance(rec.json, dict) else {}
        inputs = body.get("input", "")
        inputs = [inputs] if isinstance(inputs, str) or not isinstance(inputs, list) else inputs
        if inputs and isinstance(inputs[0], int):  # a single pre-tokenised input
            inputs = [inputs]
        data = []
        for i, item in enumerate(inputs):
            digest = hashlib.sha256(orjson.dumps(item)).digest()
            vec = [round(b / 127.5 - 1.0, 6) for b in digest[:8]]
            emb: Any = vec
            if body.get("encoding_format") == "base64":  # the openai client asks for this
                emb = base64.b64encode(struct.pack("<8f", *vec)).decode()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        tokens = sum(len(orjson.dumps(x)) // 4 for x in inputs)
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": body.get("model") or MODEL_IDS[0],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def _slow(self, request: Request, rec: Recorded) -> Response:
        return JSONResponse({"slow": True, "delay": _float(rec.headers.get("x-test-delay"))})

    async def _echo(self, request: Request, rec: Recorded) -> Response:
        return JSONResponse(
            {
                "method": rec.method,
                "path": rec.path,
                "query": rec.query,
                "body": rec.body.decode("utf-8", "replace"),
            }
        )


def _float(value: str | None) -> float:
    try:
        return float(value) if value else 0.0
    except ValueError:
        return 0.0


def _flood_chunks(chunks: list[dict], n: int, pad: int) -> Iterator[dict]:
    """``n`` chunks of ``"<i>:" + pad x's`` each between the answer's first chunk (its role)
    and its last ones (finish, usage), in place of the scripted reply's own text."""
    first, *last = chunks
    yield first
    filler = "x" * pad
    for i in range(n):
        yield {**first, "choices": [{**first["choices"][0], "delta": {"content": f"{i}:{filler}"}}]}
    yield from (c for c in last if not (c["choices"] and c["choices"][0]["delta"].get("content")))


async def _cut_watched(events: AsyncIterator[bytes], cut: threading.Event):
    """``events``; ``cut`` set when they are stopped before their end (Starlette cancels a
    streaming response whose client disconnected)."""
    ended = False
    try:
        async for event in events:
            yield event
        ended = True
    finally:
        if not ended:
            cut.set()


async def _flooded(events: AsyncIterator[bytes], done: threading.Event):
    """``events`` as fast as the reader takes them; ``done`` set once the last was sent
    (Starlette asks for the next event once the last one's ``send`` returned)."""
    async for event in events:
        yield event
    done.set()


def _stream_chunks(
    cid: str, model: str, message: dict, finish: str, usage: dict | None
) -> list[dict]:
    """OpenAI-shaped chat.completion.chunk objects for one assistant message."""
    created = int(time.time())

    def chunk(delta: dict, finish_reason: str | None = None) -> dict:
        out = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": "fp_scripted",
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ],
        }
        if usage is not None:
            out["usage"] = None  # OpenAI sends an explicit null until the final chunk
        return out

    chunks = [chunk({"role": "assistant", "content": ""})]
    for i, call in enumerate(message.get("tool_calls") or []):
        fn = call["function"]
        chunks.append(
            chunk(
                {
                    "tool_calls": [
                        {
                            "index": i,
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": fn["name"], "arguments": ""},
                        }
                    ]
                }
            )
        )
        args = fn.get("arguments") or ""
        for j in range(0, len(args), 16):
            chunks.append(
                chunk({"tool_calls": [{"index": i, "function": {"arguments": args[j : j + 16]}}]})
            )
    content = message.get("content") or ""
    pieces = re.findall(r"\S+\s*|\s+", content)
    for j in range(0, len(pieces), 4):
        chunks.append(chunk({"content": "".join(pieces[j : j + 4])}))
    chunks.append(chunk({}, finish))
    if usage is not None:
        final = chunk({})
        final["choices"], final["usage"] = [], usage
        chunks.append(final)
    return chunks


async def _anthropic_sse(message: dict):
    def event(name: str, data: dict) -> bytes:
        return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    usage = message["usage"]
    start = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
    yield event("message_start", {"type": "message_start", "message": start})
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            yield event(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": i,
                    "content_block": {"type": "text", "text": ""},
                },
            )
            for piece in re.findall(r"\S+\s*", block["text"]):
                yield event(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": i,
                        "delta": {"type": "text_delta", "text": piece},
                    },
                )
        elif block["type"] == "thinking":
            yield event(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": i,
                    "content_block": {"type": "thinking", "thinking": "", "signature": ""},
                },
            )
            yield event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": i,
                    "delta": {"type": "thinking_delta", "thinking": block["thinking"]},
                },
            )
            yield event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": i,
                    "delta": {"type": "signature_delta", "signature": block["signature"]},
                },
            )
        else:
            yield event(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": i,
                    "content_block": {**block, "input": {}},
                },
            )
            yield event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": i,
                    "delta": {
                        "type": "input_json_delta",
                        "partial_json": orjson.dumps(block["input"]).decode(),
                    },
                },
            )
        yield event("content_block_stop", {"type": "content_block_stop", "index": i})
    yield event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
            "usage": {"output_tokens": usage["output_tokens"]},
        },
    )
    yield event("message_stop", {"type": "message_stop"})


def opaque_blob(text: str) -> str:
    """Stands in for a provider's encrypted reasoning or thinking signature: opaque base64,
    different for every response (as the providers' are), that always starts "gAAAAB"."""
    digest = hashlib.sha256(text.encode()).digest()
    return "gAAAAB" + base64.b64encode(digest * 8).decode()


def reasoning_item(n: str, text: str, encrypted: bool) -> dict:
    """A Responses API reasoning output item (the summary is what the user may see)."""
    item = {
        "type": "reasoning",
        "id": f"rs_{n}",
        "summary": [{"type": "summary_text", "text": text}],
    }
    if encrypted:
        item["encrypted_content"] = opaque_blob(f"{n}:{text}")
    return item


async def _responses_sse(response: dict):
    """The Responses API's streaming events for a finished response, in the order OpenAI
    sends them: clients such as Codex build their history from ``output_item.done``."""
    seq = 0

    def event(data: dict) -> bytes:
        nonlocal seq
        data = {"type": data["type"], "sequence_number": seq, **data}
        seq += 1
        return b"event: " + data["type"].encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    started = {**response, "status": "in_progress", "output": [], "usage": None}
    yield event({"type": "response.created", "response": started})
    yield event({"type": "response.in_progress", "response": started})
    for i, item in enumerate(response["output"]):
        if item["type"] == "message":
            yield event(
                {
                    "type": "response.output_item.added",
                    "output_index": i,
                    "item": {**item, "status": "in_progress", "content": []},
                }
            )
            for j, part in enumerate(item["content"]):
                where = {"item_id": item["id"], "output_index": i, "content_index": j}
                yield event(
                    {"type": "response.content_part.added", **where, "part": {**part, "text": ""}}
                )
                for piece in re.findall(r"\S+\s*|\s+", part["text"]):
                    yield event(
                        {
                            "type": "response.output_text.delta",
                            **where,
                            "delta": piece,
                            "logprobs": [],
                        }
                    )
                yield event(
                    {
                        "type": "response.output_text.done",
                        **where,
                        "text": part["text"],
                        "logprobs": [],
                    }
                )
                yield event({"type": "response.content_part.done", **where, "part": part})
        elif item["type"] == "function_call":
            yield event(
                {
                    "type": "response.output_item.added",
                    "output_index": i,
                    "item": {**item, "status": "in_progress", "arguments": ""},
                }
            )
            yield event(
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": item["id"],
                    "output_index": i,
                    "delta": item["arguments"],
                }
            )
            yield event(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": i,
                    "arguments": item["arguments"],
                }
            )
        else:
            yield event({"type": "response.output_item.added", "output_index": i, "item": item})
        yield event({"type": "response.output_item.done", "output_index": i, "item": item})
    yield event({"type": "response.completed", "response": response})


def _gzip_asked(rec: Recorded) -> bool:
    """``x-test-gzip: 1`` and a request that accepts gzip: the answer is compressed, as a
    provider may compress it."""
    accepted = rec.headers.get("accept-encoding", "")
    return rec.headers.get("x-test-gzip") == "1" and "gzip" in accepted


async def _gzip_stream(parts: Any) -> Any:
    """``parts`` gzip-compressed, each flushed so it can be decoded as it arrives."""
    packer = zlib.compressobj(wbits=31)
    async for part in parts:
        yield packer.compress(part) + packer.flush(zlib.Z_SYNC_FLUSH)
    yield packer.flush()


async def _sse(chunks: Iterable[dict], delay: float, linger: float = 0.0, sleep=asyncio.sleep):
    for i, c in enumerate(chunks):
        if delay and i:
            await asyncio.sleep(delay)
        yield b"data: " + orjson.dumps(c) + b"\n\n"
    yield b"data: [DONE]\n\n"
    if linger:
        await sleep(linger)
