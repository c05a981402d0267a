"""The API surfaces the proxy compacts: OpenAI chat completions and Anthropic messages.

Each surface is a pure adapter (DESIGN §9): it validates a request body, gives the core a
message list to work on (the "view"), puts the forwarded view back into a body, reads usage
from replies and stream events, and shapes errors the way that API's clients expect. The
compaction core itself never knows which API it serves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from typing import Any, Literal, Protocol

import orjson

from proxy.core.errors import BadRequest
from proxy.core.layout import joined_runs
from proxy.core.messages import Message
from proxy.core.validation import validate_chat

View = list[Message]


class OutsideMarks(Protocol):
    """A surface's count of the client's cache marks outside the view; ``tools_json``: the
    request's tools as JSON, when the caller made it already."""

    def __call__(self, body: dict[str, Any], tools_json: bytes | None = None) -> int: ...


def _no_marks(body: dict[str, Any], tools_json: bytes | None = None) -> int:
    return 0


@dataclass(frozen=True)
class Surface:
    """One API the proxy understands."""

    name: str  # the route label in logs and metrics
    path: str
    # (body, start): the elements of the history before ``start`` were checked already.
    validate: Callable[[dict[str, Any], int], None]
    to_view: Callable[[dict[str, Any]], View]
    from_view: Callable[[dict[str, Any], View], dict[str, Any]]
    summary_role: Literal["system", "user"] | None  # None: the configured role
    stream_usage_option: bool  # OpenAI only sends stream usage when asked
    error_body: Callable[[str, str, str | None], dict[str, Any]]
    # Requests that carry no full history (server-side state): forwarded untouched.
    stateful: Callable[[dict[str, Any]], bool] = lambda body: False
    # Cache breakpoints the client placed outside the view (Anthropic ``tools``): they count
    # towards the provider's limit of 4 before the proxy adds any of its own.
    outside_cache_marks: OutsideMarks = _no_marks
    # from_view joins the summary into the next user turn (see alternating_turns).
    summary_joins: bool = False
    # The body's member that holds the history (``proxy.core.reparse``).
    history_key: str = "messages"


def openai_error(message: str, type_: str, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code, "param": None}}


def anthropic_error(message: str, type_: str, code: str | None) -> dict[str, Any]:
    kinds = {
        "invalid_request_error": "invalid_request_error",
        "authentication_error": "authentication_error",
        "upstream_error": "api_error",
        "server_error": "api_error",
    }
    if code == "request_too_large":
        kind = "request_too_large"
    elif code == "upstream_timeout":
        kind = "timeout_error"
    else:
        kind = kinds.get(type_, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# ---- OpenAI /v1/chat/completions -----------------------------------------------------------


def _chat_to_view(body: dict[str, Any]) -> View:
    messages: View = body["messages"]
    return messages


def _chat_from_view(body: dict[str, Any], view: View) -> dict[str, Any]:
    out = dict(body)
    out["messages"] = view
    return out


OPENAI_CHAT = Surface(
    name="chat.completions",
    path="/v1/chat/completions",
    validate=validate_chat,
    to_view=_chat_to_view,
    from_view=_chat_from_view,
    summary_role=None,
    stream_usage_option=True,
    error_body=openai_error,
)


# ---- Anthropic /v1/messages ----------------------------------------------------------------

# ``system`` inside ``messages``: Claude Code sends one mid-conversation; it is forwarded in
# place (it is never a cut point: only user turns are).
_ANTHROPIC_ROLES = frozenset({"user", "assistant", "system"})


def validate_messages(body: dict[str, Any], start: int = 0) -> None:
    """The Messages API fields the proxy relies on; the upstream validates the rest (from
    message ``start`` on: the ones before were checked already)."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise BadRequest("'model' must be a non-empty string")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise BadRequest("'max_tokens' must be an integer")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array")
    system = body.get("system")
    if system is not None and not isinstance(system, str | list):
        raise BadRequest("'system' must be a string or an array of text blocks")
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be a boolean")
    for i, m in enumerate(islice(messages, start, None), start):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object")
        if m.get("role") not in _ANTHROPIC_ROLES:
            raise BadRequest(f"{where}.role must be 'user', 'assistant' or 'system'")
        content = m.get("content")
        if not isinstance(content, str | list):
            raise BadRequest(f"{where}.content must be a string or an array of blocks")
        if isinstance(content, list):
            for j, block in enumerate(content):
                if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                    raise BadRequest(f"{where}.content[{j}] must be an object with a 'type'")


def _messages_to_view(body: dict[str, Any]) -> View:
    """The top-level ``system`` becomes a head message, so it is part of the prefix chain
    (a summary is never reused under another system prompt) and is never summarized."""
    view: View = list(body["messages"])
    if body.get("system"):
        view.insert(0, {"role": "system", "content": body["system"]})
    return view


def _blocks_of(content: Any) -> list[Any]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    return list(content) if isinstance(content, list) else []


def alternating_turns(messages: View) -> View:
    """The turns as the Messages API takes them: user turns side by side become one, and the
    first message is a user turn.

    A summary of ours is a user turn next to the pinned user turns kept in place (the task,
    client instructions) and the first kept user turn: user turns the client never sent side
    by side. Each such run is joined into one user turn, in order (the API merges them
    itself, so the meaning is the same; blocks keep their cache marks, so the cached prefix
    still ends where it did), at the place of its first member; system messages in between
    take no part in alternation and follow it. A system message the client sent after a turn
    that is no longer forwarded must not lead (the API wants a user turn first): leading
    system messages follow the first user turn. Pure and deterministic, so the forwarded bytes
    stay the same from one request to the next.
    """
    runs = joined_runs(messages)
    if runs:
        merged: dict[int, Message] = {}
        joined: set[int] = set()
        for members in runs:
            blocks = [b for i in members for b in _blocks_of(messages[i]["content"])]
            merged[members[0]] = {**messages[members[-1]], "content": blocks}
            joined.update(members[1:])
        messages = [merged.get(i, m) for i, m in enumerate(messages) if i not in joined]
    lead = 0
    while lead < len(messages) and messages[lead].get("role") == "system":
        lead += 1
    if 0 < lead < len(messages) and messages[lead].get("role") == "user":
        messages = [messages[lead], *messages[:lead], *messages[lead + 1 :]]
    return messages


def _messages_from_view(body: dict[str, Any], view: View) -> dict[str, Any]:
    out = dict(body)
    if body.get("system"):
        out["system"] = view[0]["content"]
        view = view[1:]
    out["messages"] = alternating_turns(view)
    return out


def tool_cache_marks(tools: Any, tools_json: bytes | None = None) -> int:
    """``count_cache_marks`` of a request's tool definitions (``tools_json``: their JSON, if
    made already). Claude Code sends ~60 KB of schemas with every request and no mark in
    them: walking them took ~120 us, finding that their JSON never says ``"cache_control"``
    takes ~15 us (#28), nothing more when the JSON was made for their token count."""
    if not tools:
        return 0
    if b'"cache_control"' not in (orjson.dumps(tools) if tools_json is None else tools_json):
        return 0
    return count_cache_marks(tools)


def _tools_marks(body: dict[str, Any], tools_json: bytes | None = None) -> int:
    return tool_cache_marks(body.get("tools"), tools_json)


def count_cache_marks(value: Any) -> int:
    """``cache_control`` marks anywhere inside ``value`` (tool definitions, blocks)."""
    if isinstance(value, dict):
        own = 1 if value.get("cache_control") is not None else 0
        return own + sum(count_cache_marks(v) for k, v in value.items() if k != "cache_control")
    if isinstance(value, list):
        return sum(count_cache_marks(v) for v in value)
    return 0


ANTHROPIC_MESSAGES = Surface(
    name="messages",
    path="/v1/messages",
    validate=validate_messages,
    to_view=_messages_to_view,
    from_view=_messages_from_view,
    # The summary is a user turn, joined to the first kept user turn on the way out.
    summary_role="user",
    stream_usage_option=False,
    error_body=anthropic_error,
    outside_cache_marks=_tools_marks,
    summary_joins=True,
)


# ---- OpenAI /v1/responses ------------------------------------------------------------------

ITEM_KEY = "_responses_item"  # the original input item behind a view message
# Responses input items that hold a compacted history (Codex's remote compaction).
CLIENT_COMPACTION_ITEMS = frozenset({"compaction", "compaction_summary"})


def validate_responses(body: dict[str, Any], start: int = 0) -> None:
    """The Responses API fields the proxy relies on (input items from ``start`` on)."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise BadRequest("'model' must be a non-empty string")
    items = body.get("input")
    if not isinstance(items, str | list):
        raise BadRequest("'input' must be a string or an array of input items")
    if isinstance(items, list):
        for i, item in enumerate(islice(items, start, None), start):
            if not isinstance(item, dict):
                raise BadRequest(f"input[{i}] must be an object")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string")
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be a boolean")


def _item_view(item: dict[str, Any]) -> Message:
    """A chat-shaped stand-in for one Responses input item, carrying the item itself.

    The stand-in's fields name the item's meaning (so fingerprints, token counts, cut points
    and transcripts work unchanged); the item is what gets forwarded.
    """
    kind = item.get("type", "message")
    if kind == "message" or "role" in item:
        view: Message = {"role": item.get("role", "user"), "content": item.get("content")}
    elif kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
        }
        view = {"role": "assistant", "tool_calls": [call]}
    elif kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else orjson.dumps(output).decode()
        view = {"role": "tool", "tool_call_id": item.get("call_id"), "content": text}
    elif kind == "reasoning":
        # Opaque (encrypted_content): carried as one block that is fingerprinted and counted
        # but never rendered into a transcript (messages.OPAQUE_BLOCKS).
        view = {"role": "assistant", "content": [item]}
    elif kind in CLIENT_COMPACTION_ITEMS:
        # The client's (or the provider's) own compacted history: opaque, and a system-level
        # item so it is pinned in place and never summarized a second time (DESIGN §10).
        view = {"role": "system", "content": [item]}
    else:  # web search, computer calls...: opaque but meaningful
        view = {"role": "assistant", "content": f"[{kind}] " + orjson.dumps(item).decode()}
    view[ITEM_KEY] = item
    return view


def _responses_to_view(body: dict[str, Any]) -> View:
    items = body["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    view: View = [_item_view(item) for item in items]
    if body.get("instructions"):
        view.insert(0, {"role": "system", "content": body["instructions"], ITEM_KEY: None})
    return view


def _responses_from_view(body: dict[str, Any], view: View) -> dict[str, Any]:
    out = dict(body)
    if body.get("instructions"):
        view = view[1:]
    items = []
    for m in view:
        if ITEM_KEY in m:
            items.append(m[ITEM_KEY])
        else:  # our summary message
            items.append({"type": "message", "role": m["role"], "content": m["content"]})
    out["input"] = items
    return out


def stateful(body: dict[str, Any]) -> bool:
    """A Responses request that continues server-side state sends only the new items:
    there is no history here to compact."""
    return bool(body.get("previous_response_id") or body.get("conversation"))


OPENAI_RESPONSES = Surface(
    name="responses",
    path="/v1/responses",
    validate=validate_responses,
    to_view=_responses_to_view,
    from_view=_responses_from_view,
    summary_role=None,
    stream_usage_option=False,
    error_body=openai_error,
    stateful=stateful,
    history_key="input",
)


def usage_of(obj: Any) -> dict[str, Any] | None:
    """Usage in a reply or a stream event of any surface (Anthropic's ``message_start``
    nests it in ``message``, Responses' ``response.completed`` in ``response``)."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    for key in ("message", "response"):
        if not isinstance(usage, dict):
            inner = obj.get(key)
            usage = inner.get("usage") if isinstance(inner, dict) else None
    return usage if isinstance(usage, dict) else None


def model_of(obj: Any) -> str | None:
    """The model an answer or a stream event names (nested as ``usage_of`` finds usage)."""
    if not isinstance(obj, dict):
        return None
    for where in (obj, obj.get("message"), obj.get("response")):
        model = where.get("model") if isinstance(where, dict) else None
        if isinstance(model, str) and model:
            return model
    return None
