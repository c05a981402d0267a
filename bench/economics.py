"""Net billed dollars of agent sessions replayed through the compaction core (issue #25).

    python -m bench.economics [--smoke] [--runs DIR ...] [--json PATH] [--jobs N]
                              [--llm-model PROVIDER=MODEL ...]
                              [--summary-reads-cache auto|on|off] [--client-clears N]
                              [--client-clock]

``--client-clears N`` replays every session as a client that clears all but its last N tool
results in place on each request (``clearing``); ``--client-clock`` as a client that writes
the time into its system prompt on each request (``clocked``).

Sessions: the synthetic 300-request agent session (``bench.agent_session``) and every recorded
real agent run in ``tests/replay/runs/*.json`` and ``tests/replay/more/*.json`` (further real
Claude Code sessions, some opening with the client's own summary; the neutral format; each
replayed open loop in
the chat-completions shape of ``tests.replay.shapes.chat_body``: before each assistant turn
the client resends its whole history). Each session goes through ``Compactor`` in process
(a diskcache store, the ledger written after every request as the service writes it, the
scripted detector and summarizer of ``bench.agent_session``: ``extractive`` for the synthetic
session, ``digits`` for the recorded runs) on a simulated clock (``now`` passed in): one
request every ``STEP_S`` seconds, so the cache stays warm; the synthetic session runs a second
time with a 10-minute break before each of its 20 user instructions (past both providers'
TTLs: the cost policy's cache-cold path). Every session runs at the default trigger (24,000);
a recorded run that never passes it runs at a stress trigger of 8,000 too, with the emergency
bound at the model's context window rather than twice that artificial trigger.

Each session is priced as billed with Anthropic's rules (``claude-sonnet-4-5``: reads 0.1x,
writes 1.25x, 5-minute TTL) and with OpenAI's (``gpt-4o``: reads 0.5x, 128-token steps), with
``proxy.core.billing``: a request's cached prefix is its longest common prefix (whole
messages, cache marks aside) with the previous request. Three ways of sending it:

- **unchanged**: the client's history as sent, with its own cache; only where it fits the
  model's context window (requests past it are "kept within the window", not compared);
- **client compacts**: the client summarizes its own history once it passes 85% of the
  window (one call reading it all, its prefix cached, writing a 2,000-token summary) and
  continues from system + summary (Claude Code's and Codex's auto-compaction, roughly);
- **proxy**: what the core forwards, plus its detector and summarizer calls (uncached, at
  the request's model's prices, or at ``--llm-model``'s when the deployment sets
  ``detection_model`` / ``summary_model`` to another model). A summarizer call in the
  client's shape (``summary_reads_cache``, ``proxy.core.sharedcall``) is the forwarded
  history plus one ask, at the request's model's prices: the prefix of the request forwarded
  last read from the cache while warm (a background compaction's call comes right after that
  request), the rest of the history written (Anthropic) or read uncached.

And the **floor**: the least a compaction to these settings' target can bill. Each request
past the trigger is priced as if a compaction that cost nothing (no calls, no rewrite) had
kept only ``compact_to_share`` of the trigger of the history the previous request had (read
from the cache while it is warm), with its new messages and its output as they are; the
requests under the trigger as sent (the proxy leaves them alone). And the **bound**: the least
any compaction can bill that leaves the requests under the trigger alone (the proxy, by its
definition, does): those requests as sent, every request's output, and no input at all for a
request past the trigger. A session whose bound is above 0.6x cannot be brought to 0.6x of
unchanged's dollars by any policy, target or summarizer: most of what it bills comes before
its history reaches the trigger. The cache-write aim's line gives the **joint bound**: every
token a request adds is written (OpenAI: sent uncached) at least once however the history
before it is forwarded, so a traffic whose write ÷ read stays within 1.5x of unchanged's reads
at least ``added ÷ (1.5 × unchanged's ratio)`` tokens from the cache; those reads, those
writes and the output are the least it bills (``joint_bound``). Above 0.6x of unchanged's
dollars, that aim and the 0.6x one cannot both hold on the session.

Reported per session, provider and policy (``cost``, the default, and ``tokens``): the proxy's
billed $ over the whole session (requests, output and its detector/summarizer calls); the
unchanged traffic's $ over the requests that fit the window, and the proxy's $ over those same
requests (and the calls made meanwhile) ÷ it, and the floor's and the bound's ÷ it; the
client-compacting traffic's $ and the proxy's ÷ it, both over the whole session; cache-write ÷
cache-read tokens (OpenAI bills no writes: there, uncached ÷ cached input) for the proxy and
for unchanged over the same requests (those that fit the window), and in brackets the proxy's
over the whole session, and the proxy's cache writes ÷ unchanged's over the same requests;
prefix breaks; LLM calls.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench import agent_session
from proxy.adapters.store import DiskStore
from proxy.config import load_prompt
from proxy.core import billing, costs, planner
from proxy.core.modelmap import context_window
from proxy.core.prepared import Prompts
from proxy.core.settings import CompactionSettings
from proxy.core.sharedcall import SharedCall
from proxy.core.surfaces import OPENAI_CHAT
from proxy.core.tokens import TokenCounter
from proxy.engine.compactor import Compactor
from proxy.operators import ledger

Message = dict[str, Any]
PROVIDERS = {"anthropic": "claude-sonnet-4-5", "openai": "gpt-4o"}
DEFAULT_TRIGGER = CompactionSettings().trigger_tokens
STRESS_TRIGGER = 8_000  # for the recorded runs that never pass the default trigger
STEP_S = 20.0  # seconds between two requests of a session (an agent's tool round)
CLIENT_COMPACTS_AT = 0.85  # share of the window at which the client compacts itself
CLIENT_SUMMARY_TOKENS = 2000
RUNS = Path(__file__).resolve().parent.parent / "tests" / "replay" / "runs"
MORE = RUNS.parent / "more"  # further real sessions (not replayed through processes in CI)
FOLDERS = (RUNS, MORE)  # the recorded runs priced by default


@dataclass(frozen=True)
class Session:
    name: str
    requests: list[list[Message]]  # the client's history before each assistant turn
    replies: list[Message]  # the assistant turn each request is answered with
    # The scripted summarizer (``bench.agent_session``): ``extractive`` keeps the planted
    # facts of the synthetic session; a recorded run has none, so ``digits`` (the lines with
    # a digit or a path) stands in for a model there.
    summarizer: str = "extractive"
    # Seconds of idle before a request that opens a new user instruction (0: none), e.g. a
    # developer reading the agent's answer before typing the next step.
    break_s: float = 0.0


def synthetic(requests: int) -> Session:
    msgs = agent_session.session(requests)
    ends = [i for i, m in enumerate(msgs) if m["role"] == "assistant"][:requests]
    return Session(f"synthetic agent ({requests} requests)", [msgs[:e] for e in ends],
                   [msgs[e] for e in ends])  # fmt: skip


def recorded(path: Path) -> Session:
    from tests.replay import shapes  # the corpus's own renderer (tests/replay)

    run = json.loads(path.read_text())
    turns = run["turns"]
    requests, replies = [], []
    for step in shapes.steps({**run, "agent": "chat"}, "gpt-4o"):
        body = shapes.chat_body(run, turns[: step.turns], "gpt-4o")
        requests.append(body["messages"])
        after = shapes.chat_body(run, turns[: step.turns + 1], "gpt-4o")["messages"]
        replies.append(after[-1])
    return Session(f"{run.get('agent')} {path.stem}", requests, replies, "digits")


CLEARED = "[Old tool result content cleared]"


def cleared(history: list[Message], keep: int, field: str = "content") -> list[Message]:
    """``history`` as a client that clears its own older tool results in place sends it: all
    but its last ``keep`` results replaced by a marker (Claude Code's microcompact, OpenCode's
    prune, SWE-agent's ``last_n_observations``). ``field``: where a result's text is (a
    recorded run's turns keep it in ``output``)."""
    results = [i for i, m in enumerate(history) if m.get("role") == "tool"]
    old = set(results[: max(len(results) - keep, 0)])
    return [{**m, field: CLEARED} if i in old else m for i, m in enumerate(history)]


def clearing(session: Session, keep: int) -> Session:
    """``session`` with every request ``cleared``: each request changes a message the
    previous one sent (#25, sixteenth stop)."""
    name = f"{session.name}, all but its last {keep} results cleared"
    return dataclasses.replace(
        session, name=name, requests=[cleared(h, keep) for h in session.requests]
    )


def clocked(session: Session) -> Session:
    """``session`` as a client that writes the time into its system prompt on every request
    (a chat UI's prompt variable, an agent printing the date and time): each request's head
    differs from the previous one's, so nothing of it is ever cached (#25, eighteenth stop).
    The time is the simulated clock's (``STEP_S`` apart)."""
    requests = []
    for i, history in enumerate(session.requests):
        hours, rest = divmod(36_000 + int(i * STEP_S), 3600)
        stamp = f"Current time: {hours:02d}:{rest // 60:02d}:{rest % 60:02d}."
        if history and history[0].get("role") == "system":
            head = {**history[0], "content": f"{history[0].get('content')}\n{stamp}"}
            requests.append([head, *history[1:]])
        else:
            requests.append([{"role": "system", "content": stamp}, *history])
    name = f"{session.name}, a clock in its system prompt"
    return dataclasses.replace(session, name=name, requests=requests)


def _plain(m: Message) -> bytes:
    """A message as the provider's cache sees it: cache marks aside, one text part as text."""
    content = m.get("content")
    if isinstance(content, list):
        parts = [{k: v for k, v in p.items() if k != "cache_control"} for p in content]
        if len(parts) == 1 and parts[0].get("type") == "text":
            content = parts[0].get("text")
        else:
            content = parts
    return orjson.dumps({**m, "content": content}, option=orjson.OPT_SORT_KEYS)


def common_prefix(a: list[bytes], b: list[bytes], counts: list[int]) -> tuple[int, bool]:
    """Tokens of ``b``'s leading messages equal to ``a``'s, and whether all of ``a`` is one."""
    total = n = 0
    for x, y, c in zip(a, b, counts, strict=False):
        if x != y:
            break
        total, n = total + c, n + 1
    return total, n == len(a)


@dataclass
class Side:
    """One way of sending a session, billed request by request."""

    usd: float = 0.0
    read: int = 0
    written: int = 0
    uncached: int = 0
    breaks: int = 0
    calls: int = 0
    calls_usd: float = 0.0
    requests: int = 0

    def add(self, b: billing.Bill) -> None:
        self.usd += b.usd
        self.read += b.cached
        self.written += b.written
        self.uncached += b.prompt - b.cached - b.written
        self.requests += 1

    def write_read(self, rules: billing.CacheRules) -> float:
        missed = self.written if rules.writes_billed else self.uncached
        return missed / self.read if self.read else 0.0


@dataclass
class Result:
    session: str
    provider: str
    policy: str
    trigger: int
    requests: int
    peak_original: int
    fits: int  # requests that fit the window as sent
    proxy: Side = field(default_factory=Side)
    # The proxy's requests (and its calls meanwhile) while the history fitted the window: the
    # requests ``unchanged`` has, so the two compare request for request.
    proxy_fit: Side = field(default_factory=Side)
    # The least a compaction to the settings' target can bill over the same requests: each
    # past the trigger as if a free one (no calls, no rewrite) kept only ``target_tokens`` of
    # the history the previous request had, its new messages and output as they are.
    floor_usd: float = 0.0
    # The least *any* compaction that leaves the requests under the trigger alone can bill
    # over the same requests: those as sent (with the client's cache), every request's
    # output, and nothing for the input of a request past the trigger (as if a free
    # compaction had sent none of it). A session above 0.6x here cannot reach 0.6x.
    bound_usd: float = 0.0
    # Over the same requests: the tokens each added to the one before (never sent before, so
    # written, or sent uncached, whatever a compaction does) and what their output bills.
    fresh: int = 0
    output_usd: float = 0.0
    unchanged: Side = field(default_factory=Side)
    client: Side = field(default_factory=Side)
    compactions: dict[str, int] = field(default_factory=dict)


async def replay(
    session: Session, provider: str, settings: CompactionSettings, counter: TokenCounter
) -> Result:
    model = PROVIDERS[provider]
    prices, rules = costs.prices_for(model), billing.rules_for(model, settings)
    window = context_window(model) or 10**9
    target = planner.target_tokens(settings)
    aux = costs.prices_for(settings.summary_model or model)
    llm = agent_session.ScriptedLLM(agent_session.SUMMARIZERS[session.summarizer], counter)
    llm.rules = rules
    # The front door's summarizer call in the client's shape (the replay's: chat completions).
    shared = SharedCall(OPENAI_CHAT, {"model": model, "messages": []}, "http://replay/", ())
    cases: dict[str, int] = {}

    def on_event(event: dict[str, Any]) -> None:
        cases[str(event.get("case"))] = cases.get(str(event.get("case")), 0) + 1

    prompts = Prompts(detector=load_prompt("detector"), summarizer=load_prompt("summarizer"))
    result = Result(session.name, provider, settings.policy, settings.trigger_tokens,
                    len(session.requests), 0, 0)  # fmt: skip
    prev_fwd: list[bytes] = []
    prev_tokens = 0
    prev_sent: list[bytes] = []
    # The client's own compaction: the history size it happened at, what replaced it, its
    # last request's size, and the prefix its first request after it shares (the head).
    client_epoch = client_base = client_prev = client_fresh = 0
    now = 0.0
    with tempfile.TemporaryDirectory(prefix="bench-economics-") as tmp:
        store = DiskStore(tmp)
        engine = Compactor(settings, store, llm, prompts, counter=counter, on_event=on_event)
        for i, (history, reply) in enumerate(zip(session.requests, session.replies, strict=True)):
            pause = session.break_s if i and history[-1].get("role") == "user" else 0.0
            idle = STEP_S + pause if i else None
            now += idle or 0.0
            calls_before = llm.prompt_tokens, llm.completion_tokens
            shared_before = len(llm.shared_calls)
            # An inline compaction's call finds the previous request's prefix cached.
            llm.cache_tokens, llm.cache_idle = prev_tokens, idle
            p = await engine.prepare(history, model=model, tenant="bench", credential="k",
                                     now=now, shared=shared)  # fmt: skip
            output = counter.count_message(reply, model)
            original = p.original_tokens
            result.peak_original = max(result.peak_original, original)
            # The proxy: what it forwarded, its prefix against the previous one.
            fwd = [_plain(m) for m in p.forwarded]
            common, kept = common_prefix(prev_fwd, fwd, p.forwarded_counts)
            result.proxy.breaks += int(bool(prev_fwd) and not kept)
            cached = billing.cached_prefix(rules, common, idle)
            bill = billing.bill(prices, rules, p.forwarded_tokens, cached, output)
            result.proxy.add(bill)
            prev_fwd = fwd
            # Unchanged: the client's history, its prefix against the previous one.
            sent = [_plain(m) for m in history]
            common_sent, _ = common_prefix(prev_sent, sent, p.original_counts)
            prev_sent = sent
            fits = original <= window
            if fits:
                result.fits += 1
                was = billing.cached_prefix(rules, common_sent, idle)
                as_sent = billing.bill(prices, rules, original, was, output)
                result.unchanged.add(as_sent)
                result.proxy_fit.add(bill)
                old = min(common_sent, original)  # (the new messages: the rest)
                past = original > settings.trigger_tokens
                output_usd = output * prices.output
                result.bound_usd += output_usd if past else as_sent.usd
                result.fresh += original - old
                result.output_usd += output_usd
                held = min(old, target) if past else old
                result.floor_usd += billing.bill(prices, rules, original - old + held,
                                                 min(was, held), output).usd  # fmt: skip
            # The client compacting by itself near the window.
            if original - client_epoch + client_base > CLIENT_COMPACTS_AT * window:
                size = original - client_epoch + client_base
                was = billing.cached_prefix(rules, client_prev, idle)
                call = billing.bill(prices, rules, size, was, CLIENT_SUMMARY_TOKENS)
                result.client.calls += 1
                result.client.calls_usd += call.usd
                head = sum(p.original_counts[: p.head_len])
                client_base = head + CLIENT_SUMMARY_TOKENS
                client_epoch, client_fresh = original, head
            size = original - client_epoch + client_base
            # Within one of the client's epochs its prefix grows like the history it sends.
            common_client = client_fresh or common_sent - client_epoch + client_base
            client_fresh = 0
            was = billing.cached_prefix(rules, max(min(common_client, size), 0), idle)
            result.client.add(billing.bill(prices, rules, size, was, output))
            client_prev = size
            # The ledger entry, as the service writes it (the cost policy reads it back).
            usage = {"prompt_tokens": p.forwarded_tokens, "completion_tokens": output,
                     "prompt_tokens_details": {"cached_tokens": bill.cached},
                     "cache_creation_input_tokens": bill.written}  # fmt: skip
            entry = ledger.RequestEntry.of(
                p, route="chat.completions", status=200, usage=usage, latency_s=0.0,
                overhead_s=0.0, ts=now, cache_ttl_s=rules.ttl_s,
            )  # fmt: skip
            ledger.record_batch(store, [(entry, None)], None)
            # A background compaction's call comes right after this request: all of it cached.
            llm.cache_tokens, llm.cache_idle = p.forwarded_tokens, 0.0
            prev_tokens = p.forwarded_tokens
            engine.schedule(p)
            await engine.drain(timeout=120)  # the agent runs its tools meanwhile
            spent_in = llm.prompt_tokens - calls_before[0]
            spent_out = llm.completion_tokens - calls_before[1]
            spent = spent_in * aux.input + spent_out * aux.output
            # Calls in the client's shape: the request's model, its cache reads and writes.
            for prompt, cached, written, out in llm.shared_calls[shared_before:]:
                spent += costs.input_cost(prices, prompt, cached, written) + out * prices.output
            result.proxy.calls_usd += spent
            if fits:
                result.proxy_fit.calls_usd += spent
        store.close()
    result.proxy.calls = llm.calls
    result.compactions = cases
    return result


def ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def joint_bound(r: Result, within: float = 1.5) -> float:
    """The least $ (÷ unchanged's) a traffic whose cache write ÷ read is ``within`` x
    unchanged's can bill over the requests that fit the window. Every token a request adds is
    written (OpenAI: sent uncached) at least once whatever is forwarded, so such a traffic
    reads at least ``fresh ÷ (within × unchanged's ratio)`` tokens from the cache and bills
    those reads, those writes and the output. Above 0.6 the two aims cannot both hold."""
    model = PROVIDERS[r.provider]
    prices, rules = costs.prices_for(model), billing.rules_for(model)
    ratio_u = r.unchanged.write_read(rules)
    if not ratio_u or not r.unchanged.usd:
        return 0.0
    reads = int(r.fresh / (within * ratio_u))
    usd = (billing.bill(prices, rules, reads, reads).usd
           + billing.bill(prices, rules, r.fresh, 0).usd + r.output_usd)  # fmt: skip
    return usd / r.unchanged.usd


def summary(r: Result) -> dict[str, Any]:
    rules = billing.rules_for(PROVIDERS[r.provider])
    proxy_usd = r.proxy.usd + r.proxy.calls_usd
    client_usd = r.client.usd + r.client.calls_usd
    llm = sum(r.compactions.get(c, 0) for c in ("summarize", "truncate"))
    return {
        "session": r.session, "provider": r.provider, "policy": r.policy, "trigger": r.trigger,
        "requests": r.requests, "peak_original": r.peak_original, "fits": r.fits,
        "passes_trigger": r.peak_original > r.trigger,
        "proxy_usd": proxy_usd, "unchanged_usd": r.unchanged.usd, "client_usd": client_usd,
        "vs_unchanged": ratio(r.proxy_fit.usd + r.proxy_fit.calls_usd, r.unchanged.usd),
        "floor_vs_unchanged": ratio(r.floor_usd, r.unchanged.usd),
        "bound_vs_unchanged": ratio(r.bound_usd, r.unchanged.usd),
        "joint_vs_unchanged": joint_bound(r),
        "vs_client": ratio(proxy_usd, client_usd),
        "net_saved_vs_client": client_usd - proxy_usd,
        # Over the requests that fit the window (all that ``unchanged`` has): a ratio over
        # the whole session beside unchanged's over its first requests compared two traffics.
        "write_read_proxy": r.proxy_fit.write_read(rules),
        "write_read_proxy_session": r.proxy.write_read(rules),
        "missed_vs_unchanged": ratio(
            r.proxy_fit.written + r.proxy_fit.uncached, r.unchanged.written + r.unchanged.uncached
        ),
        "write_read_unchanged": r.unchanged.write_read(rules),
        "prefix_breaks": r.proxy.breaks, "llm_calls": r.proxy.calls,
        "llm_compactions": llm, "prunings": r.compactions.get("prune", 0),
        "emergencies": r.compactions.get("emergency", 0), "client_compactions": r.client.calls,
    }  # fmt: skip


def sessions(smoke: bool, runs: Sequence[Path]) -> list[tuple[Session, tuple[int, ...]]]:
    """Each session with the triggers it runs at: the default, and for a recorded run that
    never passes it ``STRESS_TRIGGER`` too, so that its compactions are measured. The smoke
    run takes the smallest recorded run."""
    agent = synthetic(agent_session.SMOKE_REQUESTS if smoke else 300)
    breaks = dataclasses.replace(agent, name=f"{agent.name}, 10-minute breaks", break_s=600.0)
    out: list[tuple[Session, tuple[int, ...]]] = [
        (agent, (DEFAULT_TRIGGER,)),
        (breaks, (DEFAULT_TRIGGER,)),
    ]
    paths = [path for folder in runs for path in sorted(folder.glob("*.json"))]
    if smoke:
        paths = sorted(paths, key=lambda p: p.stat().st_size)[:1]
    counter = TokenCounter()
    for path in paths:
        session = recorded(path)
        peak = counter.count_total(session.requests[-1], PROVIDERS["openai"])
        passes = peak > DEFAULT_TRIGGER
        out.append((session, (DEFAULT_TRIGGER,) if passes else (DEFAULT_TRIGGER, STRESS_TRIGGER)))
    return out


def settings_for(
    trigger: int, policy: str, provider: str, llm_model: str | None = None,
    reads_cache: str = "auto",
) -> CompactionSettings:  # fmt: skip
    """The defaults at ``trigger``. At the stress trigger the emergency bound is the model's
    context window, not twice that artificial trigger: the stress trigger stands for a
    deployment that compacts early on a large window, whose emergency bound (the default's
    2 x 24,000 included) is nowhere near a 16,000-token request. ``llm_model``: the
    detector's and summarizer's (default: the request's), priced as that model's;
    ``reads_cache``: ``summary_reads_cache``."""
    window = context_window(PROVIDERS[provider]) or 2 * trigger
    settings = CompactionSettings(trigger_tokens=trigger, policy=policy,  # type: ignore[arg-type]
                                  detection_model=llm_model, summary_model=llm_model,
                                  summary_reads_cache=reads_cache)  # type: ignore[arg-type]  # fmt: skip
    if trigger >= DEFAULT_TRIGGER:
        return settings
    return dataclasses.replace(settings, emergency_factor=window / trigger)


def _cell(
    session: Session, trigger: int, provider: str, policy: str, llm_model: str | None,
    reads_cache: str = "auto",
) -> dict[str, Any]:  # fmt: skip
    settings = settings_for(trigger, policy, provider, llm_model, reads_cache)
    return summary(asyncio.run(replay(session, provider, settings, TokenCounter())))


def run(smoke: bool = False, runs: Sequence[Path] = FOLDERS,
        policies: tuple[str, ...] = ("cost", "tokens"), log: Any = sys.stderr, jobs: int = 1,
        llm_models: dict[str, str] | None = None,
        reads_cache: str = "auto", clears: int | None = None,
        clock: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    """Every cell (session, trigger, provider, policy), in ``jobs`` processes (each cell is
    independent and deterministic: the order of the rows does not depend on ``jobs``).
    ``llm_models``: the detector's and summarizer's model per provider (default: the
    request's); ``reads_cache``: ``summary_reads_cache`` (auto, the default, on or off);
    ``clears``: each session as a client clearing all but this many of its last tool
    results sends it (``clearing``); ``clock``: as a client writing the time into its system
    prompt sends it (``clocked``)."""
    found = sessions(smoke, runs)
    if clears is not None:
        found = [(clearing(session, clears), triggers) for session, triggers in found]
    if clock:
        found = [(clocked(session), triggers) for session, triggers in found]
    cells = [(session, trigger, provider, policy, (llm_models or {}).get(provider), reads_cache)
             for session, triggers in found for trigger in triggers
             for provider in PROVIDERS for policy in policies]  # fmt: skip
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            results = list(pool.map(_cell, *zip(*cells, strict=True)))
    else:
        results = [_cell(*cell) for cell in cells]
    for s in results:
        print(f"{s['session']} trigger {s['trigger']} {s['provider']} {s['policy']}: "
              f"{s['vs_unchanged']:.3f}x unchanged, {s['vs_client']:.3f}x client",
              file=log)  # fmt: skip
    return results


def markdown(results: list[dict[str, Any]]) -> str:
    out = [
        "| session | trigger | provider | policy | requests (fit the window) | peak sent | "
        "proxy $ | unchanged $ | ÷ unchanged | floor ÷ unchanged | bound ÷ unchanged | "
        "client compacts $ | "
        "÷ client | "
        "write÷read proxy / unchanged (proxy, whole session) | writes ÷ unchanged's | "
        "prefix breaks | "
        "LLM calls (compactions) | prunings |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in results:
        out.append(
            f"| {s['session']} | {s['trigger']:,} | {s['provider']} | {s['policy']} | "
            f"{s['requests']} ({s['fits']}) | {s['peak_original']:,} | ${s['proxy_usd']:.3f} | "
            f"${s['unchanged_usd']:.3f} | **{s['vs_unchanged']:.3f}×** | "
            f"{s['floor_vs_unchanged']:.3f}× | {s['bound_vs_unchanged']:.3f}× | "
            f"${s['client_usd']:.3f} | "
            f"{s['vs_client']:.3f}× | {s['write_read_proxy']:.3f} / "
            f"{s['write_read_unchanged']:.3f} ({s['write_read_proxy_session']:.3f}) | "
            f"{s['missed_vs_unchanged']:.2f}× | "
            f"{s['prefix_breaks']} | "
            f"{s['llm_calls']} ({s['llm_compactions']}) | {s['prunings']} |"
        )
    return "\n".join(out)


def aims(results: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """Issue #25's aims over the default policy's rows, the worst session of each trigger and
    provider: (aim, measured, verdict)."""
    out: list[tuple[str, str, str]] = []
    rows = [s for s in results if s["policy"] == "cost"]
    for trigger in sorted({s["trigger"] for s in rows}, reverse=True):
        for provider in PROVIDERS:
            group = [s for s in rows if s["trigger"] == trigger and s["provider"] == provider]
            if not group:
                continue
            where = f"trigger {trigger:,}, {provider}'s prices"
            worst = max(group, key=lambda s: s["vs_unchanged"])
            out.append((f"net $ ≤ 1.0× unchanged, every session ({where})",
                        f"{worst['vs_unchanged']:.3f}× ({worst['session']})",
                        "met" if worst["vs_unchanged"] <= 1.0 + 1e-9 else "missed"))  # fmt: skip
            passing = [s for s in group if s["passes_trigger"]]
            if passing:
                worst = max(passing, key=lambda s: s["vs_unchanged"])
                floor = max(s["floor_vs_unchanged"] for s in passing)
                bound = max(passing, key=lambda s: s["bound_vs_unchanged"])
                beyond = sum(s["bound_vs_unchanged"] > 0.6 for s in passing)
                out.append((f"net $ ≤ 0.6× unchanged, sessions past the trigger ({where})",
                            f"{worst['vs_unchanged']:.3f}× ({worst['session']}); "
                            f"highest floor {floor:.3f}×; highest bound "
                            f"{bound['bound_vs_unchanged']:.3f}× ({bound['session']}), "
                            f"{beyond} of {len(passing)} above 0.6×",
                            "met" if worst["vs_unchanged"] <= 0.6 else "missed"))  # fmt: skip

            def times(s: dict[str, Any]) -> float:
                base = s["write_read_unchanged"]
                return float(s["write_read_proxy"] / base) if base else 1.0

            worst = max(group, key=times)
            joint = max(passing or group, key=lambda s: s["joint_vs_unchanged"])
            out.append((f"cache write ÷ read within 1.5× of unchanged's ({where})",
                        f"{times(worst):.2f}× ({worst['session']}); within it "
                        f"{joint['session']} bills ≥ {joint['joint_vs_unchanged']:.3f}× "
                        "unchanged",
                        "met" if times(worst) <= 1.5 else "missed"))  # fmt: skip
    return out


def aims_markdown(results: list[dict[str, Any]]) -> str:
    rows = [f"| {a} | {m} | {v} |" for a, m, v in aims(results)]
    return "\n".join(["| aim (#25) | measured | |", "|---|---:|---|", *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.economics",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--smoke", action="store_true", help="short sessions, one recorded run")
    parser.add_argument(
        "--runs", type=Path, action="append",
        help="a recorded runs' folder, repeatable (default: tests/replay/runs and more)",
    )  # fmt: skip
    parser.add_argument("--policy", action="append", choices=["cost", "tokens"])
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--jobs", type=int, default=1, help="cells run in this many processes")
    parser.add_argument(
        "--llm-model", action="append", default=[], metavar="PROVIDER=MODEL",
        help="the detector's and summarizer's model for one provider's sessions, e.g. "
        "anthropic=claude-haiku-4-5 (default: the request's model)",
    )  # fmt: skip
    parser.add_argument(
        "--summary-reads-cache", choices=["auto", "on", "off"], default="auto",
        help="the summarizer call in the client's shape, reading the conversation's cache "
        "(compaction.summary_reads_cache; off: the standalone call, as before #25's ninth stop)",
    )  # fmt: skip
    parser.add_argument(
        "--client-clears", type=int, metavar="N",
        help="replay each session as a client that clears all but its last N tool results in "
        "place on every request (as Claude Code's microcompact or SWE-agent do)",
    )  # fmt: skip
    parser.add_argument(
        "--client-clock", action="store_true",
        help="replay each session as a client that writes the time into its system prompt on "
        "every request (a prompt variable)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.client_clears is not None and args.client_clears < 0:
        parser.error("--client-clears: N is 0 or more")
    pairs = [pair.split("=", 1) for pair in args.llm_model]
    if any(len(p) != 2 or p[0] not in PROVIDERS or not costs.prices_for(p[1]).known
           for p in pairs):  # fmt: skip
        parser.error(f"--llm-model: PROVIDER is one of {', '.join(PROVIDERS)}, MODEL a "
                     "model with known prices")  # fmt: skip
    llm_models = {provider: model for provider, model in pairs}
    results = run(args.smoke, args.runs or FOLDERS, tuple(args.policy or ("cost", "tokens")),
                  jobs=args.jobs, llm_models=llm_models,
                  reads_cache=args.summary_reads_cache,
                  clears=args.client_clears, clock=args.client_clock)  # fmt: skip
    print(markdown(results) + "\n\n" + aims_markdown(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
