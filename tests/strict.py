"""What the real providers reject, checked the way they check it (used by tests/upstream.py).

Each ``check_*`` function takes a request body and returns the reason a real provider would
answer 400, or None when it would accept it. The rules follow the providers' documented
validation errors (OpenAI chat completions and Responses, Anthropic Messages):

- chat: a ``tool`` message must answer a ``tool_calls`` id of the assistant message right
  before it (only tool messages in between); every ``tool_calls`` id must be answered by
  the tool messages that follow it; an assistant message needs content or tool calls; a
  content array must not be empty.
- Anthropic: every ``tool_use`` in an assistant turn is answered by a ``tool_result`` in the
  very next user turn and every ``tool_result`` answers a ``tool_use`` of the assistant turn
  right before, and stands at the beginning of its message (before any text); the first
  message is a user turn (a ``system`` message first is refused too); user and assistant
  turns alternate (the API
  itself merges consecutive same-role turns, but the proxy must never create them, so the
  strict upstream flags them; a test that sends them on purpose opts out); no empty content
  (except a final assistant turn, the prefill); at most 4 ``cache_control`` blocks over
  ``tools``, ``system`` and ``messages``, and none on a ``thinking`` or ``redacted_thinking``
  block (their schemas have no such field, and a thinking block must come back unmodified).
  ``system`` messages inside ``messages`` (sent by Claude Code) are accepted and take no
  part in alternation.
- Responses: a ``reasoning`` item must be followed by the item it produced (not the end of
  the input, not a user message, not a tool output); every ``function_call`` has its
  ``function_call_output`` and every output its call.
"""

from __future__ import annotations

from typing import Any

MAX_CACHE_CONTROL = 4


def _empty(content: Any) -> bool:
    if content is None:
        return True
    if isinstance(content, str):
        return content == ""
    if isinstance(content, list):
        if not content:
            return True
        return any(
            isinstance(b, dict) and b.get("type") == "text" and not b.get("text") for b in content
        )
    return False


# ---- OpenAI chat completions ---------------------------------------------------------------


def check_chat(body: dict[str, Any]) -> str | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty array"
    open_calls: set[str] = set()  # ids of the latest tool-calling turn still unanswered
    in_tool_block = False
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"messages[{i}] must be an object"
        role = m.get("role")
        content = m.get("content")
        if isinstance(content, list) and not content:
            return f"messages[{i}].content: array too short (empty content)"
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not in_tool_block or call_id not in open_calls:
                return (
                    f"messages[{i}]: messages with role 'tool' must be a response to a "
                    f"preceding message with 'tool_calls' (tool_call_id {call_id!r})"
                )
            open_calls.discard(call_id)
            continue
        if open_calls:
            missing = ", ".join(sorted(open_calls))
            return (
                "An assistant message with 'tool_calls' must be followed by tool messages "
                f"responding to each 'tool_call_id'. Missing: {missing}"
            )
        in_tool_block = False
        if role == "assistant":
            calls = m.get("tool_calls") or []
            # "content is required unless tool_calls or function_call is specified"
            if not calls and content is None and not m.get("function_call"):
                return f"messages[{i}]: an assistant message needs content or tool_calls"
            if calls:
                open_calls = {c.get("id") for c in calls if isinstance(c, dict)}
                in_tool_block = True
    if open_calls:
        missing = ", ".join(sorted(str(c) for c in open_calls))
        return (
            "An assistant message with 'tool_calls' must be followed by tool messages "
            f"responding to each 'tool_call_id'. Missing: {missing}"
        )
    return None


# ---- Anthropic messages --------------------------------------------------------------------


def count_cache_control(value: Any) -> int:
    if isinstance(value, dict):
        own = 1 if value.get("cache_control") is not None else 0
        return own + sum(count_cache_control(v) for k, v in value.items() if k != "cache_control")
    if isinstance(value, list):
        return sum(count_cache_control(v) for v in value)
    return 0


def _blocks(message: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    content = message.get("content")
    if not isinstance(content, list):
        return []
    return [b for b in content if isinstance(b, dict) and b.get("type") == kind]


_UNMARKABLE = ("thinking", "redacted_thinking")  # blocks whose schema has no cache_control


def check_messages(body: dict[str, Any], *, alternation: bool = True) -> str | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages: at least one message is required"
    marks = sum(count_cache_control(body.get(k)) for k in ("tools", "system", "messages"))
    if marks > MAX_CACHE_CONTROL:
        return (
            f"A maximum of {MAX_CACHE_CONTROL} blocks with cache_control may be provided. "
            f"Found {marks}."
        )
    turns = [
        (i, m) for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") != "system"
    ]
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            return f"messages.{i}.role: Input should be 'user' or 'assistant'"
        content = m.get("content")
        for j, b in enumerate(content if isinstance(content, list) else ()):
            if isinstance(b, dict) and b.get("type") in _UNMARKABLE and "cache_control" in b:
                kind = b["type"]
                return (
                    f"messages.{i}.content.{j}.{kind}.cache_control: "
                    "Extra inputs are not permitted"
                )
    if messages[0].get("role") != "user":
        return "messages: first message must use the 'user' role"
    last_turn = turns[-1][0] if turns else -1
    for i, m in enumerate(messages):
        if _empty(m.get("content")) and not (i == last_turn and m.get("role") == "assistant"):
            return f"messages.{i}: all messages must have non-empty content"
    previous: dict[str, Any] | None = None
    for n, (i, m) in enumerate(turns):
        role = m["role"]
        if alternation and previous is not None and previous["role"] == role:
            return f"messages.{i}: roles must alternate between 'user' and 'assistant'"
        results = [b.get("tool_use_id") for b in _blocks(m, "tool_result")]
        if results:
            issued = (
                {b.get("id") for b in _blocks(previous, "tool_use")}
                if previous is not None and previous["role"] == "assistant"
                else set()
            )
            content = m.get("content") or []
            leading = next(
                (
                    n
                    for n, b in enumerate(content)
                    if not (isinstance(b, dict) and b.get("type") == "tool_result")
                ),
                len(content),
            )
            if leading < len(results):
                return (
                    f"messages.{i}: Did not find {len(results)} `tool_result` block(s) at the "
                    "beginning of this message. Messages following `tool_use` blocks must "
                    "begin with a matching number of `tool_result` blocks."
                )
            unmatched = [r for r in results if r not in issued]
            if role != "user" or unmatched:
                return (
                    f"messages.{i}.content: unexpected `tool_use_id` found in `tool_result` "
                    f"blocks: {unmatched}. Each `tool_result` block must have a corresponding "
                    "`tool_use` block in the previous message."
                )
        uses = [b.get("id") for b in _blocks(m, "tool_use")]
        if uses:
            following = turns[n + 1][1] if n + 1 < len(turns) else None
            answered = (
                {b.get("tool_use_id") for b in _blocks(following, "tool_result")}
                if following is not None
                else set()
            )
            missing = [u for u in uses if u not in answered]
            if missing and following is not None:
                return (
                    f"messages.{i}: `tool_use` ids were found without `tool_result` blocks "
                    f"immediately after: {missing}. Each `tool_use` block must have a "
                    "corresponding `tool_result` block in the next message."
                )
        previous = m
    return None


# ---- OpenAI Responses ----------------------------------------------------------------------

_NOT_PRODUCED = frozenset({"function_call_output", "reasoning", "item_reference"})


def check_responses(body: dict[str, Any]) -> str | None:
    items = body.get("input")
    if isinstance(items, str):
        return None
    if not isinstance(items, list):
        return "'input' must be a string or an array"
    calls: set[str] = set()
    outputs: set[str] = set()
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            return f"input[{i}] must be an object"
        kind = item.get("type", "message")
        if kind == "message" and _empty(item.get("content")):
            return f"input[{i}].content: empty content"
        if kind == "reasoning":
            following = items[i + 1] if i + 1 < len(items) else None
            ok = (
                isinstance(following, dict)
                and following.get("type", "message") not in _NOT_PRODUCED
                and following.get("role", "assistant") == "assistant"
            )
            if not ok:
                return (
                    f"Item '{item.get('id')}' of type 'reasoning' was provided without its "
                    "required following item."
                )
        if kind == "function_call":
            calls.add(str(item.get("call_id")))
        if kind == "function_call_output":
            call_id = str(item.get("call_id"))
            if call_id not in calls:
                return f"No tool call found for function call output with call_id {call_id}."
            outputs.add(call_id)
    missing = sorted(calls - outputs)
    if missing:
        return f"No tool output found for function call {missing[0]}."
    return None
