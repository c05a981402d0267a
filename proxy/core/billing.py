"""Requests priced as the provider bills them, with its prompt-cache rules (DESIGN §11). Pure.

A forwarded request costs: uncached input x 1, cache writes x w, cache reads x r, output x o
(times the model's input or output price). Which part of a prompt a provider serves from its
cache depends on the previous request of the conversation: the longest common prefix, if it
was sent less than the cache's time to live ago, above the provider's minimum, in its steps.

- Anthropic: reads 0.1x, writes 1.25x (what follows the cached prefix, up to the last cache
  mark, is written), 5-minute TTL, from 1,024 tokens.
- OpenAI: reads 0.5x, no write premium, automatic prefix caching from 1,024 tokens in 128-token
  steps; "cached prefixes generally remain active for 5 to 10 minutes of inactivity": 10 by
  default, the longer of the two, so neither the counterfactual nor the cache-cold test of the
  planner flatters a compaction.

Time comes in as numbers (seconds of idle), never from a clock: callers pass it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from proxy.core.costs import Prices, RequestSaving, input_cost, prices_for
from proxy.core.modelmap import context_window, provider_family
from proxy.core.settings import CompactionSettings


@dataclass(frozen=True)
class CacheRules:
    """One provider family's prompt cache: price ratios to input, TTL, granularity."""

    family: str
    read: float
    write: float
    ttl_s: float
    min_tokens: int = 1024
    step: int = 1
    writes_billed: bool = False  # the uncached tail is written at ``write`` (Anthropic)
    caches: bool = True  # False: every prompt is read in full at the input price


ANTHROPIC = CacheRules("anthropic", 0.1, 1.25, 300.0, 1024, 1, writes_billed=True)
OPENAI = CacheRules("openai", 0.5, 1.0, 600.0, 1024, 128)
# Other providers (LiteLLM-routed): prefix caching like OpenAI's, the shorter TTL.
OTHER = CacheRules("other", 0.5, 1.0, 300.0, 1024, 128)
_RULES = {"anthropic": ANTHROPIC, "openai": OPENAI}
# A provider seen not to cache: one without a prompt cache, or Anthropic's API for a client
# that marks nothing (it caches only up to the client's ``cache_control`` marks).
UNCACHED = CacheRules("uncached", 1.0, 1.0, 0.0, caches=False)
# A conversation's requests sent as is that could each have read the previous one's prefix
# from the cache (the rules' prediction) and read none: then the provider does not cache it.
CACHE_CHECKS = 5


def rules_for(model: str, settings: CompactionSettings | None = None) -> CacheRules:
    """The cache rules of ``model``'s provider family, with the configured TTL if any."""
    rules = _RULES.get(provider_family(model), OTHER)
    if settings is not None:
        ttl = {
            "anthropic": settings.cache_ttl_anthropic_s,
            "openai": settings.cache_ttl_openai_s,
        }.get(rules.family, settings.cache_ttl_other_s)
        rules = with_ttl(rules, ttl)
    return rules


@functools.lru_cache(maxsize=64)
def with_ttl(rules: CacheRules, ttl_s: float) -> CacheRules:
    """``rules`` with another cache TTL (one value per family and TTL: asked per request)."""
    return rules if rules.ttl_s == ttl_s else replace(rules, ttl_s=ttl_s)


def warm(rules: CacheRules, idle_s: float | None) -> bool:
    """Whether a prefix sent ``idle_s`` seconds ago is still cached (None: never sent)."""
    return rules.caches and idle_s is not None and 0 <= idle_s <= rules.ttl_s


def observed(rules: CacheRules, meta: object, *, forwarded: bool = False) -> CacheRules:
    """``rules``, or ``UNCACHED`` when the conversation's ledger row (``meta``) says the
    provider served none of ``CACHE_CHECKS`` or more of its requests sent as is from its cache
    although the rules predicted it would: the client's own requests are then priced without
    a cache (the counterfactual). ``forwarded``: for what the proxy forwards (the cost
    policy's forecast: a compaction breaks no cache), which must not have read from the
    cache either (the proxy's own cache marks, on Anthropic, can make a cache the client's
    requests never had)."""
    if isinstance(meta, dict):
        checks, reads = meta.get("cache_checks"), meta.get("cache_reads")
        if forwarded and meta.get("forwarded_reads"):
            return rules
        if isinstance(checks, int) and checks >= CACHE_CHECKS and not reads:
            return UNCACHED
    return rules


def cached_prefix(rules: CacheRules, common_tokens: int, idle_s: float | None) -> int:
    """Tokens of a prompt the provider serves from cache: the common prefix with the previous
    request, when that is still cached and long enough, rounded down to the cache's steps."""
    if not warm(rules, idle_s) or common_tokens < rules.min_tokens:
        return 0
    return common_tokens // rules.step * rules.step


@dataclass(frozen=True)
class Bill:
    """One request's billed tokens and dollars."""

    prompt: int
    cached: int
    written: int
    output: int
    usd: float


def bill(prices: Prices, rules: CacheRules, prompt: int, cached: int, output: int = 0) -> Bill:
    """What the provider bills for a prompt of ``prompt`` tokens of which ``cached`` are read
    from its cache: on a provider that bills writes, the rest of a prompt long enough to be
    cached is written (the client, or the proxy's stability marks, mark its end)."""
    cached = min(max(cached, 0), prompt)
    written = prompt - cached if rules.writes_billed and prompt >= rules.min_tokens else 0
    uncached = prompt - cached - written
    usd = (
        uncached * prices.input
        + cached * _read_price(prices, rules)
        + written * _write_price(prices, rules)
        + output * prices.output
    )
    return Bill(prompt, cached, written, output, usd)


def cache_check(
    rules: CacheRules, meta: dict[str, object], common: int, idle_s: float | None, cached: int
) -> dict[str, int]:
    """``observed``'s counts after one more request sent as is onto the client's own cache:
    counted when ``rules`` predicted it would read its ``common`` prefix with the previous
    one from the cache (a read when the provider reported any cached token)."""
    if not cached_prefix(rules, common, idle_s):
        return {}
    checks, reads = meta.get("cache_checks"), meta.get("cache_reads")
    return {
        "cache_checks": (checks if isinstance(checks, int) else 0) + 1,
        "cache_reads": (reads if isinstance(reads, int) else 0) + (cached > 0),
    }


def _read_price(prices: Prices, rules: CacheRules) -> float:
    if not rules.caches:
        return prices.input
    return prices.cache_read or prices.input * rules.read


def _write_price(prices: Prices, rules: CacheRules) -> float:
    if not rules.caches:
        return prices.input
    return prices.cache_write or prices.input * rules.write


def request_saving(
    prices: Prices,
    rules: CacheRules,
    *,
    original_tokens: int,
    forwarded_tokens: int,
    previous_original_tokens: int,
    idle_s: float | None,
    cached: int,
    written: int = 0,
    as_sent: bool = False,
) -> RequestSaving:
    """One forwarded request against the client's own request, both priced as billed.

    Counterfactual: the client's history, its previous request's history read from cache
    while that is warm (``idle_s`` within the TTL; None: no previous request), the rest
    written where the provider bills writes. Actual: the forwarded prompt with the cache
    reads and writes the upstream reported. Output is the same on both sides: left out.

    ``as_sent``: this request went upstream as the client sent it, and so did the one before
    it while its prefix could still be cached: the client would have sent the same bytes onto
    the same cache, so the counterfactual is what was billed. (The model's cache is an
    estimate; priced against the provider's real figures it would book the provider's own
    misses, or a cache it does not offer, as the proxy's loss or saving.)
    """
    actual = input_cost(prices, forwarded_tokens, cached, written)
    if as_sent:
        return RequestSaving(0, 0, actual, actual)
    common = min(previous_original_tokens, original_tokens)
    would_be_cached = cached_prefix(rules, common, idle_s)
    counterfactual = bill(prices, rules, original_tokens, would_be_cached)
    return RequestSaving(
        gross_tokens=max(original_tokens - forwarded_tokens, 0),
        cache_tokens_lost=max(would_be_cached - cached, 0),
        actual_usd=actual,
        counterfactual_usd=counterfactual.usd,
    )


def over_window(model: str, tokens: int) -> bool:
    """Whether a request of ``tokens`` (messages plus what it reserves) cannot be sent to
    ``model`` at all: then forwarding it unchanged is no counterfactual, and what compaction
    took off it is "kept within the window", not money saved."""
    window = context_window(model)
    return window is not None and window > 0 and tokens > window


@dataclass(frozen=True)
class Forecast:
    """What compacting now is expected to save over the next requests, in USD."""

    saved_reads: float  # the removed tokens no longer read, over the horizon
    rewrite: float  # the new prefix's first request: a write (or uncached read) not a read
    llm: float  # the detector and summarizer calls
    net: float


def forecast(
    prices: Prices,
    rules: CacheRules,
    *,
    forwarded_tokens: int,
    expected_after: int,
    horizon: int,
    idle_s: float | None,
    llm_input_tokens: int,
    llm_output_tokens: int,
) -> Forecast:
    """Net USD of compacting now, applied from the next request, against not compacting.

    Without compaction each of the next ``horizon`` requests reads the current history from
    cache; with it each reads ``expected_after`` instead, but the first one misses the cache
    for it (a write on Anthropic, uncached input elsewhere). A cold cache (idle past the TTL)
    misses anyway: the history would be written again in full, so the rewrite is free and the
    removed tokens are not written either. The LLM calls are billed uncached.
    """
    removed = max(forwarded_tokens - expected_after, 0)
    read, write = _read_price(prices, rules), _write_price(prices, rules)
    miss = write if rules.writes_billed else prices.input
    if warm(rules, idle_s):
        saved = max(horizon, 0) * removed * read
        rewrite = expected_after * (miss - read)
    else:
        saved = removed * miss + max(horizon - 1, 0) * removed * read
        rewrite = 0.0
    llm = llm_input_tokens * prices.input + llm_output_tokens * prices.output
    return Forecast(saved, rewrite, llm, saved - rewrite - llm)


__all__ = [
    "ANTHROPIC",
    "CACHE_CHECKS",
    "OPENAI",
    "UNCACHED",
    "Bill",
    "CacheRules",
    "Forecast",
    "bill",
    "cache_check",
    "cached_prefix",
    "forecast",
    "observed",
    "over_window",
    "prices_for",
    "request_saving",
    "rules_for",
    "warm",
]
