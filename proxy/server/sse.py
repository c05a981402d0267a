"""Server-sent events, relayed event by event without buffering the stream (pure)."""

from __future__ import annotations

import re
from typing import Any

import orjson

# The blank line that ends an event, with LF or CRLF line ends (or both mixed).
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\n\n|\n\r\n|\r\r")


class EventSplitter:
    """Feed raw bytes, get back complete SSE events (each ending in a blank line).

    Events keep their bytes exactly as sent (CRLF stays CRLF). Only an incomplete trailing
    event is held back, so the client sees every event as soon as its last byte arrives.
    """

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self._buffer + chunk
        if b"\r" not in data:
            # LF line ends only (what providers send): split in C. A provider streams an
            # event a write, and the regular expression cost a microsecond each (#28).
            *whole, self._buffer = data.split(b"\n\n")
            return [event + b"\n\n" for event in whole]
        events = []
        start = 0
        # A CR at the very end may be half of a CRLF: look at it again with the next bytes.
        while (end := _EVENT_END.search(data, start)) is not None:
            if end.group() == b"\r\r" and end.end() == len(data):
                break
            events.append(data[start : end.end()])
            start = end.end()
        self._buffer = data[start:]
        return events

    def complete(self, chunk: bytes) -> bytes:
        """``feed``'s events joined: the bytes up to the end of the last event ``chunk``
        completed (b"" when none). The relay passes a read's events on as one piece and looks
        at them one by one only when they may carry usage or the stream's end (#28)."""
        if b"\r" in chunk or b"\r" in self._buffer:
            return b"".join(self.feed(chunk))
        data = self._buffer + chunk
        *whole, rest = data.split(b"\n\n")  # the same cut as ``feed``'s
        self._buffer = rest
        return data[: len(data) - len(rest)] if whole else b""

    def flush(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest


def event_json(event: bytes) -> Any:
    """The JSON payload of a ``data:`` event, or None (for ``[DONE]`` and non-JSON data)."""
    payload = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
    if not payload or payload == b"[DONE]":
        return None
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None


def is_usage_only(obj: Any) -> bool:
    """The final chunk that ``stream_options.include_usage`` adds: usage and no choices."""
    return isinstance(obj, dict) and obj.get("usage") is not None and not obj.get("choices")


# The events after which a stream has nothing more to say: chat completions' ``[DONE]``,
# Anthropic's ``message_stop``, the Responses API's final response events.
_TERMINAL_TYPES = frozenset(
    {
        b"message_stop",
        b"response.completed",
        b"response.failed",
        b"response.incomplete",
    }
)
# What a terminal event holds somewhere: the quick test of every relayed event.
_MAY_END = (b"[DONE]", *sorted(_TERMINAL_TYPES))


def events_of(data: bytes) -> list[bytes]:
    """``data`` (complete events, as ``EventSplitter.complete`` gives them) event by event:
    joined, the pieces are ``data`` again."""
    splitter = EventSplitter()
    events = splitter.feed(data)
    rest = splitter.flush()
    return [*events, rest] if rest else events


def may_matter(data: bytes) -> bool:
    """Whether any event in ``data`` may carry usage or end the stream: if not, the relay
    passes ``data`` on without looking at its events (most reads of a stream)."""
    return b'"usage"' in data or _may_end(data)


def _may_end(data: bytes) -> bool:
    """The quick test of ``is_terminal``: whether ``data`` holds any end marker. (A plain
    loop: a generator in ``any`` cost twice as much per event, #28.)"""
    for marker in _MAY_END:
        if marker in data:
            return True
    return False


def is_terminal(event: bytes) -> bool:
    """Whether ``event`` ends its stream (pure; looks at the ``event:``/``data:`` lines)."""
    if not _may_end(event):
        return False  # the common case (every event but the last), decided without parsing
    for line in event.split(b"\n"):
        if line.startswith(b"data:") and line[5:].strip() == b"[DONE]":
            return True
        if line.startswith(b"event:") and line[6:].strip() in _TERMINAL_TYPES:
            return True
    if b'"type"' in event:
        obj = event_json(event)
        kind = obj.get("type") if isinstance(obj, dict) else None
        return isinstance(kind, str) and kind.encode() in _TERMINAL_TYPES
    return False
