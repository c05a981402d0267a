"""Numbers as operators read them, the same in the dashboard and the ``stats`` table."""

from __future__ import annotations

from typing import Any


def fmt_int(value: Any) -> str:
    return f"{int(value or 0):,}"


def fmt_usd(value: Any) -> str:
    amount = float(value or 0.0)
    return f"${amount:,.2f}" if amount >= 1 else f"${amount:.4f}"


def fmt_pct(value: Any) -> str:
    return f"{float(value or 0.0):.1f}%"
