"""The pruning tier: old tool results become short placeholders, no LLM call (DESIGN §10). Pure.

Rules (learned from Anthropic's ``clear_tool_uses`` and OpenCode's prune, made cache-aware):
- only tool results are cleared: OpenAI ``tool`` messages, Anthropic ``tool_result`` blocks,
  Responses ``function_call_output`` items (each stays a valid item of its own kind, with its
  call id, so the call/result structure is intact on every surface);
- the most recent ``prune_keep_tool_results`` results are never cleared, nor the results
  within the most recent ``prune_protect_tokens`` of tool output, nor any result of a tool in
  ``prune_exclude_tools``, nor the latest result of a call the loop breaker keeps (``keep``);
- a repeated identical call (same tool, same arguments) keeps only its latest output, wherever
  the older ones are (outside the most recent N);
- a plan is only worth applying when it frees at least ``prune_clear_at_least`` tokens: every
  pruning moves the cached prefix, so it must pay for the cache it breaks.
The placeholder names the tool, its key arguments and how many tokens were cleared, so the
model knows what to call again, and it is deterministic: the same history prunes to the same
bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.core import references
from proxy.core.messages import Message
from proxy.core.settings import CompactionSettings

ITEM_KEY = "_responses_item"  # proxy.surfaces.ITEM_KEY (kept here: the core imports no surface)
CLEARED = "[tool result cleared by compaction-proxy: "
FACTS_CHARS = 160  # key references a placeholder keeps from the output it replaces
KEY_ARGUMENTS = (
    "path",
    "file_path",
    "filePath",
    "file",
    "filename",
    "paths",
    "command",
    "cmd",
    "pattern",
    "query",
    "url",
    "uri",
    "name",
    "id",
)


@dataclass(frozen=True)
class ToolResult:
    """One tool result in a forwarded list."""

    position: int  # message index
    block: int | None  # index of the Anthropic tool_result block, None for a whole message
    call_id: str
    name: str
    arguments: Any
    text: str


@dataclass(frozen=True)
class PrunePlan:
    """What one pruning would replace, and what it would free."""

    replacements: dict[int, Message]  # position -> the message forwarded instead
    freed_tokens: int
    cleared: list[str]  # one line per cleared result, for the loss report
    cleared_text: str  # the cleared outputs, for the key-facts report

    @property
    def end(self) -> int:
        """One past the last replaced position."""
        return max(self.replacements) + 1 if self.replacements else 0


def arguments_of(raw: Any) -> Any:
    """A call's arguments parsed (OpenAI sends them as a JSON string; kept as is if not)."""
    if isinstance(raw, str):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw
    return raw


Call = tuple[str, Any, bool]  # tool name, arguments as sent, whether they are a JSON string


def issued(m: Message) -> list[tuple[str, Call]]:
    """The calls a message issues, (id, call), their arguments not parsed yet (OpenAI
    ``tool_calls`` or Anthropic ``tool_use`` blocks)."""
    out: list[tuple[str, Call]] = []
    for call in m.get("tool_calls") or []:
        if isinstance(call, dict) and isinstance(call.get("id"), str):
            fn = call.get("function") or {}
            out.append((call["id"], (str(fn.get("name", "?")), fn.get("arguments"), True)))
    content = m.get("content")
    if isinstance(content, list):
        for b in content:
            if isinstance(b, dict) and b.get("type") == "tool_use" and "id" in b:
                out.append((str(b["id"]), (str(b.get("name", "?")), b.get("input"), False)))
    return out


def _calls(messages: Sequence[Message]) -> dict[str, tuple[str, Any]]:
    """Every call id issued in ``messages`` -> (tool name, parsed arguments)."""
    return {
        call_id: (name, arguments_of(raw) if encoded else raw)
        for m in messages
        for call_id, (name, raw, encoded) in issued(m)
    }


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(b.get("text", "")) if isinstance(b, dict) else str(b) for b in content)
    return "" if content is None else orjson.dumps(content).decode()


def tool_results(messages: Sequence[Message]) -> list[ToolResult]:
    """The tool results of ``messages`` in order, with the call each one answers."""
    calls = _calls(messages)
    out: list[ToolResult] = []
    for i, m in enumerate(messages):
        if m.get("role") == "tool":
            call_id = str(m.get("tool_call_id"))
            name, args = calls.get(call_id, ("?", None))
            out.append(ToolResult(i, None, call_id, name, args, _text(m.get("content"))))
            continue
        content = m.get("content")
        if m.get("role") != "user" or not isinstance(content, list):
            continue
        for j, b in enumerate(content):
            if isinstance(b, dict) and b.get("type") == "tool_result":
                call_id = str(b.get("tool_use_id"))
                name, args = calls.get(call_id, ("?", None))
                out.append(ToolResult(i, j, call_id, name, args, _text(b.get("content"))))
    return out


def key_arguments(arguments: Any, max_items: int = 3, max_chars: int = 60) -> str:
    """The identifiers that say what a call was about: ``path=src/app.py, pattern=TODO``."""
    if isinstance(arguments, str):
        return arguments[:max_chars]
    if not isinstance(arguments, dict):
        return ""
    keys = [k for k in KEY_ARGUMENTS if k in arguments]
    keys += [k for k, v in arguments.items() if k not in keys and isinstance(v, str | int | float)]
    parts = []
    for key in keys[:max_items]:
        value = arguments[key]
        text = value if isinstance(value, str) else orjson.dumps(value).decode()
        text = " ".join(text.split())
        if len(text) > max_chars:
            text = text[: max_chars - 1] + "…"
        parts.append(f"{key}={text}")
    return ", ".join(parts)


def placeholder(result: ToolResult, tokens: int, repeated: bool) -> str:
    call = f"{result.name}({key_arguments(result.arguments)})"
    refs = key_references(result.text)
    if repeated:
        # The later output need not repeat every fact of this one: keep its key references.
        tail = f"; key references: {refs}]" if refs else "]"
        return (
            f"{CLEARED}{call} was called again later with the same arguments; see the latest{tail}"
        )
    tail = f". Key references: {refs}]" if refs else "]"
    return f"{CLEARED}{call} returned {tokens} tokens; call the tool again if you need them{tail}"


def key_references(text: str, max_chars: int = FACTS_CHARS) -> str:
    """The output's most needed facts (errors, files, ids, numbers with units...), each with
    the words that say what it is when those fit (``references``), bounded: what the model
    most likely needs again without calling the tool."""
    kept: list[str] = []
    used = 0
    for ref in references.references(text, limit=50):
        fact = " ".join(ref.fact.split())
        if len(fact) > 60 or any(fact in k for k in kept):
            continue
        item = " ".join(ref.item.removeprefix(references.USER_MARK).split())
        if len(item) > 90 or used + len(item) + 2 > max_chars:
            item = fact
        if used + len(item) + 2 > max_chars:
            continue
        kept.append(item)
        used += len(item) + 2
    return "; ".join(kept)


def _replace(message: Message, result: ToolResult, text: str) -> Message:
    """``message`` with the result's content replaced, still a valid item of its kind."""
    if result.block is None:
        out = {**message, "content": text}
        item = message.get(ITEM_KEY)
        if isinstance(item, dict):  # a Responses function_call_output item
            out[ITEM_KEY] = {**item, "output": text}
        return out
    blocks = list(message["content"])
    block = {k: v for k, v in blocks[result.block].items() if k != "cache_control"}
    block["content"] = text
    blocks[result.block] = block
    return {**message, "content": blocks}


def _identity(result: ToolResult) -> bytes:
    return orjson.dumps([result.name, result.arguments], option=orjson.OPT_SORT_KEYS)


def plan(
    messages: Sequence[Message],
    settings: CompactionSettings,
    count_text: Callable[[str], int],
    start: int = 0,
    keep: frozenset[str] = frozenset(),
    end: int | None = None,
) -> PrunePlan:
    """Which tool results of ``messages[start:end]`` to clear (the caller decides whether the
    plan pays: ``freed_tokens >= prune_clear_at_least``). Only tool-result content is ever
    replaced: a pinned user turn that also carries tool results keeps its own text."""
    stop = len(messages) if end is None else end
    results = [r for r in tool_results(messages) if start <= r.position < stop]
    recent = settings.prune_keep_tool_results
    keep_recent = {id(r) for r in results[len(results) - recent :]} if recent else set()
    excluded = set(settings.prune_exclude_tools)
    latest: dict[bytes, int] = {}
    for n, r in enumerate(results):
        latest[_identity(r)] = n
    protected_tokens = kept_tokens = 0
    chosen: list[tuple[ToolResult, str, int]] = []
    for n in range(len(results) - 1, -1, -1):
        r = results[n]
        if id(r) in keep_recent or r.name in excluded or r.text.startswith(CLEARED):
            continue
        tokens = count_text(r.text)
        repeated = latest[_identity(r)] != n
        if keep and not repeated and _identity(r).decode() in keep:
            # The agent re-fetched it after a compaction: the loop breaker keeps it, within
            # a protect window of its own (newest first), so pruning still frees something.
            if kept_tokens + tokens <= settings.prune_protect_tokens:
                kept_tokens += tokens
                continue
        if not repeated:
            if protected_tokens + tokens <= settings.prune_protect_tokens:
                protected_tokens += tokens
                continue
            # Past the protect window every result goes, so the next pruning is far away.
            protected_tokens = settings.prune_protect_tokens
        text = placeholder(r, tokens, repeated)
        saved = tokens - count_text(text)
        if saved > 0:
            chosen.append((r, text, saved))
    chosen.reverse()
    replacements: dict[int, Message] = {}
    cleared: list[str] = []
    for r, text, _ in chosen:
        current = replacements.get(r.position, messages[r.position])
        replacements[r.position] = _replace(current, r, text)
        cleared.append(text[len(CLEARED) : -1])
    return PrunePlan(
        replacements,
        sum(saved for _, _, saved in chosen),
        cleared,
        "\n".join(r.text for r, _, _ in chosen),
    )
