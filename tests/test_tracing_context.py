"""Trace context reaching the services the proxy calls (issue #27), checked in a real Phoenix
and on what the scripted upstream received: the relayed routes (``/v1/models``, embeddings,
the probes) and a detector/summarizer on another provider, reached through LiteLLM."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.phoenix import Phoenix
from tests.tracedchat import (
    CLIENT_SPAN,
    COMPACTION,
    all_arrived,
    converse,
    spans_when,
    traced_proxy,
)
from tests.upstream import ScriptedUpstream

ANTHROPIC = "anthropic/claude-haiku-4-5"


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phoenix]:
    with Phoenix(tmp_path_factory.mktemp("phoenix")) as ph:
        yield ph


def test_a_summarizer_reached_through_litellm_gets_its_spans_traceparent(
    phoenix: Phoenix, tmp_path: Path
) -> None:
    """Detector and summarizer on another provider (``anthropic/...``, called through
    ``litellm.acompletion``): each of their requests, as the provider received it, carries the
    traceparent of its own span, in the client's trace."""
    project = "litellm-llm-" + secrets.token_hex(4)
    trace = secrets.token_hex(16)
    other = {**COMPACTION, "detection_model": ANTHROPIC, "summary_model": ANTHROPIC}
    with ScriptedUpstream() as up:
        env = {"ANTHROPIC_API_BASE": up.base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": "x"}
        with traced_proxy(tmp_path, up, phoenix, project, trace, env, compaction=other) as proxy:
            converse(proxy[1])
            spans = spans_when(phoenix, project, all_arrived)
        provider = [r for r in up.requests if r.path == "/v1/messages"]
    calls = [s for s in spans if "compaction_proxy.purpose" in s["attributes"]]
    assert len(calls) >= 2 and len(provider) == len(calls), (len(calls), len(provider))
    assert {s["attributes"]["gen_ai.request.model"] for s in calls} == {ANTHROPIC}
    assert sorted(r.headers.get("traceparent", "") for r in provider) == sorted(
        f"00-{trace}-{s['context']['span_id']}-01" for s in calls
    )


def test_relayed_routes_make_a_span_and_an_upstream_span_in_the_clients_trace(
    phoenix: Phoenix, tmp_path: Path
) -> None:
    """``/v1/models``, embeddings and the root probe, relayed as sent: each has a request span
    (the GenAI operation and model where the route names one) with an ``upstream`` span under
    it, whose traceparent the upstream received in the client's trace."""
    project = "relay-" + secrets.token_hex(4)
    trace = secrets.token_hex(16)
    context = {"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"}
    with ScriptedUpstream() as up:
        with traced_proxy(tmp_path, up, phoenix, project, trace) as (px, client):
            assert client.models.list().data
            client.embeddings.create(model="text-embedding-3-small", input="refund ledger")
            file = httpx.get(f"{px.base_url}/files/file-1", headers=context, timeout=10)
            # The reachability probe, answered 503 by the upstream.
            failing = {**context, "x-test-status": "503"}
            probe = httpx.head(f"{px.root}/", headers=failing, timeout=10)
            spans = spans_when(phoenix, project, lambda s: len(s) == 8)
        relayed = {r.path: r for r in up.requests}
    assert file.status_code == 200 and probe.status_code == 503
    assert len(spans) == 8, [s["name"] for s in spans]
    by_id = {s["context"]["span_id"]: s for s in spans}
    requests = {s["name"]: s for s in spans if s["name"] != "upstream"}
    assert set(requests) == {
        "GET /v1/models",
        "embeddings text-embedding-3-small",
        "GET /v1/files/file-1",
        "HEAD /",
    }, sorted(requests)
    for span in requests.values():
        assert span["context"]["trace_id"] == trace and span["parent_id"] == CLIENT_SPAN
        assert span["attributes"]["compaction_proxy.route"] == "passthrough"
        assert len(span["attributes"]["compaction_proxy.tenant"]) >= 16  # a hash, never the key
    embeddings = requests["embeddings text-embedding-3-small"]["attributes"]
    assert embeddings["gen_ai.operation.name"] == "embeddings"
    assert embeddings["gen_ai.request.model"] == "text-embedding-3-small"
    assert embeddings["gen_ai.provider.name"] == "openai"
    dumped = orjson.dumps(spans).decode()
    assert "refund ledger" not in dumped and "sk-client" not in dumped
    assert "gen_ai.operation.name" not in requests["GET /v1/models"]["attributes"]
    failed = requests["HEAD /"]
    assert failed["attributes"]["http.response.status_code"] == 503
    assert failed["status_code"] == "ERROR"
    assert requests["GET /v1/files/file-1"]["status_code"] != "ERROR"
    for upstream in (s for s in spans if s["name"] == "upstream"):
        parent = by_id[upstream["parent_id"]]
        path = parent["attributes"]["url.path"]
        sent = relayed[path].headers["traceparent"]
        assert sent == f"00-{trace}-{upstream['context']['span_id']}-01"
        status = upstream["attributes"]["http.response.status_code"]
        assert status == parent["attributes"]["http.response.status_code"]
