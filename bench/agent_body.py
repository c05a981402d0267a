"""A request shaped like a coding agent's, at a real agent's sizes, for the CPU benchmarks.

The benchmarks' usual bodies (``bench.overhead.request_body``) are plain chat turns with no
tools and a one-line system prompt. Real agents resend, with every request, long
instructions and the JSON schemas of every tool they have: Claude Code 2.1 sends a ~5.6 KB
system prompt and 24 tools in ~62 KB of JSON (``shared/data/client-shapes``, read for its
sizes only). That part is the same on every request of a session, and a proxy that re-reads
it on each one pays for it on each one (#28: counting the schemas' tokens alone took 4-9 ms
a request). This body has those sizes in the chat-completions shape (as LiteLLM or an
OpenAI-compatible agent sends them): a system prompt, ``TOOLS`` function tools with long
descriptions and nested parameter schemas, and turns of assistant tool calls, tool results
and user instructions. Deterministic; the text is varied words, not one repeated phrase
(a tokenizer's cost depends on the text). Below the default trigger.
"""

from __future__ import annotations

import random
from typing import Any

import orjson

MODEL = "gpt-4o-mini"
SYSTEM_CHARS = 5_600
TOOLS = 24
TOOL_DESCRIPTION_CHARS = 1_100
TURNS = 17  # a call, its result and a user note each: 2 + 3 * 17 = 53 messages
WORDS = (
    "file read edit the a to of and in is that for it with as on be this by are or from at "
    "test run build change function class module import return value error path line code "
    "repository branch commit diff patch tool call result output user agent task plan step "
    "check verify before after when not only each every should must may can will use make"
).split()


def _text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]


def _tool(rng: random.Random, i: int) -> dict[str, Any]:
    properties = {f"arg_{j}": {"type": "string", "description": _text(rng, 90)} for j in range(6)}
    properties["options"] = {
        "type": "object",
        "properties": {
            f"flag_{j}": {"type": "boolean", "description": _text(rng, 80)} for j in range(4)
        },  # fmt: skip
    }
    return {
        "type": "function",
        "function": {
            "name": f"Tool{i}",
            "description": _text(rng, TOOL_DESCRIPTION_CHARS),
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": ["arg_0"],
                "additionalProperties": False,
            },
        },
    }


def agent_body(stream: bool, conversation: int = 0) -> bytes:
    """The body (bytes); ``conversation`` > 0 changes the first user turn only (another
    conversation to the proxy, the same sizes)."""
    rng = random.Random(2_197)
    messages: list[dict[str, Any]] = [{"role": "system", "content": _text(rng, SYSTEM_CHARS)}]
    first = "Fix the failing test in the parser module and keep the diff small."
    messages.append(
        {"role": "user", "content": f"[{conversation}] {first}" if conversation else first}
    )
    for turn in range(TURNS):
        call_id = f"call_{turn:04d}"
        arguments = orjson.dumps({"arg_0": f"src/module_{turn}.py"}).decode()
        messages.append({
            "role": "assistant",
            "content": None,
            "tool_calls": [{
                "id": call_id,
                "type": "function",
                "function": {"name": f"Tool{turn % TOOLS}", "arguments": arguments},
            }],
        })  # fmt: skip
        messages.append({"role": "tool", "tool_call_id": call_id, "content": _text(rng, 1_200)})
        messages.append({"role": "user", "content": _text(rng, 200)})
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "tools": [_tool(rng, i) for i in range(TOOLS)],
        "max_tokens": 64,
    }
    if stream:
        body["stream"] = True
    return orjson.dumps(body)
