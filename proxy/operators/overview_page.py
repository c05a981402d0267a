"""The dashboard's overview: tiles, the rollout card, the hourly chart, the conversations table."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from proxy.core.fingerprint import conversation_label
from proxy.operators.charts import hourly_chart, legend
from proxy.operators.formatting import fmt_int, fmt_pct, fmt_usd, fmt_usd_known
from proxy.operators.html import (
    badge,
    conversation_url,
    esc,
    fmt_short_ts,
    fmt_ts,
    plural,
    render,
    short,
    tile,
)
from proxy.operators.phantom import phantom

PER_PAGE = 25
CHART_HOURS = 24


def overview_tiles(totals: dict[str, Any]) -> str:
    cancelled = totals.get("cancelled")
    return (
        usd_tile(totals, usd_note(totals))
        + tile(
            "saved-tokens", "Tokens saved", fmt_int(totals["saved_tokens"]),
            totals["saved_tokens"], f"of {fmt_int(totals['original_tokens'])} sent", accent=True,
        )
        + tile(
            "saved-pct", "Saved", fmt_pct(totals["saved_pct"]), totals["saved_pct"],
            f"{fmt_int(totals['forwarded_tokens'])} forwarded",
        )
        + tile(
            "compactions", "Compactions", fmt_int(totals.get("compactions")),
            totals.get("compactions", 0), f"{fmt_int(totals.get('compaction_failures'))} failed",
        )
        + tile(
            "cache-hit", "Cache-hit rate", fmt_pct(100 * totals["cache_hit_rate"]),
            totals["cache_hit_rate"], f"{fmt_int(totals['cached_tokens'])} cached tokens",
        )
        + tile(
            "requests", "Requests", fmt_int(totals["requests"]), totals["requests"],
            f"{plural(totals.get('conversations'), 'conversation')}, "
            f"{plural(totals['errors'], 'error')}"
            + (f", {fmt_int(cancelled)} cancelled" if cancelled else ""),
        )
    )  # fmt: skip


def rollout_card(totals: dict[str, Any]) -> str:
    """Shadow-mode figures and the requests that opt-outs or the clients' own compactions
    kept unchanged; nothing when there are none."""
    lines = []
    shadow = totals.get("shadow")
    if isinstance(shadow, dict) and shadow.get("requests"):
        net = shadow.get("net_saved_usd")
        net_text = (
            f", {fmt_usd(net)} net of predicted cache misses and summary calls"
            if net is not None
            else ""
        )
        lines.append(
            f"<p><b>Shadow mode</b>: {plural(shadow['requests'], 'request')} forwarded exactly "
            f"as sent; compaction would have saved {fmt_int(shadow.get('saved_tokens'))} tokens "
            f"({fmt_pct(shadow.get('saved_pct'))}){net_text}. The would-be compactions and "
            "their loss reports are listed on each conversation's page.</p>"
        )
    if totals.get("opted_out"):
        lines.append(
            f"<p>{plural(totals['opted_out'], 'request')} opted out (configured "
            "tenants or models, or paused conversations): forwarded as sent.</p>"
        )
    if totals.get("client_compactions"):
        lines.append(
            f"<p>{plural(totals['client_compactions'], 'client compaction')}: "
            "the client summarized its own history; passed through untouched.</p>"
        )
    return render("rollout", lines="".join(lines)) if lines else ""


def usd_tile(figures: dict[str, Any], note: str = "") -> str:
    """The headline: net dollars saved (after cache misses, cache writes and the detector and
    summarizer calls); "n/a" (not a green $0) when no request had a model with a known price.
    The gross figure is the detail under it (``usd_note``)."""
    text = fmt_usd_known(
        figures["net_saved_usd"], figures.get("requests"), figures.get("unpriced_requests")
    )
    if text == "n/a":
        note = "no price known for these models (LiteLLM's map)"
        return tile("saved-usd", "Net dollars saved", text, "n/a", note)
    unpriced = int(figures.get("unpriced_requests") or 0)
    if unpriced:
        note = f"{note}; {plural(unpriced, 'request')} without a known price left out"
    value = figures["net_saved_usd"]
    return tile("saved-usd", "Net dollars saved", text, value, note, accent=value > 0)


def usd_note(totals: dict[str, Any]) -> str:
    kept = int(totals.get("kept_within_window") or 0)
    note = (
        f"gross {fmt_usd(totals['saved_usd'])} at each model's input price, before cache "
        "misses, cache writes and compaction calls"
    )
    if kept:
        note += f"; {plural(kept, 'request')} kept within the context window (not savings)"
    return note


def phantom_card(totals: dict[str, Any]) -> str:
    """The phantom-savings warning (``phantom.phantom``), or nothing."""
    warning = phantom(totals)
    if not warning:
        return ""
    text = f"<p><b>Phantom savings</b>: {esc(warning)}</p>"
    return f'<section class="card" id="phantom">{text}</section>'


# (row key, header, sort key or None when the column does not sort)
_COLUMNS = [
    ("conversation", "Conversation", None),
    ("tenant", "Tenant", "tenant"),
    ("model", "Model", "model"),
    ("requests", "Requests", "requests"),
    ("messages", "Messages", "messages"),
    ("original_tokens", "Original tokens", "original_tokens"),
    ("forwarded_tokens", "Forwarded tokens", "forwarded_tokens"),
    ("saved_tokens", "Saved", "saved_tokens"),
    ("saved_pct", "Saved %", "saved_pct"),
    ("net_saved_usd", "Net $", "net_saved_usd"),
    ("saved_usd", "Gross $", "saved_usd"),
    ("compactions", "Compactions", "compactions"),
    ("last_case", "Last case", None),
    ("last_seen", "Last seen", "last_seen"),
]
_TEXT_COLUMNS = {"conversation", "tenant", "model", "last_case", "last_seen"}


def _query(params: dict[str, Any]) -> str:
    return "?" + urlencode({k: v for k, v in params.items() if v not in (None, "")})


def _head(listing: dict[str, Any], params: dict[str, Any]) -> str:
    head = []
    for key, label, sort_key in _COLUMNS:
        cls = "" if key in _TEXT_COLUMNS else "num"
        if sort_key is None:
            head.append(f'<th class="{cls}">{esc(label)}</th>')
            continue
        active = listing["sort"] == sort_key
        order = "asc" if active and listing["order"] == "desc" else "desc"
        arrow = (" ▼" if listing["order"] == "desc" else " ▲") if active else ""
        link = _query({**params, "sort": sort_key, "order": order, "page": None})
        cls = f"{cls} sorted" if active else cls
        head.append(f'<th class="{cls}"><a href="{esc(link)}">{esc(label)}{arrow}</a></th>')
    return "".join(head)


def _row(c: dict[str, Any]) -> str:
    return render(
        "conversation_row",
        url=esc(conversation_url(c["id"])),
        label=esc(short(conversation_label(c["conversation"]), 16)),
        tenant=esc(c["tenant"]),
        tenant_short=esc(short(c["tenant"], 8)),
        model=esc(c.get("model")),
        requests=fmt_int(c["requests"]),
        messages=fmt_int(c.get("messages")),
        original_tokens=fmt_int(c["original_tokens"]),
        forwarded_tokens=fmt_int(c["forwarded_tokens"]),
        saved_tokens=fmt_int(c["saved_tokens"]),
        saved_pct=fmt_pct(c["saved_pct"]),
        net_saved_usd=esc(
            fmt_usd_known(c["net_saved_usd"], c.get("requests"), c.get("unpriced_requests"))
        ),
        saved_usd=esc(fmt_usd_known(c["saved_usd"], c.get("requests"), c.get("unpriced_requests"))),
        compactions=fmt_int(c["compactions"]),
        case=badge(c.get("last_case")),
        last_seen=esc(fmt_ts(c.get("last_seen"))),
        last_seen_short=esc(fmt_short_ts(c.get("last_seen"))),
    )


def conversations_table(listing: dict[str, Any], params: dict[str, Any]) -> str:
    rows = [_row(c) for c in listing["items"]]
    if not rows:
        rows.append(
            f'<tr><td colspan="{len(_COLUMNS)}" class="empty">No conversations yet.</td></tr>'
        )
    page_no, pages = listing["page"], max(1, -(-listing["total"] // listing["per_page"]))
    pager = [
        f'<span class="mute">page {page_no} of {pages} · '
        f"{plural(listing['total'], 'conversation')}</span>"
    ]
    if page_no > 1:
        pager.append(f'<a href="{esc(_query({**params, "page": page_no - 1}))}">← newer</a>')
    if page_no < pages:
        pager.append(f'<a href="{esc(_query({**params, "page": page_no + 1}))}">older →</a>')
    return render(
        "conversations_table",
        head=_head(listing, params),
        rows="".join(rows),
        pager="".join(pager),
    )


def filters_form(listing: dict[str, Any], params: dict[str, Any]) -> str:
    def select(name: str, label: str, values: list[str], show: Any) -> str:
        options = [f'<option value="">all {esc(label)}</option>']
        for value in values:
            selected = " selected" if value == params.get(name) else ""
            options.append(f'<option value="{esc(value)}"{selected}>{esc(show(value))}</option>')
        return f'<select name="{name}" aria-label="{esc(label)}">{"".join(options)}</select>'

    return render(
        "filters",
        tenants=select("tenant", "tenants", listing["tenants"], lambda t: short(t, 12)),
        models=select("model", "models", listing["models"], lambda m: m),
        sort=esc(listing["sort"]),
        order=esc(listing["order"]),
    )


def overview_body(data: dict[str, Any], listing: dict[str, Any], params: dict[str, Any]) -> str:
    totals = data["totals"]
    return render(
        "overview",
        tiles=overview_tiles(totals),
        rollout=phantom_card(totals) + rollout_card(totals),
        hours=CHART_HOURS,
        legend=legend(),
        chart=hourly_chart(data["hourly"]),
        filters=filters_form(listing, params),
        table=conversations_table(listing, params),
    )
