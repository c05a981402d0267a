"""Server-sent events, relayed event by event without buffering the stream (pure)."""

from __future__ import annotations

from typing import Any

import orjson


class EventSplitter:
    """Feed raw bytes, get back complete SSE events (each ending in a blank line).

    Only an incomplete trailing event is held back, so the client sees every event as soon
    as its last byte arrives.
    """

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self._buffer + chunk
        data = data.replace(b"\r\n", b"\n")
        events = []
        while True:
            end = data.find(b"\n\n")
            if end < 0:
                break
            events.append(data[: end + 2])
            data = data[end + 2 :]
        self._buffer = data
        return events

    def flush(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest


def event_json(event: bytes) -> Any:
    """The JSON payload of a ``data:`` event, or None (for ``[DONE]`` and non-JSON data)."""
    payload = b"".join(
        line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")
    )
    if not payload or payload == b"[DONE]":
        return None
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None


def is_usage_only(obj: Any) -> bool:
    """The final chunk that ``stream_options.include_usage`` adds: usage and no choices."""
    return isinstance(obj, dict) and obj.get("usage") is not None and not obj.get("choices")
