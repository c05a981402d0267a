"""Whether JSON bytes are exactly what ``orjson`` writes for their value (#28).

A body in that form says by its bytes where each of its values begins and ends, which is what
``proxy.core.reparse`` reads a resent body by. Pure.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.core.validation import MAX_DEPTH, SLICED_BYTES, WRITABLE_LEVELS, written_within


def canonical_value(text: bytes, nested: int = 0) -> Any:
    """``text``'s value when orjson writes it back byte for byte and, ``nested`` levels
    deeper in the body, it lies within the proxy's depth (one write of it inside as many
    arrays: ``validation.written_within``), else None: parsed whole, the body gets the
    verdict a whole parse gives."""
    if len(text) >= SLICED_BYTES:
        return None
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    limit = MAX_DEPTH - nested
    written = written_within(value, limit)
    if written is None:
        return None  # deeper than the proxy allows, or a value orjson cannot write
    levels = WRITABLE_LEVELS - limit
    if written != b"[" * levels + text + b"]" * levels:
        return None  # a member repeated, or not written as orjson writes it
    return value
