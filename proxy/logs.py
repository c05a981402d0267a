"""Structured logs: one JSON object per line. Keys and message content never appear at INFO."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                data[key] = value
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(data, default=str).decode()


def setup_logging(level: str = "INFO") -> None:
    """JSON lines on stderr for our loggers; uvicorn's access log is ours per-request line."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("compaction_proxy")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    logging.Formatter.converter = time.gmtime
