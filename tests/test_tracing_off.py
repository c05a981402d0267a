"""Traces cost nothing unless asked for, and never cost a request (issue #27).

- Without an OTLP endpoint no OpenTelemetry module is imported, through either front door.
- With an endpoint but without the ``[otel]`` extra, start-up says so and the proxy serves.
- A collector that never answers: every request is answered, the spans that could not be
  queued are counted in ``/metrics``.
- Where traces go: the standard variables, the config key, the protocol.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from proxy.config import Tracing
from proxy.engine.tracing import target
from tests.proxyproc import ProxyProcess
from tests.upstream import ScriptedUpstream

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "tracing-admin-token-0123456789abcdef"

# Builds both front doors' services and sends one chat request through the server's app
# (its lifespan runs), then prints every module loaded.
_PROBE = """
import json, sys
import httpx
from starlette.testclient import TestClient
from proxy.config import parse_config
from proxy.server.app import create_app
import hooks.litellm_compaction
from hooks.litellm_service import start_service

def answer(request):
    return httpx.Response(200, json={
        "id": "x", "object": "chat.completion", "model": "gpt-4o-mini",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "hi"}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})

config = parse_config({"store": {"url": "diskcache://" + sys.argv[1] + "/a"},
                       "admin": {"token": "t" * 32}})
with TestClient(create_app(config, transport=httpx.MockTransport(answer))) as client:
    r = client.post("/v1/chat/completions", headers={"authorization": "Bearer sk-x"},
                    json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
start_service(parse_config({"store": {"url": "diskcache://" + sys.argv[1] + "/b"}}))
print(json.dumps(sorted(sys.modules)))
"""

# Makes OpenTelemetry look uninstalled to the process (as without the [otel] extra).
_HIDE_OTEL = """
import importlib.abc, sys

class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
"""


def test_without_an_endpoint_no_opentelemetry_module_is_imported(tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(ROOT), "LITELLM_LOCAL_MODEL_COST_MAP": "True", "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,  # nothing of the OTEL_* variables this test run may have
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert "proxy.engine.tracing" in loaded  # the service ran ...
    assert [m for m in loaded if m.split(".")[0] == "opentelemetry"] == []  # ... untraced
    assert "proxy.adapters.otel" not in loaded


def _chat(px: ProxyProcess) -> httpx.Response:
    client = openai.OpenAI(base_url=px.base_url, api_key="sk-client", max_retries=0, timeout=30)
    return client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hello there"}]
    ).http_response


def test_an_endpoint_without_the_extra_says_so_and_serves(tmp_path: Path) -> None:
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(_HIDE_OTEL)
    pythonpath = f"{hide}:{ROOT}"
    with ScriptedUpstream() as up:
        px = ProxyProcess(tmp_path, up.base_url, admin={"token": TOKEN})
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "PYTHONPATH": pythonpath}
        px.start(env=env)
        try:
            assert _chat(px).status_code == 200
            metrics = httpx.get(
                f"{px.root}/metrics", headers={"authorization": f"Bearer {TOKEN}"}
            ).text
        finally:
            px.stop()
    warning = [line for line in px.logs().splitlines() if "OpenTelemetry exporter" in line]
    assert len(warning) == 1, px.logs()[-3000:]
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in warning[0]
    assert "pip install 'compaction-proxy[otel]'" in warning[0]
    assert "trace_spans_dropped" not in metrics


def test_a_collector_that_never_answers_costs_no_request(tmp_path: Path) -> None:
    # A collector that accepts connections and never answers: each export waits for its
    # timeout while requests keep ending spans into a queue of 4.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
    requests = 12
    try:
        with ScriptedUpstream() as up:
            px = ProxyProcess(tmp_path, up.base_url, admin={"token": TOKEN})
            env = {
                "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                "OTEL_BSP_MAX_QUEUE_SIZE": "4",
                "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "2",
                "OTEL_BSP_SCHEDULE_DELAY": "10",
                "OTEL_EXPORTER_OTLP_TIMEOUT": "120",
            }
            px.start(env=env)
            try:
                statuses = [_chat(px).status_code for _ in range(requests)]
                metrics = httpx.get(
                    f"{px.root}/metrics", headers={"authorization": f"Bearer {TOKEN}"}
                ).text
            finally:
                px.stop()
    finally:
        silent.close()
    assert statuses == [200] * requests
    dropped = _sample(metrics, 'compaction_proxy_trace_spans_dropped_total{reason="queue_full"}')
    # Two spans a request; at most one batch in the stuck export and 4 queued.
    assert dropped >= 2 * requests - 4 - 2, metrics


def _sample(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not in /metrics")


ENDPOINT, TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
PROTOCOL, TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


@pytest.mark.parametrize(
    ("settings", "environ", "endpoint", "protocol"),
    [
        (Tracing(), {}, None, None),
        (Tracing(), {ENDPOINT: "http://c:4318"}, None, "http/protobuf"),
        (Tracing(), {TRACES_ENDPOINT: "http://c:4317", PROTOCOL: "grpc"}, None, "grpc"),
        (
            Tracing(),
            {ENDPOINT: "http://c", TRACES_PROTOCOL: "grpc", PROTOCOL: "http/protobuf"},
            None,
            "grpc",
        ),
        (Tracing(endpoint="http://c:4318"), {}, "http://c:4318/v1/traces", "http/protobuf"),
        (Tracing(endpoint="http://c:4317", protocol="grpc"), {}, "http://c:4317", "grpc"),
        (Tracing(), {ENDPOINT: "http://c", PROTOCOL: "http/json"}, None, "http/protobuf"),
    ],
)
def test_where_traces_go(
    settings: Tracing,
    environ: dict[str, str],
    endpoint: str | None,
    protocol: str | None,
) -> None:
    found = target(settings, environ)
    if protocol is None:
        assert found is None
        return
    assert found is not None
    assert (found.endpoint, found.protocol) == (endpoint, protocol)
    assert found.capture_content is False


def test_content_is_exported_only_when_the_operator_turns_it_on() -> None:
    on = {ENDPOINT: "http://c", "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "true"}
    found = target(Tracing(), on)
    assert found is not None and found.capture_content is True
    found = target(Tracing(endpoint="http://c", capture_content=True), {})
    assert found is not None and found.capture_content is True


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", True),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", False),
        (None, None),
        ("", None),
        ("garbage", None),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", None),  # no flags
        ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", None),  # zero trace id
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", None),  # zero span id
        ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),  # forbidden version
        ("00-4bf92f3577b34da6a3ce929d0e0e473x-00f067aa0ba902b7-01", None),  # not hex
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", None),
    ],
)
def test_a_client_traceparent_is_continued_only_when_valid(
    header: str | None, expected: bool | None
) -> None:
    from proxy.adapters.otel import parse_traceparent

    found = parse_traceparent(header)
    if expected is None:
        assert found is None
    else:
        assert found == (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, expected)
