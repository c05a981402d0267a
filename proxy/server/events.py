"""What the relay does with each read of a streamed answer (pure): the events it completed
passed on as one piece, the usage read from the events that carry it (and dropped when the
proxy asked for it and the client did not), the stream's end noticed.

Shared by the two ways a stream is relayed (``proxy.server.relay``): pulled read by read in
the relaying task, or pushed from the upstream connection's callbacks (``proxy.server.push``).
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.core.surfaces import Surface, model_of, usage_of
from proxy.server.sse import (
    EventSplitter,
    event_json,
    events_of,
    is_terminal,
    is_usage_only,
    may_matter,
)


class StreamReads:
    """One stream's reads, in order. ``read`` gives what to send the client now; ``ended``
    turns true with the read that holds the stream's terminal event (``[DONE]``,
    ``message_stop``, ``response.completed``...), after which nothing more is read."""

    __slots__ = ("_splitter", "_drop_usage", "usage", "model", "ended")

    def __init__(self, drop_usage: bool) -> None:
        self._splitter = EventSplitter()
        self._drop_usage = drop_usage
        self.usage: dict[str, Any] = {}
        self.model: str | None = None  # as the upstream named it (traces)
        self.ended = False

    def read(self, chunk: bytes) -> bytes:
        """The events ``chunk`` completed, joined (b"" when none, or none to send)."""
        done = self._splitter.complete(chunk)
        if not done or not may_matter(done):
            return done  # most reads: no usage, not the end, passed on whole
        out = []
        for event in events_of(done):
            if b'"usage"' in event:
                obj = event_json(event)
                found = usage_of(obj)
                if found:
                    # Anthropic splits usage over message_start and message_delta.
                    self.usage.update({k: v for k, v in found.items() if v is not None})
                    self.model = model_of(obj) or self.model
                    if self._drop_usage and is_usage_only(obj):
                        continue
            out.append(event)
            self.ended = self.ended or is_terminal(event)
        return b"".join(out)

    def rest(self) -> bytes:
        """What the upstream sent after its last complete event, once its body ended."""
        return self._splitter.flush()


def broken_event(surface: Surface) -> bytes:
    """The event that tells a client its stream broke before its end (the route's shape)."""
    message = surface.error_body("upstream stream interrupted", "upstream_error", "upstream_error")
    return b"event: error\ndata: " + orjson.dumps(message) + b"\n\n"
