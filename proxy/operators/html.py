"""The dashboard's HTML building blocks: templates, escaping, formatting and the page frame.

Markup lives in package files under ``templates/`` (``$name`` placeholders, rendered with
``string.Template``). Every value put into a template is a string the caller has escaped
(``esc``) or built from escaped parts; a placeholder without a value raises ``KeyError``
rather than rendering blank.
"""

from __future__ import annotations

import functools
import html
import secrets
import time
from pathlib import Path
from string import Template
from typing import Any
from urllib.parse import quote

from starlette.responses import HTMLResponse

from proxy.operators.formatting import fmt_int

_HERE = Path(__file__).parent
CSS = (_HERE / "static" / "dashboard.css").read_text()
JS = (_HERE / "static" / "dashboard.js").read_text()
REFRESH_MS = 10_000


@functools.cache
def _template(name: str) -> Template:
    # The files end with a newline for editors; the fragment itself does not.
    return Template((_HERE / "templates" / f"{name}.html").read_text().removesuffix("\n"))


def render(name: str, /, **values: Any) -> str:
    """``templates/{name}.html`` with its placeholders filled (values already escaped)."""
    return _template(name).substitute({k: str(v) for k, v in values.items()})


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


def tile(key: str, label: str, value: str, raw: Any, sub: str = "", accent: bool = False) -> str:
    return render(
        "tile",
        cls="tile accent" if accent else "tile",
        key=key,
        raw=esc(raw),
        label=esc(label),
        value=esc(value),
        sub=esc(sub),
    )


def page(
    title: str, body: str, *, logout: bool, status: int = 200, refresh: int = REFRESH_MS
) -> HTMLResponse:
    """A complete page; its only script is the inlined auto-refresh, tagged with a nonce."""
    nonce = secrets.token_urlsafe(16)
    doc = render(
        "page",
        title=esc(title),
        css=CSS,
        refresh=refresh,
        updated=time.strftime("%H:%M:%S UTC", time.gmtime()),
        tools=render("logout") if logout else "",
        body=body,
        nonce=nonce,
        js=JS,
    )
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
