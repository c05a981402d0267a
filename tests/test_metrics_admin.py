"""The operators' view through a real proxy process: /metrics, /admin/api, auth, `stats` CLI.

A scripted conversation goes through the proxy; the numbers /metrics and the stats API report
are checked against what the scripted upstream actually received, recounted the same way.
"""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from proxy.adapters.store import DiskStore
from proxy.config import parse_config
from proxy.core.tokens import TokenCounter
from proxy.operators.metrics import input_price
from proxy.server.app import create_app
from tests.conversations import FACTS, drive_conversation
from tests.proxyproc import ProxyProcess, cli_path
from tests.upstream import ScriptedUpstream

SYSTEM = "You are a careful coding assistant for the billing service."
MODEL = "gpt-4o-mini"
OTHER_MODEL = "gpt-4o"
TOKEN = "admin-secret-for-tests"
COMPACTION = {
    "trigger_tokens": 4000,
    "verbatim_window_tokens": 1200,
    "summary_budget_tokens": 300,
    "mode": "inline",
}
COMPACTED_CASES = ("summarize", "truncate", "emergency")
_counter = TokenCounter()


def count(messages: list[dict[str, Any]], model: str = MODEL) -> int:
    """Tokens of a history, counted as the proxy counts them."""
    return _counter.count_total(messages, model)


def run_conversation(
    base_url: str, key: str, n_turns: int, model: str = MODEL, seed: int = 0
) -> tuple[list[list[dict[str, Any]]], list[httpx.Headers]]:
    """Drive a scripted conversation through the proxy; what was sent and the reply headers."""
    sent: list[list[dict[str, Any]]] = []
    headers: list[httpx.Headers] = []
    with httpx.Client(timeout=30) as client:

        def send(messages: list[dict[str, Any]]) -> dict[str, Any]:
            sent.append(messages)
            r = client.post(
                f"{base_url}/chat/completions",
                json={"model": model, "messages": messages},
                headers={"authorization": f"Bearer {key}"},
            )
            r.raise_for_status()
            headers.append(r.headers)
            return r.json()["choices"][0]["message"]

        drive_conversation(send, n_turns, SYSTEM, seed=seed)
    return sent, headers


def wait_for_requests(root: str, expected: int, token: str | None = TOKEN) -> dict[str, Any]:
    """The stats API once the ledger has all ``expected`` requests (written after responses)."""
    auth = {"authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + 15
    while True:
        data = httpx.get(f"{root}/admin/api/stats?hours=3", headers=auth, timeout=10).json()
        if data["totals"]["requests"] >= expected or time.monotonic() > deadline:
            return data
        time.sleep(0.1)


Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def parse(text: str) -> Samples:
    """Exposition text as {sample name: {sorted labels: value}}."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def scrape(root: str, token: str | None = None) -> Samples:
    auth = {"authorization": f"Bearer {token}"} if token else {}
    r = httpx.get(f"{root}/metrics", headers=auth, timeout=10)
    r.raise_for_status()
    return parse(r.text)


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(
        v
        for key, v in samples.get(name, {}).items()
        if all((k, val) in key for k, val in labels.items())
    )


class Run:
    """One proxy with an admin token after two conversations of two tenants."""

    def __init__(self, upstream: ScriptedUpstream, proxy: ProxyProcess) -> None:
        self.upstream, self.proxy = upstream, proxy
        # A short one first (another tenant, another model, below the trigger) ...
        self.short_sent, self.short_headers = run_conversation(
            proxy.base_url, "sk-tenant-b", 2, model=OTHER_MODEL, seed=7
        )
        self.short_forwarded = [r.json for r in upstream.chat_requests()]
        # ... then the long one that compacts.
        self.sent, self.headers = run_conversation(proxy.base_url, "sk-tenant-a", 14)
        self.forwarded = [r.json for r in upstream.chat_requests()][len(self.short_forwarded) :]
        self.n_requests = len(self.sent) + len(self.short_sent)
        self.stats = wait_for_requests(proxy.root, self.n_requests)
        self.auth = {"authorization": f"Bearer {TOKEN}"}

    def api(self, path: str, **params: Any) -> Any:
        r = httpx.get(f"{self.proxy.root}{path}", params=params, headers=self.auth, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def long_id(self) -> str:
        items = self.api("/admin/api/conversations", sort="saved_tokens")["items"]
        return str(items[0]["id"])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("operators")
    with ScriptedUpstream() as upstream:
        proxy = ProxyProcess(
            tmp,
            upstream.base_url,
            compaction=COMPACTION,
            admin={"token": TOKEN, "protect_metrics": True},
        )
        with proxy:
            yield Run(upstream, proxy)


# ---- numbers agree with what the upstream received --------------------------------------


def test_metrics_and_stats_agree_with_what_the_upstream_received(run: Run) -> None:
    # The long conversation compacted: the upstream got less than the client sent.
    assert any(h["x-compaction-case"] in COMPACTED_CASES for h in run.headers)
    sent = run.short_sent + run.sent
    forwarded = run.short_forwarded + run.forwarded
    models = [OTHER_MODEL] * len(run.short_sent) + [MODEL] * len(run.sent)
    assert len(forwarded) == len(sent) == run.n_requests
    original_tokens = sum(count(m, model) for m, model in zip(sent, models, strict=True))
    forwarded_tokens = sum(
        count(body["messages"], model) for body, model in zip(forwarded, models, strict=True)
    )
    saved = [
        count(m, model) - count(body["messages"], model)
        for m, body, model in zip(sent, forwarded, models, strict=True)
    ]
    assert all(s >= 0 for s in saved)
    saved_usd = sum(s * input_price(model) for s, model in zip(saved, models, strict=True))
    cached = sum(c for _, c in run.upstream.cached_log)
    assert original_tokens > forwarded_tokens > 0 and saved_usd > 0

    m = scrape(run.proxy.root, TOKEN)
    t = run.stats["totals"]
    assert total(m, "compaction_proxy_original_prompt_tokens_total") == original_tokens
    assert t["original_tokens"] == original_tokens
    assert total(m, "compaction_proxy_forwarded_prompt_tokens_total") == forwarded_tokens
    assert t["forwarded_tokens"] == forwarded_tokens
    assert total(m, "compaction_proxy_saved_prompt_tokens_total") == sum(saved)
    assert t["saved_tokens"] == sum(saved)
    assert total(m, "compaction_proxy_saved_usd_total") == pytest.approx(saved_usd)
    assert t["saved_usd"] == pytest.approx(saved_usd)
    assert total(m, "compaction_proxy_cached_prompt_tokens_total") == cached
    assert t["cached_tokens"] == cached
    assert t["prompt_tokens"] == sum(p for p, _ in run.upstream.cached_log)
    assert t["saved_pct"] == pytest.approx(100 * sum(saved) / original_tokens, abs=0.01)

    # Requests by route, case and status, as the response headers named the case.
    assert total(m, "compaction_proxy_requests_total") == run.n_requests
    for case in {h["x-compaction-case"] for h in run.short_headers + run.headers}:
        expected = sum(h["x-compaction-case"] == case for h in run.short_headers + run.headers)
        got = total(
            m, "compaction_proxy_requests_total", route="chat.completions", case=case, status="200"
        )
        assert got == expected, case

    # Every compaction was one summarizer call (the scripted detector never finds a boundary).
    summaries = len(run.upstream.chat_requests("summarizer"))
    assert summaries >= 1
    assert total(m, "compaction_proxy_compactions_total", case="summarize") == summaries
    assert total(m, "compaction_proxy_compaction_duration_seconds_count") == summaries
    assert t["compactions"] == summaries
    assert total(m, "compaction_proxy_llm_failures_total") == 0
    assert total(m, "compaction_proxy_upstream_latency_seconds_count") == run.n_requests
    assert total(m, "compaction_proxy_overhead_seconds_count") == run.n_requests


def test_each_request_is_recorded_with_original_and_forwarded_counts(run: Run) -> None:
    detail = run.api(f"/admin/api/conversations/{run.long_id()}")
    requests = detail["requests"]
    assert len(requests) == len(run.sent)
    for entry, sent, body, headers in zip(
        requests, run.sent, run.forwarded, run.headers, strict=True
    ):
        assert entry["original_messages"] == len(sent)
        assert entry["forwarded_messages"] == len(body["messages"])
        assert (
            entry["original_tokens"] == count(sent) == int(headers["x-compaction-original-tokens"])
        )
        assert entry["forwarded_tokens"] == count(body["messages"])
        assert entry["forwarded_tokens"] == int(headers["x-compaction-forwarded-tokens"])
        assert entry["case"] == headers["x-compaction-case"]
    meta = detail["meta"]
    assert meta["requests"] == len(run.sent)
    assert meta["saved_tokens"] == sum(r["saved_tokens"] for r in requests)


# ---- the stats API -----------------------------------------------------------------------


def test_stats_has_totals_and_an_even_hourly_series(run: Run) -> None:
    data = run.api("/admin/api/stats", hours=6)
    totals, hourly = data["totals"], data["hourly"]
    for key in (
        "requests", "original_tokens", "forwarded_tokens", "saved_tokens", "saved_pct",
        "saved_usd", "compactions", "cached_tokens", "cache_hit_rate", "conversations", "tenants",
    ):  # fmt: skip
        assert key in totals, key
    assert totals["conversations"] == 2 and totals["tenants"] == 2
    assert len(hourly) == 6
    assert [h["ts"] for h in hourly] == sorted(h["ts"] for h in hourly)
    assert all(b["ts"] - a["ts"] == 3600 for a, b in zip(hourly, hourly[1:], strict=False))
    # Everything happened within the last hour or two: the series adds up to the totals.
    for key in ("requests", "original_tokens", "forwarded_tokens", "saved_tokens"):
        assert sum(h[key] for h in hourly) == totals[key], key
    assert sum(h["compactions"] for h in hourly) == totals["compactions"]


def test_conversations_are_paged_sorted_and_filtered_by_tenant_and_model(run: Run) -> None:
    listing = run.api("/admin/api/conversations", sort="saved_tokens", order="desc")
    assert listing["total"] == 2 and len(listing["tenants"]) == 2
    assert sorted(listing["models"]) == sorted([MODEL, OTHER_MODEL])
    first, second = listing["items"]
    assert first["saved_tokens"] > second["saved_tokens"] == 0
    assert first["model"] == MODEL and first["compactions"] >= 1
    assert first["id"] == f"{first['tenant']}:{first['conversation']}"
    # Tenants are hashes of the key, never the key.
    assert "sk-tenant" not in str(listing)

    by_tenant = run.api("/admin/api/conversations", tenant=second["tenant"])
    assert [c["id"] for c in by_tenant["items"]] == [second["id"]]
    by_prefix = run.api("/admin/api/conversations", tenant=first["tenant"][:8])
    assert [c["id"] for c in by_prefix["items"]] == [first["id"]]
    by_model = run.api("/admin/api/conversations", model=OTHER_MODEL)
    assert [c["id"] for c in by_model["items"]] == [second["id"]]

    page2 = run.api(
        "/admin/api/conversations", sort="saved_tokens", order="asc", per_page=1, page=2
    )
    assert page2["total"] == 2 and [c["id"] for c in page2["items"]] == [first["id"]]
    r = httpx.get(
        f"{run.proxy.root}/admin/api/conversations", params={"sort": "bogus"}, headers=run.auth
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_every_compaction_has_its_summary_and_a_loss_report(run: Run) -> None:
    detail = run.api(f"/admin/api/conversations/{run.long_id()}")
    compactions = detail["compactions"]
    assert len(compactions) == len(run.upstream.chat_requests("summarizer"))
    for c in compactions:
        assert c["case"] == "summarize"
        assert c["summary"].startswith("[History Summary - ")
        assert c["tokens_before"] > c["tokens_after"] > 0
        assert c["duration_s"] >= 0 and isinstance(c["boundary_reason"], str)
        assert 0.0 <= c["confidence"] <= 1.0
        assert isinstance(c["facts_kept"], list) and isinstance(c["facts_dropped"], list)
        # The loss report: every key fact is either in the summary, or reported dropped.
        for fact in c["facts_kept"]:
            assert fact in c["summary"]
    kept = {f for c in compactions for f in c["facts_kept"]}
    # A planted fact from the first turn: that turn is the task, pinned, never summarized.
    assert all(any("the task" in p for p in c["pinned"]) for c in compactions)
    assert "OPS-4821" not in kept
    assert any(fact.split(" is ")[-1].rstrip(".") in compactions[-1]["summary"] for fact in FACTS)
    assert detail["failures"] == []


def test_original_is_the_full_history_the_client_last_sent(run: Run) -> None:
    conv = run.long_id()
    original = run.api(f"/admin/api/conversations/{conv}/original")
    assert original["messages"] == run.sent[-1]
    assert original["count"] == len(run.sent[-1])
    assert original["total_tokens"] == count(run.sent[-1])
    forwarded = run.api(f"/admin/api/conversations/{conv}/forwarded")
    assert forwarded["messages"] == run.forwarded[-1]["messages"]
    assert forwarded["total_tokens"] == count(run.forwarded[-1]["messages"])
    assert forwarded["record"]["case"] == "summarize"
    # A bare conversation id (no tenant) is found across tenants.
    bare = conv.split(":", 1)[1]
    assert run.api(f"/admin/api/conversations/{bare}/original")["messages"] == run.sent[-1]


def test_unknown_conversation_is_a_404(run: Run) -> None:
    r = httpx.get(f"{run.proxy.root}/admin/api/conversations/nope", headers=run.auth)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"


# ---- auth --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    ["/admin/api/stats", "/admin/api/conversations", "/admin/api/conversations/x", "/metrics"],
)
def test_admin_api_and_protected_metrics_refuse_without_the_token(run: Run, path: str) -> None:
    for headers in ({}, {"authorization": "Bearer wrong"}, {"cookie": "compaction_proxy_admin=x"}):
        r = httpx.get(f"{run.proxy.root}{path}", headers=headers)
        assert r.status_code == 401, (path, headers)
        error = r.json()["error"]
        assert error["type"] == "authentication_error"
        assert error["code"] == "invalid_admin_token"
        assert TOKEN not in r.text
    ok = httpx.get(f"{run.proxy.root}{path}", headers=run.auth)
    assert ok.status_code in (200, 404)


def test_dashboard_login_sets_an_httponly_cookie(run: Run) -> None:
    root = run.proxy.root
    refused = httpx.get(f"{root}/dashboard")
    assert refused.status_code == 401 and 'name="token"' in refused.text
    assert "Tokens saved" not in refused.text
    assert httpx.get(f"{root}/dashboard", headers=run.auth).status_code == 200

    wrong = httpx.post(f"{root}/dashboard/login", data={"token": "nope", "next": "/dashboard"})
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    good = httpx.post(f"{root}/dashboard/login", data={"token": TOKEN, "next": "//evil.example"})
    assert good.status_code == 303 and good.headers["location"] == "/dashboard"
    cookie = good.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    assert TOKEN not in cookie
    jar = {"compaction_proxy_admin": good.cookies["compaction_proxy_admin"]}
    with httpx.Client(cookies=jar) as client:
        page = client.get(f"{root}/dashboard")
        assert page.status_code == 200 and "Tokens saved" in page.text
        assert client.get(f"{root}/admin/api/stats").status_code == 200
    assert "default-src 'none'" in page.headers["content-security-policy"]


# ---- the stats CLI -----------------------------------------------------------------------


def test_stats_cli_prints_totals_and_top_conversations(run: Run) -> None:
    result = subprocess.run(
        [cli_path(), "stats", "--config", str(run.proxy.config_path), "--top", "5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    totals = run.api("/admin/api/stats")["totals"]
    assert f"{totals['requests']:,}" in out
    assert f"{totals['saved_tokens']:,} ({totals['saved_pct']:.1f}%)" in out
    assert f"{totals['original_tokens']:,}" in out and f"{totals['forwarded_tokens']:,}" in out
    assert "Top 2 conversations by tokens saved" in out
    rows = [line for line in out.splitlines() if MODEL in line or OTHER_MODEL in line]
    assert len(rows) == 2
    long_id = run.long_id()
    # Sorted by tokens saved: the compacted one first.
    assert rows[0].split()[:2] == [long_id[:8], long_id.split(":")[1][:15] + "…"]
    assert TOKEN not in out


def test_stats_cli_on_an_empty_store(tmp_path: Path) -> None:
    config = tmp_path / "proxy.yaml"
    config.write_text(f"store:\n  url: diskcache://{tmp_path / 'store'}\n")
    result = subprocess.run(
        [cli_path(), "stats", "--config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "No conversations recorded yet." in result.stdout


# ---- registries and workers --------------------------------------------------------------


def test_two_apps_in_one_process_each_have_their_own_registry(tmp_path: Path) -> None:
    config = parse_config({"store": {"url": f"diskcache://{tmp_path}"}, "admin": {"token": TOKEN}})
    transport = httpx.MockTransport(lambda request: httpx.Response(500))
    apps = [
        create_app(config, transport=transport, store=DiskStore(tmp_path / str(i))) for i in (1, 2)
    ]
    with TestClient(apps[0]) as first, TestClient(apps[1]) as second:
        for client in (first, second):
            r = client.get("/metrics", headers={"authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 200
            assert "compaction_proxy_compactions_total" in r.text
        assert first.app.state.res.metrics.registry is not second.app.state.res.metrics.registry


def test_metrics_sum_every_worker_in_multiprocess_mode(tmp_path: Path) -> None:
    multiproc = tmp_path / "prom"
    multiproc.mkdir()
    n = 32

    def send(i: int) -> int:
        r = httpx.post(
            f"{proxy.base_url}/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": f"hello {i}"}]},
            # Slow replies overlap, so the workers share the requests between them.
            headers={"x-test-delay": "0.2"},
            timeout=30,
        )
        return r.status_code

    with ScriptedUpstream() as upstream:
        proxy = ProxyProcess(tmp_path, upstream.base_url)
        proxy.start(["--workers", "2"], env={"PROMETHEUS_MULTIPROC_DIR": str(multiproc)})
        try:
            with ThreadPoolExecutor(8) as pool:
                assert list(pool.map(send, range(n))) == [200] * n
            per_worker = {
                path.name: sum(
                    s.value
                    for metric in MultiProcessCollector._read_metrics([str(path)]).values()
                    for s in metric.samples
                    if s.name == "compaction_proxy_requests_total"
                )
                for path in multiproc.glob("counter_*.db")
            }
            assert len(per_worker) == 2 and sum(per_worker.values()) == n
            assert all(v > 0 for v in per_worker.values()), per_worker
            # No admin.token configured: both workers use the one generated on first start.
            token = (tmp_path / "store" / "admin-token").read_text().strip()
            auth = {"authorization": f"Bearer {token}", "connection": "close"}
            # Every scrape, whichever worker answers it, shows all workers' requests.
            for _ in range(6):
                with httpx.Client() as fresh:
                    r = fresh.get(f"{proxy.root}/metrics", headers=auth)
                assert r.status_code == 200, r.text
                assert total(parse(r.text), "compaction_proxy_requests_total") == n
        finally:
            proxy.stop()
