"""A summarizer call that reads the conversation's own prompt cache (#25). Pure.

The standalone summarizer call sends the span as a transcript under its own system prompt:
the provider reads all of it uncached, at the input price, although the request it
shortens read the same history from the cache (a tenth of the price on Anthropic). Claude
Code's own compaction sends instead the conversation as it is plus one instruction; so does
this call: the body the proxy would forward now (the client's model, system, tools,
``tool_choice``, thinking, cache marks: all that makes the provider's cache key), its
history as forwarded, and one user message asking for the memory of everything before the
messages that stay. The provider reads that prefix from its cache. What changes is only
what no cache key holds: the stream flag, the reply's length, and (Responses) ``store``.

Not every request allows it: a tool call forced by ``tool_choice`` or a structured
``response_format`` would not give prose; then the standalone call is made (and it is made
too when this one's answer is no usable summary: ``proxy.core.flow_compact``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.core.costs import Prices, input_cost
from proxy.core.frozen import quick_init
from proxy.core.messages import Message, render
from proxy.core.stability import MAX_BREAKPOINTS, has_cache_marks, markable, with_marks
from proxy.core.surfaces import ANTHROPIC_MESSAGES, OPENAI_RESPONSES, Surface, count_cache_marks

# The instruction's first words: a scripted upstream (tests, the bench) knows the call by
# them; a model reads them as the start of the request.
MARK = "[compaction-proxy: memory request]"
_QUOTE_CHARS = 160
# Reply-length keys of each surface, in the order they are looked for.
_LENGTH_KEYS = {
    "chat.completions": ("max_completion_tokens", "max_tokens"),
    "messages": ("max_tokens",),
    "responses": ("max_output_tokens",),
}


@quick_init
@dataclass(frozen=True)
class SharedCall:
    """What the front door knows to make the call: the surface, the client's body (its
    history is replaced by the forwarded one), the upstream URL and the headers it forwards
    (the client's key among them: kept in memory only, never logged or stored)."""

    surface: Surface
    body: Mapping[str, Any]
    url: str
    headers: tuple[tuple[bytes, bytes], ...]

    def __repr__(self) -> str:  # never the headers (they carry the client's key)
        return f"SharedCall({self.surface.name}, {self.url})"


@dataclass(frozen=True)
class SharedReply:
    """The answer of a detector or summarizer call, as the flow needs it
    (``proxy.core.commands.Reply``): a shared call's, or a standalone one's
    (``proxy.adapters.llm.LLMReply`` is this type)."""

    text: str
    finish_reason: str | None
    prompt_tokens: int  # all of the input, cached or not
    completion_tokens: int
    model: str
    cached_tokens: int = 0
    written_tokens: int = 0


def usable(call: SharedCall) -> bool:
    """Whether the client's request leaves the model free to answer in prose."""
    body = call.body
    choice = body.get("tool_choice")
    if call.surface is ANTHROPIC_MESSAGES:
        if isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
            return False
    elif choice is not None and choice not in ("auto", "none"):
        return False  # "required" or one named function
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return False
    text = body.get("text")
    inner = text.get("format") if isinstance(text, dict) else None
    if isinstance(inner, dict) and inner.get("type") not in (None, "text"):
        return False
    if body.get("output_format") is not None:  # Anthropic's structured outputs
        return False
    modalities = body.get("modalities")
    if isinstance(modalities, list) and "audio" in modalities:
        return False  # (the answer would be spoken)
    n = body.get("n")
    return n is None or n == 1


# Reasoning the client cannot read: Responses' encrypted reasoning items, Anthropic's
# redacted thinking, a provider's compaction items. (Anthropic's plain thinking blocks are in
# the client's hands already.)
_HIDDEN = frozenset({"reasoning", "redacted_thinking", "compaction", "compaction_summary"})


def hides_reasoning(history: Sequence[Message]) -> bool:
    """Whether ``history`` holds reasoning the client cannot read. A call in the client's
    shape would show it to the model, and the memory it writes must not put into words
    what the provider keeps from the client: then the standalone call is made, which never
    shows reasoning (``messages.render``)."""
    for m in history:
        content = m.get("content")
        if isinstance(content, list):
            for block in content:
                if isinstance(block, dict) and block.get("type") in _HIDDEN:
                    return True
    return False


def instruction(prompt: str, budget: int, kept: Sequence[Message]) -> str:
    """The one user message that asks for the memory: the summarizer's own instructions, and
    where the part to summarize ends (the first message that stays, quoted)."""
    rules = prompt.replace("{budget}", str(budget))
    scope = (
        "The conversation above will be shortened: its older messages are replaced by the "
        "memory you write now. Its system prompt and pinned instructions (the task among them)"
    )
    if kept:
        first = " ".join(render(kept[0]).split())[:_QUOTE_CHARS]
        scope += (
            f" and everything from its last {len(kept)} messages on (the first of them "
            f"begins: \u201c{first}\u201d) stay as they are: do not repeat them."
        )
    else:
        scope += " stay as they are: do not repeat them."
    return (
        f"{MARK}\n{scope}\n\n{rules}\n\nDo not call any tool and do not continue the task: "
        "reply with the memory only, as text."
    )


def cache_marked(call: SharedCall, history: list[Message], outside: int) -> list[Message]:
    """``history`` with the breakpoints the Messages API reads a cache at: its end, then the
    system prompt (where the proxy's own forwarded requests have theirs), unless marked
    already, within the limit of four (``outside``: the client's marks on its tools). An
    inline compaction runs before the request's own marks are placed; without a breakpoint
    the provider reads no cache at all. Other surfaces cache without marks."""
    if call.surface is not ANTHROPIC_MESSAGES or not history:
        return history
    budget = MAX_BREAKPOINTS - outside - count_cache_marks(history)
    picks = []
    for i in (len(history) - 1, 0):
        m = history[i]
        if i == 0 and m.get("role") != "system":
            continue
        if budget > 0 and i not in picks and markable(m) and not has_cache_marks([m]):
            picks.append(i)
            budget -= 1
    return with_marks(history, picks) if picks else history


def request_body(call: SharedCall, view: list[Message], max_tokens: int) -> dict[str, Any]:
    """The body to send: the client's, with ``view`` (the forwarded history and the
    instruction) as its history, not streamed, and ``max_tokens`` of reply (on top of a
    thinking budget the client set, which stays: changing it would drop the cache)."""
    out = call.surface.from_view(dict(call.body), view)
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("n", None)
    keys = _LENGTH_KEYS.get(call.surface.name, ("max_tokens",))
    key = next((k for k in keys if k in out), keys[-1])
    thinking = out.get("thinking")
    extra = 0
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        budget = thinking.get("budget_tokens")
        extra = budget if isinstance(budget, int) and not isinstance(budget, bool) else 0
    out[key] = max_tokens + extra
    if call.surface is OPENAI_RESPONSES:
        out["store"] = False  # a memory request is nothing to keep server-side
        out.pop("background", None)
    return out


def reply_of(call: SharedCall, body: Any, model: str) -> SharedReply | None:
    """The summary text and usage in the upstream's answer (None: not an answer of the
    surface's shape)."""
    if not isinstance(body, dict):
        return None
    got = body.get("usage")
    usage: dict[str, Any] = got if isinstance(got, dict) else {}
    try:
        if call.surface is ANTHROPIC_MESSAGES:
            blocks = body.get("content") or []
            text = "".join(
                b.get("text", "") for b in blocks if isinstance(b, dict) and b.get("type") == "text"
            )
            stop = body.get("stop_reason")
            finish: str | None = {"max_tokens": "length", "tool_use": "tool_calls"}.get(
                str(stop), stop if isinstance(stop, str) else None
            )
            fresh = int(usage.get("input_tokens") or 0)
            read = int(usage.get("cache_read_input_tokens") or 0)
            wrote = int(usage.get("cache_creation_input_tokens") or 0)
            return SharedReply(
                text, finish, fresh + read + wrote, int(usage.get("output_tokens") or 0),
                model, read, wrote,
            )  # fmt: skip
        if call.surface is OPENAI_RESPONSES:
            parts = [
                c.get("text", "")
                for item in body.get("output") or []
                if isinstance(item, dict) and item.get("type") == "message"
                for c in item.get("content") or []
                if isinstance(c, dict) and c.get("type") == "output_text"
            ]
            calls = any(
                isinstance(i, dict) and i.get("type") == "function_call"
                for i in body.get("output") or []
            )
            details = body.get("incomplete_details") or {}
            finish = "length" if details.get("reason") == "max_output_tokens" else "stop"
            cached = (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
            return SharedReply(
                "".join(parts), "tool_calls" if calls and not parts else finish,
                int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0),
                model, int(cached),
            )  # fmt: skip
        return chat_reply(body, model)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError):
        return None


def chat_reply(body: dict[str, Any], model: str) -> SharedReply:
    """A chat completion's text and usage (the standalone calls' answers too); raises
    ``KeyError``, ``IndexError``, ``TypeError``, ``AttributeError`` or ``ValueError`` when
    the body is not one."""
    got = body.get("usage")
    usage: dict[str, Any] = got if isinstance(got, dict) else {}
    choice = body["choices"][0]
    message = choice.get("message") or {}
    content = message.get("content")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return SharedReply(
        content if isinstance(content, str) else "", choice.get("finish_reason"),
        int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
        model, int(cached),
    )  # fmt: skip


def cheaper(
    request_prices: Prices,
    summary_prices: Prices,
    *,
    forwarded_tokens: int,
    cached_tokens: int,
    span_tokens: int,
    prompt_tokens: int = 1000,
) -> bool:
    """Whether the shared call's input (the forwarded history, ``cached_tokens`` of it read
    from the cache, plus the instruction) costs less than the standalone call's (the span
    and its prompt, at the summary model's input price). Outputs are alike."""
    shared = input_cost(request_prices, forwarded_tokens + prompt_tokens, cached_tokens)
    alone = (span_tokens + prompt_tokens) * summary_prices.input
    return shared < alone
