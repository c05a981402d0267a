"""Compaction settings: one frozen value read once, shared by the proxy and the LiteLLM hook."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DEFAULT_EMERGENCY_FACTOR = 2.0


@dataclass(frozen=True)
class CompactionSettings:
    """The ``compaction:`` block of the config (DESIGN §5). Defaults are the documented ones."""

    enabled: bool = True
    trigger_tokens: int = 24_000
    verbatim_window_tokens: int = 4_000
    summary_budget_tokens: int = 500
    min_verbatim_exchanges: int = 2
    min_confidence: float = 0.5
    # Over factor x trigger (or the model's context window) a request is compacted before it
    # is forwarded, whatever it costs. null: 2.0 with ``policy: tokens``; with ``policy: cost``
    # the model's context window (2.0 when the window is unknown): that policy holds a
    # compaction past the trigger until it pays, so a bound at twice the trigger forced the
    # compactions it had declined, near the end of a session where nothing could pay them back.
    emergency_factor: float | None = None
    detection_model: str | None = None
    summary_model: str | None = None
    summary_role: Literal["system", "user"] = "system"
    truncate_keeps_note: bool = True
    # shadow: plan and compact in the background, forward exactly what the client sent.
    mode: Literal["background", "inline", "shadow"] = "background"
    policy: Literal["tokens", "cost"] = "cost"
    cooldown_s: float = 300.0
    soft_cooldown_s: float = 30.0
    llm_timeout_s: float = 120.0
    # A whole compaction (a long span is summarized in several calls): past it the request
    # goes on without it. The conversation's lock lives this long plus 30 s.
    compaction_timeout_s: float = 300.0
    detector_window_messages: int = 50
    # A topic's start shows in its messages' first lines; past them the detector's input is
    # paid uncached at every compaction (the bulk of its calls' cost on Claude's prices once
    # the summary reads the cache): 400, not 1,000 (docs/benchmarks.md, #25's tenth stop).
    detector_chars_per_message: int = 400
    key_references_max_chars: int = 600
    cost_horizon_requests: int = 20
    # The providers' prompt-cache time to live (DESIGN §11; docs: Anthropic 5 minutes,
    # OpenAI 5-10 minutes of inactivity): past it the cache is cold and a compaction breaks
    # nothing. Used by ``policy: cost`` and to price the counterfactual in the ledger.
    cache_ttl_anthropic_s: float = 300.0
    cache_ttl_openai_s: float = 600.0
    cache_ttl_other_s: float = 300.0
    # No treadmill: a compaction must leave the forwarded history at most this share of the
    # trigger (its cut is moved later when it would not, or it is not done), and two LLM
    # compactions of one conversation are this many requests apart at least, unless the
    # emergency bound or the context window forces one.
    compact_to_share: float = 0.5
    min_requests_between_compactions: int = 5
    tier_l1_requests: int = 1
    tier_l2_requests: int = 3
    tier_l3_requests: int = 10
    # Shadow mode: the share of conversations whose would-be compactions are really run
    # (their detector and summarizer calls cost money); the rest are only measured.
    shadow_sample_rate: float = 1.0
    # Opt-outs: requests of these tenants (the id the dashboard shows, or an
    # x-compaction-tenant name) or models (shell-style globs) are forwarded exactly as sent.
    opt_out_tenants: tuple[str, ...] = ()
    opt_out_models: tuple[str, ...] = ()
    # Prompt files; null: the packaged proxy/prompts/detector.md and summarizer.md.
    detector_prompt: str | None = None
    summarizer_prompt: str | None = None
    # Another OpenAI-compatible endpoint for the detector/summarizer calls (e.g. a second
    # llama.cpp server), with its own key; null: the upstream, with the client's key.
    summary_base_url: str | None = None
    summary_api_key: str | None = None
    # The summarizer call in the client's own shape, reading the conversation's prompt cache
    # (``proxy.core.sharedcall``): "auto" when it costs less than the standalone call at the
    # model's prices (on Anthropic's, nearly always), "on" whenever the request allows it,
    # "off" never. Only where the calls go to the upstream with the request's model.
    summary_reads_cache: Literal["auto", "on", "off"] = "auto"
    # Pinned content (DESIGN §10): never summarized or pruned, forwarded in place.
    pin_first_user: bool = True
    pin_patterns: tuple[str, ...] = ()
    pin_max_share: float = 0.25
    # The pruning tier: old tool results become placeholders before any LLM call.
    prune: bool = True
    prune_keep_tool_results: int = 3
    prune_protect_tokens: int = 4_000
    prune_clear_at_least: int = 4_000
    prune_exclude_tools: tuple[str, ...] = ()
    # The loop breaker (#26): after a compaction, this many repeated tool calls whose results
    # it cleared make the proxy keep those results out of pruning (0: never).
    loop_breaker_repeats: int = 3

    @property
    def emergency_tokens(self) -> int:
        """factor x trigger (``emergency_factor``, 2.0 when null); see ``planner.hard_limit``."""
        factor = self.emergency_factor
        if factor is None:
            factor = DEFAULT_EMERGENCY_FACTOR
        return int(self.trigger_tokens * factor)

    @property
    def bound_is_window(self) -> bool:
        """Whether the hard limit is the model's context window alone (when it is known)."""
        return self.emergency_factor is None and self.policy == "cost"
