"""A 300-request coding-agent session with large tool outputs, through the compaction core.

    python -m bench.agent_session [--smoke] [--summarizer extractive|digits] [--json PATH]

The session (built here, deterministic): a system prompt, a first user message carrying the
task and CLAUDE.md-style instructions in a ``<system-reminder>``, then 20 user instructions,
each followed by tool rounds of 1-4 parallel calls (file reads of 1,500-3,000 tokens, test
logs, greps, the same file read again now and then) and a final answer. Every request is the
client's whole history up to the next assistant message; 20 facts are planted in user turns
and tool outputs (``FACTS``). The requests go through ``proxy.compactor.Compactor`` with the
default settings (trigger 24,000, background mode: a compaction runs after the response and
is used from the next request on) but ``policy: tokens`` (this driver writes no ledger, which
the default cost policy reads: section 9 replays this session with it), a diskcache store
and a scripted detector/summarizer (``Summarizer``: pluggable; ``extractive`` keeps the
lines naming a fact or a path, ``digits`` keeps only transcript lines containing a digit or
'/').

Measured per request: tokens sent by the client and forwarded upstream, and the cacheable
part — the longest common prefix (whole messages) with the previous forwarded request, which
a provider's prompt cache can serve. Priced at $2.50/M input and $0.25/M cached input;
detector/summarizer calls at $2.50/M input (never cached) and $10/M output. The baseline is
the same session forwarded unchanged (append-only, so everything but the new messages is
cacheable) — a baseline that outgrows a 128k context window; it is priced as if it fit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.adapters.llm import LLMReply
from proxy.adapters.store import DiskStore
from proxy.config import load_prompt
from proxy.core import billing
from proxy.core.messages import render
from proxy.core.prepared import Prompts
from proxy.core.settings import CompactionSettings
from proxy.core.sharedcall import SharedCall, SharedReply
from proxy.core.tokens import TokenCounter
from proxy.engine.compactor import Compactor

Message = dict[str, Any]
Summarizer = Callable[[str, int], str]  # (transcript, budget tokens) -> summary text
MODEL = "gpt-4o-mini"
INPUT_USD, CACHED_USD, OUTPUT_USD = 2.50e-6, 0.25e-6, 10.0e-6
FULL_REQUESTS, SMOKE_REQUESTS = 300, 40

FACTS = [
    "FACT-01: the staging database host is pg-stage-07.internal",
    "FACT-02: the invoice rounding bug is tracked as BILL-4821",
    "FACT-03: the retry limit for sync_ledger is 68 attempts",
    "FACT-04: the release branch is release/2024.11-hotfix3",
    "FACT-05: the failing test is tests/test_invoice.py::test_half_cent",
    "FACT-06: the config file lives at /srv/billing/config.yaml",
    "FACT-07: the currency table has 164 rows",
    "FACT-08: the owner of the ledger service is Dana Okafor",
    "FACT-09: the queue timeout is 45 seconds",
    "FACT-10: the feature flag is billing.v2_rounding",
    "FACT-11: the metrics endpoint is https://metrics.example.internal/billing",
    "FACT-12: the hotfix must ship before 2024-11-29",
    "FACT-13: the cache TTL for rates is 900 s",
    "FACT-14: the broken commit is 3f9c2e1",
    "FACT-15: the refund worker runs on worker-12",
    "FACT-16: the max batch size is 2500 invoices",
    "FACT-17: the API version header is X-Billing-Version: 7",
    "FACT-18: the tenant with the bug is acme-eu",
    "FACT-19: the migration file is migrations/0042_rounding.py",
    "FACT-20: the on-call channel is #billing-oncall",
]
# The identifying value of each fact: what the model needs, in any wording.
FACT_KEYS = [
    "pg-stage-07.internal", "BILL-4821", "68 attempts", "release/2024.11-hotfix3",
    "tests/test_invoice.py::test_half_cent", "/srv/billing/config.yaml", "164 rows",
    "Dana Okafor", "45 seconds", "billing.v2_rounding",
    "https://metrics.example.internal/billing", "2024-11-29", "900 s", "3f9c2e1", "worker-12",
    "2500 invoices", "X-Billing-Version: 7", "acme-eu", "migrations/0042_rounding.py",
    "#billing-oncall",
]  # fmt: skip
SYSTEM = (
    "You are a coding agent working in a Python repository. Use the tools to read files, "
    "search, run tests and edit code. Keep changes small and explain them. " * 12
)
REMINDER = (
    "<system-reminder>Contents of /repo/CLAUDE.md (project instructions):\n"
    "- Always answer in French.\n- Run the tests before saying a fix works.\n"
    "- Never push to main.\n</system-reminder>"
)
WORDS = (
    "invoice ledger rounding cents currency refund worker queue retry batch tenant rate cache "
    "parser schema migration handler config total amount charge balance report export import"
).split()
FILES = [f"src/billing/{name}.py" for name in WORDS[:16]]


def extractive(transcript: str, budget: int) -> str:
    """Keeps the transcript lines that name a planted fact or a source path (in order, whole
    lines, within the budget at ~4 characters a token)."""
    keep = [ln for ln in transcript.splitlines() if "FACT-" in ln or "src/" in ln]
    return _bounded(keep, budget) or "The agent read files and ran the tests."


def digits(transcript: str, budget: int) -> str:
    """Keeps only transcript lines containing a digit or '/' (whole lines, within budget)."""
    keep = [ln for ln in transcript.splitlines() if re.search(r"[0-9/]", ln)]
    return _bounded(keep, budget) or "The agent read files and ran the tests."


def _bounded(lines: list[str], budget: int) -> str:
    out: list[str] = []
    used = 0
    for line in dict.fromkeys(x.strip() for x in lines if x.strip()):
        line = line[:300]
        if used + len(line) > budget * 3:
            break
        out.append(line)
        used += len(line) + 1
    return "\n".join(out)


SUMMARIZERS: dict[str, Summarizer] = {"extractive": extractive, "digits": digits}


class ScriptedLLM:
    """``proxy.llm.LLM`` in process: the detector never finds a boundary; the summarizer is a
    ``Summarizer`` over the transcript it is sent. Counts tokens like a provider would."""

    def __init__(self, summarize: Summarizer, counter: TokenCounter) -> None:
        self.summarize, self.counter = summarize, counter
        self.prompt_tokens = self.completion_tokens = self.calls = 0
        # The summarizer calls in the client's shape (``proxy.core.sharedcall``): the replay
        # says what the provider has cached when one is made (the tokens of the request
        # forwarded last, how long ago, its cache rules); each call's (prompt, cached,
        # written, completion) tokens are kept for pricing.
        self.cache_tokens = 0
        self.cache_idle: float | None = None
        self.rules: billing.CacheRules | None = None
        self.shared_calls: list[tuple[int, int, int, int]] = []

    async def shared(self, call: SharedCall, body: dict[str, Any], *, purpose: str) -> SharedReply:
        """The conversation and the ask: summarized like a transcript of the conversation;
        its prefix up to the request forwarded last read from the cache, if warm; on
        Anthropic, the rest of the history up to its end (a breakpoint) written."""
        history = body["messages"][:-1]
        # A model that follows the ask: the memory of what comes before the messages that
        # stay. Given the span the standalone call's transcript holds (not the system prompt,
        # not the task, which is pinned), so that the two calls differ in price only.
        kept = re.search(r"from its last (\d+) messages on", str(body["messages"][-1]["content"]))
        older = history[: len(history) - int(kept.group(1))] if kept else history
        older = [m for m in older if m.get("role") != "system"
                 or render(m).startswith("SYSTEM: [History Summary - ")]  # fmt: skip
        task = next((i for i, m in enumerate(older) if m.get("role") == "user"), None)
        if task is not None:
            del older[task]
        transcript = "\n\n".join(render(m) for m in older)
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 500)
        text = self.summarize(f"TRANSCRIPT ({len(history)} messages):\n{transcript}", max_tokens)
        model = str(body.get("model") or MODEL)
        prompt = self.counter.count_total(list(body["messages"]), model)
        upto = self.counter.count_total(history, model)
        rules = self.rules or billing.UNCACHED
        cached = billing.cached_prefix(rules, min(self.cache_tokens, upto), self.cache_idle)
        written = max(upto - cached, 0) if rules.writes_billed else 0
        completion = self.counter.count_text(text, model)
        self.calls += 1
        self.shared_calls.append((prompt, cached, written, completion))
        return SharedReply(text, "stop", prompt, completion, model, cached, written)

    async def complete(
        self, model: str, messages: Any, *, max_tokens: int, purpose: str, credential: Any
    ) -> LLMReply:
        if purpose == "detector":
            text = '{"boundary_index": null, "boundary_reason": "", "confidence": 0.0}'
        else:
            text = self.summarize(str(messages[-1]["content"]), max_tokens)
        prompt = self.counter.count_total(list(messages), MODEL)
        completion = self.counter.count_text(text, MODEL)
        self.calls += 1
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        return LLMReply(text, "stop", prompt, completion, model)


def session(
    requests: int, seed: int = 7, scale: float = 1.0, writes: bool = False
) -> list[Message]:
    """The whole session; request i sends every message before the i-th assistant message.
    ``writes``: about one tool round in three also writes or edits a new file (#26's artifact
    trail; drawn from a second random stream, so the rest of the session is unchanged)."""
    rng = random.Random(seed)
    wrng = random.Random(seed + 1)
    facts = list(FACTS)
    msgs: list[Message] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{REMINDER}\nFix the invoice rounding bug. {facts.pop(0)}."},
    ]
    per_instruction = max(2, requests // 20)
    call_no = 0
    assistants = 0
    instruction = 0
    while assistants < requests:
        if instruction:
            fact = facts.pop(0) if facts and rng.random() < 0.5 else ""
            msgs.append(
                {
                    "role": "user",
                    "content": f"Next step {instruction}: look at {rng.choice(FILES)}. {fact}",
                }
            )
        instruction += 1
        for _ in range(per_instruction - 1):
            if assistants >= requests:
                break
            calls = []
            for _ in range(rng.choice([1, 1, 2, 3, 4])):
                call_no += 1
                tool = rng.choice(["read_file", "read_file", "grep", "run_tests"])
                target = rng.choice(FILES)
                args = {"path": target} if tool == "read_file" else {"pattern": rng.choice(WORDS)}
                if tool == "run_tests":
                    args = {"target": "tests/test_" + rng.choice(WORDS) + ".py"}
                calls.append((f"call_{call_no}", tool, args))
            if writes and wrng.random() < 0.3:
                n = len([c for c in calls if c[1] in ("write_file", "edit_file")]) + call_no
                path = f"src/billing/{wrng.choice(WORDS)}_v{n}.py"
                calls.append(
                    (f"call_w{n}", wrng.choice(["write_file", "edit_file"]), {"path": path})
                )
            msgs.append(
                {
                    "role": "assistant",
                    "content": f"Checking {len(calls)} things.",
                    "tool_calls": [
                        {
                            "id": cid,
                            "type": "function",
                            "function": {"name": tool, "arguments": json.dumps(args)},
                        }
                        for cid, tool, args in calls
                    ],
                }
            )
            assistants += 1
            for cid, tool, _args in calls:
                if tool in ("write_file", "edit_file"):
                    msgs.append({"role": "tool", "tool_call_id": cid, "content": "ok, 41 lines"})
                    continue
                size = {"read_file": (1500, 3000), "grep": (300, 800), "run_tests": (800, 2000)}
                lo, hi = size[tool]
                body = _output(rng, int(rng.randint(lo, hi) * scale))
                if facts and rng.random() < 0.06:
                    body += f"\n{facts.pop(0)}"
                msgs.append({"role": "tool", "tool_call_id": cid, "content": body})
        if assistants < requests:
            msgs.append({"role": "assistant", "content": f"Done with step {instruction}."})
            assistants += 1
    return msgs


def _output(rng: random.Random, tokens: int) -> str:
    lines = []
    for n in range(max(1, tokens // 12)):
        lines.append(f"{n:4d}  " + " ".join(rng.choice(WORDS) for _ in range(9)))
    return "\n".join(lines)


def _prefix_tokens(a: list[Message], b: list[Message], counts: list[int]) -> int:
    """Tokens of the longest run of leading messages of ``b`` identical to ``a``'s."""
    total = 0
    for x, y, n in zip(a, b, counts, strict=False):
        if orjson.dumps(x) != orjson.dumps(y):
            break
        total += n
    return total


@dataclass
class Totals:
    sent: int = 0
    forwarded: int = 0
    cached: int = 0
    usd: float = 0.0

    def add(self, tokens: int, cached: int) -> None:
        self.forwarded += tokens
        self.cached += cached
        self.usd += (tokens - cached) * INPUT_USD + cached * CACHED_USD


def run(
    requests: int = FULL_REQUESTS,
    summarizer: str = "extractive",
    scale: float = 1.0,
    trigger: int | None = None,
    *,
    writes: bool = False,
    keep_text: bool = False,
) -> dict[str, Any]:
    """Drive the session with the default settings (or another ``trigger_tokens``) but the
    tokens policy: this driver writes no ledger, which the cost policy (the default) reads;
    ``bench.economics`` replays this session with the ledger and the default policy. Returns
    the figures (see ``markdown``); ``keep_text`` adds the session and the last forwarded
    request (``messages``, ``final_forwarded``)."""
    settings = CompactionSettings(policy="tokens")
    if trigger is not None:
        settings = CompactionSettings(trigger_tokens=trigger, policy="tokens")
    msgs = session(requests, scale=scale, writes=writes)
    result = asyncio.run(_run(msgs, requests, SUMMARIZERS[summarizer], summarizer, settings))
    if not keep_text:
        result.pop("messages"), result.pop("final_forwarded")
    return result


async def _run(
    msgs: list[Message],
    requests: int,
    summarize: Summarizer,
    name: str,
    settings: CompactionSettings,
) -> dict[str, Any]:
    counter = TokenCounter()
    ends = [i for i, m in enumerate(msgs) if m["role"] == "assistant"][:requests]
    llm = ScriptedLLM(summarize, counter)
    cases: dict[str, int] = {}

    def on_event(event: dict[str, Any]) -> None:
        case = str(event.get("case"))
        cases[case] = cases.get(case, 0) + 1

    prompts = Prompts(detector=load_prompt("detector"), summarizer=load_prompt("summarizer"))
    ours, base = Totals(), Totals()
    peak = 0
    trace: list[tuple[int, int, int, str, int]] = []  # sent, forwarded, cacheable, case, new
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        store = DiskStore(tmp)
        compactor = Compactor(settings, store, llm, prompts, counter=counter, on_event=on_event)
        previous: list[Message] = []
        previous_sent: list[Message] = []
        for end in ends:
            history = msgs[:end]
            p = await compactor.prepare(history, model=MODEL, tenant="bench", credential="k")
            sent_counts = p.original_counts
            base.sent += p.original_tokens
            base.add(p.original_tokens, _prefix_tokens(previous_sent, history, sent_counts))
            ours.sent += p.original_tokens
            cacheable = _prefix_tokens(previous, p.forwarded, p.forwarded_counts)
            ours.add(p.forwarded_tokens, cacheable)
            new = len(history) - len(previous_sent)
            fresh = sum(sent_counts[len(history) - new :]) if new > 0 else 0
            trace.append((p.original_tokens, p.forwarded_tokens, cacheable, p.case, fresh))
            peak = max(peak, p.forwarded_tokens)
            previous, previous_sent = p.forwarded, history
            compactor.schedule(p)
            await compactor.drain(timeout=60)  # the agent runs its tools meanwhile
        final_text = orjson.dumps(previous).decode()
        session_text = orjson.dumps(msgs).decode()
        store.close()
    llm_usd = llm.prompt_tokens * INPUT_USD + llm.completion_tokens * OUTPUT_USD
    return {
        "requests": len(ends),
        "trigger_tokens": settings.trigger_tokens,
        "summarizer": name,
        "sent_tokens": ours.sent,
        "forwarded_tokens": ours.forwarded,
        "peak_forwarded": peak,
        "cacheable_share": ours.cached / ours.forwarded if ours.forwarded else 0.0,
        "baseline_cacheable_share": base.cached / base.forwarded if base.forwarded else 0.0,
        "usd": ours.usd + llm_usd,
        "usd_llm": llm_usd,
        "baseline_usd": base.usd,
        "llm_calls": llm.calls,
        "llm_tokens": llm.prompt_tokens + llm.completion_tokens,
        "prunings": cases.get("prune", 0),
        "compactions": sum(cases.get(c, 0) for c in ("summarize", "truncate", "emergency")),
        "failures": cases.get("failed", 0),
        "facts_in_final_request": sum(1 for f in FACTS if f in final_text),
        "fact_keys_in_final_request": sum(
            1
            for f, key in zip(FACTS, FACT_KEYS, strict=True)
            if f in session_text and key in final_text
        ),
        "facts_planted": sum(1 for f in FACTS if f in session_text),
        # New messages are never cached: this share of forwarded tokens is the ceiling.
        "new_share": sum(t[4] for t in trace) / ours.forwarded if ours.forwarded else 0.0,
        "trace": trace,
        "messages": msgs[: ends[-1]] if ends else msgs,
        "final_forwarded": previous,
    }


def markdown(results: list[dict[str, Any]]) -> str:
    """One column per run (the default trigger, and a larger one)."""

    def ratio(r: dict[str, Any]) -> str:
        return f"{r['usd'] / r['baseline_usd']:.3f}×" if r["baseline_usd"] else "n/a"

    rows: list[tuple[str, Any]] = [
        ("requests", lambda r: f"{r['requests']:,}"),
        ("tokens sent by the client", lambda r: f"{r['sent_tokens']:,}"),
        ("tokens forwarded upstream", lambda r: f"{r['forwarded_tokens']:,} "
         f"({r['forwarded_tokens'] / r['sent_tokens']:.1%} of sent)"),
        ("largest forwarded request", lambda r: f"{r['peak_forwarded']:,}"),
        ("cacheable share of forwarded tokens", lambda r: f"{r['cacheable_share']:.1%}"),
        ("ceiling: share not made of new messages", lambda r: f"{1 - r['new_share']:.1%}"),
        ("cacheable share forwarding unchanged", lambda r: f"{r['baseline_cacheable_share']:.1%}"),
        ("prunings / compactions / failures",
         lambda r: f"{r['prunings']} / {r['compactions']} / {r['failures']}"),
        ("detector + summarizer calls", lambda r: f"{r['llm_calls']} ({r['llm_tokens']:,} "
         f"tokens, ${r['usd_llm']:.3f})"),
        ("$ with compaction (incl. those calls)", lambda r: f"${r['usd']:.3f}"),
        ("$ forwarding unchanged", lambda r: f"${r['baseline_usd']:.3f}"),
        ("$ ratio", ratio),
        ("planted facts in the last forwarded request: sentence verbatim / its value",
         lambda r: f"{r['facts_in_final_request']} / {r.get('fact_keys_in_final_request', 0)} "
         f"of {r['facts_planted']} ({r['summarizer']})"),
    ]  # fmt: skip
    head = " | ".join(f"trigger {r['trigger_tokens']:,}" for r in results)
    lines = [f"| measure | {head} |", "|---" * (len(results) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(fn(r) for r in results) + " |" for name, fn in rows]
    return "\n".join(lines)


def runs(smoke: bool, summarizer: str = "extractive") -> list[dict[str, Any]]:
    """What ``bench.run`` reports: the default trigger, and (full run) a 100k trigger, the
    default of Anthropic's context editing, for agents on large context windows."""
    if smoke:
        return [run(SMOKE_REQUESTS, summarizer)]
    return [run(FULL_REQUESTS, summarizer), run(FULL_REQUESTS, summarizer, trigger=100_000)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.agent_session", description=__doc__)
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_REQUESTS} requests")
    parser.add_argument("--summarizer", choices=sorted(SUMMARIZERS), default="extractive")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    results = runs(args.smoke, args.summarizer)
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
