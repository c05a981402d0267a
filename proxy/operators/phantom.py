"""The phantom-savings check: compaction is on, yet nothing is saved net, and why.

A proxy that compacts nothing (every conversation under the trigger, opt-outs, a failing
summarizer, the cost policy refusing while the cache is warm) or whose compactions cost more
than they save (cache writes, detector and summarizer calls) should say so rather than show
a dashboard of zeros or small gross savings. Pure: reads the ledger's totals.
"""

from __future__ import annotations

import logging
from typing import Any

from proxy.operators.entry import HELD_REASONS
from proxy.operators.figures import derive

log = logging.getLogger("compaction_proxy.ledger")

MIN_REQUESTS = 20  # fewer requests than this are no window to judge
WARN_EVERY = 100  # requests between two phantom-savings log lines at most


def warn(totals: Any, added: int) -> None:
    """A log line each ``WARN_EVERY`` requests while compaction saves nothing net, naming
    why (counts and reasons only: never content). ``totals``: the ledger's raw totals just
    written, ``added`` requests ago the last time."""
    if not isinstance(totals, dict):
        return
    n = int(totals.get("requests") or 0)
    if n // WARN_EVERY == (n - added) // WARN_EVERY:
        return
    warning = phantom(derive(totals))
    if warning:
        log.warning("phantom savings", extra={"requests": n, "why": warning})


def phantom(totals: dict[str, Any], *, min_requests: int = MIN_REQUESTS) -> str | None:
    """A sentence when, over at least ``min_requests`` requests, compaction saved nothing
    net (or lost money), naming why, most frequent reason first; None otherwise. ``totals``:
    ``figures.derive``'s output."""
    requests = int(totals.get("requests") or 0)
    net = float(totals.get("net_saved_usd") or 0.0)
    saved = int(totals.get("saved_tokens") or 0)
    if requests < min_requests or (net > 0 and saved > 0):
        return None
    if net < 0:
        head = f"Compaction lost ${-net:.4f} net over {requests:,} requests"
    else:
        head = f"Compaction saved nothing net over {requests:,} requests"
    reasons: list[tuple[int, str]] = []
    held = totals.get("held")
    if isinstance(held, dict):
        for key, n in held.items():
            if isinstance(n, int) and n > 0:
                reasons.append((n, f"{HELD_REASONS.get(key, key)}: {n:,} requests"))
    failures = int(totals.get("compaction_failures") or 0)
    if failures:
        reasons.append((failures, f"the summarizer failing: {failures:,} failed compactions"))
    llm = float(totals.get("llm_usd") or 0.0)
    compactions = int(totals.get("compactions") or 0)
    if compactions and net <= 0:
        lost = int(totals.get("cache_tokens_lost") or 0)
        reasons.append(
            (
                requests + 1,  # the money itself comes first
                f"its {compactions:,} compactions cost more than they saved: ${llm:.4f} in "
                f"detector and summarizer calls and {lost:,} tokens no longer read from cache",
            )
        )
    kept = int(totals.get("kept_within_window") or 0)
    if kept:
        reasons.append((kept, f"{kept:,} requests kept within the context window (not savings)"))
    reasons.sort(key=lambda r: -r[0])
    why = "; ".join(text for _, text in reasons) or "no reason recorded"
    return f"{head}. Why: {why}."
