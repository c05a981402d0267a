"""Deterministic conversation material for integration tests.

A long tool-using coding-assistant session: early turns plant FACTS (distinctive
identifiers a compaction must preserve), every 4th turn asks for a tool call through
the ``[[tool:NAME:ARGS]]`` marker understood by ``tests.upstream.default_reply``, and
the rest is varied filler prose so the context grows like a real session.
Nothing here contains the word FACT except FACTS, so the extractive fake summarizer
keeps exactly the planted facts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Awaitable, Callable, Generator
from typing import Any

FACTS: list[str] = [
    "FACT: the deploy ticket is OPS-4821.",
    "FACT: the config lives at /srv/billing/config.yaml.",
    "FACT: the staging port is 8443.",
    "FACT: the database is pg-billing-02.",
    "FACT: the runbook URL is https://wiki.example.internal/runbooks/billing-rollback.",
    "FACT: the crash is a KeyError in parse_invoice().",
    "FACT: the on-call engineer is Priya Raman.",
    "FACT: the release branch is release/2024.11-hotfix3.",
]

TOOL_NAMES = ("read_file", "run_tests", "grep")
MAX_TOOL_ROUNDS = 4  # guard against a reply function that never stops calling tools

_PATHS = [
    "src/app.py",
    "src/billing/invoice.py",
    "src/billing/parser.py",
    "src/api/routes.py",
    "src/workers/retry.py",
    "src/db/models.py",
    "src/cache/store.py",
    "src/config.py",
    "tests/test_invoice.py",
    "tests/test_parser.py",
    "tests/test_routes.py",
]
_FUNCS = [
    "parse_invoice",
    "apply_discount",
    "load_settings",
    "retry_with_backoff",
    "render_receipt",
    "sync_ledger",
    "validate_payload",
    "flush_queue",
    "open_session",
    "compute_tax",
    "normalize_currency",
    "emit_metrics",
]
_COMPONENTS = [
    "invoice parser",
    "retry worker",
    "settings loader",
    "ledger sync job",
    "receipt renderer",
    "API router",
    "session cache",
    "metrics exporter",
    "migration script",
    "tax calculator",
]
_PROBLEMS = [
    "times out under load",
    "drops the last line item",
    "logs the wrong tenant id",
    "double-counts refunds",
    "leaks a database connection",
    "ignores the currency override",
    "retries forever on a 409",
    "returns stale totals after an update",
    "swallows validation errors",
    "rounds half-cents the wrong way",
]
_ACTIONS = [
    "add a regression test",
    "split the function in two",
    "tighten the type hints",
    "move the constant into settings",
    "add structured logging",
    "replace the ad-hoc retry with the shared helper",
    "cache the lookup per request",
    "document the invariants in the docstring",
    "make the error message actionable",
    "remove the dead branch",
]
_CONDITIONS = [
    "the tenant has more than one currency",
    "the queue backs up past a thousand jobs",
    "a refund arrives before the original charge",
    "the feature flag is off",
    "the upstream API returns a partial page",
    "daylight saving time changes",
    "two workers pick up the same invoice",
    "the payload has unicode in the memo",
]
_SENTENCES = [
    "The {comp} in {path} still {prob} when {cond}, so I would like to {act} before we go on.",
    "I looked at {path} around line {n} and noticed that {func}() {prob} in that case.",
    "Could you {act} while keeping the public behaviour of {func}() exactly the same?",
    "Last time we ran the suite it took {n} seconds and {k} of {m} cases failed in {path}.",
    "My guess is that {func}() is called twice when {cond}, which would explain the numbers.",
    "Please keep the diff small; reviewers on this team prefer several focused commits.",
    "We also need to remember that the {comp} is shared with the reporting service.",
    "If it is simpler, {act} first and we can revisit the {comp} in a follow-up change.",
    "The product manager asked whether the {comp} can be made faster without a schema change.",
    "There is an old comment in {path} saying the {comp} {prob}, but nobody verified it.",
    "When {cond}, the dashboards show a spike of roughly {n} errors per minute.",
    "I would rather not touch {func}() until we understand why it {prob}.",
    "Let us also check how {func}() interacts with {func2}() since both read the same rows.",
    "For context, the {comp} was rewritten last quarter and the tests are still thin.",
]
# Attachments pasted under the prose, like a user sharing code, a traceback or config.
_ATTACHMENTS = [
    """Here is the current version:
```python
def {func}(payload, *, strict=True, settings=None):
    items = payload.get("items", [])
    total = sum(item["amount"] * item.get("quantity", 1) for item in items)
    if strict and total < 0:
        raise ValueError(f"negative total {{total}} in {func} for {{payload.get('id')}}")
    if settings and settings.get("round_half_even"):
        total = round(total, 2)
    return {{"total": total, "count": len(items), "currency": payload.get("currency", "EUR")}}
```""",
    """This is the traceback from the last failing run:
```
Traceback (most recent call last):
  File "{path}", line {n}, in {func}
    result = {func2}(payload, settings=settings)
  File "src/billing/common.py", line {k}, in {func2}
    return lookup[payload["tenant"]][payload["currency"]]
RuntimeError: {func2} failed after {m} retries (tenant=acme-eu, invoice=INV-{n}{k})
```""",
    """And the relevant part of the settings file:
```yaml
{func}:
  enabled: true
  max_retries: {k}
  timeout_seconds: {m}
  batch_size: {n}
  currencies: [EUR, USD, GBP, CHF]
  fallback_handler: {func2}
  alert_channel: "#billing-alerts"
```""",
]


def _prose(rng: random.Random, target_words: int) -> str:
    out: list[str] = []
    words = 0
    while words < target_words:
        func, func2 = rng.sample(_FUNCS, 2)
        sentence = rng.choice(_SENTENCES).format(
            comp=rng.choice(_COMPONENTS),
            path=rng.choice(_PATHS),
            prob=rng.choice(_PROBLEMS),
            act=rng.choice(_ACTIONS),
            cond=rng.choice(_CONDITIONS),
            func=func,
            func2=func2,
            n=rng.randint(3, 900),
            k=rng.randint(1, 9),
            m=rng.randint(10, 60),
        )
        out.append(sentence)
        words += len(sentence.split())
    return " ".join(out)


def _tool_args(rng: random.Random, name: str) -> str:
    if name == "read_file":
        args: dict[str, Any] = {"path": rng.choice(_PATHS)}
    elif name == "run_tests":
        args = {
            "target": rng.choice([p for p in _PATHS if p.startswith("tests/")]),
            "k": rng.choice(_FUNCS),
        }
    else:
        args = {"pattern": rng.choice(_FUNCS), "path": "src/"}
    return json.dumps(args)


def user_turns(n_turns: int, seed: int = 0, facts_every: int | None = None) -> list[str]:
    """User message texts. Facts go one per turn on turns 0..7 (or on every
    ``facts_every``-th turn); turns 3, 7, 11, ... request a tool call."""
    turns = []
    for t in range(n_turns):
        rng = random.Random(f"turn:{seed}:{t}")
        parts = []
        if facts_every:
            fact_index = t // facts_every if t % facts_every == 0 else None
        else:
            fact_index = t
        if fact_index is not None and fact_index < len(FACTS):
            parts.append(FACTS[fact_index])
        if t % 4 == 3:
            name = TOOL_NAMES[(t // 4) % len(TOOL_NAMES)]
            parts.append(
                f"{_prose(rng, rng.randint(100, 150))} Use the tool for this: "
                f"[[tool:{name}:{_tool_args(rng, name)}]]"
            )
        else:
            parts.append(_prose(rng, rng.randint(200, 300)))
            for attachment in rng.sample(_ATTACHMENTS, 1 + (rng.random() < 0.6)):
                func, func2 = rng.sample(_FUNCS, 2)
                parts.append(
                    attachment.format(
                        func=func,
                        func2=func2,
                        path=rng.choice(_PATHS),
                        n=rng.randint(10, 400),
                        k=rng.randint(2, 9),
                        m=rng.randint(10, 90),
                    )
                )
        turns.append("\n\n".join(parts))
    return turns


def _call_fields(tool_call: Any) -> tuple[str, str]:
    if not isinstance(tool_call, dict):  # e.g. an openai pydantic object
        tool_call = tool_call.model_dump()
    fn = tool_call.get("function") or {}
    return fn.get("name", ""), fn.get("arguments") or "{}"


def tool_result(tool_call: Any) -> str:
    """Deterministic output for a tool call, ~100-200 words shaped like the real tool."""
    name, raw_args = _call_fields(tool_call)
    rng = random.Random(f"tool:{name}:{raw_args}")
    try:
        args = json.loads(raw_args)
    except ValueError:
        args = {}
    if name == "read_file":
        path = args.get("path", "src/app.py")
        lines = [
            f"# {path}",
            "from __future__ import annotations",
            "import logging",
            "",
            "log = logging.getLogger(__name__)",
            "",
        ]
        for func in rng.sample(_FUNCS, 6):
            lines += [
                f"def {func}(payload, settings=None):",
                f'    """{rng.choice(_COMPONENTS).capitalize()} helper; '
                f'{rng.choice(_PROBLEMS)} when {rng.choice(_CONDITIONS)}."""',
                f"    log.debug('{func} start %s', payload.get('id'))",
                f"    return {rng.choice(_FUNCS)}(payload, settings)",
                "",
            ]
        return "\n".join(lines)
    if name == "run_tests":
        target = args.get("target", "tests")
        lines = [f"$ pytest -q {target} -k {args.get('k', '')}".rstrip()]
        failed = 0
        for func in rng.sample(_FUNCS, 12):
            ok = rng.random() < 0.75
            failed += not ok
            lines.append(
                f"{target}::test_{func}_{rng.choice(['basic', 'edge', 'unicode'])} "
                f"{'PASSED' if ok else 'FAILED'}"
            )
            if not ok:
                lines.append(
                    f"    AssertionError: {func}() {rng.choice(_PROBLEMS)} "
                    f"(expected {rng.randint(1, 99)}, got {rng.randint(100, 999)})"
                )
        lines.append(f"{failed} failed, {12 - failed} passed in {rng.uniform(0.5, 9):.2f}s")
        return "\n".join(lines)
    pattern = args.get("pattern", name or "tool")
    lines = [f"$ grep -rn {pattern} {args.get('path', '.')}"]
    for path in rng.sample(_PATHS, 11):
        lines.append(
            f"{path}:{rng.randint(5, 400)}:    result = {pattern}(payload, "
            f"settings=settings)  # {rng.choice(_PROBLEMS)}"
        )
    lines.append(f"{len(lines) - 1} matches in {len(_PATHS)} files searched")
    return "\n".join(lines)


def _clean(message: Any) -> dict:
    """Keep only the fields a follow-up request needs, as plain JSON-able data."""
    if not isinstance(message, dict):
        message = message.model_dump()
    out = {"role": message.get("role") or "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": c["id"],
                "type": c.get("type") or "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": c["function"].get("arguments") or "",
                },
            }
            for c in message["tool_calls"]
        ]
    return out


def _driver(
    n_turns: int, system_prompt: str, seed: int, facts_every: int | None
) -> Generator[list[dict], Any, list[dict]]:
    """Shared loop: yields the messages to send and receives the assistant reply, so the
    sync and async drivers cannot drift apart."""
    messages: list[dict] = [{"role": "system", "content": system_prompt}]
    for text in user_turns(n_turns, seed, facts_every):
        messages.append({"role": "user", "content": text})
        for _ in range(MAX_TOOL_ROUNDS + 1):
            reply = _clean((yield list(messages)))
            messages.append(reply)
            calls = reply.get("tool_calls") or []
            if not calls:
                break
            for call in calls:
                messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": tool_result(call)}
                )
    return messages


def drive_conversation(
    send: Callable[[list[dict]], Any],
    n_turns: int,
    system_prompt: str,
    seed: int = 0,
    facts_every: int | None = None,
) -> list[dict]:
    gen = _driver(n_turns, system_prompt, seed, facts_every)
    try:
        outgoing = next(gen)
        while True:
            outgoing = gen.send(send(outgoing))
    except StopIteration as done:
        return done.value


async def adrive_conversation(
    asend: Callable[[list[dict]], Awaitable[Any]],
    n_turns: int,
    system_prompt: str,
    seed: int = 0,
    facts_every: int | None = None,
) -> list[dict]:
    gen = _driver(n_turns, system_prompt, seed, facts_every)
    try:
        outgoing = next(gen)
        while True:
            outgoing = gen.send(await asend(outgoing))
    except StopIteration as done:
        return done.value


def take_responses_output(items: list[dict[str, Any]], output: list[dict[str, Any]]) -> bool:
    """Add a Responses answer's ``output`` items to ``items`` and, for each function call in
    it, the tool's result; whether it called any (the agent's tool loop goes on)."""
    items.extend(output)
    calls = [o for o in output if o["type"] == "function_call"]
    for c in calls:
        result = tool_result({"function": {"name": c["name"], "arguments": c["arguments"]}})
        items.append({"type": "function_call_output", "call_id": c["call_id"], "output": result})
    return bool(calls)
