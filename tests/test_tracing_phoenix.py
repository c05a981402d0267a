"""Traces in a real collector (issue #27): Arize Phoenix, started by the test, receives a
10-turn conversation with a compaction through each front door (the standalone proxy, a
LiteLLM proxy with the hook), and the spans are read back from Phoenix's REST API.

Checked on what Phoenix stored and what the strict upstream received: one span per request
with the GenAI attributes and ours, the upstream call under it (its traceparent, in the
client's trace, is the one the upstream got), a compaction span with its event and one span
per detector/summarizer call; no message text anywhere; the same spans through both doors.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from proxy.core import keyfacts
from tests.checks import INLINE
from tests.conversations import user_turns
from tests.litellmproc import MODEL, LiteLLMProcess
from tests.phoenix import Phoenix
from tests.proxyproc import ProxyProcess
from tests.upstream import ScriptedUpstream

SYSTEM = "You are a careful coding assistant for the billing service."
TURNS = 10
# A short summary and a tight key-references line: the compaction drops facts, whose ids and
# categories (never their text) the compaction event carries.
COMPACTION = {**INLINE, "key_references_max_chars": 40}
CLIENT_SPAN = "00f067aa0ba902b7"
TOKEN = "admin-traces"
ANTHROPIC = "anthropic/claude-haiku-4-5"


def short_summary(request: dict[str, Any]) -> str:
    return "The user and the assistant worked through the billing service refactor together."


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phoenix]:
    with Phoenix(tmp_path_factory.mktemp("phoenix")) as ph:
        yield ph


def otel_env(phoenix: Phoenix, project: str, **more: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": phoenix.url,
        "OTEL_RESOURCE_ATTRIBUTES": f"openinference.project.name={project}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: export soon after each request
        **more,
    }


def converse(client: openai.OpenAI) -> list[dict[str, str]]:
    """A plain chat past the inline trigger, every other turn streamed; each turn's
    ``x-compaction-*`` response headers."""
    texts = [t for t in user_turns(2 * TURNS) if "[[tool:" not in t][:TURNS]
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    seen = []
    for i, text in enumerate(texts):
        messages.append({"role": "user", "content": text})
        if i % 2:
            with client.chat.completions.with_streaming_response.create(
                model=MODEL, messages=messages, stream=True
            ) as raw:
                headers = raw.headers
                chunks = list(raw.parse())
            reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            raw_whole = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages
            )
            headers = raw_whole.headers
            reply = raw_whole.parse().choices[0].message.content or ""
        seen.append({k: v for k, v in headers.items() if k.startswith("x-compaction")})
        messages.append({"role": "assistant", "content": reply})
    return seen


def spans_when(
    phoenix: Phoenix, project: str, ready: Callable[[list[dict[str, Any]]], bool]
) -> list[dict[str, Any]]:
    """Phoenix's spans of ``project`` once ``ready`` holds (export is batched, then stored)."""
    deadline = time.monotonic() + 60
    spans = phoenix.spans(project)
    while not ready(spans) and time.monotonic() < deadline:
        time.sleep(0.5)
        spans = phoenix.spans(project)
    return spans


def ours(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request spans (LiteLLM may export its own spans too), in order."""
    found = [s for s in spans if "compaction_proxy.route" in s["attributes"]]
    return sorted(found, key=lambda s: s["start_time"])


def children(spans: list[dict[str, Any]], parent: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in spans if s["parent_id"] == parent["context"]["span_id"]]


def all_arrived(spans: list[dict[str, Any]]) -> bool:
    requests = ours(spans)
    llm = [s for s in spans if "compaction_proxy.purpose" in s["attributes"]]
    ups = [s for s in spans if s["name"] == "upstream"]
    return len(requests) == TURNS and len(ups) == TURNS and len(llm) >= 2


def shape(spans: list[dict[str, Any]]) -> dict[str, Any]:
    """What must be the same whichever door: per request its case, tokens and usage; the
    compaction spans' events; the detector/summarizer calls."""
    varying = {"compaction_proxy.route", "compaction_proxy.tenant", "compaction_proxy.overhead_ms"}
    requests = []
    for span in ours(spans):
        a = span["attributes"]
        requests.append(
            {
                "name": span["name"],
                "keys": sorted(k for k in a if k.startswith(("gen_ai.", "compaction_proxy."))),
                **{k: v for k, v in a.items() if k.startswith(("gen_ai.", "compaction_proxy."))}
                | {"gen_ai.conversation.id": None, "compaction_proxy.record": None}
                | dict.fromkeys(varying),
                "children": sorted(c["name"] for c in children(spans, span)),
            }
        )
    events = [
        {k: v for k, v in e["attributes"].items() if k.split(".")[-1] not in ("record", "ids")}
        | {"ids": len(e["attributes"]["compaction_proxy.facts.dropped.ids"])}
        for s in spans
        if s["name"] == "compaction"
        for e in s["events"]
    ]
    llm = sorted(
        s["attributes"]["compaction_proxy.purpose"]
        for s in spans
        if "compaction_proxy.purpose" in s["attributes"]
    )
    return {"requests": requests, "events": events, "llm": llm}


def check_spans(
    spans: list[dict[str, Any]], headers: list[dict[str, str]], up: ScriptedUpstream, trace: str
) -> None:
    requests = ours(spans)
    assert len(requests) == TURNS
    forwarded = up.chat_requests(None)
    assert len(forwarded) == TURNS
    for span, head, sent in zip(requests, headers, forwarded, strict=True):
        a = span["attributes"]
        assert span["name"] == f"chat {MODEL}"
        assert span["context"]["trace_id"] == trace
        assert span["parent_id"] == CLIENT_SPAN  # the client's span: its trace continues
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.provider.name"] == "openai"
        assert a["gen_ai.request.model"] == MODEL
        assert a["gen_ai.response.model"] == sent.json["model"].split("/")[-1]
        assert a["compaction_proxy.case"] == head["x-compaction-case"]
        assert a["compaction_proxy.tokens.original"] == int(head["x-compaction-original-tokens"])
        assert a["compaction_proxy.tokens.forwarded"] == int(head["x-compaction-forwarded-tokens"])
        assert a["gen_ai.conversation.id"] == head["x-compaction-conversation"]
        assert a["gen_ai.conversation.compacted"] == (head["x-compaction-case"] == "summarize")
        assert len(a["compaction_proxy.tenant"]) >= 16  # a hash, never the key
        assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] > 0
        assert "gen_ai.usage.cache_read.input_tokens" in a
        assert "gen_ai.usage.cache_creation.input_tokens" in a
        # The upstream got the traceparent of the upstream span under this request's span.
        upstream = [c for c in children(spans, span) if c["name"] == "upstream"]
        assert len(upstream) == 1
        context = upstream[0]["context"]
        assert sent.headers["traceparent"] == f"00-{trace}-{context['span_id']}-01"
    cases = [h["x-compaction-case"] for h in headers]
    assert "summarize" in cases, cases
    compacted_at = cases.index("summarize")
    (compaction,) = [s for s in spans if s["name"] == "compaction"]
    assert compaction["parent_id"] == requests[compacted_at]["context"]["span_id"]
    (event,) = compaction["events"]
    e = event["attributes"]
    assert event["name"] == "gen_ai.conversation.compacted"
    assert e["gen_ai.conversation.compacted"] is True
    assert e["compaction_proxy.case"] == "summarize"
    assert e["compaction_proxy.facts.dropped"] > 0
    ids, kinds = (
        e["compaction_proxy.facts.dropped.ids"],
        e["compaction_proxy.facts.dropped.categories"],
    )
    assert len(ids) == len(kinds) == e["compaction_proxy.facts.dropped"]
    assert all(i.startswith(e["compaction_proxy.record"] + "#") for i in ids)
    assert set(kinds) <= {kind for kind, _, _ in keyfacts._COMPILED} | {"other"}, kinds
    # One span per detector/summarizer call the upstream received, under the compaction.
    calls = [s for s in spans if "compaction_proxy.purpose" in s["attributes"]]
    internal = up.chat_requests("detector") + up.chat_requests("summarizer")
    assert sorted(s["attributes"]["compaction_proxy.purpose"] for s in calls) == sorted(
        r.purpose for r in internal
    )
    assert all(s["parent_id"] == compaction["context"]["span_id"] for s in calls)
    # Each call's request carried its span's context: a collector at the summarizer joins.
    sent_context = sorted(r.headers.get("traceparent", "") for r in internal)
    assert sent_context == sorted(f"00-{trace}-{s['context']['span_id']}-01" for s in calls)


def check_net(spans: list[dict[str, Any]], px: ProxyProcess) -> None:
    """Each request span's net dollars are the ledger's for that request (the admin API's
    conversation page), and with the compaction's detector/summarizer spend they add up to
    the conversation's net."""
    requests = ours(spans)
    last = requests[-1]["attributes"]  # (the first request's row joined the session's)
    name = f"{last['compaction_proxy.tenant']}:{last['gen_ai.conversation.id']}"
    auth = {"authorization": f"Bearer {TOKEN}"}
    url = f"{px.root}/admin/api/conversations/{name}"
    detail = httpx.get(url, headers=auth, timeout=10).json()
    assert "requests" in detail, detail
    recorded = [r["net_usd"] for r in detail["requests"]]
    assert len(recorded) == TURNS and all(isinstance(n, float) for n in recorded), recorded
    on_spans = [s["attributes"]["compaction_proxy.usd.net"] for s in requests]
    assert on_spans == recorded
    assert any(n > 0 for n in on_spans), on_spans
    llm = sum(
        e["attributes"]["compaction_proxy.llm.usd"]
        for s in spans
        if s["name"] == "compaction"
        for e in s["events"]
    )
    assert detail["meta"]["llm_usd"] == pytest.approx(llm, abs=1e-8)
    assert sum(on_spans) - llm == pytest.approx(detail["meta"]["net_saved_usd"], abs=1e-8)


def assert_no_content(spans: list[dict[str, Any]], texts: list[str]) -> None:
    dumped = orjson.dumps(spans).decode()
    assert SYSTEM not in dumped
    for text in texts:
        assert text[:60] not in dumped, "message content was exported"
    assert "sk-client" not in dumped


def test_the_proxy_exports_a_compacted_conversation_to_phoenix(
    phoenix: Phoenix, tmp_path: Path
) -> None:
    trace = secrets.token_hex(16)
    project = "proxy-" + secrets.token_hex(4)
    with ScriptedUpstream(summarizer=short_summary) as up:
        px = ProxyProcess(tmp_path, up.base_url, compaction=COMPACTION, admin={"token": TOKEN})
        px.start(env=otel_env(phoenix, project))
        client = openai.OpenAI(
            base_url=px.base_url,
            api_key="sk-client",
            max_retries=0,
            default_headers={"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"},
        )
        try:
            headers = converse(client)
            spans = spans_when(phoenix, project, all_arrived)
            check_net(spans, px)
        finally:
            px.stop()
        check_spans(spans, headers, up, trace)
    texts = [t for t in user_turns(2 * TURNS) if "[[tool:" not in t][:TURNS]
    assert_no_content(spans, texts)


def test_both_front_doors_export_the_same_spans(phoenix: Phoenix, tmp_path: Path) -> None:
    shapes = []
    for door in ("server", "litellm"):
        trace = secrets.token_hex(16)
        project = f"{door}-" + secrets.token_hex(4)
        work = tmp_path / door
        work.mkdir()
        with ScriptedUpstream(summarizer=short_summary) as up:
            if door == "server":
                px = ProxyProcess(work, up.base_url, compaction=COMPACTION)
                px.start(env=otel_env(phoenix, project))
                client = openai.OpenAI(
                    base_url=px.base_url,
                    api_key="sk-client",
                    max_retries=0,
                    default_headers={"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"},
                )
                stop = px.stop
            else:
                proc = LiteLLMProcess(
                    work, up.base_url, COMPACTION, f"diskcache://{work / 'store'}", "env"
                )
                proc.env.update(otel_env(phoenix, project))
                proc.start()
                client = proc.client(tenant="traced")
                client = client.with_options(
                    default_headers={
                        "x-compaction-tenant": "traced",
                        "traceparent": f"00-{trace}-{CLIENT_SPAN}-01",
                    }
                )
                stop = proc.stop
            try:
                headers = converse(client)
                spans = spans_when(phoenix, project, all_arrived)
                check_spans(spans, headers, up, trace)
            finally:
                stop()
        shapes.append(shape(spans))
    server, hook = shapes
    assert hook == server, "\n".join(differences(hook, server))


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two shapes differ, for the failure message."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            d
            for k in sorted(a.keys() | b.keys())
            for d in differences(a.get(k), b.get(k), f"{where}.{k}")
        ]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y, f"{where}[{i}]")
        ]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def test_grpc_and_content_when_the_operator_asks(phoenix: Phoenix, tmp_path: Path) -> None:
    """``OTEL_EXPORTER_OTLP_PROTOCOL=grpc`` reaches Phoenix's gRPC receiver, and with content
    capture turned on the forwarded messages are on the request span."""
    project = "grpc-" + secrets.token_hex(4)
    env = otel_env(
        phoenix,
        project,
        OTEL_EXPORTER_OTLP_ENDPOINT=phoenix.grpc_url,
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT="true",
    )
    with ScriptedUpstream() as up:
        px = ProxyProcess(tmp_path, up.base_url)
        px.start(env=env)
        try:
            client = openai.OpenAI(base_url=px.base_url, api_key="sk-client", max_retries=0)
            question = "Which ledger column holds the refund id?"
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": question}]
            )
            spans = spans_when(phoenix, project, lambda s: len(ours(s)) == 1)
        finally:
            px.stop()
    (span,) = ours(spans)
    assert question in span["attributes"]["gen_ai.input.messages"]


def test_a_background_compaction_joins_the_trace_of_the_request_that_scheduled_it(
    phoenix: Phoenix, tmp_path: Path
) -> None:
    project = "background-" + secrets.token_hex(4)
    trace = secrets.token_hex(16)
    # A trigger the chat crosses early enough for a later turn to use what was made.
    background = {**COMPACTION, "mode": "background", "trigger_tokens": 3000}
    with ScriptedUpstream(summarizer=short_summary) as up:
        px = ProxyProcess(tmp_path, up.base_url, compaction=background)
        px.start(env=otel_env(phoenix, project))
        try:
            client = openai.OpenAI(
                base_url=px.base_url,
                api_key="sk-client",
                max_retries=0,
                default_headers={"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"},
            )
            headers = converse(client)
            spans = spans_when(
                phoenix, project, lambda s: all_arrived(s) and any(x["events"] for x in s)
            )
        finally:
            px.stop()
    assert "summarize" in [h["x-compaction-case"] for h in headers]  # used once it was made
    compactions = [s for s in spans if s["name"] == "compaction" and s["events"]]
    assert compactions, [s["name"] for s in spans]
    first = min(compactions, key=lambda s: s["start_time"])
    requests = {s["context"]["span_id"]: s for s in ours(spans)}
    for compaction in compactions:
        scheduled_by = requests[compaction["parent_id"]]  # a request span of this trace
        assert compaction["context"]["trace_id"] == trace
        # Scheduled after a request that went as sent, or under the record a first
        # background compaction made (this chat crosses the trigger twice).
        assert scheduled_by["attributes"]["compaction_proxy.case"] in ("none", "summarize")
        assert compaction["attributes"]["compaction_proxy.inline"] is False
        assert compaction["start_time"] >= scheduled_by["start_time"]
    assert requests[first["parent_id"]]["attributes"]["compaction_proxy.case"] == "none"


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
        root = up.base_url.removesuffix("/v1")
        env = otel_env(phoenix, project, ANTHROPIC_API_BASE=root, ANTHROPIC_API_KEY="sk-ant-x")
        px = ProxyProcess(tmp_path, up.base_url, compaction=other)
        px.start(env=env)
        try:
            client = openai.OpenAI(
                base_url=px.base_url,
                api_key="sk-client",
                max_retries=0,
                default_headers={"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"},
            )
            converse(client)
            spans = spans_when(phoenix, project, all_arrived)
        finally:
            px.stop()
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
        px = ProxyProcess(tmp_path, up.base_url)
        px.start(env=otel_env(phoenix, project))
        try:
            client = openai.OpenAI(
                base_url=px.base_url, api_key="sk-client", max_retries=0, default_headers=context
            )
            assert client.models.list().data
            client.embeddings.create(model="text-embedding-3-small", input="refund ledger")
            file = httpx.get(f"{px.base_url}/files/file-1", headers=context, timeout=10)
            # The reachability probe, answered 503 by the upstream.
            failing = {**context, "x-test-status": "503"}
            probe = httpx.head(f"{px.root}/", headers=failing, timeout=10)
            spans = spans_when(phoenix, project, lambda s: len(s) == 8)
        finally:
            px.stop()
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
    embeddings = requests["embeddings text-embedding-3-small"]["attributes"]
    assert embeddings["gen_ai.operation.name"] == "embeddings"
    assert embeddings["gen_ai.request.model"] == "text-embedding-3-small"
    assert embeddings["gen_ai.provider.name"] == "openai"
    assert "refund ledger" not in orjson.dumps(spans).decode()
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
