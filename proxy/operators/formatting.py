"""Numbers as operators read them, the same in the dashboard and the ``stats`` table."""

from __future__ import annotations

from typing import Any


def fmt_int(value: Any) -> str:
    return f"{int(value or 0):,}"


def fmt_usd(value: Any) -> str:
    amount = float(value or 0.0)
    sign, amount = ("-", -amount) if amount < 0 else ("", amount)
    return f"{sign}${amount:,.2f}" if amount >= 1 else f"{sign}${amount:.4f}"


def fmt_pct(value: Any) -> str:
    return f"{float(value or 0.0):.1f}%"


def fmt_usd_known(value: Any, requests: Any, unpriced: Any) -> str:
    """Dollars, or "n/a" when no request counted had a known price (never a false $0)."""
    if int(requests or 0) > 0 and int(unpriced or 0) >= int(requests or 0):
        return "n/a"
    return fmt_usd(value)
