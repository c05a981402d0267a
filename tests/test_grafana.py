"""deploy/: the Grafana dashboard only queries metrics /metrics exposes; Prometheus scrapes it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from proxy.adapters.store import DiskStore
from proxy.config import parse_config
from proxy.server.app import create_app

DEPLOY = Path(__file__).parent.parent / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboard.json"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
HEADLINES = ("Tokens saved", "% saved", "Dollars saved", "Compactions", "Cache-hit rate")

# PromQL words that are not metric names.
PROMQL_WORDS = {
    "sum", "avg", "min", "max", "count", "rate", "irate", "increase", "histogram_quantile",
    "clamp_min", "clamp_max", "by", "without", "on", "ignoring", "group_left", "group_right",
    "and", "or", "unless", "offset", "bool", "topk", "bottomk", "abs", "vector", "scalar",
    "label_values", "e",
}  # fmt: skip


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows


def expressions(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", []) if t.get("expr")]
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        if isinstance(query, dict) and query.get("query"):
            exprs.append(query["query"])
    return exprs


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (label matchers, groupings and ranges removed)."""
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges: [5m], [$__rate_interval]
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"\$\{?\w+\}?", "", expr)  # Grafana variables
    label_args = re.findall(r"label_values\(\s*[\w:]+\s*,\s*(\w+)\s*\)", expr)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))
    return words - PROMQL_WORDS - set(label_args)


def grouping_labels(expr: str) -> set[str]:
    labels: set[str] = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        labels |= {x.strip() for x in group.split(",") if x.strip()}
    return labels


@pytest.fixture(scope="module")
def exposed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """Sample names /metrics exposes after a few requests, with their label names."""
    tmp = tmp_path_factory.mktemp("grafana")

    def upstream(request: httpx.Request) -> httpx.Response:
        body = {
            "id": "x",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
            "usage": {
                "prompt_tokens": 12,
                "completion_tokens": 1,
                "prompt_tokens_details": {"cached_tokens": 4},
            },
        }
        return httpx.Response(200, json=body)

    config = parse_config({"store": {"url": f"diskcache://{tmp}"}, "admin": {"token": "t0ken"}})
    app = create_app(config, transport=httpx.MockTransport(upstream), store=DiskStore(tmp))
    with TestClient(app) as client:
        for i in range(3):
            r = client.post(
                "/v1/chat/completions",
                json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"hi {i}"}]},
            )
            assert r.status_code == 200
        text = client.get("/metrics", headers={"authorization": "Bearer t0ken"}).text
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def test_every_metric_the_grafana_dashboard_queries_is_exposed(
    exposed: dict[str, set[str]],
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = expressions(dashboard)
    assert len(exprs) >= 10
    used: set[str] = set()
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        missing = names - set(exposed)
        assert not missing, f"{expr!r} uses metrics /metrics does not expose: {missing}"
        used |= names
        labels = set().union(*(exposed[n] for n in names)) | {"le", "job", "instance"}
        assert grouping_labels(expr) <= labels, expr
    # The headline numbers are all there.
    for name in (
        "compaction_proxy_saved_prompt_tokens_total",
        "compaction_proxy_saved_usd_total",
        "compaction_proxy_compactions_total",
        "compaction_proxy_cached_prompt_tokens_total",
        "compaction_proxy_original_prompt_tokens_total",
        "compaction_proxy_forwarded_prompt_tokens_total",
        "compaction_proxy_llm_failures_total",
        "compaction_proxy_upstream_latency_seconds_bucket",
        "compaction_proxy_overhead_seconds_bucket",
        "compaction_proxy_compaction_duration_seconds_bucket",
    ):
        assert name in used, name


def test_grafana_dashboard_is_well_formed(exposed: dict[str, set[str]]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    titles = [p["title"] for p in panels(dashboard)]
    for headline in HEADLINES:
        assert headline in titles, headline
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in panels(dashboard):
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        for target in panel["targets"]:
            assert target["refId"] and target["expr"]


def test_prometheus_scrapes_the_proxy_metrics_endpoint() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    job = jobs["compaction-proxy"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    default_port = parse_config({}).listen.port
    assert any(t.endswith(f":{default_port}") for t in targets)
