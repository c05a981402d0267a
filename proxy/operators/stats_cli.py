"""``compaction-proxy stats``: the totals and the top conversations, as a terminal table.

It reads the same store the proxy writes (a diskcache folder can be read while the proxy
runs, or after), through the same queries as the admin API, so the numbers match.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO
from urllib.parse import urlsplit, urlunsplit

from proxy.adapters.store import open_store
from proxy.config import Config
from proxy.core.errors import StoreError
from proxy.operators import queries, reindex
from proxy.operators.formatting import fmt_int, fmt_usd, fmt_usd_known
from proxy.operators.phantom import phantom


def _when(ts: Any) -> str:
    if not isinstance(ts, int | float):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(ts))


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def redact(url: str) -> str:
    """The store URL without any password (a redis:// URL may carry one)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> str:
    """Aligned columns; the columns in ``right`` (numbers) are right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        out = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def _rollout_lines(totals: dict[str, Any]) -> list[tuple[str, str]]:
    """Shadow-mode figures and requests passed as sent by opt-outs or client compactions."""
    lines = []
    shadow = totals.get("shadow")
    if isinstance(shadow, dict) and shadow.get("requests"):
        lines.append(("shadow requests", fmt_int(shadow["requests"])))
        lines.append(
            (
                "shadow: would save",
                f"{fmt_int(shadow.get('saved_tokens'))} tokens "
                f"({shadow.get('saved_pct', 0.0):.1f}%)",
            )
        )
        if "net_saved_usd" in shadow:
            lines.append(("shadow: would save net", fmt_usd(shadow["net_saved_usd"])))
    if totals.get("opted_out"):
        lines.append(("opted out (as sent)", fmt_int(totals["opted_out"])))
    if totals.get("client_compactions"):
        lines.append(("client compactions", fmt_int(totals["client_compactions"])))
    return lines


def _llm_spend(totals: dict[str, Any]) -> str:
    """What the compactions' own calls cost (in the net figure), and how much of their input
    the provider read from its cache (summaries asked in the client's shape, mostly)."""
    spend = f"{fmt_usd(totals.get('llm_usd', 0.0))}, {fmt_int(totals.get('llm_tokens'))} tokens"
    cached = totals.get("llm_cached_tokens")
    return f"{spend} ({fmt_int(cached)} read from the cache)" if cached else spend


def render(totals: dict[str, Any], conversations: Sequence[dict[str, Any]], source: str) -> str:
    """The report printed by ``compaction-proxy stats``."""
    known = (totals["requests"], totals.get("unpriced_requests"))
    summary = [
        # Net first (#25): what the bill shows, after cache misses, cache writes and the
        # detector/summarizer calls; the gross figure is the detail under it.
        ("net dollars saved", fmt_usd_known(totals["net_saved_usd"], *known)),
        ("gross (saved tokens x input price)", fmt_usd_known(totals["saved_usd"], *known)),
        ("requests", fmt_int(totals["requests"])),
        ("conversations", fmt_int(totals.get("conversations"))),
        ("original tokens", fmt_int(totals["original_tokens"])),
        ("forwarded tokens", fmt_int(totals["forwarded_tokens"])),
        ("tokens saved", f"{fmt_int(totals['saved_tokens'])} ({totals['saved_pct']:.1f}%)"),
        (
            "kept within the window",
            f"{fmt_int(totals.get('kept_within_window'))} requests, "
            f"{fmt_int(totals.get('kept_window_tokens'))} tokens (not counted as saved)",
        ),
        ("compactions", fmt_int(totals.get("compactions"))),
        ("detector/summarizer spend", _llm_spend(totals)),
        ("compaction failures", fmt_int(totals.get("compaction_failures"))),
        (
            "key facts kept / dropped",
            f"{fmt_int(totals.get('facts_kept'))} / {fmt_int(totals.get('facts_dropped'))}",
        ),
        ("cache-hit rate", f"{100 * totals['cache_hit_rate']:.1f}%"),
        ("upstream errors", fmt_int(totals["errors"])),
        *_rollout_lines(totals),
        ("cancelled by the client", fmt_int(totals.get("cancelled"))),
    ]
    label_width = max(len(k) for k, _ in summary)
    lines = [f"compaction-proxy stats ({source})", ""]
    lines += [f"  {k.ljust(label_width)}  {v}" for k, v in summary]
    lines.append("")
    warning = phantom(totals)
    if warning:
        lines += [f"Phantom savings: {warning}", ""]
    if not conversations:
        lines.append("No conversations recorded yet.")
        return "\n".join(lines)
    lines.append(f"Top {len(conversations)} conversations by tokens saved")
    headers = [
        "TENANT", "CONVERSATION", "MODEL", "REQS", "ORIGINAL", "FORWARDED", "SAVED", "SAVED%",
        "NET $", "GROSS $", "COMPACTIONS", "LAST SEEN (UTC)",
    ]  # fmt: skip
    rows = [
        [
            c["tenant"][:8],
            _clip(c["conversation"], 16),
            _clip(str(c.get("model") or "-"), 24),
            fmt_int(c["requests"]),
            fmt_int(c["original_tokens"]),
            fmt_int(c["forwarded_tokens"]),
            fmt_int(c["saved_tokens"]),
            f"{c['saved_pct']:.1f}%",
            fmt_usd_known(c["net_saved_usd"], c["requests"], c.get("unpriced_requests")),
            fmt_usd_known(c["saved_usd"], c["requests"], c.get("unpriced_requests")),
            fmt_int(c["compactions"]),
            _when(c.get("last_seen")),
        ]
        for c in conversations
    ]
    lines.append(table(headers, rows, right=set(range(3, 11))))
    return "\n".join(lines)


def print_stats(config: Config, top: int = 10, out: TextIO | None = None) -> int:
    """Print the report for the store in ``config``; 0 on success, 1 if the store is unusable."""
    out = out or sys.stdout
    try:
        store = open_store(config.store.url)
    except (StoreError, ValueError) as exc:
        print(f"compaction-proxy: cannot open the store: {exc}", file=sys.stderr)
        return 1
    try:
        reindex.ensure(store, config.retention_s)
        totals = queries.stats(store, hours=1)["totals"]
        listing = queries.list_conversations(
            store, sort="saved_tokens", order="desc", per_page=max(top, 1)
        )
    except StoreError as exc:
        print(f"compaction-proxy: cannot read the store: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
    items = listing["items"][: max(top, 0)]
    print(render(totals, items, redact(config.store.url)), file=out)
    return 0
