"""A row's derived figures, as every operators' view shows them: % saved (of the original
tokens), cache-hit rate, and dollars saved net of cache misses and compaction calls."""

from __future__ import annotations

from typing import Any


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def derive(totals: dict[str, Any]) -> dict[str, Any]:
    """Percentages from the raw sums: % saved (of original tokens) and cache-hit rate."""
    out = dict(totals)
    for key in (
        "requests", "original_tokens", "forwarded_tokens", "saved_tokens", "prompt_tokens",
        "cached_tokens", "cache_write_tokens", "completion_tokens", "errors", "cancelled",
        "unpriced_requests",
    ):  # fmt: skip
        out.setdefault(key, 0)
    out.setdefault("saved_usd", 0.0)
    out["saved_pct"] = round(100 * _ratio(out["saved_tokens"], out["original_tokens"]), 2)
    out["cache_hit_rate"] = round(_ratio(out["cached_tokens"], out["prompt_tokens"]), 4)
    # Net of cache misses, cache writes and detector/summarizer calls (ledger.net_usd): the
    # headline everywhere; ``saved_usd`` (saved tokens x input price) is the gross detail.
    out["net_saved_usd"] = (
        out.get("counterfactual_usd", 0.0) - out.get("actual_usd", 0.0) - out.get("llm_usd", 0.0)
    )
    out.setdefault("kept_within_window", 0)
    out.setdefault("kept_window_tokens", 0)
    shadow = out.get("shadow")
    if isinstance(shadow, dict):
        # Shadow mode: what compaction would have saved; its detector/summarizer calls were
        # really made, so they are charged against it.
        shadow = {k: v for k, v in shadow.items() if not k.startswith("last_")}
        shadow.setdefault("saved_tokens", 0)
        shadow["saved_pct"] = round(
            100 * _ratio(shadow["saved_tokens"], shadow.get("original_tokens", 0)), 2
        )
        if "counterfactual_usd" in shadow:
            shadow["net_saved_usd"] = (
                shadow["counterfactual_usd"]
                - shadow.get("actual_usd", 0.0)
                - out.get("llm_usd", 0.0)
            )
        out["shadow"] = shadow
    return out
