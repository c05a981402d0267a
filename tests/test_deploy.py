"""The deploy files stay consistent with the code: configs parse, names and ports line up."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import yaml

from proxy.config import parse_config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def test_container_config_parses_with_defaults_and_overrides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raw = yaml.safe_load((DEPLOY / "container-proxy.yaml").read_text())
    for name in ("UPSTREAM_BASE_URL", "STORE_URL", "COMPACTION_MODE", "ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    config = parse_config(raw)
    assert config.listen.host == "0.0.0.0" and config.admin.token is None
    assert config.store.url.startswith("diskcache:///var/lib/compaction-proxy")
    monkeypatch.setenv("STORE_URL", "redis://redis:6379/0")
    monkeypatch.setenv("COMPACTION_MODE", "inline")
    config = parse_config(raw)
    assert config.store.url == "redis://redis:6379/0" and config.compaction.mode == "inline"


def test_kubernetes_config_map_is_a_valid_proxy_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ADMIN_TOKEN", raising=False)
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "compaction-proxy.yaml").read_text()))
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("Service", "compaction-proxy-redis") in kinds
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    config = parse_config(yaml.safe_load(config_map["data"]["proxy.yaml"]))
    assert config.store.url == "redis://compaction-proxy-redis:6379/0", "replicas must share Redis"
    deployment = next(
        d for d in docs if d["metadata"]["name"] == "compaction-proxy" and d["kind"] == "Deployment"
    )
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["ports"][0]["containerPort"] == config.listen.port


def test_compose_and_its_prometheus_agree() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    proxy = compose["services"]["proxy"]
    assert proxy["environment"]["STORE_URL"].startswith("redis://redis:")
    assert "redis" in compose["services"]
    prom = yaml.safe_load((DEPLOY / "prometheus" / "compose.yml").read_text())
    assert prom["scrape_configs"][0]["static_configs"][0]["targets"] == ["proxy:4000"]


def test_dockerfile_runs_the_console_script() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "compaction-proxy" in scripts
    assert 'ENTRYPOINT ["compaction-proxy", "serve"]' in dockerfile
    assert "COPY deploy/container-proxy.yaml /etc/compaction-proxy/proxy.yaml" in dockerfile
