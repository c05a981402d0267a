"""The ledger's money figures on ``/metrics``, net first (#25).

Net dollars need each conversation's previous request (its cached prefix, its idle time),
which only the ledger has; they are read from the store at each scrape, so they are the same
whichever worker answers, without prometheus-client's multiprocess mode.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.operators.metrics import PREFIX


def ledger_exposition(totals: Mapping[str, Any], phantom: bool) -> bytes:
    """The ledger's totals (``figures.derive``'s) as Prometheus gauges, net first."""
    figures = (
        ("net_saved_usd", "Dollars saved net of cache misses, cache writes and detector/"
         "summarizer calls, against what the clients sent priced with their own cache.",
         totals.get("net_saved_usd", 0.0)),
        ("counterfactual_usd", "Input dollars of what the clients sent, as billed.",
         totals.get("counterfactual_usd", 0.0)),
        ("forwarded_usd", "Input dollars of what was forwarded, as billed.",
         totals.get("actual_usd", 0.0)),
        ("compaction_llm_usd", "Dollars spent on detector and summarizer calls.",
         totals.get("llm_usd", 0.0)),
        ("compaction_llm_cached_tokens", "Prompt tokens of the detector and summarizer calls "
         "that the provider read from its prompt cache (most of a summary asked in the "
         "client's shape: the conversation's own cache).",
         totals.get("llm_cached_tokens", 0)),
        ("kept_within_window_requests", "Requests longer than the model's context window as "
         "sent: what compaction took off them is not counted as saved.",
         totals.get("kept_within_window", 0)),
        ("phantom_savings", "1 when compaction is on but saved nothing net over the recorded "
         "requests (the dashboard and compaction-proxy stats say why).", int(phantom)),
    )  # fmt: skip
    lines = []
    for name, help_text, value in figures:
        full = f"{PREFIX}_{name}"
        lines += [f"# HELP {full} {help_text}", f"# TYPE {full} gauge", f"{full} {float(value)!r}"]
    return ("\n".join(lines) + "\n").encode()
