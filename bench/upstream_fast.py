"""A minimal, fast OpenAI-compatible upstream for the overhead benchmark.

    python -m bench.upstream_fast --port 8765 [--host 127.0.0.1] [--delay-ms 0]

An ``asyncio.Protocol`` over ``httptools`` (uvloop when installed) answering every
``POST /v1/chat/completions`` with the same fixed reply, as JSON or, when the body asks for
``"stream": true``, as server-sent events (with a usage chunk when ``include_usage`` is
asked for). ``GET /v1/models`` lists the one model; anything else is a 404. HTTP/1.1
keep-alive, no logging, no JSON parsing of the request: the benchmark wants an upstream whose
own cost is a small, constant part of every row. ``--delay-ms`` holds every answer that long
(a provider's time to answer; the event loop stays free meanwhile). ``--drip-events N``
streams replies as a provider does: N events (the last one ``[DONE]``), each in a write of
its own, ``--drip-ms`` apart, so a proxy relays each on its own. ``--tls-cert``/``--tls-key``
serve it over HTTPS, as providers are (``bench.tlscert`` makes a pair). It prints
``ready <port>`` on stdout once it listens. Only ever bind it to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import sys
import time
from typing import Any

import httptools
import orjson

MODEL = "gpt-4o-mini"
REPLY_TEXT = "This is the fixed reply of the benchmark upstream; it never changes."
USAGE = {
    "prompt_tokens": 1000,
    "completion_tokens": 16,
    "total_tokens": 1016,
    "prompt_tokens_details": {"cached_tokens": 0},
}


def _completion(text: str = REPLY_TEXT) -> bytes:
    return orjson.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": MODEL,
            "system_fingerprint": "fp_bench",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": USAGE,
        }
    )


def _chunk(delta: dict[str, object], finish: str | None = None) -> dict[str, object]:
    return {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": MODEL,
        "system_fingerprint": "fp_bench",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


def _events(include_usage: bool) -> bytes:
    """The SSE body, each event as its own HTTP chunk (as a real upstream would frame it)."""
    words = REPLY_TEXT.split(" ")
    pieces = [" ".join(words[i : i + 4]) + " " for i in range(0, len(words), 4)]
    chunks = [_chunk({"role": "assistant", "content": ""})]
    chunks += [_chunk({"content": piece}) for piece in pieces]
    chunks.append(_chunk({}, "stop"))
    if include_usage:
        chunks.append(_usage_chunk())
    return b"".join(_http_chunk(c) for c in chunks) + _http_chunk(None) + STREAM_END


def _head(status: str, content_type: bytes, extra: bytes, keep_alive: bool) -> bytes:
    connection = b"keep-alive" if keep_alive else b"close"
    return (
        b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + content_type + b"\r\n"
        b"connection: " + connection + b"\r\n" + extra + b"\r\n"
    )


def _drip_events(count: int, usage: bool) -> list[bytes]:
    """A streamed reply of ``count`` events (HTTP chunks) as a provider sends one: its
    role, ``count - 3`` words, its finish, the usage when it was asked for (not counted),
    the last one [DONE]."""
    words = DRIP_WORDS[: max(count - 3, 0)]
    return [DRIP_ROLE, *words, DRIP_STOP, *((DRIP_USAGE,) if usage else ()), DRIP_DONE]


def _http_chunk(payload: dict[str, Any] | None) -> bytes:
    """One SSE event (``[DONE]`` for None) as one HTTP chunk."""
    event = b"data: " + (orjson.dumps(payload) if payload is not None else b"[DONE]") + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


def _usage_chunk() -> dict[str, Any]:
    final = _chunk({})
    final["choices"], final["usage"] = [], USAGE
    return final


STREAM_HEAD_START = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream"
STREAM_END = b"0\r\n\r\n"  # the last HTTP chunk
DRIP_ROLE = _http_chunk(_chunk({"role": "assistant", "content": ""}))
DRIP_WORDS = [_http_chunk(_chunk({"content": f"word{i} "})) for i in range(2_000)]
DRIP_STOP = _http_chunk(_chunk({}, "stop"))
DRIP_USAGE = _http_chunk(_usage_chunk())
DRIP_DONE = _http_chunk(None)
JSON_BODY = _completion()
STREAM_BODY = _events(include_usage=False)
STREAM_USAGE_BODY = _events(include_usage=True)
MODELS_BODY = orjson.dumps(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}
)
NOT_FOUND = orjson.dumps({"error": {"message": "not found", "type": "invalid_request_error"}})


def _stream_asked(body: bytes) -> tuple[bool, bool]:
    """Whether the body asks for streaming (and usage), without parsing the JSON."""
    stream = b'"stream":true' in body or b'"stream": true' in body
    usage = stream and (b'"include_usage":true' in body or b'"include_usage": true' in body)
    return stream, usage


# The proxy's summarizer requests carry a transcript (or, in the reduce step of a long span's
# map-reduce, the parts' summaries) under these headings; only those requests are parsed
# (while seeding records), never the measured ones.
SUMMARIZER_MARK = b"TRANSCRIPT ("
REDUCE_MARK = b"SUMMARIES OF CONSECUTIVE PARTS"
_LEAD = "The conversation so far covered these points: "


def summary_of(body: bytes) -> str:
    """A summary the proxy's checks accept: the transcript's lines that carry identifiers
    (a digit or a path), as a careful summarizer would keep them, ending with a sentence."""
    try:
        messages = orjson.loads(body)["messages"]
        transcript = str(messages[-1]["content"])
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        return REPLY_TEXT
    lines = [line.removeprefix(_LEAD).rstrip(".") for line in transcript.splitlines()[1:]]
    lines = [line.split(": ", 1)[-1].strip() for line in lines if not line.startswith("PART ")]
    kept = [line for line in lines if any(c.isdigit() for c in line) or "/" in line]
    text = " ".join(kept)[:1200].rsplit(" ", 1)[0]
    return f"{_LEAD}{text}."


def response_for(method: bytes, url: bytes, body: bytes, keep_alive: bool) -> bytes:
    path = url.split(b"?", 1)[0].rstrip(b"/")
    summarizing = SUMMARIZER_MARK in body or REDUCE_MARK in body
    if method == b"POST" and path.endswith(b"/chat/completions") and summarizing:
        summary = _completion(summary_of(body))
        length = b"content-length: %d\r\n" % len(summary)
        return _head("200 OK", b"application/json", length, keep_alive) + summary
    if method == b"POST" and path.endswith(b"/chat/completions"):
        stream, usage = _stream_asked(body)
        if stream:
            events = STREAM_USAGE_BODY if usage else STREAM_BODY
            head = _head(
                "200 OK", b"text/event-stream", b"transfer-encoding: chunked\r\n", keep_alive
            )
            return head + events
        length = b"content-length: %d\r\n" % len(JSON_BODY)
        return _head("200 OK", b"application/json", length, keep_alive) + JSON_BODY
    if method == b"GET" and path.endswith(b"/models"):
        length = b"content-length: %d\r\n" % len(MODELS_BODY)
        return _head("200 OK", b"application/json", length, keep_alive) + MODELS_BODY
    length = b"content-length: %d\r\n" % len(NOT_FOUND)
    return _head("404 Not Found", b"application/json", length, keep_alive) + NOT_FOUND


class UpstreamProtocol(asyncio.Protocol):
    """One connection: parse requests with httptools, answer each from the fixed replies."""

    delay_s = 0.0  # set once by ``main``
    drip_events = 0  # (and these two: a stream's events one write each, this far apart)
    drip_s = 0.0

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.transport is None:
            return
        keep_alive = self.parser.should_keep_alive()
        answer = response_for(self.parser.get_method(), self.url, b"".join(self.body), keep_alive)
        if self.delay_s:
            asyncio.get_running_loop().call_later(self.delay_s, self._answer, answer, keep_alive)
        else:
            self._answer(answer, keep_alive)

    def _answer(self, answer: bytes, keep_alive: bool) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if self.drip_events and answer.startswith(STREAM_HEAD_START):
            usage = answer.endswith(STREAM_USAGE_BODY)
            self._drip(answer[: answer.index(b"\r\n\r\n") + 4], keep_alive, usage)
            return
        self.transport.write(answer)
        if not keep_alive:
            self.transport.close()

    def _drip(self, head: bytes, keep_alive: bool, usage: bool) -> None:
        """A stream as a provider sends one: the head, then ``drip_events`` events each in a
        write of its own, ``drip_s`` apart (the usage too, when asked), then the end."""
        assert self.transport is not None
        self.transport.write(head)
        loop = asyncio.get_running_loop()
        events = _drip_events(self.drip_events, usage)

        def send(i: int) -> None:
            if self.transport is None or self.transport.is_closing():
                return
            if i < len(events):
                self.transport.write(events[i])
                loop.call_later(self.drip_s, send, i + 1)
                return
            self.transport.write(STREAM_END)
            if not keep_alive:
                self.transport.close()

        send(0)


async def serve(host: str, port: int, tls: ssl.SSLContext | None = None) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(UpstreamProtocol, host, port, backlog=1024, ssl=tls)
    actual = server.sockets[0].getsockname()[1]
    print(f"ready {actual}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.upstream_fast", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="hold every answer this long")
    parser.add_argument(
        "--drip-events",
        type=int,
        default=0,
        help="stream replies as this many events (at most 2,000), each in a write of its own",
    )
    parser.add_argument("--drip-ms", type=float, default=1.0, help="the time between them")
    parser.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM)")
    parser.add_argument("--tls-key", help="and this key (PEM)")
    args = parser.parse_args(argv)
    tls = None
    if args.tls_cert:
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(args.tls_cert, args.tls_key)
    UpstreamProtocol.delay_s = max(args.delay_ms, 0.0) / 1000
    UpstreamProtocol.drip_events = min(max(args.drip_events, 0), len(DRIP_WORDS))
    UpstreamProtocol.drip_s = max(args.drip_ms, 0.0) / 1000
    try:
        from uvloop import run
    except ImportError:  # plain asyncio works, a little slower
        from asyncio import run  # type: ignore[assignment]
    try:
        run(serve(args.host, args.port, tls))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
