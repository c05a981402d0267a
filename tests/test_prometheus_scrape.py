"""A real Prometheus (Debian's ``prometheus``) scrapes a real proxy's ``/metrics`` with the
admin token, configured as ``deploy/prometheus/prometheus.yml`` says, and PromQL over the
headline series returns what the admin API reports for the same conversation (issue #27).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests import childproc
from tests.checks import INLINE
from tests.conversations import user_turns
from tests.proxyproc import ProxyProcess, free_port
from tests.upstream import ScriptedUpstream

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "deploy" / "prometheus" / "prometheus.yml"
TOKEN = "prometheus-scrape-admin-token-0123456789"
TURNS = 10
# PromQL over the proxy's headline series -> the admin API's totals key it must equal.
HEADLINES = {
    "sum(compaction_proxy_requests_total)": "requests",
    "sum(compaction_proxy_original_prompt_tokens_total)": "original_tokens",
    "sum(compaction_proxy_forwarded_prompt_tokens_total)": "forwarded_tokens",
    "sum(compaction_proxy_saved_prompt_tokens_total)": "saved_tokens",
    "sum(compaction_proxy_cached_prompt_tokens_total)": "cached_tokens",
    "sum(compaction_proxy_compactions_total{case!='failed'})": "compactions",
    "sum(compaction_proxy_facts_dropped_total)": "facts_dropped",
}


def prometheus_bin() -> str:
    found = shutil.which("prometheus")
    assert found, "prometheus is not installed (apt-get install -y prometheus, as .ci/run does)"
    return found


class Prometheus:
    """``prometheus`` on a free port of 127.0.0.1 with the shipped config, its target and
    its token file filled in."""

    def __init__(self, work: Path, target: str, token: str) -> None:
        self.work, self.port = work, free_port()
        token_file = work / "compaction-proxy-admin-token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        config = yaml.safe_load(SHIPPED.read_text())
        config["global"]["scrape_interval"] = "1s"
        (job,) = config["scrape_configs"]
        job["static_configs"] = [{"targets": [target]}]
        # What the shipped file's comment says to uncomment, with our file.
        job["authorization"] = {"type": "Bearer", "credentials_file": str(token_file)}
        self.config_path = work / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = work / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Prometheus:
        command = [
            prometheus_bin(),
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.work / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        childproc.wait_ready(self.proc, f"{self.url}/-/ready", 60, "prometheus", self.logs)
        return self

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        childproc.stop(self.proc)

    def query(self, promql: str) -> float | None:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10)
        r.raise_for_status()
        result = r.json()["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def targets(self) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.url}/api/v1/targets", timeout=10)
        r.raise_for_status()
        return list(r.json()["data"]["activeTargets"])


def wait_for(condition: Callable[[], bool], timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.25)
    return condition()


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[ProxyProcess]:
    with (
        ScriptedUpstream() as up,
        ProxyProcess(tmp_path, up.base_url, compaction=INLINE, admin={"token": TOKEN}) as px,
    ):
        yield px


def test_the_shipped_config_says_how_to_send_the_admin_token() -> None:
    text = SHIPPED.read_text()
    assert "credentials_file" in text and "admin" in text


def test_prometheus_scrapes_what_the_admin_api_reports(proxy: ProxyProcess, tmp_path: Path) -> None:
    client = openai.OpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You help with billing."}]
    for text in [t for t in user_turns(2 * TURNS) if "[[tool:" not in t][:TURNS]:
        messages.append({"role": "user", "content": text})
        answer = client.chat.completions.create(model="gpt-4o-mini", messages=messages)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    auth = {"authorization": f"Bearer {TOKEN}"}

    def totals() -> dict[str, Any]:
        r = httpx.get(f"{proxy.root}/admin/api/stats", headers=auth, timeout=10)
        r.raise_for_status()
        return dict(r.json()["totals"])

    # The ledger is written in batches after each answer.
    assert wait_for(lambda: totals().get("requests") == TURNS), totals()
    reported = totals()
    assert reported["saved_tokens"] > 0 and reported["compactions"] > 0, reported

    work = tmp_path / "prometheus"
    work.mkdir()
    prom = Prometheus(work, f"127.0.0.1:{proxy.port}", TOKEN).start()
    try:
        assert wait_for(lambda: any(t["health"] == "up" for t in prom.targets())), prom.targets()
        for promql, key in HEADLINES.items():
            assert wait_for(lambda q=promql, k=key: prom.query(q) == reported[k]), (
                promql,
                prom.query(promql),
                reported[key],
            )
    finally:
        prom.stop()
    assert totals() == reported  # nothing moved while Prometheus scraped
