"""The per-request log line: ``info_line`` writes what ``logger.info`` would (#28)."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import orjson
import pytest

from proxy.logs import info_line, setup_logging

FIELDS = {
    "route": "chat.completions",
    "conversation": "c-1",
    "case": "passthrough",
    "tokens_before": 1200,
    "tokens_after": None,
    "latency_ms": 3.25,
    "odd": object(),  # written with ``str`` as the formatter does
}


@pytest.fixture
def stream(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """``setup_logging``'s handler writing to a buffer; the loggers (and the formatters' clock,
    which it sets) restored afterwards."""
    root = logging.getLogger("compaction_proxy")
    saved = root.handlers[:], root.level, root.propagate, root.filters[:]
    buffer = io.StringIO()
    monkeypatch.setattr("sys.stderr", buffer)
    monkeypatch.setattr(logging.Formatter, "converter", logging.Formatter.converter)
    setup_logging("INFO")
    yield buffer
    root.handlers[:], root.level, root.propagate, root.filters[:] = saved


def lines(buffer: io.StringIO) -> list[dict[str, object]]:
    return [orjson.loads(line) for line in buffer.getvalue().splitlines()]


def test_the_line_is_the_one_logging_writes(stream: io.StringIO) -> None:
    log = logging.getLogger("compaction_proxy.service")
    info_line(log, "request", FIELDS)
    log.info("request", extra=FIELDS)
    fast, slow = lines(stream)
    assert list(fast) == list(slow)  # the same keys in the same order
    assert abs(float(fast.pop("ts")) - float(slow.pop("ts"))) < 5  # type: ignore[arg-type]
    assert fast == slow
    assert fast["logger"] == "compaction_proxy.service" and fast["level"] == "info"
    assert str(fast["odd"]).startswith("<object object")


def test_below_the_level_nothing_is_written(stream: io.StringIO) -> None:
    logging.getLogger("compaction_proxy").setLevel("WARNING")
    info_line(logging.getLogger("compaction_proxy.service"), "request", FIELDS)
    assert stream.getvalue() == ""


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_anything_else_attached_gets_the_record(stream: io.StringIO) -> None:
    """A second handler, a filter or a handler that is not ours: the record goes through
    ``logging`` so each of them sees it as before."""
    log = logging.getLogger("compaction_proxy.service")
    capture = Capture()
    log.addHandler(capture)
    try:
        info_line(log, "request", FIELDS)
    finally:
        log.removeHandler(capture)
    assert [r.getMessage() for r in capture.records] == ["request"]
    assert capture.records[0].conversation == "c-1"  # type: ignore[attr-defined]
    assert len(lines(stream)) == 1  # and the JSON line still, through logging

    dropped: list[str] = []

    def drop(record: logging.LogRecord) -> bool:
        dropped.append(record.getMessage())
        return False

    root = logging.getLogger("compaction_proxy")
    for filtered in (log, root.handlers[0]):  # the record's own logger's, the handler's
        filtered.addFilter(drop)
        try:
            info_line(log, "request", FIELDS)
        finally:
            filtered.removeFilter(drop)
    assert dropped == ["request"] * 2 and len(lines(stream)) == 1  # the filters decided

    root.handlers[:] = [capture]
    info_line(log, "request", FIELDS)
    assert len(capture.records) == 2 and len(lines(stream)) == 1
