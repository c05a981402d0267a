"""Savings: long scripted tool-using sessions through the proxy, tokens and money.

    python -m bench.savings [--smoke] [--json PATH] [--chart PATH]

Each session is ``tests.conversations.drive_conversation`` (a coding-assistant session with
planted facts, a tool round every fourth turn) sent with httpx to a real
``compaction-proxy serve`` process (default compaction settings, background mode) in front of
``tests.upstream.ScriptedUpstream``: its detector answers "no boundary", its summarizer keeps
the planted facts, its prompt-cache simulation reports cached tokens the way OpenAI does
(exact byte prefixes of earlier requests, from 1,024 tokens, in 128-token steps), and it
counts tokens with ``proxy.tokens.TokenCounter`` so its usage agrees with the proxy's headers.

Per session: tokens the client sent (``x-compaction-original-tokens``) against tokens
forwarded (the upstream's ``prompt_tokens``), compactions (summarizer calls), the cached share
of forwarded tokens, and the cost at a reference price. The cost without compaction is the
proxy's own counterfactual (``proxy.costs.request_saving``: the full history, its previous
request's prefix read from cache); ``bench.policies`` measures that alternative for real.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from proxy.core import costs
from proxy.core.fingerprint import fingerprints
from proxy.core.tokens import TokenCounter
from tests.conversations import drive_conversation
from tests.proxyproc import ProxyProcess
from tests.upstream import ScriptedUpstream, default_detector, default_summarizer

MODEL = "gpt-4o-mini"  # the model requests name, and the reference price
SYSTEM = "You are a careful coding assistant for the billing service."
API_KEY = "sk-bench-savings"
Message = dict[str, Any]


@dataclass(frozen=True)
class Profile:
    name: str
    turns: tuple[int, ...]
    compaction: dict[str, Any]  # the proxy's ``compaction:`` block ({} = the defaults)


FULL = Profile("full", (50, 200, 500), {})
SMOKE = Profile(
    "smoke",
    (6, 12),
    {"trigger_tokens": 3000, "verbatim_window_tokens": 1200, "summary_budget_tokens": 300},
)


def token_counter() -> Callable[[Any], int]:
    """Prompt tokens of a message list, as the proxy counts them (memoised per message)."""
    counter = TokenCounter()

    def count(messages: Any) -> int:
        msgs = [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
        return counter.count_total(msgs, MODEL, fingerprints(msgs))

    return count


@dataclass
class InternalCalls:
    """Detector and summarizer calls the upstream answered, with their token usage."""

    count: Callable[[Any], int]
    calls: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wrap(self, purpose: str, answer: Callable[[dict], str]) -> Callable[[dict], str]:
        def recorded(body: dict) -> str:
            text = answer(body)
            call = {
                "purpose": purpose,
                "prompt_tokens": self.count(body.get("messages") or []),
                "completion_tokens": max(1, self.count([{"role": "assistant", "content": text}])),
                "cached_tokens": 0,  # the upstream reports no cache for internal calls
            }
            with self.lock:
                self.calls.append(call)
            return text

        return recorded

    def of(self, purpose: str) -> list[dict[str, Any]]:
        with self.lock:
            return [c for c in self.calls if c["purpose"] == purpose]


def scripted_upstream(count: Callable[[Any], int]) -> tuple[ScriptedUpstream, InternalCalls]:
    calls = InternalCalls(count)
    upstream = ScriptedUpstream(
        count_tokens=count,
        detector=calls.wrap("detector", default_detector),
        summarizer=calls.wrap("summarizer", default_summarizer),
    )
    return upstream, calls


def drive(
    base_url: str,
    n_turns: int,
    upstream: ScriptedUpstream,
    count: Callable[[Any], int],
    transform: Callable[[list[Message]], list[Message]] | None = None,
) -> list[dict[str, Any]]:
    """Run one session against ``base_url``; one record per request the client made."""
    records: list[dict[str, Any]] = []
    with httpx.Client(timeout=180) as client:

        def send(messages: list[Message]) -> Message:
            forwarded = transform(messages) if transform else messages
            response = client.post(
                f"{base_url}/chat/completions",
                content=orjson.dumps({"model": MODEL, "messages": forwarded}),
                headers={"authorization": f"Bearer {API_KEY}", "content-type": "application/json"},
            )
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:500]}")
            data = orjson.loads(response.content)
            usage = data["usage"]
            original = response.headers.get("x-compaction-original-tokens")
            records.append(
                {
                    "turn": sum(1 for m in messages if m.get("role") == "user"),
                    "messages": len(messages),
                    "original_tokens": int(original) if original else count(messages),
                    "case": response.headers.get("x-compaction-case"),
                    "prompt_tokens": usage["prompt_tokens"],
                    "cached_tokens": (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens", 0
                    ),
                    "completion_tokens": usage["completion_tokens"],
                }
            )
            del upstream.requests[:]  # the recorder keeps every body; keep memory flat
            message: Message = data["choices"][0]["message"]
            return message

        drive_conversation(send, n_turns, SYSTEM)
    return records


def bill(prices: costs.Prices, calls: list[dict[str, Any]]) -> float:
    """USD for requests or LLM calls: uncached input, cache reads and output at their prices."""
    return sum(
        costs.input_cost(prices, c["prompt_tokens"], c["cached_tokens"])
        + c["completion_tokens"] * prices.output
        for c in calls
    )


def session_summary(
    records: list[dict[str, Any]], internal: list[dict[str, Any]], prices: costs.Prices
) -> dict[str, Any]:
    sent = sum(r["original_tokens"] for r in records)
    forwarded = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    counterfactual = 0.0
    previous = 0
    for r in records:
        saving = costs.request_saving(
            prices,
            original_tokens=r["original_tokens"],
            forwarded_tokens=r["prompt_tokens"],
            previous_original_tokens=previous,
            cached=r["cached_tokens"],
        )
        counterfactual += saving.counterfactual_usd + r["completion_tokens"] * prices.output
        previous = r["original_tokens"]
    requests_usd = bill(prices, records)
    compaction_usd = bill(prices, internal)
    return {
        "turns": max((r["turn"] for r in records), default=0),
        "requests": len(records),
        "sent_tokens": sent,
        "forwarded_tokens": forwarded,
        "cached_tokens": cached,
        "cached_share": cached / forwarded if forwarded else 0.0,
        "peak_original_tokens": max((r["original_tokens"] for r in records), default=0),
        "peak_forwarded_tokens": max((r["prompt_tokens"] for r in records), default=0),
        "compactions": sum(1 for c in internal if c["purpose"] == "summarizer"),
        "detector_calls": sum(1 for c in internal if c["purpose"] == "detector"),
        "compaction_tokens": sum(c["prompt_tokens"] + c["completion_tokens"] for c in internal),
        "requests_usd": requests_usd,
        "compaction_usd": compaction_usd,
        "total_usd": requests_usd + compaction_usd,
        "without_compaction_usd": counterfactual,
    }


def run_session(n_turns: int, compaction: dict[str, Any], work: Path) -> dict[str, Any]:
    count = token_counter()
    upstream, calls = scripted_upstream(count)
    tmp = Path(tempfile.mkdtemp(prefix=f"session-{n_turns}-", dir=work))
    with upstream, ProxyProcess(tmp, upstream.base_url, compaction=compaction) as proxy:
        started = time.monotonic()
        records = drive(proxy.base_url, n_turns, upstream, count)
        seconds = time.monotonic() - started
    summary = session_summary(records, calls.calls, costs.prices_for(MODEL))
    return {"turns": n_turns, "seconds": round(seconds, 1), "summary": summary,
            "records": records}  # fmt: skip


def run(profile: Profile, log: Any = sys.stderr) -> dict[str, Any]:
    sessions = []
    with tempfile.TemporaryDirectory(prefix="bench-savings-") as work:
        for n_turns in profile.turns:
            session = run_session(n_turns, profile.compaction, Path(work))
            s = session["summary"]
            print(
                f"session {n_turns} turns: {s['requests']} requests, sent {s['sent_tokens']:,} "
                f"forwarded {s['forwarded_tokens']:,} tokens, {s['compactions']} compactions, "
                f"{session['seconds']}s",
                file=log,
            )
            sessions.append(session)
    return {"profile": profile.__dict__, "model": MODEL, "sessions": sessions}


def price_line(model: str = MODEL) -> str:
    p = costs.prices_for(model)
    m = 1_000_000
    return (
        f"`{model}` from LiteLLM's price map: ${p.input * m:.3f} per million input tokens, "
        f"${p.cache_read * m:.3f} cached, ${p.output * m:.3f} output"
    )


def markdown(results: dict[str, Any]) -> str:
    out = [
        "| session | requests | tokens sent by the client | tokens forwarded | forwarded ÷ sent "
        "| peak forwarded | compactions | cached share of forwarded | compaction LLM tokens "
        "| cost with the proxy | cost without compaction | saved |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for session in results["sessions"]:
        s = session["summary"]
        ratio = s["forwarded_tokens"] / s["sent_tokens"] if s["sent_tokens"] else 0.0
        without = s["without_compaction_usd"]
        saved = 1 - s["total_usd"] / without if without else 0.0
        out.append(
            f"| {session['turns']} turns | {s['requests']:,} | {s['sent_tokens']:,} | "
            f"{s['forwarded_tokens']:,} | {ratio:.2f} | {s['peak_forwarded_tokens']:,} | "
            f"{s['compactions']} | {s['cached_share']:.0%} | {s['compaction_tokens']:,} | "
            f"${s['total_usd']:.4f} | ${without:.4f} | {saved:.0%} |"
        )
    out.append(
        f'\nReference price: {price_line(results["model"])}. "Cost with the proxy" bills the '
        "forwarded requests (cache reads at the cached price) plus the detector and summarizer "
        'calls (uncached); "without compaction" is the proxy\'s own counterfactual — the full '
        "history, with the previous request's history read from cache."
    )
    return "\n".join(out)


def chart(results: dict[str, Any], path: Path) -> None:
    """Original vs forwarded prompt tokens per request, one panel per session."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sessions = results["sessions"]
    fig, axes = plt.subplots(len(sessions), 1, figsize=(9, 2.8 * len(sessions)), squeeze=False)
    for ax, session in zip(axes[:, 0], sessions, strict=True):
        records = session["records"]
        x = range(1, len(records) + 1)
        ax.plot(x, [r["original_tokens"] for r in records], label="sent by the client")
        ax.plot(x, [r["prompt_tokens"] for r in records], label="forwarded upstream")
        ax.plot(x, [r["cached_tokens"] for r in records], label="of which cached", lw=0.8)
        ax.set_title(f"{session['turns']}-turn session", fontsize=10)
        ax.set_ylabel("prompt tokens")
        ax.grid(alpha=0.3)
        ax.yaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:,.0f}"))
    axes[0, 0].legend(loc="upper left", fontsize=8)
    axes[-1, 0].set_xlabel("request (one per user turn, one more per tool round)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.savings",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--smoke", action="store_true", help="two short sessions, low trigger")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--chart", metavar="PATH", help="write the PNG chart here")
    args = parser.parse_args(argv)
    results = run(SMOKE if args.smoke else FULL)
    print(markdown(results))
    if args.chart:
        chart(results, Path(args.chart))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
