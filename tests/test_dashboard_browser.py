"""The dashboard in a real browser: headless Chromium (Debian's) driven by Playwright.

After a scripted conversation through a proxy with ``admin.token`` set: refused without the
token, let in with it (login form, or a Bearer header); the tiles show tokens saved; the
conversation's page shows its summary, loss report and both histories; it auto-refreshes.
Screenshots go to tests/artifacts/.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.proxyproc import ProxyProcess
from tests.test_metrics_admin import COMPACTION, TOKEN, run_conversation, wait_for_requests
from tests.upstream import ScriptedUpstream

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).parent / "artifacts"

playwright_sync = pytest.importorskip("playwright.sync_api")
if not shutil.which(CHROMIUM) and not os.environ.get("CI"):
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("dashboard")
    with ScriptedUpstream() as upstream:
        with ProxyProcess(
            tmp, upstream.base_url, compaction=COMPACTION, admin={"token": TOKEN}
        ) as p:
            sent, _ = run_conversation(p.base_url, "sk-browser", 14)
            wait_for_requests(p.root, len(sent))
            yield p


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_sync.sync_playwright() as pw:
        instance = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield instance
        instance.close()


def tile_value(page: Any, key: str) -> float:
    return float(page.get_attribute(f"#tile-{key}", "data-value"))


def test_dashboard_refuses_without_the_token_and_lets_in_with_it(
    proxy: ProxyProcess, browser: Any
) -> None:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    response = page.goto(f"{proxy.root}/dashboard")
    assert response is not None and response.status == 401
    assert page.locator("#tile-saved-tokens").count() == 0
    assert page.locator("input[name=token]").is_visible()

    page.fill("input[name=token]", "not-the-token")
    page.click("button[type=submit]")
    assert "not the admin token" in page.inner_text("main")
    assert page.locator("#tile-saved-tokens").count() == 0

    page.fill("input[name=token]", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_selector("#tile-saved-tokens")
    assert page.url.endswith("/dashboard")
    assert tile_value(page, "saved-tokens") > 0
    cookies = {c["name"]: c for c in context.cookies()}
    assert cookies["compaction_proxy_admin"]["httpOnly"] is True
    # Scripts cannot read the session cookie.
    assert "compaction_proxy_admin" not in page.evaluate("document.cookie")

    page.click("text=Log out")
    page.wait_for_selector("input[name=token]")
    assert page.goto(f"{proxy.root}/dashboard").status == 401
    context.close()


def test_dashboard_shows_savings_and_a_conversations_summary(
    proxy: ProxyProcess, browser: Any
) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    context = browser.new_context(
        viewport={"width": 1400, "height": 900},
        extra_http_headers={"authorization": f"Bearer {TOKEN}"},
    )
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    outside: list[str] = []
    page.on(
        "request",
        lambda req: None if req.url.startswith(proxy.root) else outside.append(req.url),
    )

    assert page.goto(f"{proxy.root}/dashboard").status == 200
    saved = tile_value(page, "saved-tokens")
    assert saved > 0
    assert re.search(r"\d", page.inner_text("#tile-saved-tokens .value"))
    assert 0 < tile_value(page, "saved-pct") < 100
    assert tile_value(page, "saved-usd") > 0
    assert tile_value(page, "compactions") >= 1
    assert page.locator("#hourly svg rect.fwd").count() > 0
    rows = page.locator("#conversations tbody tr")
    assert rows.count() == 1
    page.screenshot(path=str(ARTIFACTS / "dashboard-overview.png"), full_page=True)

    page.click("#conversations a.conv-link")
    page.wait_for_selector("#timeline")
    summary = page.locator("#timeline pre.summary").first
    assert summary.inner_text().startswith("[History Summary - ")
    # A planted fact of the first turn: that turn is the task, pinned and forwarded in place
    # (listed as such), so the summary need not carry it.
    assert "the task" in (page.locator("#timeline .agent-pinned").first.text_content() or "")
    assert page.locator("#timeline .fact.kept").count() > 0
    assert "Loss report" in page.inner_text("#timeline")
    original = page.locator("#histories .side-orig .msg")
    forwarded = page.locator("#histories .side-fwd .msg")
    assert any("OPS-4821" in text for text in forwarded.all_text_contents())
    assert original.count() > forwarded.count() > 0
    assert page.locator("#histories .side-fwd .msg.is-summary").count() == 1
    # The replaced span sits opposite the summary that replaces it.
    span = page.locator("#histories .replaced-span")
    assert span.locator(".side-fwd .msg.is-summary").count() == 1
    assert "replaced by the summary" in span.locator(".side-orig").inner_text()
    span.screenshot(path=str(ARTIFACTS / "dashboard-replaced-span.png"))
    assert page.locator("#requests tbody tr").count() > 1
    page.screenshot(path=str(ARTIFACTS / "dashboard-conversation.png"), full_page=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard-conversation-top.png"))
    page.locator("#histories").scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "dashboard-histories.png"))
    page.locator("#timeline").screenshot(path=str(ARTIFACTS / "dashboard-timeline.png"))
    assert errors == []
    assert outside == []  # nothing fetched from anywhere but the proxy: works offline
    context.close()


def test_dashboard_auto_refreshes(proxy: ProxyProcess, browser: Any) -> None:
    context = browser.new_context(extra_http_headers={"authorization": f"Bearer {TOKEN}"})
    page = context.new_page()
    page.goto(f"{proxy.root}/dashboard?refresh=1")
    before = tile_value(page, "requests")
    sent, _ = run_conversation(proxy.base_url, "sk-browser-2", 1, seed=3)
    page.wait_for_function(
        "n => Number(document.querySelector('#tile-requests').dataset.value) > n",
        arg=before,
        timeout=15_000,
    )
    assert tile_value(page, "requests") == before + len(sent)
    assert page.locator("#conversations tbody tr").count() == 2
    context.close()


TABLES_FIT = """() => {
  const wide = Array.from(document.querySelectorAll('table'))
    .filter(t => t.scrollWidth > t.parentElement.clientWidth + 1)
    .map(t => `${t.id}: ${t.scrollWidth} > ${t.parentElement.clientWidth}`);
  if (document.documentElement.scrollWidth > window.innerWidth) wide.push('page');
  return wide;
}"""


def test_tables_fit_a_1400_px_window(proxy: ProxyProcess, browser: Any) -> None:
    context = browser.new_context(
        viewport={"width": 1400, "height": 900},
        extra_http_headers={"authorization": f"Bearer {TOKEN}"},
    )
    page = context.new_page()
    page.goto(f"{proxy.root}/dashboard")
    assert page.evaluate(TABLES_FIT) == []
    page.click("#conversations a.conv-link")
    page.wait_for_selector("#requests")
    assert page.evaluate(TABLES_FIT) == []
    context.close()


def test_unknown_prices_show_n_a_not_zero_dollars(
    tmp_path_factory: pytest.TempPathFactory, browser: Any
) -> None:
    tmp = tmp_path_factory.mktemp("unpriced")
    with ScriptedUpstream() as upstream:
        # A model LiteLLM's price map does not know (a local server's, with a long name).
        model = "local/some-lab/a-rather-long-model-name-70b-instruct-q4_k_m.gguf"
        with ProxyProcess(
            tmp, upstream.base_url, compaction=COMPACTION, admin={"token": TOKEN}
        ) as p:
            sent, _ = run_conversation(p.base_url, "sk-unpriced", 4, model=model)
            wait_for_requests(p.root, len(sent))
            context = browser.new_context(
                viewport={"width": 1400, "height": 900},
                extra_http_headers={"authorization": f"Bearer {TOKEN}"},
            )
            page = context.new_page()
            page.goto(f"{p.root}/dashboard")
            usd = page.locator("#tile-saved-usd")
            assert usd.locator(".value").inner_text() == "n/a"
            assert "accent" not in (usd.get_attribute("class") or "")
            row = page.locator("#conversations tbody tr").first
            assert "n/a" in row.inner_text() and "$" not in row.inner_text()
            assert page.evaluate(TABLES_FIT) == []  # the long model name is cut, not the table
            page.click("#conversations a.conv-link")
            page.wait_for_selector("#requests")
            assert page.locator("#tile-saved-usd .value").inner_text() == "n/a"
            assert page.evaluate(TABLES_FIT) == []
            context.close()
