"""What requests and compactions cost, honestly (DESIGN §6). Pure.

A compaction is not free: the rewritten prefix misses the provider's cache once (and on
Anthropic pays a cache write at a premium), and the detector and summarizer read the span.
Savings are reported net of all of it. Prices are USD per token from LiteLLM's price map.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from proxy.core.modelmap import model_info, provider_family

CACHE_MIN_TOKENS = 1024  # OpenAI caches prompts from 1,024 tokens ...
CACHE_BLOCK = 128  # ... in 128-token increments.


@dataclass(frozen=True)
class Prices:
    input: float
    cache_read: float
    cache_write: float
    output: float

    @property
    def known(self) -> bool:
        return self.input > 0


@functools.lru_cache(maxsize=4096)  # as model_info's: the ledger asks ~5 times a request
def prices_for(model: str) -> Prices:
    """The model's prices; cache prices default to the provider's usual ratios when absent."""
    info = model_info(model)
    if info is None or not info.input_cost_per_token:
        return Prices(0.0, 0.0, 0.0, 0.0)
    price = info.input_cost_per_token
    anthropic = provider_family(model) == "anthropic"
    read = info.cache_read_input_token_cost
    write = info.cache_creation_input_token_cost
    return Prices(
        input=price,
        cache_read=read if read is not None else price * (0.1 if anthropic else 0.5),
        cache_write=write if write is not None else price * (1.25 if anthropic else 1.0),
        output=info.output_cost_per_token or 0.0,
    )


def cacheable(tokens: int) -> int:
    """Tokens of a reused prefix that an OpenAI-style cache would serve."""
    return 0 if tokens < CACHE_MIN_TOKENS else tokens // CACHE_BLOCK * CACHE_BLOCK


def input_cost(prices: Prices, prompt: int, cached: int, written: int = 0) -> float:
    """Billed input: uncached at the input price, cache reads and writes at theirs."""
    uncached = max(prompt - cached - written, 0)
    return uncached * prices.input + cached * prices.cache_read + written * prices.cache_write


@dataclass(frozen=True)
class RequestSaving:
    """One request against the counterfactual of forwarding the full history."""

    gross_tokens: int
    cache_tokens_lost: int
    actual_usd: float
    counterfactual_usd: float

    @property
    def net_usd(self) -> float:
        return self.counterfactual_usd - self.actual_usd


def request_saving(
    prices: Prices,
    *,
    original_tokens: int,
    forwarded_tokens: int,
    previous_original_tokens: int,
    cached: int,
    written: int = 0,
) -> RequestSaving:
    """Without compaction the client's previous history would have been a cached prefix.

    Counterfactual: ``original_tokens`` with ``cacheable(previous_original_tokens)`` read
    from cache. Actual: what the upstream reported for the forwarded request.
    """
    would_be_cached = min(cacheable(previous_original_tokens), original_tokens)
    return RequestSaving(
        gross_tokens=max(original_tokens - forwarded_tokens, 0),
        cache_tokens_lost=max(would_be_cached - cached, 0),
        actual_usd=input_cost(prices, forwarded_tokens, cached, written),
        counterfactual_usd=input_cost(prices, original_tokens, would_be_cached),
    )


def llm_cost(prices: Prices, prompt_tokens: int, completion_tokens: int) -> float:
    return prompt_tokens * prices.input + completion_tokens * prices.output
