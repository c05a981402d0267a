"""Server-sent events are split exactly where a blank line ends them, however the stream is
cut into reads: the splitter's fast path for LF-only streams (#28) and its path for CR line
ends both give what the definition gives, and no byte is lost or moved."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.server import sse
from proxy.server.sse import EventSplitter, is_terminal

# The definition: an event ends at the first blank line (LF, CRLF or CR line ends, mixed).
BLANK = re.compile(rb"\r\n\r\n|\n\n|\r\n\n|\n\r\n|\r\r")


def reference(data: bytes) -> tuple[list[bytes], bytes]:
    events, start = [], 0
    while (end := BLANK.search(data, start)) is not None:
        if end.group() == b"\r\r" and end.end() == len(data):
            break
        events.append(data[start : end.end()])
        start = end.end()
    return events, data[start:]


def split_all(data: bytes, cuts: list[int]) -> tuple[list[bytes], bytes]:
    splitter = EventSplitter()
    events: list[bytes] = []
    last = 0
    for cut in sorted({min(c, len(data)) for c in cuts}) + [len(data)]:
        events += splitter.feed(data[last:cut])
        last = cut
    return events, splitter.flush()


LINE_PIECES = st.sampled_from(
    [b'data: {"x": 1}', b"event: message_stop", b"data: [DONE]", b": ping", b"a", b""]
)


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.tuples(LINE_PIECES, st.sampled_from([b"\n", b"\r\n", b"\r"])), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6),
    lf_only=st.booleans(),
)
def test_events_are_split_as_the_definition_splits_them(
    pieces: list[tuple[bytes, bytes]], cuts: list[int], lf_only: bool
) -> None:
    data = b"".join(text + (b"\n" if lf_only else end) for text, end in pieces)
    # Read whole, the splitter gives the definition's events and holds the rest.
    assert split_all(data, []) == reference(data)
    # Cut anywhere, no byte is lost or moved, and every event ends with a blank line.
    events, rest = split_all(data, cuts)
    assert b"".join(events) + rest == data
    assert all(BLANK.search(event) is not None for event in events)
    if lf_only:  # (with CRs a cut between CR and LF may close an event sooner: CR CR)
        assert (events, rest) == reference(data)


def test_a_provider_s_stream_read_event_by_event() -> None:
    stream = [b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n', b"data: [DONE]\n\n"]
    splitter = EventSplitter()
    assert splitter.feed(stream[0][:10]) == []
    assert splitter.feed(stream[0][10:]) == [stream[0]]
    assert splitter.feed(stream[1]) == [stream[1]]
    assert is_terminal(stream[1]) and not is_terminal(stream[0])
    assert splitter.flush() == b""


def test_every_api_s_common_events_are_decided_without_parsing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def parsed(event: bytes) -> None:
        raise AssertionError(f"parsed: {event!r}")

    monkeypatch.setattr(sse, "event_json", parsed)
    common = [
        b'data: {"choices":[{"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n',
        b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{}}\n\n',
        b'event: message_delta\ndata: {"type":"message_delta","delta":{}}\n\n',
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta"}\n\n',
        b'event: response.created\ndata: {"type":"response.created"}\n\n',
    ]
    for event in common:
        assert not is_terminal(event)
