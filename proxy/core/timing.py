"""Cache-aware timing: whether compacting a conversation now pays (DESIGN §11). Pure.

Between the trigger and the hard limit a compaction is optional, and on ~98%-cached agent
traffic it is only worth it when the reads it saves over the next requests exceed the cache it
breaks (a write at 1.25x on Anthropic) plus its own detector and summarizer calls; or when the
cache is cold anyway (the conversation idled past the provider's TTL), which makes the rewrite
free. Above the hard limit it runs regardless (``planner.decide``).

Time is data here: the driver passes ``now`` and the ledger's ``last_seen`` of the
conversation; nothing in this module reads a clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy.core import billing, planner
from proxy.core.messages import Message
from proxy.core.settings import CompactionSettings

# A summary costs about its transcript and the detector's window in input tokens; the
# detector reads at most this many tokens (its window of messages, each cut to ~250 tokens).
_PROMPT_TOKENS = 1000
HORIZON_DIVISOR = 9  # n requests so far: n/9 more expected (90% confidence, see ``judge``)


@dataclass(frozen=True)
class Timing:
    """The cost policy's verdict on compacting now: ``pays``; ``cold`` when the cache is
    cold (compact this very request: its prefix is not cached anyway); ``reason`` for logs,
    events and the phantom-savings report; ``net_usd`` the forecast."""

    pays: bool
    cold: bool = False
    reason: str = ""
    net_usd: float = 0.0


ALWAYS = Timing(True, reason="tokens policy")


def idle_seconds(meta: Any, now: float | None) -> float | None:
    """Seconds since the conversation's last forwarded request (None: none recorded)."""
    if now is None or not isinstance(meta, dict):
        return None
    last = meta.get("last_seen")
    return max(now - float(last), 0.0) if isinstance(last, int | float) else None


def too_soon(
    s: CompactionSettings,
    original: Sequence[Message],
    original_counts: Sequence[int],
    since: int,
) -> str | None:
    """No treadmill, whatever the policy: why an optional LLM compaction must wait (None: it
    need not). The conversation's last one (``since``: the message count of its request,
    ``records.llm_since``, whether or not its record still matches the client's history)
    must be ``min_requests_between_compactions`` requests old, and the client's history must
    have grown by a trigger's worth since: then each LLM compaction pays for one trigger of
    growth at most, however large each request is. The hard limit overrides this
    (``planner``); ``min_requests_between_compactions: 0`` turns it off."""
    if s.min_requests_between_compactions <= 0:
        return None  # configured off (tests of the mechanics at tiny triggers)
    if since <= 0 or since > len(original):
        return None  # none yet, or the client's own history shrank: a new start
    requests = sum(1 for m in original[since:] if m.get("role") == "assistant")
    if requests < s.min_requests_between_compactions:
        return f"the last LLM compaction was {requests} requests ago"
    growth = sum(original_counts[since:])
    if growth < s.trigger_tokens:
        return (
            f"the history grew {growth} tokens since the last LLM compaction, "
            f"less than the trigger ({s.trigger_tokens})"
        )
    return None


def shares_cache(s: CompactionSettings, model: str, shared: bool) -> bool:
    """Whether a summary may come from the call in the client's shape: the front door can
    make it (``shared``), the settings allow it, and the calls go to the upstream with the
    request's own model (another model or endpoint has another cache)."""
    if not shared or s.summary_reads_cache == "off" or s.summary_base_url:
        return False
    return s.summary_model in (None, model)


def expected_after(s: CompactionSettings, head_tokens: int, forwarded_tokens: int) -> int:
    """What an LLM compaction is expected to leave: the head, the verbatim window and the
    summary, at most ``compact_to_share`` of the trigger (the cut moves later otherwise)."""
    natural = head_tokens + s.verbatim_window_tokens + s.summary_budget_tokens
    return min(forwarded_tokens, natural, planner.target_tokens(s))


def judge(
    s: CompactionSettings,
    model: str,
    *,
    forwarded_tokens: int,
    head_tokens: int,
    meta: Any,
    now: float | None,
    after: int | None = None,
    llm: bool = True,
    llm_model: str | None = None,
    shared: bool = False,
) -> Timing:
    """Whether compacting ``forwarded_tokens`` of ``model`` now pays (``policy: cost``).

    ``after``: what the compaction leaves when known (a pruning built already), else the
    expectation of an LLM compaction; ``llm``: whether detector and summarizer calls are
    part of it. ``meta``: the ledger's row of the conversation (requests, ``last_seen``).
    """
    if s.policy != "cost" or forwarded_tokens <= s.trigger_tokens:
        return ALWAYS
    meta = meta if isinstance(meta, dict) else {}
    # A provider the conversation showed to cache none of its requests: no cache to break.
    rules = billing.observed(billing.rules_for(model, s), meta, forwarded=True)
    idle = idle_seconds(meta, now)
    cold = not rules.caches or idle is not None and not billing.warm(rules, idle)
    remaining = after if after is not None else expected_after(s, head_tokens, forwarded_tokens)
    span = max(forwarded_tokens - remaining, 0)
    window = s.detector_window_messages * s.detector_chars_per_message // 4
    llm_in = span + min(forwarded_tokens, window) + 2 * _PROMPT_TOKENS if llm else 0
    prices = billing.prices_for(model)
    if llm and not cold and shares_cache(s, model, shared):
        # The summarizer call in the client's shape (``proxy.core.sharedcall``) reads the
        # history from the cache instead of the span uncached: priced as the equivalent
        # input tokens, when cheaper (``auto``) or always (``on``).
        if prices.known:
            ratio = prices.cache_read / prices.input
            as_shared = int(forwarded_tokens * ratio) + min(forwarded_tokens, window)
            as_shared += 2 * _PROMPT_TOKENS
            if s.summary_reads_cache == "on" or as_shared < llm_in:
                llm_in = as_shared
    llm_out = s.summary_budget_tokens + 200 if llm else 0
    # The next ones, conservatively: if now is a uniform point of a session's life, one that
    # has lasted n requests lasts at least n/9 more with 90% confidence; at most the configured
    # horizon. Expecting n more (the median) or n/3 (75%) still compacted recorded sessions
    # that ended a few requests later, at a loss (replay, docs/benchmarks.md section 9).
    horizon = max(
        1, min(int(meta.get("requests") or 1) // HORIZON_DIVISOR, s.cost_horizon_requests)
    )
    found = billing.forecast(
        prices,
        rules,
        forwarded_tokens=forwarded_tokens,
        expected_after=remaining,
        horizon=horizon,
        idle_s=idle if cold else 0.0,
        llm_input_tokens=llm_in,
        llm_output_tokens=llm_out,
    )
    if llm and llm_model and llm_model != model:
        # Detector and summarizer at their own model's prices.
        theirs = billing.prices_for(llm_model)
        if theirs.known:
            cost = llm_in * theirs.input + llm_out * theirs.output
            found = billing.Forecast(
                found.saved_reads, found.rewrite, cost, found.saved_reads - found.rewrite - cost
            )
    if not prices.known:
        return Timing(True, cold, "no price known: compacting on tokens", 0.0)
    if cold:
        if found.net <= 0:
            why = f"cache cold but the calls would cost more (net ${found.net:.4f})"
        elif rules.caches:  # (cold with a cache: idle past its TTL)
            why = f"cache cold (idle {idle:.0f} s > TTL {rules.ttl_s:.0f} s)"
        else:
            why = "no cache reads seen from the provider"
        return Timing(found.net > 0, cold=found.net > 0, reason=why, net_usd=found.net)
    if found.net > 0:
        return Timing(True, reason=f"expected net saving ${found.net:.4f}", net_usd=found.net)
    return Timing(
        False,
        reason=(
            f"cache warm: compacting would cost ${found.rewrite + found.llm:.4f} "
            f"to save ${found.saved_reads:.4f} over {horizon} requests"
        ),
        net_usd=found.net,
    )
