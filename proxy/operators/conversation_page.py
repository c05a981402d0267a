"""The dashboard's page for one conversation: its tiles, the tokens of each request, the
compaction timeline (each summary and loss report), its requests, and the original and
forwarded histories side by side."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from proxy.core.fingerprint import conversation_label
from proxy.core.messages import SUMMARY_PREFIX, text_of
from proxy.operators.charts import legend, request_chart
from proxy.operators.formatting import fmt_int, fmt_pct
from proxy.operators.html import badge, esc, fmt_ts, plural, render, tile
from proxy.operators.overview_page import usd_note, usd_tile
from proxy.operators.quality_page import anchors_html, behaviour_html

MESSAGE_PREVIEW_CHARS = 1200
VERBATIM_PREVIEW_CHARS = 160
AGENT_LIST_SHOWN = 50


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

    groups = (
        group("kept", "Kept", kept)
        + group("appended", "Added as key references", appended)
        + group("elsewhere", "Still in the forwarded messages", elsewhere)
        + group("dropped", "Dropped", dropped)
        + ('<div class="mute">Nothing dropped.</div>' if not dropped else "")
    )
    return render(
        "facts",
        kept=len(kept),
        appended=len(appended),
        elsewhere=len(elsewhere),
        dropped=len(dropped),
        groups=groups,
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
            shown = "".join(f"<li>{esc(v)}</li>" for v in values[:AGENT_LIST_SHOWN])
            extra = len(values) - AGENT_LIST_SHOWN
            more = f'<li class="mute">… and {extra} more</li>' if extra > 0 else ""
            out.append(
                render(
                    "agent_list", key=key, count=len(values), label=esc(label), items=shown + more
                )
            )
    return "".join(out)


def _compaction_item(i: int, c: dict[str, Any]) -> str:
    before, after = int(c.get("tokens_before") or 0), int(c.get("tokens_after") or 0)
    summary = c.get("summary")
    summary_html = (
        f'<pre class="summary">{esc(summary)}</pre>'
        if summary
        else '<p class="mute">No summary kept (the old topic was dropped without a note, '
        "or the record has expired).</p>"
    )
    return render(
        "compaction",
        n=i,
        case=badge(c.get("case")),
        ts=esc(fmt_ts(c.get("ts"))),
        before=fmt_int(before),
        after=fmt_int(after),
        cut=f"{100 * (before - after) / before if before else 0.0:.0f}",
        covered=fmt_int(c.get("covered")),
        boundary=esc(c.get("boundary_reason") or "—"),
        confidence=f"{float(c.get('confidence') or 0):.2f}",
        took=f"{float(c.get('duration_s') or 0):.2f}",
        llm_tokens=fmt_int(c.get("llm_tokens")),
        llm_cached=_cached_note(c.get("llm_cached_tokens")),
        summary=summary_html,
        facts=facts(
            c["facts_kept"], c["facts_appended"], c["facts_dropped"], c.get("facts_elsewhere") or ()
        ),
        agent=agent_lists(c) + anchors_html(c.get("anchors") or {}),
    )


def timeline(compactions: Sequence[dict[str, Any]], failures: Sequence[dict[str, Any]]) -> str:
    items = [_compaction_item(i, c) for i, c in enumerate(compactions, 1)]
    for f in failures:
        items.append(
            render(
                "failure",
                case=badge(f.get("case")),
                ts=esc(fmt_ts(f.get("ts"))),
                soft='<span class="mute">(soft: short cooldown)</span>' if f.get("soft") else "",
                error=esc(f.get("error")),
            )
        )
    if not items:
        return '<p class="empty">No compactions yet.</p>'
    return f'<ol class="timeline">{"".join(items)}</ol>'


def requests_table(requests: Sequence[dict[str, Any]]) -> str:
    rows = [
        render(
            "request_row",
            n=i,
            ts=esc(fmt_ts(r.get("ts"))),
            case=badge(r.get("case")),
            status=esc(r.get("status")),
            original_messages=fmt_int(r.get("original_messages")),
            original_tokens=fmt_int(r.get("original_tokens")),
            forwarded_messages=fmt_int(r.get("forwarded_messages")),
            forwarded_tokens=fmt_int(r.get("forwarded_tokens")),
            saved_tokens=fmt_int(r.get("saved_tokens")),
            cached_tokens=fmt_int(r.get("cached_tokens")),
            latency=f"{1000 * float(r.get('latency_s') or 0):.0f}",
            overhead=f"{1000 * float(r.get('overhead_s') or 0):.1f}",
        )
        for i, r in enumerate(requests, 1)
    ]
    return render("requests_table", rows="".join(rows))


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
        shown = render(
            "message_long", preview=esc(body[:preview]), chars=f"{len(body):,}", body=esc(body)
        )
    else:
        shown = f'<div class="body">{esc(body)}</div>'
    label = "summary" if is_summary else role
    return render("message", cls=cls, label=esc(label), tokens=fmt_int(tokens), shown=shown)


def histories_html(hist: dict[str, Any]) -> str:
    """Original and forwarded side by side, aligned: the head, then the replaced span opposite
    what replaces it (pins, the summary or note, pruned placeholders), then the verbatim tail."""
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
        rows.append(render("history_pair", cls=cls, left=left, right=right))

    def title(name: str, side: dict[str, Any], note: str) -> str:
        return render(
            "history_title",
            name=esc(name),
            count=plural(side["count"], "message"),
            tokens=fmt_int(side["total_tokens"]),
            note=esc(note),
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
        left = render(
            "replaced_span",
            count=plural(k - head_len, "message"),
            tokens=fmt_int(sum(ot[head_len:k])),
            messages="".join(message_html(om[i], ot[i]) for i in range(head_len, k)),
        )
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
        usd_tile(meta, usd_note(meta))  # net first (#25), gross in its note
        + tile("requests", "Requests", fmt_int(meta["requests"]), meta["requests"])
        + tile(
            "saved-tokens", "Tokens saved", fmt_int(meta["saved_tokens"]), meta["saved_tokens"],
            f"of {fmt_int(meta['original_tokens'])} sent", accent=True,
        )
        + tile("saved-pct", "Saved", fmt_pct(meta["saved_pct"]), meta["saved_pct"])
        + tile("compactions", "Compactions", fmt_int(meta["compactions"]), meta["compactions"],
               f"{fmt_int(meta['failures'])} failed")
        + tile("cache-hit", "Cache-hit rate", fmt_pct(100 * meta["cache_hit_rate"]),
               meta["cache_hit_rate"])
    )  # fmt: skip
    status = ""
    if meta.get("paused"):
        status += "<span><b>compaction paused</b> (requests pass as sent)</span>"
    refused = meta.get("refused")
    if refused:
        # A defect of ours cost one retry: say so where the operator looks first.
        status += (
            f'<span class="refused"><b>compaction stopped</b>: the upstream refused a '
            f"compacted request ({esc(refused.get('case'))}, {esc(fmt_ts(refused.get('ts')))}); "
            "it was sent again as the client sent it, and requests pass as sent since</span>"
        )
    return render(
        "conversation",
        label=esc(conversation_label(detail["conversation"])),
        tenant=esc(detail["tenant"]),
        model=esc(meta.get("model")),
        first_seen=esc(fmt_ts(meta.get("first_seen"))),
        last_seen=esc(fmt_ts(meta.get("last_seen"))),
        paused=status,
        json_id=esc(quote(detail["id"], safe=":")),
        tiles=tiles,
        legend=legend(),
        chart=request_chart(detail["requests"]),
        timeline=behaviour_html(detail.get("behaviour"), detail.get("loop"))
        + timeline(detail["compactions"], detail["failures"]),
        requests=requests_table(detail["requests"]),
        histories=histories_html(hist),
    )


def _cached_note(cached: object) -> str:
    """How much of the detector's and summarizer's input the provider read from its prompt
    cache (most of it when the summary was asked in the client's shape), or nothing."""
    if not isinstance(cached, int) or isinstance(cached, bool) or cached <= 0:
        return ""
    return f' <span class="mute">({fmt_int(cached)} read from the provider\'s cache)</span>'
