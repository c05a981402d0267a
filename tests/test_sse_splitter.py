"""Server-sent events are split exactly where a blank line ends them, however the stream is
cut into reads: the splitter's fast path for LF-only streams (#28) and its path for CR line
ends both give what the definition gives, and no byte is lost or moved."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.server import sse
from proxy.server.sse import EventSplitter, events_of, is_terminal, may_matter

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
# A stream: lines with their ends (LF, CRLF or CR); and where its reads are cut.
PIECES = st.lists(st.tuples(LINE_PIECES, st.sampled_from([b"\n", b"\r\n", b"\r"])), max_size=12)
CUTS = st.lists(st.integers(min_value=0, max_value=400), max_size=6)


@settings(max_examples=300, deadline=None)
@given(pieces=PIECES, cuts=CUTS, lf_only=st.booleans())
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


@settings(max_examples=300, deadline=None)
@given(pieces=PIECES, cuts=CUTS, lf_only=st.booleans())
def test_a_read_s_events_joined_are_what_feed_gives_and_split_back_into_them(
    pieces: list[tuple[bytes, bytes]], cuts: list[int], lf_only: bool
) -> None:
    """``complete`` (what the relay passes on per read, #28) is ``feed``'s events joined,
    however the stream is cut, and ``events_of`` gives them back one by one."""
    data = b"".join(text + (b"\n" if lf_only else end) for text, end in pieces)
    by_feed, by_complete = EventSplitter(), EventSplitter()
    last = 0
    for cut in sorted({min(c, len(data)) for c in cuts}) + [len(data)]:
        events = by_feed.feed(data[last:cut])
        joined = by_complete.complete(data[last:cut])
        assert joined == b"".join(events)
        assert b"".join(events_of(joined)) == joined
        if lf_only:
            assert events_of(joined) == events
        last = cut
    assert by_complete.flush() == by_feed.flush()


def test_a_read_is_looked_at_event_by_event_only_when_it_may_carry_usage_or_the_end() -> None:
    middle = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n' * 20
    assert not may_matter(middle)
    for last in (
        b"data: [DONE]\n\n",
        b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\n',
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
        b'event: response.completed\ndata: {"type":"response.completed"}\n\n',
        b'event: response.incomplete\ndata: {"type":"response.incomplete"}\n\n',
        b'event: response.failed\ndata: {"type":"response.failed"}\n\n',
    ):
        assert may_matter(middle + last)
        # Whatever is terminal is caught by the quick test first.
        assert not is_terminal(last) or may_matter(last)


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
