"""Big non-streamed answers: relayed as they arrive rather than held whole (pure helpers).

A completion of tens of megabytes (many choices, log-probabilities) held in memory, parsed
for its usage and written out again cost the proxy several times its size. Past
``WHOLE_BODY_BYTES`` the server relays the body chunk by chunk and reads the usage from its
last bytes, where every API puts it.
"""

from __future__ import annotations

from typing import Any

import orjson

WHOLE_BODY_BYTES = 1024 * 1024  # answers up to this size are read whole (usage parsed)
TAIL_BYTES = 64 * 1024  # how much of the end of a bigger one is kept to find its usage


def usage_in_tail(tail: bytes) -> dict[str, Any] | None:
    """The last ``"usage": {...}`` object in ``tail``, or None.

    Braces are counted to find the object's end; usage objects hold only numbers and nested
    objects, so no brace hides in a string there.
    """
    at = tail.rfind(b'"usage"')
    while at >= 0:
        start = tail.find(b"{", at)
        colon = tail.find(b":", at + 7)
        if start < 0 or colon < 0 or tail[colon + 1 : start].strip():
            at = tail.rfind(b'"usage"', 0, at)
            continue
        depth = 0
        for i in range(start, len(tail)):
            c = tail[i]
            if c == 0x7B:  # {
                depth += 1
            elif c == 0x7D:  # }
                depth -= 1
                if depth == 0:
                    try:
                        value = orjson.loads(tail[start : i + 1])
                    except orjson.JSONDecodeError:
                        break
                    return value if isinstance(value, dict) else None
        at = tail.rfind(b'"usage"', 0, at)
    return None
