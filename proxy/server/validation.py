"""Request validation: a clear 400 naming the field, before anything else runs."""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

from proxy.core.errors import BadRequest

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# orjson writes at most 254 levels of arrays and objects; a body the proxy has to write back
# (a compacted history, a stream asking for usage, the ledger's copy) must fit, with room.
MAX_DEPTH = 200


# Past this size a body is parsed value by value (see ``parse_in_slices``) ...
SLICED_BYTES = 1024 * 1024
# ... unless it escapes UTF-16 surrogates: orjson refuses a lone one (which it could never
# write back), the standard library does not, so such a body keeps orjson's verdict.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abAB]")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or ``BadRequest``."""
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        sliced = len(raw) >= SLICED_BYTES and not _SURROGATE_ESCAPE.search(raw)
        body = parse_in_slices(raw) if sliced else orjson.loads(raw)
    except (orjson.JSONDecodeError, ValueError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if not within_depth(body, MAX_DEPTH):
        raise BadRequest(
            f"request body is nested deeper than {MAX_DEPTH} levels of arrays and objects"
        )
    return body


def within_depth(value: Any, limit: int) -> bool:
    """Whether no array or object in ``value`` lies more than ``limit`` levels deep."""
    level: list[Any] = [value]
    depth = 1
    while level:
        if depth > limit:
            return False
        below: list[Any] = []
        for node in level:
            children = node.values() if type(node) is dict else node
            below.extend(c for c in children if type(c) is dict or type(c) is list)
        level = below
        depth += 1
    return True


def validate_chat(body: dict[str, Any]) -> None:
    """Check the fields the proxy relies on; the upstream validates the rest."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array")
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be a boolean")
    for i, m in enumerate(messages):
        # The common case, checked cheaply first: {"role": ..., "content": "text"}.
        if type(m) is dict and len(m) == 2 and type(m.get("content")) is str:
            if m.get("role") in ROLES:
                continue
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
            if key in m and m[key] is not None and not isinstance(m[key], str):
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


def parse_in_slices(raw: bytes) -> Any:
    """The same value as ``orjson.loads(raw)``, parsed one top-level member and one array
    element at a time.

    One C call over megabytes holds the interpreter lock throughout, so a big body parsed
    in a worker thread still silenced the event loop (and ``/healthz``) for its whole
    parse; between these small calls other threads run. Raises ``ValueError`` when the
    body is not JSON.
    """
    text = raw.decode("utf-8")
    decode, space = _DECODER.raw_decode, _SPACE.match

    def skip(at: int) -> int:
        found = space(text, at)
        return found.end() if found else at

    def expect(at: int, char: str) -> int:
        if text[at : at + 1] != char:
            raise ValueError(f"expected {char!r} at character {at}")
        return skip(at + 1)

    def value(at: int) -> tuple[Any, int]:
        if text[at : at + 1] != "[":
            return decode(text, at)
        items: list[Any] = []
        at = skip(at + 1)
        if text[at : at + 1] == "]":
            return items, at + 1
        while True:
            item, at = decode(text, at)
            items.append(item)
            at = skip(at)
            if text[at : at + 1] == "]":
                return items, at + 1
            at = expect(at, ",")

    at = skip(0)
    if text[at : at + 1] != "{":
        result, at = value(at)
    else:
        result = {}
        at = skip(at + 1)
        if text[at : at + 1] == "}":
            at += 1
        else:
            while True:
                key, at = decode(text, at)
                if not isinstance(key, str):
                    raise ValueError(f"object key expected at character {at}")
                result[key], at = value(expect(skip(at), ":"))
                at = skip(at)
                if text[at : at + 1] == "}":
                    at += 1
                    break
                at = expect(at, ",")
    if skip(at) != len(text):
        raise ValueError(f"extra data at character {skip(at)}")
    return result
