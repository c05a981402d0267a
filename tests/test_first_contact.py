"""A newcomer's first contact with the command line (issue #15): flags validated like the
config file, one clear start-up error without LiteLLM's data, `check`, an unreachable
upstream named plainly, and no temporary metrics folder left behind by `--workers`."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from proxy.adapters.reach import classify, safe_url
from proxy.config import ConfigError, parse_config
from tests.proxyproc import ProxyProcess, cli_path, free_port
from tests.upstream import ScriptedUpstream

WORKTREE = Path(__file__).resolve().parent.parent


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, str]:
    """The CLI's exit code and everything it printed."""
    done = subprocess.run(
        [cli_path(), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    return done.returncode, done.stdout + done.stderr


def yaml_error(tmp_path: Path, section: str, key: str, value: object) -> str:
    """The message the same value gets in the config file."""
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({section: {key: value}}))
    code, out = run_cli("serve", "--config", str(path))
    assert code == 2, out
    return out.strip().splitlines()[-1]


@pytest.mark.parametrize("port", [70000, 0, -1])
def test_port_flag_is_validated_like_the_config_file(tmp_path: Path, port: int) -> None:
    code, out = run_cli("serve", "--port", str(port))
    assert code == 2, out
    assert "Traceback" not in out
    expected = yaml_error(tmp_path, "listen", "port", port)
    assert expected in out  # the YAML message, word for word ...
    assert f"--port {port}" in out  # ... and which flag set it


def test_upstream_flag_is_validated_like_the_config_file(tmp_path: Path) -> None:
    code, out = run_cli("serve", "--upstream", "ftp://example")
    assert code == 2
    assert yaml_error(tmp_path, "upstream", "base_url", "ftp://example") in out
    assert "--upstream ftp://example" in out


def test_bogus_log_level_is_a_clear_error() -> None:
    code, out = run_cli("serve", "--log-level", "bogus")
    assert code == 2
    assert "Traceback" not in out and "KeyError" not in out
    assert "--log-level: must be one of" in out and "'bogus'" in out


def test_trigger_below_the_default_window_scales_the_window() -> None:
    config = parse_config({"compaction": {"trigger_tokens": 3000}})
    assert 0 < config.compaction.verbatim_window_tokens < 3000
    with pytest.raises(ConfigError) as raised:
        parse_config({"compaction": {"trigger_tokens": 3000, "verbatim_window_tokens": 4000}})
    assert "4000" in str(raised.value) and "3000" in str(raised.value)


def test_start_up_without_litellm_data_fails_once_and_clearly(tmp_path: Path) -> None:
    # A `litellm` package without its data files shadows the real one for this process.
    fake = tmp_path / "shadow" / "litellm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    path = os.pathsep.join([str(fake.parent), str(WORKTREE)])
    port = free_port()
    code, out = run_cli("serve", "--port", str(port), env={"PYTHONPATH": path})
    assert code == 2, out
    assert "Traceback" not in out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    assert "cannot start" in lines[0] and "model map" in lines[0]
    assert "pip install" in lines[0]
    code, out = run_cli("check", env={"PYTHONPATH": path})
    assert code == 1 and "model map" in out


def test_check_prints_what_it_found(tmp_path: Path) -> None:
    with ScriptedUpstream() as upstream:
        proxy = ProxyProcess(tmp_path, upstream.base_url)
        code, out = run_cli("check", "--config", str(proxy.config_path))
    assert code == 0, out
    for what in (
        "config",
        "tokenizer",
        "detector prompt",
        "summarizer prompt",
        "store",
        "upstream",
    ):
        assert any(line.startswith(what) and " ok " in line for line in out.splitlines()), out
    assert upstream.base_url in out and "HTTP 200" in out
    closed = f"http://127.0.0.1:{free_port()}/v1"
    code, out = run_cli("check", "--config", str(proxy.config_path), "--upstream", closed)
    assert code == 1
    assert f"{closed} unreachable: connection refused" in out


def test_unreachable_upstream_is_named_and_not_retried(tmp_path: Path) -> None:
    port = free_port()
    # Credentials in the URL must never be printed or sent back.
    configured = f"http://user:s3cret@127.0.0.1:{port}/v1"
    shown = f"http://127.0.0.1:{port}/v1"
    with ProxyProcess(tmp_path, configured) as px:
        r = httpx.post(
            f"{px.base_url}/chat/completions",
            json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]},
            timeout=20,
        )
        assert r.status_code == 502
        error = r.json()["error"]
        assert error["code"] == "upstream_unreachable"
        assert f"{shown}/chat/completions" in error["message"]
        assert "connection refused" in error["message"]
        assert r.headers["x-should-retry"] == "false"
        # The official SDK (2 retries by default) sends it once: our 502 says not to retry.
        before = px.logs().count("upstream failure")
        client = openai.OpenAI(base_url=px.base_url, api_key="k")
        with pytest.raises(openai.InternalServerError) as raised:
            client.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
            )
        assert shown in str(raised.value)
        assert px.logs().count("upstream failure") == before + 1
        logs = px.logs()
    assert f"-> {shown}" in logs  # the start-up line names the upstream ...
    assert "s3cret" not in logs  # ... without its credentials


def test_dns_failure_is_said_plainly() -> None:
    # Built rather than looked up: the tests never depend on a resolver's behaviour.
    request = httpx.Request("POST", "https://api.example.invalid/v1/chat/completions?key=zz")
    try:
        try:
            raise socket.gaierror(-2, "Name or service not known")
        except socket.gaierror as cause:
            raise httpx.ConnectError("[Errno -2]", request=request) from cause
    except httpx.ConnectError as exc:
        found = classify(exc, str(request.url))
    assert found.permanent
    assert "api.example.invalid does not resolve" in found.reason
    assert safe_url("https://u:p@h.example:8443/v1?key=zz") == "https://h.example:8443/v1"


def test_workers_remove_their_metrics_folder_on_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with ScriptedUpstream() as upstream:
        proxy = ProxyProcess(tmp_path, upstream.base_url)
        try:
            proxy.start(["--workers", "2"], env={"TMPDIR": str(scratch)})
            assert len(list(scratch.glob("compaction-proxy-metrics-*"))) == 1
        finally:
            proxy.stop()
    assert proxy.proc is not None and proxy.proc.returncode is not None
    assert list(scratch.glob("compaction-proxy-metrics-*")) == []


def test_conversation_id_header_is_echoed_as_sent(tmp_path: Path) -> None:
    with ScriptedUpstream() as upstream, ProxyProcess(tmp_path, upstream.base_url) as px:
        r = httpx.post(
            f"{px.base_url}/chat/completions",
            json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-conversation-id": "my-conv-42"},
            timeout=20,
        )
    assert r.status_code == 200
    assert r.headers["x-compaction-conversation"] == "my-conv-42"
