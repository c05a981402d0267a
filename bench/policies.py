"""Three compaction policies over one long session: cached share and billed cost side by side.

    python -m bench.policies [--smoke] [--json PATH]

The same scripted tool-using session (``tests.conversations``) is sent three times, each time
to a fresh ``tests.upstream.ScriptedUpstream`` (prompt-cache simulation on, tokens counted
with ``proxy.tokens.TokenCounter``):

- **no compaction**: the client's full history, straight to the upstream;
- **our compaction**: through a ``compaction-proxy serve`` process (the same compaction
  settings as the savings table), whose detector and summarizer calls the upstream answers;
- **naive**: a client-side compactor that, on every request whose history is over the same
  trigger, has a summarizer re-summarise everything but the head system message and the
  last user turn (with its tool round), and forwards ``system + fresh summary + last turn``.

Every request and every LLM call is billed at the reference price with ``proxy.costs``:
uncached input, cache reads and output at their prices, cached tokens as the upstream's
simulation reports them. Our detector/summarizer calls are billed uncached (their transcript
changes with every compaction). The naive summarizer's calls go to a second simulated
upstream with its own cache and an append-only transcript, so a growing history *is* read
from cache — the most favourable case for the naive policy.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.savings import FULL as SAVINGS_FULL
from bench.savings import SMOKE as SAVINGS_SMOKE
from bench.savings import Message, bill, drive, price_line, scripted_upstream, token_counter
from proxy.config import load_prompt
from proxy.core import costs
from proxy.core.messages import head_length, transcript
from proxy.core.planner import summary_message
from proxy.core.settings import CompactionSettings
from tests.proxyproc import ProxyProcess
from tests.upstream import ScriptedUpstream, default_summarizer

MODEL = "gpt-4o-mini"
FULL_TURNS = 200  # ~120k tokens uncompacted by the end: still inside gpt-4o-mini's window
SMOKE_TURNS = 12


class NaiveCompactor:
    """The client-side transform of the naive policy; ``calls`` logs its summarizer calls."""

    def __init__(
        self, summarizer_url: str, settings: CompactionSettings, count: Callable[[Any], int]
    ) -> None:
        self.url = f"{summarizer_url}/chat/completions"
        self.settings = settings
        self.count = count
        self.prompt = load_prompt("summarizer").replace(
            "{budget}", str(settings.summary_budget_tokens)
        )
        self.calls: list[dict[str, Any]] = []
        self.client = httpx.Client(timeout=180)

    def __call__(self, messages: list[Message]) -> list[Message]:
        if self.count(messages) <= self.settings.trigger_tokens:
            return messages
        head = head_length(messages)
        last_user = max(i for i, m in enumerate(messages) if m.get("role") == "user")
        span = messages[head:last_user]
        if not span:
            return messages
        # Append-only (no message count up front), so the provider's cache can reuse the
        # previous call's transcript: the kindest version of this policy.
        request = [
            {"role": "system", "content": self.prompt},
            {"role": "user", "content": f"TRANSCRIPT:\n{transcript(span)}"},
        ]
        response = self.client.post(
            self.url,
            content=orjson.dumps({"model": MODEL, "messages": request}),
            headers={"content-type": "application/json"},
        )
        response.raise_for_status()
        data = orjson.loads(response.content)
        usage = data["usage"]
        self.calls.append(
            {
                "purpose": "naive-summarizer",
                "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                "completion_tokens": usage["completion_tokens"],
            }
        )
        text = data["choices"][0]["message"]["content"] or ""
        summary = summary_message(text, len(span), self.settings.summary_role)
        return [*messages[:head], summary, *messages[last_user:]]

    def close(self) -> None:
        self.client.close()


def summarize(
    name: str, records: list[dict[str, Any]], calls: list[dict[str, Any]], seconds: float
) -> dict[str, Any]:
    prices = costs.prices_for(MODEL)
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    call_prompt = sum(c["prompt_tokens"] for c in calls)
    call_cached = sum(c["cached_tokens"] for c in calls)
    requests_usd = bill(prices, records)
    compaction_usd = bill(prices, calls)
    return {
        "policy": name,
        "requests": len(records),
        "peak_forwarded_tokens": max((r["prompt_tokens"] for r in records), default=0),
        "forwarded_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": cached / prompt if prompt else 0.0,
        "compaction_calls": len(calls),
        "compaction_prompt_tokens": call_prompt,
        "compaction_cached_tokens": call_cached,
        "billed_input_tokens": prompt + call_prompt,
        "billed_cached_tokens": cached + call_cached,
        "requests_usd": requests_usd,
        "compaction_usd": compaction_usd,
        "total_usd": requests_usd + compaction_usd,
        "seconds": round(seconds, 1),
    }


def run(n_turns: int, compaction: dict[str, Any], log: Any = sys.stderr) -> dict[str, Any]:
    settings = CompactionSettings(**compaction)
    policies = []
    with tempfile.TemporaryDirectory(prefix="bench-policies-") as work:
        # 1. No compaction: the whole history, every request.
        count = token_counter()
        upstream, _ = scripted_upstream(count)
        with upstream:
            started = time.monotonic()
            records = drive(upstream.base_url, n_turns, upstream, count)
        policies.append(summarize("no compaction", records, [], time.monotonic() - started))

        # 2. Ours: through the proxy.
        count = token_counter()
        upstream, internal = scripted_upstream(count)
        with upstream, ProxyProcess(Path(work), upstream.base_url, compaction=compaction) as px:
            started = time.monotonic()
            records = drive(px.base_url, n_turns, upstream, count)
            seconds = time.monotonic() - started
        policies.append(summarize("our compaction", records, internal.calls, seconds))

        # 3. Naive: a fresh summary of everything but the last turn on every request.
        count = token_counter()
        upstream, _ = scripted_upstream(count)
        summarizer = ScriptedUpstream(
            count_tokens=count,
            reply=lambda body: {"role": "assistant", "content": default_summarizer(body)},
        )
        with upstream, summarizer:
            naive = NaiveCompactor(summarizer.base_url, settings, count)
            started = time.monotonic()
            try:
                records = drive(upstream.base_url, n_turns, upstream, count, naive)
            finally:
                naive.close()
            seconds = time.monotonic() - started
        policies.append(summarize("naive re-summarising", records, naive.calls, seconds))
    for p in policies:
        print(
            f"{p['policy']:22} {p['requests']} requests, billed {p['billed_input_tokens']:,} "
            f"input tokens, cached {p['cached_share']:.0%}, ${p['total_usd']:.4f}, "
            f"{p['seconds']}s",
            file=log,
        )
    return {
        "turns": n_turns,
        "model": MODEL,
        "compaction": {
            "trigger_tokens": settings.trigger_tokens,
            "verbatim_window_tokens": settings.verbatim_window_tokens,
            "summary_budget_tokens": settings.summary_budget_tokens,
        },
        "policies": policies,
    }


def markdown(results: dict[str, Any]) -> str:
    base = results["policies"][0]["total_usd"]
    out = [
        "| policy | requests | peak prompt | forwarded tokens | cached share of forwarded "
        "| compaction LLM calls | their input tokens (cached) | billed input tokens "
        "| cost of requests | cost of compaction calls | total cost | ÷ no compaction |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in results["policies"]:
        ratio = p["total_usd"] / base if base else 0.0
        out.append(
            f"| {p['policy']} | {p['requests']:,} | {p['peak_forwarded_tokens']:,} | "
            f"{p['forwarded_tokens']:,} | {p['cached_share']:.0%} | {p['compaction_calls']:,} | "
            f"{p['compaction_prompt_tokens']:,} ({p['compaction_cached_tokens']:,}) | "
            f"{p['billed_input_tokens']:,} | ${p['requests_usd']:.4f} | "
            f"${p['compaction_usd']:.4f} | **${p['total_usd']:.4f}** | {ratio:.2f} |"
        )
    c = results["compaction"]
    out.append(
        f"\nOne {results['turns']}-turn session; trigger {c['trigger_tokens']:,} tokens, "
        f"verbatim window {c['verbatim_window_tokens']:,}, summary budget "
        f"{c['summary_budget_tokens']:,}. Reference price: {price_line(results['model'])}."
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.policies",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--smoke", action="store_true", help="a short session, low trigger")
    parser.add_argument("--turns", type=int, help=f"session length (default {FULL_TURNS})")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    profile = SAVINGS_SMOKE if args.smoke else SAVINGS_FULL
    turns = args.turns or (SMOKE_TURNS if args.smoke else FULL_TURNS)
    results = run(turns, profile.compaction)
    print(markdown(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
