"""Traces in a real collector (issue #27): Arize Phoenix, started by the test, receives a
10-turn conversation with a compaction through each front door (the standalone proxy, a
LiteLLM proxy with the hook), and the spans are read back from Phoenix's REST API.

Checked on what Phoenix stored and what the strict upstream received: one span per request
with the GenAI attributes and ours, the upstream call under it (its traceparent, in the
client's trace, is the one the upstream got), a compaction span with its event and one span
per detector/summarizer call; no message text anywhere; the same spans through both doors.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from proxy.core import keyfacts
from tests.conversations import user_turns
from tests.litellmproc import MODEL, LiteLLMProcess
from tests.phoenix import Phoenix
from tests.proxyproc import ProxyProcess
from tests.tracedchat import (
    CLIENT_SPAN,
    COMPACTION,
    SYSTEM,
    TURNS,
    all_arrived,
    children,
    converse,
    otel_env,
    ours,
    short_summary,
    spans_when,
    traced_proxy,
)
from tests.upstream import ScriptedUpstream

TOKEN = "admin-traces"

# The LiteLLM hook does not own the forwarding, so it makes no summarizer call in the
# client's shape (proxy.core.sharedcall): the two doors are compared with it off on both.
BOTH_DOORS = {**COMPACTION, "summary_reads_cache": "off"}


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phoenix]:
    with Phoenix(tmp_path_factory.mktemp("phoenix")) as ph:
        yield ph


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
        with traced_proxy(
            tmp_path, up, phoenix, project, trace, compaction=COMPACTION, admin={"token": TOKEN}
        ) as (px, client):
            headers = converse(client)
            spans = spans_when(phoenix, project, all_arrived)
            check_net(spans, px)
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
        with ScriptedUpstream(summarizer=short_summary) as up, contextlib.ExitStack() as stack:
            client: openai.OpenAI
            if door == "server":
                proxy = traced_proxy(work, up, phoenix, project, trace, compaction=BOTH_DOORS)
                _, client = stack.enter_context(proxy)
            else:
                proc = LiteLLMProcess(
                    work, up.base_url, BOTH_DOORS, f"diskcache://{work / 'store'}", "env"
                )
                proc.env.update(otel_env(phoenix, project))
                stack.callback(proc.stop)
                proc.start()
                client = proc.client(tenant="traced")
                client = client.with_options(
                    default_headers={
                        "x-compaction-tenant": "traced",
                        "traceparent": f"00-{trace}-{CLIENT_SPAN}-01",
                    }
                )
            headers = converse(client)
            spans = spans_when(phoenix, project, all_arrived)
            check_spans(spans, headers, up, trace)
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
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": phoenix.grpc_url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "true",
    }
    question = "Which ledger column holds the refund id?"
    with (
        ScriptedUpstream() as up,
        traced_proxy(tmp_path, up, phoenix, project, None, env) as (_, client),
    ):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}]
        )
        spans = spans_when(phoenix, project, lambda s: len(ours(s)) == 1)
    (span,) = ours(spans)
    assert question in span["attributes"]["gen_ai.input.messages"]


def test_a_background_compaction_joins_the_trace_of_the_request_that_scheduled_it(
    phoenix: Phoenix, tmp_path: Path
) -> None:
    project = "background-" + secrets.token_hex(4)
    trace = secrets.token_hex(16)
    # A trigger the chat crosses early enough for a later turn to use what was made.
    background = {**COMPACTION, "mode": "background", "trigger_tokens": 3000}
    with (
        ScriptedUpstream(summarizer=short_summary) as up,
        traced_proxy(tmp_path, up, phoenix, project, trace, compaction=background) as (_, client),
    ):
        history: list[dict[str, Any]] = []
        headers = converse(client, history)
        spans = spans_when(
            phoenix, project, lambda s: all_arrived(s) and any(x["events"] for x in s)
        )
        # A compaction's span ends once its record is stored: the next turn uses it (on a
        # busy machine the chat may end before the compaction does).
        history.append({"role": "user", "content": "Where did we leave the refund ledger?"})
        reply = client.chat.completions.with_raw_response.create(model=MODEL, messages=history)
    cases = [h["x-compaction-case"] for h in headers] + [reply.headers["x-compaction-case"]]
    assert cases[-1] == "summarize", cases  # used once it was made
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
