"""Request validation: a clear 400 naming the field, before anything else runs."""

from __future__ import annotations

import json
import re
from itertools import chain, compress, islice
from typing import Any

import orjson

from proxy.core.errors import BadRequest

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# orjson writes at most 254 levels of arrays and objects; a body the proxy has to write back
# (a compacted history, a stream asking for usage, the ledger's copy) must fit, with room.
MAX_DEPTH = 200


# Past this size a body is parsed in slices (see ``parse_in_slices``).
SLICED_BYTES = 1024 * 1024


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or ``BadRequest``."""
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = parse_in_slices(raw) if len(raw) >= SLICED_BYTES else orjson.loads(raw)
    except (ValueError, RecursionError) as exc:  # (orjson.JSONDecodeError is a ValueError)
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if not within_depth(body, MAX_DEPTH):
        raise BadRequest(
            f"request body is nested deeper than {MAX_DEPTH} levels of arrays and objects"
        )
    return body


def within_depth(value: Any, limit: int) -> bool:
    """Whether no array or object in ``value`` lies more than ``limit`` levels deep.

    orjson writes at most ``WRITABLE_LEVELS`` levels: ``value`` inside ``WRITABLE_LEVELS - limit``
    arrays is written exactly when it is within ``limit``, in one C call (a Python walk over
    every value of a big history cost as much as parsing it). When orjson refuses, for its
    depth or for a value it cannot write (an integer past 64 bits), the walk decides."""
    if 0 < limit <= WRITABLE_LEVELS and written_within(value, limit) is not None:
        return True
    return _walk_within(value, limit)


def written_within(value: Any, limit: int) -> bytes | None:
    """What orjson writes for ``value`` inside ``WRITABLE_LEVELS - limit`` arrays, or None
    when it refuses: too deep for ``limit`` (or a value it cannot write at all)."""
    wrapped = value
    for _ in range(WRITABLE_LEVELS - limit):
        wrapped = [wrapped]
    try:
        return orjson.dumps(wrapped)
    except orjson.JSONEncodeError:
        return None


def _walk_within(value: Any, limit: int) -> bool:
    """``within_depth`` level by level, iterating in C (``map``, ``compress``, ``chain``)."""
    level: list[Any] = [value] if type(value) in _CONTAINERS else []
    depth = 1
    while level:
        if depth > limit:
            return False
        dicts = compress(level, map(_IS_DICT, map(type, level)))
        lists = compress(level, map(_IS_LIST, map(type, level)))
        children = [*chain.from_iterable(map(dict.values, dicts)), *chain.from_iterable(lists)]
        level = list(compress(children, map(_IS_CONTAINER, map(type, children))))
        depth += 1
    return True


_CONTAINERS = frozenset({dict, list})
_IS_CONTAINER = _CONTAINERS.__contains__
_IS_DICT = frozenset({dict}).__contains__
_IS_LIST = frozenset({list}).__contains__


def _writable_levels() -> int:
    """The levels of arrays orjson writes (254 in every version so far); 0 if not that."""

    def nested(levels: int) -> Any:
        value: Any = 0
        for _ in range(levels):
            value = [value]
        return value

    try:
        orjson.dumps(nested(254))
    except orjson.JSONEncodeError:
        return 0
    try:
        orjson.dumps(nested(255))
    except orjson.JSONEncodeError:
        return 254
    return 0


WRITABLE_LEVELS = _writable_levels()


def validate_chat(body: dict[str, Any], start: int = 0) -> None:
    """Check the fields the proxy relies on; the upstream validates the rest. Messages
    before ``start`` were checked already (``proxy.core.reparse``: the same values)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array")
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be a boolean")
    for i, m in enumerate(islice(messages, start, None), start):
        # The common shapes, checked cheaply first: {"role": ..., "content": "text"}, a tool
        # result (with a "tool_call_id") and a tool-calling turn (content text or null).
        if type(m) is dict:
            role, content = m.get("role"), m.get("content")
            if type(role) is str and role in ROLES:
                n = len(m)
                if type(content) is str and (
                    n == 2 or n == 3 and type(m.get("tool_call_id")) is str
                ):
                    continue
                if n == 3 and (content is None and "content" in m or type(content) is str):
                    calls = m.get("tool_calls")
                    if type(calls) is list and all(type(c) is dict for c in calls):
                        continue
        _check_message(i, m)


def _check_message(i: int, m: Any) -> None:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise BadRequest(f"{where} must be an object")
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise BadRequest(f"{where}.role must be one of {sorted(ROLES)}")
    content = m.get("content")
    if content is not None and not isinstance(content, str | list):
        raise BadRequest(f"{where}.content must be a string, an array of parts or null")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise BadRequest(f"{where}.content[{j}] must be an object with a 'type'")
    for key in ("name", "tool_call_id"):
        value = m.get(key)
        if value is not None and not isinstance(value, str):
            raise BadRequest(f"{where}.{key} must be a string")
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise BadRequest(f"{where}.tool_calls must be an array")
        for j, call in enumerate(calls):
            if not isinstance(call, dict):
                raise BadRequest(f"{where}.tool_calls[{j}] must be an object")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)
_SPACE = re.compile(r"[ \t\n\r]*")
_SURROGATE_TEXT = re.compile(r"\\u[dD][89a-fA-F]")  # D800-DFFF
# A big array is parsed by orjson a slice of about this many characters at a time (well under
# a millisecond each) ...
_SLICE = 64 * 1024
# ... ending at an element boundary: '}', JSON whitespace, then ',' or the array's ']' (an
# array of objects; any other array is parsed element by element). A boundary is only a
# candidate, found without knowing whether it lies inside a string or a nested value: the
# slice is kept only if orjson parses it as an array, which it does exactly when the cut is
# between two elements of this array (parsed from a real element start, a cut inside a
# string leaves it unterminated, a cut inside a nested value leaves it unclosed).
_BOUNDARY = re.compile(r"\}[ \t\n\r]*[,\]]")
_WINDOW = 16 * 1024  # how far past ``_SLICE`` a boundary is looked for
_TRIES = 2  # candidates tried per slice
_FAILURES = 16  # slices refused per body before the standard library parses the rest
# The key the rest of the body is parsed under, as JSON text; never used when the body has it.
_TAIL_KEY = "\\u0000"


class _Surrogates(Exception):
    """The standard library met a UTF-16 surrogate escape: orjson gives the verdict (it
    refuses a lone surrogate, which it could never write back; the standard library does not)."""


def parse_in_slices(raw: bytes) -> Any:
    """The same value as ``orjson.loads(raw)``, parsed in slices of at most ~64 K characters.

    One C call over megabytes holds the interpreter lock throughout, so a big body parsed
    in a worker thread still silenced the event loop (and ``/healthz``) for its whole
    parse; between these calls other threads run. The members of the top-level object and
    the elements of a top-level array (the messages) are found one at a time; runs of
    elements are parsed by orjson (``_BOUNDARY``), the last ``2 * _SLICE`` characters in one
    call, and what no slice covers by the standard library. A surrogate escape where the
    standard library parses means the whole body is orjson's (which refuses a lone one, the
    standard library does not). Raises ``ValueError`` when the body is not JSON.
    """
    text = raw.decode("utf-8")
    try:
        return _Slices(text).parse()
    except _Surrogates:
        return orjson.loads(raw)


class _Slices:
    def __init__(self, text: str) -> None:
        self.text = text
        self.failures = 0

    def skip(self, at: int) -> int:
        found = _SPACE.match(self.text, at)
        return found.end() if found else at

    def expect(self, at: int, char: str) -> int:
        if self.text[at : at + 1] != char:
            raise ValueError(f"expected {char!r} at character {at}")
        return self.skip(at + 1)

    def std(self, at: int) -> tuple[Any, int]:
        """The standard library's value at ``at`` (where it ends)."""
        value, end = _DECODER.raw_decode(self.text, at)
        if _SURROGATE_TEXT.search(self.text, at, end):
            raise _Surrogates
        return value, end

    def fast(self, piece: str) -> Any:
        """orjson's value of ``piece``; None (a failure counted) when it is not JSON."""
        try:
            return orjson.loads(piece)
        except orjson.JSONDecodeError:
            self.failures += 1
            return None

    def run(self, at: int) -> tuple[list[Any], int] | None:
        """Elements from ``at`` up to a boundary about ``_SLICE`` on, in one orjson call, and
        where their separator ends."""
        text = self.text
        found = _BOUNDARY.finditer(text, at + _SLICE, at + _SLICE + _WINDOW)
        for _, cut in zip(range(_TRIES), found, strict=False):
            if self.failures >= _FAILURES:
                return None
            items = self.fast("[" + text[at : cut.start() + 1] + "]")
            if items is not None:
                return items, cut.end()
        return None

    def array(self, at: int, member: bool) -> tuple[list[Any], int, dict[str, Any] | None]:
        """The array opening at ``at``, where it ends, and, when the rest of the body was
        parsed with it (``member``: it is a member of the top-level object), the members
        after it."""
        text = self.text
        items: list[Any] = []
        at = self.skip(at + 1)
        if text[at : at + 1] == "]":
            return items, at + 1, None
        retry = at  # where orjson is tried again after a refused slice
        while True:
            if text[at : at + 1] == "]":  # after a comma
                raise ValueError(f"value expected at character {at}")
            if at >= retry and self.failures < _FAILURES:
                rest = len(text) - at
                if member and rest <= 2 * _SLICE and text.find(_TAIL_KEY, at) < 0:
                    tail = self.fast('{"' + _TAIL_KEY + '":[' + text[at:])
                    if tail is not None:
                        items.extend(tail.pop("\x00"))
                        return items, len(text), tail
                else:
                    got = self.run(at)
                    if got is not None:
                        more, at = got
                        items.extend(more)
                        if text[at - 1] == "]":
                            return items, at, None
                        at = self.skip(at)
                        continue
                retry = at + _SLICE
            item, at = self.sliced(at)
            items.append(item)
            at = self.skip(at)
            if text[at : at + 1] == "]":
                return items, at + 1, None
            at = self.expect(at, ",")

    def sliced(self, at: int) -> tuple[Any, int]:
        """``std``'s value at ``at``, except that a long string in it (one 30 MB message) is
        decoded a slice at a time (``string``): the standard library decodes a string in one
        C call, 40 ms for 30 MB, holding the interpreter lock throughout (#29)."""
        text = self.text
        opening = text[at : at + 1]
        if opening == '"':
            return self.string(at)
        if opening not in ("{", "["):
            return self.std(at)
        closing = "}" if opening == "{" else "]"
        obj: dict[str, Any] = {}
        arr: list[Any] = []
        at = self.skip(at + 1)
        if text[at : at + 1] == closing:
            return (obj if opening == "{" else arr), at + 1
        while True:
            if opening == "{":
                key, at = self.std(at)
                if not isinstance(key, str):
                    raise ValueError(f"object key expected at character {at}")
                obj[key], at = self.sliced(self.expect(self.skip(at), ":"))
            else:
                item, at = self.sliced(at)
                arr.append(item)
            at = self.skip(at)
            if text[at : at + 1] == closing:
                return (obj if opening == "{" else arr), at + 1
            at = self.expect(at, ",")

    def string(self, at: int) -> tuple[str, int]:
        """The string opening at ``at`` (``std``'s value) and where it ends; past ``_SLICE``
        characters decoded by orjson a slice at a time, each cut before a backslash run (so
        never inside an escape)."""
        text = self.text
        quote = at
        while True:  # the closing quote: one not escaped by an odd run of backslashes
            quote = text.find('"', quote + 1)
            if quote < 0:
                raise ValueError(f"unterminated string starting at character {at}")
            run = quote
            while text[run - 1] == "\\":
                run -= 1
            if (quote - run) % 2 == 0:
                break
        if quote - at <= _SLICE:
            return self.std(at)
        pieces: list[str] = []
        start = at + 1
        while start < quote:
            cut = min(start + _SLICE, quote)
            if cut < quote and text.rfind("\\", cut - 6, cut) >= 0:
                cut = text.rfind("\\", cut - 6, cut)
                while cut > start and text[cut - 1] == "\\":
                    cut -= 1
            piece = self.fast('"' + text[start:cut] + '"') if cut > start else None
            if not isinstance(piece, str):  # (a surrogate pair cut in two, say)
                return self.std(at)
            pieces.append(piece)
            start = cut
        return "".join(pieces), quote + 1

    def value(self, at: int, member: bool) -> tuple[Any, int, dict[str, Any] | None]:
        if self.text[at : at + 1] == "[":
            return self.array(at, member)
        value, at = self.sliced(at)
        return value, at, None

    def parse(self) -> Any:
        text = self.text
        at = self.skip(0)
        if text[at : at + 1] != "{":
            result, at, _ = self.value(at, False)
        else:
            result = {}
            at = self.skip(at + 1)
            if text[at : at + 1] == "}":
                at += 1
            else:
                while True:
                    key, at = self.std(at)
                    if not isinstance(key, str):
                        raise ValueError(f"object key expected at character {at}")
                    result[key], at, rest = self.value(self.expect(self.skip(at), ":"), True)
                    if rest is not None:  # the rest of the body came with it
                        result.update(rest)
                        break
                    at = self.skip(at)
                    if text[at : at + 1] == "}":
                        at += 1
                        break
                    at = self.expect(at, ",")
        if self.skip(at) != len(text):
            raise ValueError(f"extra data at character {self.skip(at)}")
        return result
