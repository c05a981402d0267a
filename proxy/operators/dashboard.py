"""``/dashboard``: the operators' page, server-rendered by the proxy (DESIGN §8).

Plain HTML with its CSS and one small script (auto-refresh) inlined from ``proxy/static/``:
no CDN, nothing fetched from elsewhere, so it works offline. Every value that came from a
client (messages, model names, conversation ids) is HTML-escaped, and a strict
Content-Security-Policy allows only the page's own nonce-tagged script.

Pages: the overview (tiles, original vs forwarded tokens per hour, the conversations table)
and a conversation (its requests, its compaction timeline with each summary and loss report,
and the original and forwarded histories side by side). With ``admin.token`` set, both need
the token: a login form sets an HttpOnly cookie, or send ``Authorization: Bearer``.
"""

from __future__ import annotations

import asyncio
import html
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from proxy.core.errors import NotFound
from proxy.core.fingerprint import conversation_label
from proxy.core.messages import SUMMARY_PREFIX, text_of
from proxy.operators import admin
from proxy.operators.formatting import fmt_int, fmt_pct, fmt_usd, fmt_usd_known

_STATIC = Path(__file__).parent / "static"
CSS = (_STATIC / "dashboard.css").read_text()
JS = (_STATIC / "dashboard.js").read_text()
REFRESH_MS = 10_000
PER_PAGE = 25
CHART_HOURS = 24
MESSAGE_PREVIEW_CHARS = 1200
VERBATIM_PREVIEW_CHARS = 160
COOKIE_MAX_AGE = 7 * 86400


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def fmt_ts(ts: Any) -> str:
    if not isinstance(ts, int | float):
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def fmt_short_ts(ts: Any) -> str:
    return time.strftime("%m-%d %H:%M", time.gmtime(ts)) if isinstance(ts, int | float) else ""


def plural(n: Any, word: str) -> str:
    return f"{fmt_int(n)} {word}{'' if n == 1 else 's'}"


def short(value: str, n: int = 10) -> str:
    return value if len(value) <= n else value[:n] + "…"


def badge(case: Any) -> str:
    return f'<span class="badge {esc(case)}">{esc(case)}</span>'


def conversation_url(conv_id: str) -> str:
    return "/dashboard/conversations/" + quote(conv_id, safe=":")


# ---- page frame --------------------------------------------------------------------------


def refresh_ms(request: Request) -> int:
    """Auto-refresh period: ``?refresh=SECONDS`` (1 to 3600), else every 10 s."""
    try:
        seconds = float(request.query_params.get("refresh") or REFRESH_MS / 1000)
    except ValueError:
        seconds = REFRESH_MS / 1000
    return int(min(max(seconds, 1.0), 3600.0) * 1000)


def page(
    title: str, body: str, *, logout: bool, status: int = 200, refresh: int = REFRESH_MS
) -> HTMLResponse:
    """A complete page; its only script is the inlined auto-refresh, tagged with a nonce."""
    nonce = secrets.token_urlsafe(16)
    tools = ""
    if logout:
        tools = (
            '<form method="post" action="/dashboard/logout">'
            '<button type="submit">Log out</button></form>'
        )
    doc = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{esc(title)} · compaction-proxy</title>
<style>{CSS}</style></head>
<body data-refresh-ms="{refresh}">
<header><a class="brand" href="/dashboard">compaction-proxy</a>
<nav><a href="/dashboard">Overview</a><a href="/admin/api/stats">JSON API</a>
<a href="/metrics">/metrics</a></nav>
<div class="tools"><span id="updated">updated {time.strftime("%H:%M:%S UTC", time.gmtime())}</span>
<label><input type="checkbox" id="auto-refresh" checked> auto-refresh</label>{tools}</div>
</header>
<main>{body}</main>
<script nonce="{nonce}">{JS}</script>
</body></html>"""
    csp = (
        "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; "
        f"script-src 'nonce-{nonce}'; connect-src 'self'; form-action 'self'; "
        "base-uri 'none'; frame-ancestors 'none'"
    )
    headers = {
        "content-security-policy": csp,
        "cache-control": "no-store",
        "x-content-type-options": "nosniff",
        "referrer-policy": "no-referrer",
    }
    return HTMLResponse(doc, status_code=status, headers=headers)


def tile(key: str, label: str, value: str, raw: Any, sub: str = "", accent: bool = False) -> str:
    cls = "tile accent" if accent else "tile"
    return (
        f'<div class="{cls}" id="tile-{key}" data-value="{esc(raw)}">'
        f'<div class="label">{esc(label)}</div><div class="value">{esc(value)}</div>'
        f'<div class="sub">{esc(sub)}</div></div>'
    )


# ---- charts (inline SVG) -----------------------------------------------------------------

_W, _H, _PAD_L, _PAD_B, _PAD_T = 1000, 210, 56, 22, 10


def _axis(top: float) -> str:
    out = []
    for frac in (0.0, 0.5, 1.0):
        y = _PAD_T + (_H - _PAD_T - _PAD_B) * (1 - frac)
        out.append(
            f'<line class="grid" x1="{_PAD_L}" x2="{_W}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text x="{_PAD_L - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt_int(top * frac)}</text>'
        )
    return "".join(out)


def hourly_chart(series: Sequence[dict[str, Any]]) -> str:
    """Original (grey) and forwarded (blue, in front) prompt tokens per hour, as bars."""
    top = max([float(h.get("original_tokens") or 0) for h in series] + [1.0])
    inner_h = _H - _PAD_T - _PAD_B
    step = (_W - _PAD_L) / max(len(series), 1)
    bars = []
    for i, hour in enumerate(series):
        x = _PAD_L + i * step + step * 0.15
        w = step * 0.7
        for cls, key in (("orig", "original_tokens"), ("fwd", "forwarded_tokens")):
            value = float(hour.get(key) or 0)
            h = inner_h * value / top
            bars.append(
                f'<rect class="{cls}" x="{x:.1f}" y="{_PAD_T + inner_h - h:.1f}" '
                f'width="{w:.1f}" height="{h:.1f}"><title>{esc(hour.get("hour"))}: '
                f"{esc(key.replace('_', ' '))} {fmt_int(value)}</title></rect>"
            )
        if i % 6 == 0 or i == len(series) - 1:
            label = time.strftime("%H:00", time.gmtime(hour.get("ts", 0)))
            bars.append(
                f'<text x="{x + w / 2:.1f}" y="{_H - 6}" text-anchor="middle">{label}</text>'
            )
    return (
        f'<svg class="chart" viewBox="0 0 {_W} {_H}" role="img" '
        f'aria-label="original vs forwarded tokens per hour">{_axis(top)}{"".join(bars)}</svg>'
    )


def request_chart(requests: Sequence[dict[str, Any]]) -> str:
    """Original and forwarded prompt tokens of each request, in order; dots mark compactions
    taking effect (forwarded dropping while original keeps growing)."""
    if not requests:
        return '<p class="empty">No requests recorded.</p>'
    top = max([float(r.get("original_tokens") or 0) for r in requests] + [1.0])
    inner_h = _H - _PAD_T - _PAD_B
    n = len(requests)
    step = (_W - _PAD_L - 10) / max(n - 1, 1)

    def point(i: int, key: str) -> tuple[float, float]:
        value = float(requests[i].get(key) or 0)
        return _PAD_L + i * step, _PAD_T + inner_h * (1 - value / top)

    lines = []
    for cls, key in (("line-orig", "original_tokens"), ("line-fwd", "forwarded_tokens")):
        pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in (point(i, key) for i in range(n)))
        lines.append(f'<polyline class="{cls}" points="{pts}"/>')
    for i in range(1, n):
        prev, cur = requests[i - 1], requests[i]
        if (cur.get("forwarded_tokens") or 0) < (prev.get("forwarded_tokens") or 0):
            x, y = point(i, "forwarded_tokens")
            lines.append(
                f'<circle class="dot" cx="{x:.1f}" cy="{y:.1f}" r="5">'
                f"<title>request {i + 1}: compaction in effect</title></circle>"
            )
    for i in range(0, n, max(1, n // 10)):
        x, _ = point(i, "original_tokens")
        lines.append(f'<text x="{x:.1f}" y="{_H - 6}" text-anchor="middle">#{i + 1}</text>')
    return (
        f'<svg class="chart" viewBox="0 0 {_W} {_H}" role="img" '
        f'aria-label="tokens per request">{_axis(top)}{"".join(lines)}</svg>'
    )


def legend() -> str:
    return (
        '<div class="legend"><span><span class="swatch orig"></span>original (sent by the client)'
        '</span><span><span class="swatch fwd"></span>forwarded (sent upstream)</span></div>'
    )


# ---- overview ----------------------------------------------------------------------------


def overview_tiles(totals: dict[str, Any]) -> str:
    return (
        '<div class="tiles" id="tiles" data-refresh>'
        + tile(
            "saved-tokens", "Tokens saved", fmt_int(totals["saved_tokens"]),
            totals["saved_tokens"], f"of {fmt_int(totals['original_tokens'])} sent", accent=True,
        )
        + tile(
            "saved-pct", "Saved", fmt_pct(totals["saved_pct"]), totals["saved_pct"],
            f"{fmt_int(totals['forwarded_tokens'])} forwarded",
        )
        + usd_tile(totals, usd_note(totals))
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
            + (f", {fmt_int(totals['cancelled'])} cancelled" if totals.get("cancelled") else ""),
        )
        + "</div>"
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
            if (net is not None)
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
    if not lines:
        return ""
    return (
        '<section class="card" id="rollout" data-refresh><h2>Rollout</h2>'
        + "".join(lines)
        + "</section>"
    )


def usd_tile(figures: dict[str, Any], note: str = "") -> str:
    """Dollars saved; "n/a" (not a green $0) when no request had a model with a known price."""
    text = fmt_usd_known(
        figures["saved_usd"], figures.get("requests"), figures.get("unpriced_requests")
    )
    if text == "n/a":
        note = "no price known for these models (LiteLLM's map)"
        return tile("saved-usd", "Dollars saved", text, "n/a", note)
    unpriced = int(figures.get("unpriced_requests") or 0)
    if unpriced:
        note = f"{note}; {plural(unpriced, 'request')} without a known price left out"
    return tile("saved-usd", "Dollars saved", text, figures["saved_usd"], note, accent=True)


def usd_note(totals: dict[str, Any]) -> str:
    if "net_saved_usd" in totals:
        return f"{fmt_usd(totals['net_saved_usd'])} net of cache misses and compaction calls"
    return "at each model's input price"


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
    ("saved_usd", "$ saved", "saved_usd"),
    ("compactions", "Compactions", "compactions"),
    ("last_case", "Last case", None),
    ("last_seen", "Last seen", "last_seen"),
]
_TEXT_COLUMNS = {"conversation", "tenant", "model", "last_case", "last_seen"}


def usd_cell(row: dict[str, Any]) -> str:
    return esc(fmt_usd_known(row["saved_usd"], row.get("requests"), row.get("unpriced_requests")))


def _query(params: dict[str, Any]) -> str:
    return "?" + urlencode({k: v for k, v in params.items() if v not in (None, "")})


def conversations_table(listing: dict[str, Any], params: dict[str, Any]) -> str:
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
    rows = []
    for c in listing["items"]:
        url = conversation_url(c["id"])
        rows.append(
            "<tr>"
            f'<td><a class="mono conv-link" href="{esc(url)}">'
            f"{esc(short(conversation_label(c['conversation']), 16))}</a></td>"
            f'<td class="mono" title="{esc(c["tenant"])}">{esc(short(c["tenant"], 8))}</td>'
            f'<td class="model" title="{esc(c.get("model"))}">{esc(c.get("model"))}</td>'
            f'<td class="num">{fmt_int(c["requests"])}</td>'
            f'<td class="num">{fmt_int(c.get("messages"))}</td>'
            f'<td class="num">{fmt_int(c["original_tokens"])}</td>'
            f'<td class="num">{fmt_int(c["forwarded_tokens"])}</td>'
            f'<td class="num">{fmt_int(c["saved_tokens"])}</td>'
            f'<td class="num">{fmt_pct(c["saved_pct"])}</td>'
            f'<td class="num">{usd_cell(c)}</td>'
            f'<td class="num">{fmt_int(c["compactions"])}</td>'
            f"<td>{badge(c.get('last_case'))}</td>"
            f'<td class="mute" title="{esc(fmt_ts(c.get("last_seen")))}">'
            f"{esc(fmt_short_ts(c.get('last_seen')))}</td>"
            "</tr>"
        )
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
    return (
        f'<div class="scroll"><table id="conversations"><thead><tr>{"".join(head)}</tr></thead>'
        f'<tbody>{"".join(rows)}</tbody></table></div><div class="pager">{"".join(pager)}</div>'
    )


def filters_form(listing: dict[str, Any], params: dict[str, Any]) -> str:
    def select(name: str, label: str, values: list[str], show: Any) -> str:
        options = [f'<option value="">all {esc(label)}</option>']
        for value in values:
            selected = " selected" if value == params.get(name) else ""
            options.append(f'<option value="{esc(value)}"{selected}>{esc(show(value))}</option>')
        return f'<select name="{name}" aria-label="{esc(label)}">{"".join(options)}</select>'

    return (
        '<form class="filters" method="get" action="/dashboard">'
        + select("tenant", "tenants", listing["tenants"], lambda t: short(t, 12))
        + select("model", "models", listing["models"], lambda m: m)
        + f'<input type="hidden" name="sort" value="{esc(listing["sort"])}">'
        + f'<input type="hidden" name="order" value="{esc(listing["order"])}">'
        + '<button type="submit">Filter</button></form>'
    )


def overview_body(data: dict[str, Any], listing: dict[str, Any], params: dict[str, Any]) -> str:
    totals = data["totals"]
    return (
        "<h1>Tokens and money saved</h1>"
        + overview_tiles(totals)
        + rollout_card(totals)
        + '<section class="card" id="hourly" data-refresh><div class="card-head">'
        + f"<h2>Original vs forwarded prompt tokens, last {CHART_HOURS} hours (UTC)</h2>"
        + legend()
        + "</div>"
        + hourly_chart(data["hourly"])
        + "</section>"
        + '<section class="card"><div class="card-head"><h2>Conversations</h2>'
        + filters_form(listing, params)
        + '</div><div id="table" data-refresh>'
        + conversations_table(listing, params)
        + "</div></section>"
    )


# ---- a conversation ----------------------------------------------------------------------


def facts(
    kept: Sequence[str],
    appended: Sequence[str],
    dropped: Sequence[str],
    elsewhere: Sequence[str] = (),
) -> str:
    """The loss report: where the key facts of the replaced span are in what is forwarded."""

    def group(cls: str, label: str, items: Sequence[str]) -> str:
        if not items:
            return ""
        chips = "".join(f'<span class="fact {cls}">{esc(f)}</span>' for f in items)
        return f'<div class="facts {cls}">{esc(label)}: {chips}</div>'

    line = (
        '<div class="facts-line"><b>Loss report</b> <span class="mute">key facts of the replaced '
        f"span: {len(kept)} kept by the summary, {len(appended)} added as key references, "
        f"{len(elsewhere)} still in the forwarded messages, {len(dropped)} dropped</span></div>"
    )
    nothing = '<div class="mute">Nothing dropped.</div>' if not dropped else ""
    return (
        line
        + group("kept", "Kept", kept)
        + group("appended", "Added as key references", appended)
        + group("elsewhere", "Still in the forwarded messages", elsewhere)
        + group("dropped", "Dropped", dropped)
        + nothing
    )


def agent_lists(c: dict[str, Any]) -> str:
    """What pruning cleared, what stayed pinned, what was too large to pin (agent sessions)."""
    out = []
    for key, label in (
        ("pruned", "tool results cleared"),
        ("pinned", "pinned, forwarded in place"),
        ("unpinned", "too large to pin, handled as content"),
    ):
        values = c.get(key) or []
        if values:
            shown = "".join(f"<li>{esc(v)}</li>" for v in values[:50])
            extra = len(values) - 50
            more = f'<li class="mute">… and {extra} more</li>' if extra > 0 else ""
            out.append(
                f'<details class="agent-{key}"><summary>{len(values)} {esc(label)}</summary>'
                f"<ul>{shown}{more}</ul></details>"
            )
    return "".join(out)


def timeline(compactions: Sequence[dict[str, Any]], failures: Sequence[dict[str, Any]]) -> str:
    items = []
    for i, c in enumerate(compactions, 1):
        before, after = int(c.get("tokens_before") or 0), int(c.get("tokens_after") or 0)
        cut = 100 * (before - after) / before if before else 0.0
        summary = c.get("summary")
        summary_html = (
            f'<pre class="summary">{esc(summary)}</pre>'
            if summary
            else '<p class="mute">No summary kept (the old topic was dropped without a note, '
            "or the record has expired).</p>"
        )
        confidence = c.get("confidence")
        items.append(
            f'<li class="compaction" id="compaction-{i}"><div><b>#{i}</b> '
            f"{badge(c.get('case'))} "
            f'<span class="mute">{esc(fmt_ts(c.get("ts")))}</span></div>'
            '<div class="kv">'
            f"<span>tokens <b>{fmt_int(before)} → {fmt_int(after)}</b> (−{cut:.0f}%)</span>"
            f"<span>replaced <b>{fmt_int(c.get('covered'))}</b> messages</span>"
            f"<span>boundary <b>{esc(c.get('boundary_reason') or '—')}</b></span>"
            f"<span>confidence <b>{float(confidence or 0):.2f}</b></span>"
            f"<span>took <b>{float(c.get('duration_s') or 0):.2f} s</b></span>"
            f"<span>LLM tokens <b>{fmt_int(c.get('llm_tokens'))}</b></span></div>"
            + summary_html
            + facts(
                c["facts_kept"],
                c["facts_appended"],
                c["facts_dropped"],
                c.get("facts_elsewhere") or (),
            )
            + agent_lists(c)
            + "</li>"
        )
    for f in failures:
        items.append(
            f'<li class="failure">{badge(f.get("case"))} '
            f'<span class="mute">{esc(fmt_ts(f.get("ts")))}</span> '
            + (' <span class="mute">(soft: short cooldown)</span>' if f.get("soft") else "")
            + f' <span class="error-text">{esc(f.get("error"))}</span></li>'
        )
    if not items:
        return '<p class="empty">No compactions yet.</p>'
    return f'<ol class="timeline">{"".join(items)}</ol>'


def requests_table(requests: Sequence[dict[str, Any]]) -> str:
    rows = []
    for i, r in enumerate(requests, 1):
        rows.append(
            f'<tr><td class="num">{i}</td><td class="mute">{esc(fmt_ts(r.get("ts")))}</td>'
            f"<td>{badge(r.get('case'))}</td>"
            f'<td class="num">{esc(r.get("status"))}</td>'
            f'<td class="num">{fmt_int(r.get("original_messages"))}</td>'
            f'<td class="num">{fmt_int(r.get("original_tokens"))}</td>'
            f'<td class="num">{fmt_int(r.get("forwarded_messages"))}</td>'
            f'<td class="num">{fmt_int(r.get("forwarded_tokens"))}</td>'
            f'<td class="num">{fmt_int(r.get("saved_tokens"))}</td>'
            f'<td class="num">{fmt_int(r.get("cached_tokens"))}</td>'
            f'<td class="num">{1000 * float(r.get("latency_s") or 0):.0f} ms</td>'
            f'<td class="num">{1000 * float(r.get("overhead_s") or 0):.1f} ms</td></tr>'
        )
    head = (
        '<tr><th class="num">#</th><th>Time</th><th>Case</th><th class="num">Status</th>'
        '<th class="num">Orig. msgs</th><th class="num">Orig. tokens</th>'
        '<th class="num">Fwd. msgs</th><th class="num">Fwd. tokens</th><th class="num">Saved</th>'
        '<th class="num">Cached</th><th class="num">Latency</th><th class="num">Overhead</th></tr>'
    )
    return (
        f'<div class="scroll"><table id="requests"><thead>{head}</thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div>"
    )


def message_html(message: dict[str, Any], tokens: int, *, verbatim: bool = False) -> str:
    """One message card; ``verbatim`` (the forwarded copy of an unchanged message) is short."""
    role = str(message.get("role") or "?")
    text = text_of(message)
    calls = []
    for call in message.get("tool_calls") or []:
        if isinstance(call, dict):
            fn = call.get("function") or {}
            calls.append(f"→ {fn.get('name', '?')}({fn.get('arguments', '')})")
    if message.get("tool_call_id"):
        role = f"{role} · {message['tool_call_id']}"
    body = "\n".join([text, *calls]).strip() or "(empty)"
    content = message.get("content")
    is_summary = isinstance(content, str) and content.startswith(SUMMARY_PREFIX)
    cls = f"msg role-{esc(str(message.get('role')))}" + (" is-summary" if is_summary else "")
    preview = VERBATIM_PREVIEW_CHARS if verbatim else MESSAGE_PREVIEW_CHARS
    if verbatim:
        cls += " verbatim"
        role += " · unchanged"
    if len(body) > preview:
        shown = (
            f'<div class="body">{esc(body[:preview])}…</div><details>'
            f"<summary>show all {len(body):,} characters</summary>"
            f'<div class="body">{esc(body)}</div></details>'
        )
    else:
        shown = f'<div class="body">{esc(body)}</div>'
    label = "summary" if is_summary else role
    return (
        f'<div class="{cls}"><div class="head"><span>{esc(label)}</span>'
        f"<span>{fmt_int(tokens)} tokens</span></div>{shown}</div>"
    )


def histories_html(hist: dict[str, Any]) -> str:
    """Original and forwarded side by side, aligned: the head, then the replaced span opposite
    the summary that replaces it, then the verbatim tail."""
    original, forwarded, record = hist["original"], hist["forwarded"], hist.get("record")
    om, ot = original["messages"], original["tokens"]
    fm, ft = forwarded["messages"], forwarded["tokens"]
    head_len = record["head_len"] if record else 0
    k = record["k"] if record else 0
    body_start = head_len + (1 if record and record["has_summary"] else 0)
    if record and isinstance(record.get("body_start"), int):
        body_start = record["body_start"]
    rows = []

    def pair(left: str, right: str, cls: str = "pair") -> None:
        rows.append(
            f'<div class="{cls}"><div class="side-orig">{left}</div>'
            f'<div class="side-fwd">{right}</div></div>'
        )

    def title(name: str, side: dict[str, Any], note: str) -> str:
        return (
            f'<h2>{esc(name)} <span class="mute">· {plural(side["count"], "message")} · '
            f'{fmt_int(side["total_tokens"])} tokens</span></h2><p class="mute">{esc(note)}</p>'
        )

    note = (
        f"With compaction k={record['k']} ({record['case']}) applied: what the proxy forwards "
        "for this history now."
        if record
        else "No compaction applies to this history yet: it is forwarded as sent."
    )
    pair(
        title("Original", original, "The full history the client last sent."),
        title("Forwarded", forwarded, note),
        "pair titles",
    )
    for i in range(min(head_len, len(om))):
        pair(message_html(om[i], ot[i]), message_html(fm[i], ft[i], verbatim=True))
    if record:
        replaced = "".join(message_html(om[i], ot[i]) for i in range(head_len, k))
        left = (
            f'<details class="replaced"><summary>{plural(k - head_len, "message")} · '
            f"{fmt_int(sum(ot[head_len:k]))} tokens replaced by the summary (show)</summary>"
            f"{replaced}</details>"
        )
        # Pins kept in place, the summary or note, pruned placeholders: what replaces the span.
        right = "".join(message_html(fm[j], ft[j]) for j in range(head_len, body_start))
        right = right or '<p class="mute">Dropped without a note.</p>'
        pair(left, right, "pair replaced-span")
    for offset, i in enumerate(range(k if record else head_len, len(om))):
        j = body_start + offset
        right = message_html(fm[j], ft[j], verbatim=True) if j < len(fm) else ""
        pair(message_html(om[i], ot[i]), right)
    if not om:
        pair('<p class="empty">Not recorded.</p>', "")
    return "".join(rows)


def conversation_body(detail: dict[str, Any], hist: dict[str, Any]) -> str:
    meta = detail["meta"]
    tiles = (
        '<div class="tiles" id="conv-tiles" data-refresh>'
        + tile("requests", "Requests", fmt_int(meta["requests"]), meta["requests"])
        + tile(
            "saved-tokens", "Tokens saved", fmt_int(meta["saved_tokens"]), meta["saved_tokens"],
            f"of {fmt_int(meta['original_tokens'])} sent", accent=True,
        )
        + tile("saved-pct", "Saved", fmt_pct(meta["saved_pct"]), meta["saved_pct"])
        + usd_tile(meta)
        + tile("compactions", "Compactions", fmt_int(meta["compactions"]), meta["compactions"],
               f"{fmt_int(meta['failures'])} failed")
        + tile("cache-hit", "Cache-hit rate", fmt_pct(100 * meta["cache_hit_rate"]),
               meta["cache_hit_rate"])
        + "</div>"
    )  # fmt: skip
    return (
        f'<p class="mute"><a href="/dashboard">Overview</a> / conversation</p>'
        f'<h1 class="mono">{esc(conversation_label(detail["conversation"]))}</h1>'
        f'<div class="kv"><span>tenant <b class="mono">{esc(detail["tenant"])}</b></span>'
        f"<span>model <b>{esc(meta.get('model'))}</b></span>"
        f"<span>first seen <b>{esc(fmt_ts(meta.get('first_seen')))}</b></span>"
        f"<span>last seen <b>{esc(fmt_ts(meta.get('last_seen')))}</b></span>"
        + (
            "<span><b>compaction paused</b> (requests pass as sent)</span>"
            if meta.get("paused")
            else ""
        )
        + f'<span><a href="/admin/api/conversations/{esc(quote(detail["id"], safe=":"))}">'
        "JSON</a></span></div>"
        + tiles
        + '<section class="card" id="per-request" data-refresh><div class="card-head">'
        + "<h2>Prompt tokens per request</h2>"
        + legend()
        + "</div>"
        + request_chart(detail["requests"])
        + "</section>"
        + '<section class="card" id="timeline" data-refresh><h2>Compaction timeline</h2>'
        + timeline(detail["compactions"], detail["failures"])
        + "</section>"
        + '<section class="card" id="requests-card" data-refresh><h2>Requests</h2>'
        + requests_table(detail["requests"])
        + "</section>"
        + '<section class="card" id="histories"><h2>Histories side by side</h2>'
        + histories_html(hist)
        + "</section>"
    )


# ---- login -------------------------------------------------------------------------------


def _safe_next(target: str | None) -> str:
    if target and target.startswith("/dashboard") and not target.startswith("//"):
        return target
    return "/dashboard"


def login_page(next_url: str, error: str = "", status: int = 401) -> HTMLResponse:
    message = f'<p class="error-text">{esc(error)}</p>' if error else ""
    body = (
        '<div class="card login"><h1>Admin login</h1>'
        '<p class="mute">This dashboard needs the proxy\'s admin token '
        "(<code>admin.token</code> in its config).</p>"
        + message
        + '<form method="post" action="/dashboard/login">'
        f'<input type="hidden" name="next" value="{esc(_safe_next(next_url))}">'
        '<label for="token">Admin token</label>'
        '<input type="password" id="token" name="token" autocomplete="current-password" autofocus>'
        '<button type="submit">Log in</button></form></div>'
    )
    return page("Login", body, logout=False, status=status)


def _gate(request: Request) -> HTMLResponse | None:
    """None when the request may see the dashboard; else the login page (401)."""
    token = request.app.state.res.config.admin.token
    if admin.is_authorized(request, token):
        return None
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return login_page(target)


async def login_form(request: Request) -> Response:
    if not request.app.state.res.config.admin.token:
        return RedirectResponse("/dashboard", status_code=303)
    return login_page(request.query_params.get("next") or "/dashboard", status=200)


async def login_submit(request: Request) -> Response:
    token = request.app.state.res.config.admin.token
    raw = await request.body()
    fields = parse_qs(raw[:8192].decode("utf-8", "replace"))
    next_url = _safe_next((fields.get("next") or [""])[0])
    if not token:
        return RedirectResponse(next_url, status_code=303)
    given = (fields.get("token") or [""])[0]
    if not secrets.compare_digest(given.encode(), token.encode()):
        return login_page(next_url, "That is not the admin token.")
    response = RedirectResponse(next_url, status_code=303)
    response.set_cookie(
        admin.COOKIE_NAME,
        admin.session_cookie_value(token),
        max_age=COOKIE_MAX_AGE,
        path="/",
        httponly=True,
        secure=request.url.scheme == "https",
        samesite="strict",
    )
    return response


async def logout(request: Request) -> Response:
    response = RedirectResponse("/dashboard/login", status_code=303)
    response.delete_cookie(admin.COOKIE_NAME, path="/")
    return response


# ---- pages -------------------------------------------------------------------------------


def _logout_shown(request: Request) -> bool:
    return bool(request.app.state.res.config.admin.token)


async def overview(request: Request) -> Response:
    refused = _gate(request)
    if refused is not None:
        return refused
    q = request.query_params
    sort, order = q.get("sort") or "last_seen", q.get("order") or "desc"
    params = {
        "tenant": q.get("tenant") or "",
        "model": q.get("model") or "",
        "sort": sort if sort in admin.SORT_KEYS else "last_seen",
        "order": order if order in ("asc", "desc") else "desc",
    }
    try:
        page_no = max(1, int(q.get("page") or 1))
    except ValueError:
        page_no = 1
    store = request.app.state.res.store

    def load() -> tuple[dict[str, Any], dict[str, Any]]:
        data = admin.stats(store, hours=CHART_HOURS)
        listing = admin.list_conversations(
            store,
            tenant=params["tenant"] or None,
            model=params["model"] or None,
            sort=params["sort"],
            order=params["order"],
            page=page_no,
            per_page=PER_PAGE,
        )
        return data, listing

    await request.app.state.res.compactor.writer.flush()
    data, listing = await asyncio.to_thread(load)
    body = overview_body(data, listing, params)
    return page("Overview", body, logout=_logout_shown(request), refresh=refresh_ms(request))


async def conversation(request: Request) -> Response:
    refused = _gate(request)
    if refused is not None:
        return refused
    res = request.app.state.res

    def load() -> tuple[dict[str, Any], dict[str, Any]]:
        tenant, conv = admin.resolve(res.store, request.path_params["id"])
        detail = admin.conversation_detail(res.store, tenant, conv)
        return detail, admin.histories(res.store, res.compactor.counter, tenant, conv)

    try:
        await res.compactor.writer.flush()
        detail, hist = await asyncio.to_thread(load)
    except NotFound as exc:
        body = f'<h1>Not found</h1><p class="mute">{esc(exc)}</p>'
        return page("Not found", body, logout=_logout_shown(request), status=404)
    title = f"Conversation {short(detail['conversation'], 12)}"
    body = conversation_body(detail, hist)
    return page(title, body, logout=_logout_shown(request), refresh=refresh_ms(request))


def routes() -> list[Route]:
    """``/dashboard`` and its pages; add them before any catch-all route."""
    return [
        Route("/dashboard", overview, methods=["GET"]),
        Route("/dashboard/", overview, methods=["GET"]),
        Route("/dashboard/login", login_form, methods=["GET"]),
        Route("/dashboard/login", login_submit, methods=["POST"]),
        Route("/dashboard/logout", logout, methods=["POST"]),
        Route("/dashboard/conversations/{id:path}", conversation, methods=["GET"]),
    ]
