"""The dashboard's charts: inline SVG computed here (no script, nothing fetched)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from proxy.operators.formatting import fmt_int
from proxy.operators.html import esc, render

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


def _svg(label: str, top: float, shapes: list[str]) -> str:
    return render(
        "chart", width=_W, height=_H, label=esc(label), shapes=_axis(top) + "".join(shapes)
    )


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
    return _svg("original vs forwarded tokens per hour", top, bars)


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
    return _svg("tokens per request", top, lines)


def legend() -> str:
    return render("legend")
