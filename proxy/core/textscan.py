"""Regular expressions over a long text, a slice at a time.

A pattern run over a whole history (megabytes) is one C call that holds the GIL until it
ends: 50-250 ms per pattern over 3.5 MB, with no match found. Run in a worker thread, that
still stops the event loop's thread for as long (issue #29). Here each call covers one slice
of at most ``SLICE_CHARS``, cut just after a line break (or else a space), so another thread
gets the interpreter between two slices. Results equal the whole-text call's for matches
that do not cross a cut: ``finditer``'s ``pos``/``endpos`` keep positions (and lookbehinds)
in the whole text, and a cut falls where a word or line ends anyway.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

SLICE_CHARS = 64 * 1024  # ~1-3 ms of scanning per pattern


def slices(text: str, size: int = SLICE_CHARS) -> Iterator[tuple[int, int]]:
    """``(start, end)`` bounds covering ``text`` in order, each at most ``size`` long unless
    no line break or space lets it end sooner."""
    start, n = 0, len(text)
    while start < n:
        end = start + size
        if end >= n:
            yield start, n
            return
        cut = text.rfind("\n", start + size // 2, end)
        if cut < 0:
            cut = text.rfind(" ", start + size // 2, end)
        end = cut + 1 if cut >= 0 else end
        yield start, end
        start = end


def finditer(pattern: re.Pattern[str], text: str) -> Iterator[re.Match[str]]:
    """``pattern.finditer(text)``, a slice at a time (positions in the whole text)."""
    if len(text) <= SLICE_CHARS:
        yield from pattern.finditer(text)
        return
    for start, end in slices(text):
        yield from pattern.finditer(text, start, end)


def findall(pattern: re.Pattern[str], text: str) -> list[str]:
    """``pattern.findall(text)`` for a pattern without groups, a slice at a time."""
    if len(text) <= SLICE_CHARS:
        return pattern.findall(text)
    found: list[str] = []
    for start, end in slices(text):
        found.extend(pattern.findall(text, start, end))
    return found


def sub(pattern: re.Pattern[str], repl: str, text: str) -> str:
    """``pattern.sub(repl, text)``, a slice at a time."""
    if len(text) <= SLICE_CHARS:
        return pattern.sub(repl, text)
    return "".join(pattern.sub(repl, text[start:end]) for start, end in slices(text))
