"""The conversation page's quality sections (#26): each compaction's anchors by category and
fate, the agent's behaviour after each compaction, and the loop breaker's decision."""

from __future__ import annotations

from typing import Any

from proxy.core.anchors import CATEGORIES, FATES
from proxy.operators.html import esc, fmt_ts

_FATE_LABELS = {
    "verbatim": "still forwarded as sent",
    "summary": "in the summary",
    "references": "in key references",
    "dropped": "dropped",
}


def anchors_html(anchors: dict[str, Any]) -> str:
    """One row per category: how many anchors met each fate; the dropped ones named."""
    counts = anchors.get("counts") if isinstance(anchors, dict) else None
    if not isinstance(counts, dict) or not counts:
        return ""
    dropped = anchors.get("dropped") or {}
    head = "".join(f"<th>{esc(_FATE_LABELS[f])}</th>" for f in FATES)
    rows = []
    for category in CATEGORIES:
        row = counts.get(category) or {}
        cells = "".join(f'<td class="num">{int(row.get(f, 0))}</td>' for f in FATES)
        lost = dropped.get(category) or []
        names = ", ".join(esc(x) for x in lost)
        rows.append(
            f'<tr class="anchor-{category}"><th>{esc(category)}</th>{cells}'
            f'<td class="mute">{names}</td></tr>'
        )
    return (
        '<details class="anchors" open><summary>Anchors by category</summary>'
        f'<table class="anchors"><tr><th></th>{head}<th>dropped anchors</th></tr>'
        f"{''.join(rows)}</table></details>"
    )


def behaviour_html(figures: Any, loop: Any) -> str:
    """The agent after each compaction, and the loop breaker's decision in force."""
    out = []
    if isinstance(loop, dict) and loop.get("action"):
        out.append(
            f'<div class="loop-breaker"><b>loop breaker: {esc(loop.get("action"))}</b> '
            f"({esc(fmt_ts(loop.get('ts')))}, fired {int(loop.get('fired') or 0)}×) — "
            f"{esc(loop.get('reason'))}</div>"
        )
    if isinstance(figures, dict) and figures:
        rows = []
        for record, f in figures.items():
            if not isinstance(f, dict):
                continue
            repeated = ", ".join(esc(x) for x in f.get("repeated") or [])
            rows.append(
                f"<tr><td>{esc(f.get('case'))} <code>{esc(str(record)[:8])}</code></td>"
                f'<td class="num">{int(f.get("repeated_calls") or 0)}</td>'
                f'<td class="num">{int(f.get("rereads") or 0)}</td>'
                f'<td class="num">{float(f.get("turns_before") or 0):.1f}</td>'
                f'<td class="num">{float(f.get("turns_after") or 0):.1f}</td>'
                f'<td class="mute">{repeated}</td></tr>'
            )
        rows.append(_conversation_row(figures))
        out.append(
            '<table class="behaviour"><tr><th>after compaction</th><th>repeated tool calls</th>'
            "<th>files re-read</th><th>turns per instruction before</th><th>after</th>"
            f"<th>repeated</th></tr>{''.join(rows)}</table>"
        )
    if not out:
        return ""
    return (
        f'<section class="behaviour"><h3>The agent after compactions</h3>{"".join(out)}</section>'
    )


def _counts(value: Any) -> tuple[int, int]:
    ok = isinstance(value, list) and [type(n) for n in value] == [int, int]
    return (value[0], value[1]) if ok else (0, 0)


def _ratio(turns: int, instructions: int) -> str:
    return f"{turns / instructions:.1f}" if instructions else "–"


def _conversation_row(figures: dict[str, Any]) -> str:
    """The whole conversation: turns per user instruction before its first compaction shown,
    and over every stretch after one (each compaction's "after" ends where the next begins)."""
    rows = [f for f in figures.values() if isinstance(f, dict)]
    if not rows:
        return ""
    before = _counts(rows[0].get("counts_before"))
    after = [_counts(f.get("counts_after")) for f in rows]
    turns, told = sum(a for a, _ in after), sum(b for _, b in after)
    total = sum(int(f.get("repeated_calls") or 0) for f in rows)
    rereads = sum(int(f.get("rereads") or 0) for f in rows)
    return (
        '<tr class="conversation"><td><b>this conversation</b></td>'
        f'<td class="num">{total}</td><td class="num">{rereads}</td>'
        f'<td class="num">{_ratio(*before)}</td><td class="num">{_ratio(turns, told)}</td>'
        "<td></td></tr>"
    )
