"""Trust before turning it on: shadow mode, opt-outs, and the client's own compaction.

A real proxy process, the official openai client, the recording upstream. What the upstream
received is compared with the exact bytes the client sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.checks import LOW_TRIGGER, summary_index
from tests.conversations import drive_conversation, take_responses_output, user_turns
from tests.proxyproc import ProxyProcess
from tests.upstream import SHARED_MARK, ScriptedUpstream

SYSTEM = "You are a careful coding assistant for the billing service."
MODEL = "gpt-4o-mini"
ADMIN = {"token": "admin-secret-for-tests"}
AUTH = {"authorization": f"Bearer {ADMIN['token']}"}


@pytest.fixture(scope="module")
def upstream() -> Any:
    with ScriptedUpstream() as up:
        yield up


class RecordingClient:
    """The official client, with the exact body bytes of every request it sent kept."""

    def __init__(
        self, base_url: str, api_key: str = "sk-user-one", model: str = MODEL, **headers: str
    ) -> None:
        self.model = model
        self.sent: list[bytes] = []
        http = httpx.Client(event_hooks={"request": [self._record]})
        self.client = openai.OpenAI(
            base_url=base_url,
            api_key=api_key,
            max_retries=0,
            http_client=http,
            default_headers=headers or None,
        )
        self.headers: list[dict[str, str]] = []

    def _record(self, request: httpx.Request) -> None:
        self.sent.append(request.read())

    def send(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        raw = self.client.chat.completions.with_raw_response.create(
            model=self.model, messages=messages, **kwargs
        )
        self.headers.append(dict(raw.headers))
        parsed = raw.parse()
        if kwargs.get("stream"):
            text = "".join(c.choices[0].delta.content or "" for c in parsed if c.choices)
            return {"role": "assistant", "content": text}
        return parsed.choices[0].message.model_dump(exclude_none=True)


def wait_for(condition: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Poll until ``condition()`` is truthy (background work lands after the response)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def admin_get(px: ProxyProcess, path: str) -> Any:
    response = httpx.get(f"{px.root}{path}", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def client_bodies(upstream: ScriptedUpstream, start: int = 0) -> list[bytes]:
    return [r.body for r in upstream.chat_requests()[start:]]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_shadow_mode_forwards_every_body_byte_for_byte_and_reports_what_it_would_save(
    upstream: ScriptedUpstream, tmp_path: Path, stream: bool
) -> None:
    upstream.reset()
    settings = {**LOW_TRIGGER, "mode": "shadow"}
    with ProxyProcess(tmp_path, upstream.base_url, compaction=settings, admin=ADMIN) as px:
        client = RecordingClient(px.base_url)
        drive_conversation(lambda m: client.send(m, stream=stream), 40, SYSTEM)
        assert client_bodies(upstream) == client.sent, "shadow mode changed a forwarded body"
        assert all(h["x-compaction-case"] == "shadow" for h in client.headers)
        for h in client.headers:
            assert h["x-compaction-forwarded-tokens"] == h["x-compaction-original-tokens"]
        would = [int(h["x-compaction-shadow-forwarded-tokens"]) for h in client.headers]
        original = [int(h["x-compaction-original-tokens"]) for h in client.headers]
        assert would[-1] < 0.6 * original[-1], "no would-be compaction was applied"
        assert any(h["x-compaction-shadow-case"] == "summarize" for h in client.headers)
        # The would-be compactions really ran (their summarizer calls cost money) ...
        assert len(upstream.chat_requests("summarizer")) >= 1

        stats = wait_for(lambda: admin_get(px, "/admin/api/stats")["totals"].get("shadow"))
        totals = admin_get(px, "/admin/api/stats")["totals"]
        # ... and the operator sees them, apart from what was really saved (nothing).
        assert totals["saved_tokens"] == 0
        assert totals["forwarded_tokens"] == totals["original_tokens"]
        assert stats["requests"] == len(client.sent)
        assert stats["saved_tokens"] > 0 and stats["saved_pct"] > 0
        assert "net_saved_usd" in stats
        items = admin_get(px, "/admin/api/conversations")["items"]
        assert len(items) == 1
        detail = admin_get(px, f"/admin/api/conversations/{items[0]['id']}")
        assert detail["compactions"], "the would-be compactions are listed"
        assert detail["compactions"][0]["summary"] and "facts_dropped" in detail["compactions"][0]
        assert all(r["shadow"] for r in detail["requests"])
        metrics = httpx.get(f"{px.root}/metrics", headers=AUTH).text
        assert 'case="shadow"' in metrics
        shadow_line = next(
            line
            for line in metrics.splitlines()
            if line.startswith("compaction_proxy_shadow_saved_prompt_tokens_total{")
        )
        assert float(shadow_line.rsplit(" ", 1)[1]) > 0
        page = httpx.get(f"{px.root}/dashboard", headers=AUTH).text
        assert "Shadow mode" in page


def test_shadow_header_measures_one_request_without_changing_it(
    upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    upstream.reset()
    settings = {**LOW_TRIGGER, "mode": "inline"}
    with ProxyProcess(tmp_path, upstream.base_url, compaction=settings, admin=ADMIN) as px:
        plain = RecordingClient(px.base_url)
        final = drive_conversation(plain.send, 30, SYSTEM)
        assert summary_index(upstream.chat_requests()[-1].json["messages"]) is not None
        shadowed = RecordingClient(px.base_url, **{"x-compaction": "shadow"})
        before = len(upstream.chat_requests())
        shadowed.send([*final, {"role": "user", "content": "And now?"}])
        assert client_bodies(upstream, before) == shadowed.sent
        assert shadowed.headers[0]["x-compaction-case"] == "shadow"
        assert shadowed.headers[0]["x-compaction-shadow-case"] == "summarize"


def _long_history(client: RecordingClient) -> list[dict[str, Any]]:
    """A history far over the low trigger (built through the proxy, so it is realistic)."""
    return drive_conversation(client.send, 30, SYSTEM)


@pytest.mark.parametrize(
    ("compaction", "headers", "reason"),
    [
        ({"opt_out_models": ["gpt-4o-mini*"]}, {}, "model"),
        ({"opt_out_tenants": ["team-reports"]}, {"x-compaction-tenant": "team-reports"}, "name"),
    ],
    ids=["model-glob", "tenant-name"],
)
def test_configured_opt_outs_forward_exactly_as_sent(
    upstream: ScriptedUpstream,
    tmp_path: Path,
    compaction: dict[str, Any],
    headers: dict[str, str],
    reason: str,
) -> None:
    upstream.reset()
    settings = {**LOW_TRIGGER, "mode": "inline", **compaction}
    with ProxyProcess(tmp_path, upstream.base_url, compaction=settings, admin=ADMIN) as px:
        client = RecordingClient(px.base_url, **headers)
        _long_history(client)
        assert client_bodies(upstream) == client.sent
        assert {h["x-compaction-case"] for h in client.headers} == {"opt-out"}
        assert not upstream.chat_requests("summarizer")
        totals = wait_for(lambda: admin_get(px, "/admin/api/stats")["totals"].get("opted_out"))
        assert totals == len(client.sent)
        # Another tenant (or model) on the same proxy is still compacted.
        other = RecordingClient(px.base_url, api_key="sk-user-two", model="gpt-4o")
        start = len(upstream.chat_requests())
        _long_history(other)
        assert any(h["x-compaction-case"] == "summarize" for h in other.headers)
        assert client_bodies(upstream, start) != other.sent


def test_tenant_id_from_the_dashboard_opts_a_key_out(
    upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    upstream.reset()
    from proxy.core.fingerprint import tenant_id

    settings = {
        **LOW_TRIGGER,
        "mode": "inline",
        "opt_out_tenants": [tenant_id("sk-user-one", None)],
    }
    with ProxyProcess(tmp_path, upstream.base_url, compaction=settings, admin=ADMIN) as px:
        client = RecordingClient(px.base_url)
        _long_history(client)
        assert client_bodies(upstream) == client.sent


def test_pausing_one_conversation_from_the_admin_api_and_resuming_it(
    upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    upstream.reset()
    settings = {**LOW_TRIGGER, "mode": "inline"}
    with ProxyProcess(tmp_path, upstream.base_url, compaction=settings, admin=ADMIN) as px:
        # One conversation throughout (the client names it, as chat UIs do).
        client = RecordingClient(px.base_url, **{"x-conversation-id": "ticket-77"})
        first = client.send(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
        )
        assert first["role"] == "assistant"
        conv = admin_get(px, "/admin/api/conversations")["items"][0]["id"]
        no_token = httpx.post(f"{px.root}/admin/api/conversations/{conv}/pause")
        assert no_token.status_code == 401
        paused = httpx.post(f"{px.root}/admin/api/conversations/{conv}/pause", headers=AUTH)
        assert paused.status_code == 200 and paused.json()["paused"] is True
        assert admin_get(px, f"/admin/api/conversations/{conv}")["meta"]["paused"] is True

        client.sent.clear()
        client.headers.clear()
        start = len(upstream.chat_requests())
        final = _long_history(client)
        assert client_bodies(upstream, start) == client.sent
        assert {h["x-compaction-case"] for h in client.headers} == {"opt-out"}
        row = admin_get(px, "/admin/api/conversations")["items"][0]
        assert row["paused"] is True
        assert "paused" in httpx.get(f"{px.root}/dashboard/conversations/{conv}", headers=AUTH).text

        resumed = httpx.post(f"{px.root}/admin/api/conversations/{conv}/resume", headers=AUTH)
        assert resumed.json()["paused"] is False
        client.send([*final, {"role": "user", "content": "Where were we?"}])
        assert client.headers[-1]["x-compaction-case"] == "summarize"


CLAUDE_CODE_COMPACT = (
    "Your task is to create a detailed summary of the conversation so far, paying close "
    "attention to the user's explicit requests and your previous actions."
)


def test_a_clients_own_compaction_request_is_never_compacted(
    upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    upstream.reset()
    settings = {**LOW_TRIGGER, "mode": "inline"}
    with ProxyProcess(tmp_path, upstream.base_url, compaction=settings, admin=ADMIN) as px:
        client = RecordingClient(px.base_url)
        history = _long_history(client)
        summarizer_calls = len(upstream.chat_requests("summarizer"))
        client.sent.clear()
        start = len(upstream.chat_requests())
        client.send([*history, {"role": "user", "content": CLAUDE_CODE_COMPACT}])
        assert client_bodies(upstream, start) == client.sent
        assert client.headers[-1]["x-compaction-case"] == "client-compaction"
        assert len(upstream.chat_requests("summarizer")) == summarizer_calls
        totals = wait_for(
            lambda: admin_get(px, "/admin/api/stats")["totals"].get("client_compactions")
        )
        assert totals == 1
        forwarded = orjson.loads(upstream.chat_requests()[-1].body)["messages"]
        assert forwarded[-1]["content"] == CLAUDE_CODE_COMPACT


CODEX_SUMMARY = (
    "Another language model started to solve this problem and produced a summary of its "
    "thinking process. Here is the summary: the invoice parser fails on EUR amounts; "
    "ticket PAY-4410; the fix goes in src/billing/parse.py."
)


def test_the_summary_a_client_continues_from_is_pinned_never_summarized_again(
    upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    upstream.reset()
    settings = {**LOW_TRIGGER, "mode": "inline"}
    with ProxyProcess(tmp_path, upstream.base_url, compaction=settings, admin=ADMIN) as px:
        client = RecordingClient(px.base_url)
        first = {"role": "user", "content": "Continue the billing work."}
        summary = {"role": "user", "content": CODEX_SUMMARY}
        history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, first]
        history.append(client.send(history))
        history.append(summary)

        def send(messages: list[dict[str, Any]]) -> dict[str, Any]:
            return client.send([*history, *messages[1:]])

        drive_conversation(send, 25, SYSTEM)
        assert any(h["x-compaction-case"] == "summarize" for h in client.headers)
        for request in upstream.chat_requests()[1:]:  # the first came before the summary
            forwarded = request.json["messages"]
            assert summary in forwarded, "the client's own summary was not forwarded as sent"
        for request in upstream.chat_requests("summarizer"):
            body = request.body.decode()
            if SHARED_MARK in body:
                continue  # (the conversation as forwarded, where the pin stays as it is)
            assert "Another language model started" not in body
        for request in upstream.chat_requests()[1:]:
            for m in request.json["messages"]:
                if str(m.get("content", "")).startswith("[History Summary - "):
                    assert "Another language model started" not in m["content"]


def test_a_responses_compaction_item_stays_first_and_opaque(
    upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    """Codex's remote compaction leaves an encrypted ``compaction`` item at the start of the
    input: it is forwarded as sent, in place, and never shown to the summarizer."""
    upstream.reset()
    item = {"type": "compaction", "encrypted_content": "gAAAAB" + "Zx9q" * 400}
    settings = {**LOW_TRIGGER, "mode": "inline"}
    with ProxyProcess(tmp_path, upstream.base_url, compaction=settings, admin=ADMIN) as px:
        client = openai.OpenAI(base_url=px.base_url, api_key="sk-user-one", max_retries=0)
        items: list[dict[str, Any]] = [item]
        for text in user_turns(25):
            items.append({"role": "user", "content": text})
            for _ in range(5):
                response = client.responses.create(model=MODEL, instructions=SYSTEM, input=items)
                output = [o.model_dump(exclude_none=True) for o in response.output]
                if not take_responses_output(items, output):
                    break
        forwarded = [r.json["input"] for r in upstream.requests if r.path == "/v1/responses" and r.purpose is None]
        sent_sizes = [len(orjson.dumps(f)) for f in forwarded]
        assert any("[History Summary" in orjson.dumps(f).decode() for f in forwarded), (
            "no compaction happened",
            sent_sizes,
        )
        assert all(f[0] == item for f in forwarded), "the compaction item moved or changed"
        assert not upstream.rejections
        for request in upstream.chat_requests("summarizer"):
            assert "Zx9qZx9q" not in request.body.decode()


def test_responses_compact_is_relayed_and_counted_as_a_client_compaction(
    upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    upstream.reset()
    with ProxyProcess(tmp_path, upstream.base_url, compaction=LOW_TRIGGER, admin=ADMIN) as px:
        client = openai.OpenAI(base_url=px.base_url, api_key="sk-user-one", max_retries=0)
        items = [{"role": "user", "content": "compact this please"}]
        raw = client.responses.with_raw_response.compact(model=MODEL, input=items)
        assert raw.status_code == 200
        received = [r for r in upstream.requests if r.path == "/v1/responses/compact"]
        assert len(received) == 1 and received[0].json["input"] == items
        totals = wait_for(
            lambda: admin_get(px, "/admin/api/stats")["totals"].get("client_compactions")
        )
        assert totals == 1


def test_shadow_sampling_runs_no_summaries_outside_the_sample(
    upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    from proxy.core.controls import sampled

    assert sampled("any", 1.0) and not sampled("any", 0.0)
    share = sum(sampled(f"conv-{i}", 0.25) for i in range(4000)) / 4000
    assert 0.2 < share < 0.3
    assert all(sampled(f"conv-{i}", 0.25) == sampled(f"conv-{i}", 0.25) for i in range(50))

    upstream.reset()
    settings = {**LOW_TRIGGER, "mode": "shadow", "shadow_sample_rate": 0.0}
    with ProxyProcess(tmp_path, upstream.base_url, compaction=settings, admin=ADMIN) as px:
        client = RecordingClient(px.base_url)
        drive_conversation(client.send, 25, SYSTEM)
        assert client_bodies(upstream) == client.sent
        assert not upstream.chat_requests("summarizer")
        assert {h["x-compaction-case"] for h in client.headers} == {"shadow"}
