"""Parsing a body that resends an earlier one's history: only past what they share (#28).

An agent resends its whole history with every request: the next body is the last one's bytes
up to (about) its last message, then the new messages and the rest of the body. Parsing it
whole costs ~50 us at 50 messages and ~3 ms at 2,000 (docs/benchmarks.md, #28), for values
the proxy parsed a moment ago. ``Reparser`` remembers recent bodies and parses a new one from
a remembered one when their bytes say it may:

- Only a body in the canonical form is remembered: its bytes are exactly what ``orjson``
  writes for its value (compact, keys in order: what the OpenAI and Anthropic SDKs and
  ``JSON.stringify`` send). Its bytes then say exactly where each element of its history
  array (``messages``, or the Responses API's ``input``) ends: ``cuts``.
- A new body that starts with a remembered body's bytes up to one of those cuts (compared
  byte for byte, not hashed) is, up to there, in the very state the remembered one was: inside
  the top-level object, in the history array, after its first ``k`` elements. Its value is the
  remembered members before the array, the first ``k`` elements, and what the rest of its
  bytes give when parsed in that state: ``{"\\u0000":[0`` followed by them, one small
  ``orjson`` call.
- That rest must be canonical too (written back by ``orjson``, byte for byte: no member
  repeated, none of the members before the array and not the array's name again), and within
  the depth ``parse_json_object`` allows; anything else parses the whole body as before.
  When the members after the array are the remembered ones byte for byte (the tools), only
  the new elements between are parsed.
- The engine takes the shared elements' fingerprints and prefix chain from the earlier
  request's (``proxy.core.reprint``), and the surface does not validate them again.

The value is the one ``orjson.loads`` gives (``tests/test_reparse.py`` checks it against
every recorded agent run); the elements before the cut are the remembered objects themselves,
which the proxy never changes in place (every step copies what it alters). Bounded: at most
``max_entries`` bodies and ``max_bytes`` of their bytes; small bodies are not remembered
(parsing them is cheaper than finding them). Thread-safe: big bodies are parsed in a worker
thread. Pure: no I/O, no clock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.core import byteruns
from proxy.core.byteruns import Run
from proxy.core.canonical import canonical_value
from proxy.core.reprint import NOTHING_YET, Prints, Reuse
from proxy.core.validation import SLICED_BYTES

# A body is filed under the bytes just before a probe position (256, 512, 1024, ...): the
# largest one within what a body extending it must share. A lookup reads the new body at
# every probe, a few dozen bytes each, and finds the bodies filed there: conversations that
# agree on their first bytes (the model, a system prompt) are told apart further on.
FIRST_PROBE = 256
PROBES = tuple(FIRST_PROBE << i for i in range(24))
# Parsing a body below this size costs less than remembering it.
MIN_BYTES = 8 * 1024
# The new body may share fewer elements than the remembered one had: clients move their cache
# marks to the newest messages (Claude Code), so the last one or two differ.
BACK_CUTS = 4
_PER_KEY = 16  # bodies kept under one probe's bytes (the most recent)
# Bodies a lookup compares in full at most (bodies alike but for a few bytes): up to its last
# cut and, when that differs, up to its earliest possible one; the first ``_HEAD`` bytes first.
_COMPARES = 1
_HEAD = 4096
_MISSES = 64  # lookups in a row that found nothing, before remembering only ...
_SAMPLE = 32  # ... one body in this many
_QUICK = 32  # bytes compared before a cut to rule a body out cheaply
_TAIL_KEY = "\x00"
_OPEN = b'{"\\u0000":[0'  # the rest of a body, parsed as if the array had one element


@dataclass(frozen=True)
class Remembered:
    """A canonical body: its bytes up to the end of its history array's last element, where
    each element ends, the members before the array and the array's elements."""

    name: str
    prefix: Run  # its bytes up to its last cut, in pieces (``proxy.core.byteruns``)
    cuts: tuple[int, ...]  # where the last ``BACK_CUTS`` elements end (at most), in order
    head: tuple[tuple[str, Any], ...]
    items: list[Any]
    rest: bytes  # from the array's closing bracket to the end
    after: tuple[tuple[str, Any], ...]  # the members after the array
    prints: Prints = field(default_factory=Prints)
    quick: tuple[bytes, ...] = ()  # the bytes just before each cut (set by ``_entry``)
    # Where it is filed: the furthest probe at or before its first cut, and the bytes just
    # before that probe (any body that extends it has them there).
    key: tuple[int, bytes] = (0, b"")

    @property
    def size(self) -> int:
        return self.cuts[-1] + len(self.rest)


@dataclass(frozen=True)
class Reparsed:
    """A body parsed from a remembered one: its value, how many of its history's elements it
    took from there (``shared``: parsed and validated before), and the ``Remembered`` it
    becomes (``entry``) in place of the one it extends (``extends``) once it is accepted."""

    body: dict[str, Any]
    shared: int
    entry: Remembered
    extends: Remembered
    fresh: int  # the bytes parsed (the new elements, and the members after them if changed)

    @property
    def reuse(self) -> Reuse:
        items, prints = len(self.entry.items), self.entry.prints
        return Reuse(self.extends.prints, self.shared, items, prints, self.fresh)


class Reparser:
    """Recent canonical bodies, and the parse of a body that extends one of them."""

    def __init__(
        self,
        *,
        max_entries: int = 128,
        max_bytes: int = 8 * 1024 * 1024,
        min_bytes: int = MIN_BYTES,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.min_bytes = max(min_bytes, FIRST_PROBE + _QUICK)
        self._filed: dict[tuple[int, bytes], list[Remembered]] = {}
        self._order: OrderedDict[int, Remembered] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._missed = 0  # lookups in a row that found nothing
        self._sampled = 0
        self.reused = 0  # bodies parsed from a remembered one (for tests and benchmarks)

    def parse(self, raw: bytes, name: str, max_fresh: int | None = None) -> Reparsed | None:
        """``raw``'s value from a remembered body it extends, or None (parse it whole).
        ``max_fresh``: None as well when more than that many bytes would be parsed; the
        caller then parses the body elsewhere, where this is done again, so nothing found
        here is not counted as a miss (it is there)."""
        if len(raw) < self.min_bytes:
            return None
        compares = [_COMPARES]  # full comparisons this lookup may still make
        size = len(raw)
        for probe in reversed(PROBES):  # the furthest first: the most telling, and usually
            if probe > size:  # where the body it extends is filed
                continue
            with self._lock:
                bucket = list(self._filed.get((probe, raw[probe - _QUICK : probe]), ()))
            for entry in bucket:
                if entry.name == name:
                    try:
                        found = _extend(entry, raw, compares, max_fresh)
                    except _TooFresh:
                        return None
                    if found is not None:
                        return found
                    if compares[0] <= 0:
                        break  # (bodies alike but for a few bytes: no more full compares)
            if compares[0] <= 0:
                break
        if max_fresh is None:
            with self._lock:
                self._missed += 1
        return None

    def accept(self, found: Reparsed) -> None:
        """Remember the body ``found`` parsed (valid, the route took it) instead of the one
        it extends."""
        with self._lock:
            self.reused += 1
            self._missed = 0
            self._drop(found.extends)
            self._add(found.entry)

    def remember(self, raw: bytes, body: dict[str, Any], name: str) -> Reuse | None:
        """Keep ``raw`` (parsed whole into ``body``, valid) when it is canonical; then where
        its prints go (nothing to take: it extends no remembered body).

        When many lookups in a row found nothing (more conversations than the bounds hold,
        or a client that rewrites its history), only one body in ``_SAMPLE`` is remembered:
        remembering costs up to a sixth of a parse, and nothing comes back then. The next
        request of a conversation so remembered is found (lookups go on: a few us), which
        ends that (``accept``)."""
        if len(raw) < self.min_bytes or len(raw) > self.max_bytes // 2:
            return None  # (one that big would leave at once, or push out all the others)
        with self._lock:
            if self._missed >= _MISSES:
                self._sampled = (self._sampled + 1) % _SAMPLE
                if self._sampled:
                    return None
        entry = _canonical(raw, body, name)
        if entry is None:
            return None
        with self._lock:
            self._add(entry)
        return Reuse(NOTHING_YET, 0, len(entry.items), entry.prints, len(raw))

    def _add(self, entry: Remembered) -> None:
        bucket = self._filed.setdefault(entry.key, [])
        bucket.insert(0, entry)
        self._order[id(entry)] = entry
        self._bytes += entry.size
        while len(bucket) > _PER_KEY:
            self._drop(bucket[-1])
        while self._order and (len(self._order) > self.max_entries or self._bytes > self.max_bytes):
            self._drop(next(iter(self._order.values())))

    def _drop(self, entry: Remembered) -> None:
        if self._order.pop(id(entry), None) is None:
            return  # dropped already (by another thread's request of the same conversation)
        self._bytes -= entry.size
        bucket = self._filed.get(entry.key)
        if bucket is not None:
            bucket[:] = [e for e in bucket if e is not entry]
            if not bucket:
                del self._filed[entry.key]

    def __len__(self) -> int:
        return len(self._order)


class _TooFresh(Exception):
    """More than ``max_fresh`` bytes to parse past the shared part."""


def _extend(
    entry: Remembered, raw: bytes, compares: list[int], max_fresh: int | None = None
) -> Reparsed | None:
    """``raw`` parsed from ``entry`` when it starts with ``entry``'s bytes up to one of its
    last cuts (the latest such cut): up to the last one, compared whole; else up to the
    earliest that looks possible (the bytes just before it agree), the later ones then
    comparing only the bytes between."""
    cuts = entry.cuts
    first = len(entry.items) - len(cuts) + 1  # the elements before ``cuts[0]``
    size = len(raw)
    possible = [
        (first + i, cut)
        for i, (cut, before) in enumerate(zip(cuts, entry.quick, strict=True))
        if cut < size and raw.startswith(before, cut - _QUICK)
    ]
    if not possible or compares[0] <= 0:
        return None
    prefix = entry.prefix
    low = possible[0][1]
    if not byteruns.starts_with(raw, prefix, min(_HEAD, low)):
        # Conversations alike but for their first messages (one agent's sessions: the same
        # system prompt and message endings) are told apart here, not in a full compare: the
        # lookup goes on to the next body filed with this one (it gave up at the first).
        return None
    compares[0] -= 1
    k, cut = possible[-1]
    if cut == cuts[-1] and byteruns.starts_with(raw, prefix, cut):
        return _with_rest(entry, k, raw, cut, max_fresh)  # (a body that extends the last)
    if not byteruns.starts_with(raw, prefix, low):
        return None
    for k, cut in reversed(possible):
        if cut == low or raw[low:cut] == byteruns.between(prefix, low, cut):
            return _with_rest(entry, k, raw, cut, max_fresh)
    return None


def _with_rest(
    entry: Remembered, k: int, raw: bytes, cut: int, max_fresh: int | None = None
) -> Reparsed | None:
    """The body: ``entry``'s members before the array, its first ``k`` elements, and what the
    bytes from ``cut`` on give; None when they are not JSON or not canonical there. Raises
    ``_TooFresh`` rather than parse more than ``max_fresh`` bytes."""
    end = len(raw) - len(entry.rest)
    same_after = end >= cut and raw.endswith(entry.rest)
    if max_fresh is not None and (end if same_after else len(raw)) - cut > max_fresh:
        raise _TooFresh
    if same_after:
        # The same members after the array (the tools, say), byte for byte: only the new
        # elements between are parsed. They are whole values, each after a comma, exactly
        # when '[0' + them + ']' is one canonical array; then the array closes where the
        # remembered one did, and the rest is in the state it was in there.
        added = canonical_value(b"[0" + raw[cut:end] + b"]", nested=1)
        if isinstance(added, list) and added and added[0] == 0:
            return _reparsed(entry, k, raw, cut, added[1:], entry.after, end - cut)
    if max_fresh is not None and len(raw) - cut > max_fresh:
        raise _TooFresh
    if len(raw) - cut >= SLICED_BYTES:
        return None  # a huge new part is parsed in slices, as a whole body would be
    tail = canonical_value(_OPEN + raw[cut:])
    if not isinstance(tail, dict):
        return None
    members = iter(tail.items())
    first, added = next(members)
    if first != _TAIL_KEY or not isinstance(added, list) or not added or added[0] != 0:
        return None
    after = tuple(members)
    names = {name for name, _ in entry.head}
    names.add(entry.name)
    if any(name in names for name, _ in after):
        return None  # a member the part before the cut has: parse it whole
    return _reparsed(entry, k, raw, cut, added[1:], after, len(raw) - cut)


def _reparsed(
    entry: Remembered,
    k: int,
    raw: bytes,
    cut: int,
    added: list[Any],
    after: tuple[tuple[str, Any], ...],
    fresh: int,
) -> Reparsed:
    items = entry.items[:k] + added
    body = dict(entry.head)
    body[entry.name] = items
    body.update(after)
    first = len(entry.items) - len(entry.cuts) + 1
    cuts = list(entry.cuts[: k - first + 1])
    at = cut + 1
    for item in added:
        at += len(orjson.dumps(item))
        cuts.append(at)
        at += 1
    prefix = byteruns.extended(entry.prefix, cut, raw[cut : cuts[-1]])  # (nothing big copied)
    new = _entry(entry.name, raw, cuts[-BACK_CUTS:], entry.head, items, after, prefix)
    return Reparsed(body, k, new, entry, fresh)


def _canonical(raw: bytes, body: dict[str, Any], name: str) -> Remembered | None:
    """``raw`` as a ``Remembered`` when it is exactly what orjson writes for ``body``."""
    items = body.get(name)
    if not isinstance(items, list) or not items:
        return None
    keys = list(body)
    at_name = keys.index(name)
    head = [(key, body[key]) for key in keys[:at_name]]
    after = [(key, body[key]) for key in keys[at_name + 1 :]]
    try:
        # '{' + the members before, ',' between, then '"name":[' and the elements, ','
        # between. The start and the first element first: a client that writes otherwise
        # (spaces, ASCII escapes) is told apart without writing the whole body.
        start = orjson.dumps(dict(head))[:-1] + (b"," if head else b"") + orjson.dumps(name)
        first = orjson.dumps(items[0])
        at = len(start) + 2
        if raw[:at] != start + b":[" or raw[at : at + len(first)] != first:
            return None
        # The body as orjson writes it, in two parts: up to the array's closing bracket,
        # and the members after it (so where the array ends is known without a third write).
        front = orjson.dumps({**dict(head), name: items})
        last = len(front) - 2  # the array's ']'
        if not raw.startswith(front[:-1]):
            return None
        if after:
            back = orjson.dumps(dict(after))
            if len(raw) != last + len(back) + 1 or raw[last + 1 : last + 2] != b",":
                return None
            if not raw.endswith(back[1:]):
                return None
        elif len(raw) != len(front):
            return None
    except orjson.JSONEncodeError:
        return None
    cuts = [last]
    for item in reversed(
        items[len(items) - BACK_CUTS + 1 :] if len(items) >= BACK_CUTS else items[1:]
    ):
        cuts.append(cuts[-1] - len(orjson.dumps(item)) - 1)
    cuts.reverse()
    if cuts[-1] < FIRST_PROBE:
        return None  # the history ends before the first probe: nothing to file it under
    return _entry(name, raw, cuts, tuple(head), items, tuple(after))


def _entry(
    name: str,
    raw: bytes,
    cuts: list[int],
    head: tuple[tuple[str, Any], ...],
    items: list[Any],
    after: tuple[tuple[str, Any], ...],
    prefix: Run | None = None,
) -> Remembered:
    """``raw`` remembered: its bytes up to its last cut (``prefix`` when known, in pieces)
    and after, and ``_QUICK`` bytes before each cut (a lookup rules a body out with them
    without copying anything)."""
    cuts = [cut for cut in cuts if cut >= FIRST_PROBE]  # (at or after the first probe)
    last = cuts[-1]
    quick = tuple(raw[cut - _QUICK : cut] for cut in cuts)
    probe = 1 << (cuts[0].bit_length() - 1)  # (PROBES are the powers of two from 256)
    key = (probe, raw[probe - _QUICK : probe])
    run = prefix if prefix is not None else (raw[:last],)
    return Remembered(name, run, tuple(cuts), head, items, raw[last:], after, quick=quick, key=key)
