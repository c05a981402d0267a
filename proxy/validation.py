"""Request validation: a clear 400 naming the field, before anything else runs."""

from __future__ import annotations

from typing import Any

import orjson

from .errors import BadRequest

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or ``BadRequest``."""
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


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
