"""Why the upstream could not be reached, said plainly, and its URL safe to print.

Shared by the request path (``forward.mapped_errors``), the start-up line and
``compaction-proxy check``, so a newcomer reads the same words everywhere.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit


def safe_url(url: str) -> str:
    """``url`` without credentials: user:password@ and the query string (which may hold a key)
    are dropped; scheme, host, port and path are kept."""
    try:
        parts = urlsplit(str(url))
        host = parts.hostname or ""
    except ValueError:
        return "<unparseable url>"
    if ":" in host:
        host = f"[{host}]"  # IPv6 literal
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = f"{host}:{port}" if port is not None else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


@dataclass(frozen=True)
class Unreachable:
    """What went wrong, in words, and whether trying again soon is pointless."""

    reason: str
    permanent: bool


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and everything it was raised from (causes, contexts, exception groups)."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        stack.extend([current.__cause__, current.__context__])
        stack.extend(getattr(current, "exceptions", ()) or ())


def classify(exc: BaseException, url: str) -> Unreachable:
    """Plain words for a failed connection to ``url``.

    A name that does not resolve and a refused connection are ``permanent``: the same request
    to the same configured upstream fails the same way, so clients should not retry it.
    """
    host = urlsplit(str(url)).hostname or "the upstream"
    for cause in _causes(exc):
        if isinstance(cause, socket.gaierror):
            return Unreachable(
                f"the host name {host} does not resolve (DNS lookup failed: offline, or a typo "
                "in upstream.base_url?)",
                permanent=True,
            )
        if isinstance(cause, ConnectionRefusedError) or (
            isinstance(cause, OSError) and cause.errno == errno.ECONNREFUSED
        ):
            return Unreachable(
                f"connection refused by {host}: nothing listens on that port (is the server "
                "running, and is upstream.base_url right?)",
                permanent=True,
            )
    name = type(exc).__name__
    if "Timeout" in name:
        return Unreachable(f"no answer in time ({name})", permanent=False)
    return Unreachable(f"network error ({name})", permanent=False)
