"""The proxy on the wire with official clients: streams that end before their connection
does, conversation identity, the proxy's own 4xx, bypass, response headers and start-up."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest

from tests.checks import LOW_TRIGGER
from tests.conversations import user_turns
from tests.proxyproc import ProxyProcess
from tests.strict import count_cache_control
from tests.upstream import ScriptedUpstream

CLAUDE = "claude-sonnet-4-5-20250929"
SYSTEM = "You are a careful coding assistant for the billing service."
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _forwarded_messages(up: ScriptedUpstream) -> list[dict[str, Any]]:
    return [r.json for r in up.requests if r.path == "/v1/messages"]


ADMIN = {"token": "admin-token-for-tests"}


def _metric(root: str, name: str, **labels: str) -> float:
    auth = {"authorization": f"Bearer {ADMIN['token']}"}
    text = httpx.get(f"{root}/metrics", headers=auth, timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def _wait_for(predicate: Any, what: str, limit_s: float = 60) -> None:
    """Poll until ``predicate()``; a generous limit only so a broken build cannot hang."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def test_a_stream_is_complete_at_its_terminal_event(tmp_path: Path) -> None:
    """The upstream sends [DONE] and closes a second later; the openai SDK closes first."""
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for n, text in enumerate(user_turns(12)):
        history += [
            {"role": "user", "content": text.replace("[[tool:", "[[no-tool:")},
            {"role": "assistant", "content": f"Done with step {n}."},
        ]
    history.append({"role": "user", "content": "What next?"})
    with (
        ScriptedUpstream() as up,
        ProxyProcess(tmp_path, up.base_url, compaction=LOW_TRIGGER, admin=ADMIN) as px,
    ):
        client = openai.OpenAI(base_url=px.base_url, api_key="sk-test", max_retries=0)
        stream = client.chat.completions.create(
            model="gpt-4o-mini",
            messages=history,  # type: ignore[arg-type]
            stream=True,
            extra_headers={"x-test-close-delay": "1"},
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        stream.close()
        assert text.startswith("Acknowledged")
        _wait_for(lambda: up.chat_requests("summarizer"), "the background compaction")
        _wait_for(
            lambda: _metric(px.root, "compaction_proxy_requests_total", status="200") == 1,
            "the request recorded as 200",
        )
        assert _metric(px.root, "compaction_proxy_requests_total", status="499") == 0
        # The next request of the conversation gets the compaction.
        more = [*history, {"role": "assistant", "content": text}, {"role": "user", "content": "ok"}]
        _wait_for(
            lambda: (
                client.chat.completions.with_raw_response.create(
                    model="gpt-4o-mini",
                    messages=more,  # type: ignore[arg-type]
                ).headers["x-compaction-case"]
                != "none"
            ),
            "the stored compaction applied",
        )
    assert up.rejections == []


def test_sessions_with_the_same_first_message_get_their_own_ids(tmp_path: Path) -> None:
    opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the bug."}]
    with ScriptedUpstream() as up, ProxyProcess(tmp_path, up.base_url) as px:
        client = openai.OpenAI(base_url=px.base_url, api_key="sk-test", max_retries=0)

        def conv(messages: list[dict[str, Any]], **headers: str) -> str:
            raw = client.chat.completions.with_raw_response.create(
                model="gpt-4o-mini",
                messages=messages,  # type: ignore[arg-type]
                extra_headers=headers,
            )
            return str(raw.headers["x-compaction-conversation"])

        first = conv(opening)
        ids = []
        for session in ("A", "B"):
            history = [*opening, {"role": "assistant", "content": f"Session {session} here."}]
            seen = set()
            for turn in range(3):
                history.append({"role": "user", "content": f"step {turn}"})
                seen.add(conv(history))
                history.append({"role": "assistant", "content": f"did step {turn}"})
            assert len(seen) == 1, "the id changed within a session"
            ids.append(seen.pop())
        assert ids[0] != ids[1] and first not in ids
        # The client's own id wins, and comes back as it was sent.
        assert conv(opening, **{"x-conversation-id": "my-conv-42"}) == "my-conv-42"
    assert up.rejections == []


def test_the_first_requests_records_follow_the_session(tmp_path: Path) -> None:
    """Request 1 has no reply yet, so its id differs from the session's; what it recorded
    (the stability tracker, the ledger row) is found from request 2 on."""
    token = "admin-token-for-tests"
    with ScriptedUpstream() as up:
        with ProxyProcess(tmp_path, up.base_url, admin={"token": token}) as px:
            client = anthropic.Anthropic(base_url=px.root, api_key="sk-ant", max_retries=0)
            messages: list[dict[str, Any]] = [{"role": "user", "content": "Read the README."}]
            for turn in range(3):
                reply = client.messages.create(
                    model=CLAUDE, max_tokens=100, system=SYSTEM, messages=messages
                )
                messages += [
                    {"role": "assistant", "content": reply.content[0].text},  # type: ignore[union-attr]
                    {"role": "user", "content": f"and then step {turn}"},
                ]
            auth = {"authorization": f"Bearer {token}"}

            def rows() -> list[dict[str, Any]]:
                r = httpx.get(f"{px.root}/admin/api/conversations", headers=auth, timeout=10)
                return list(r.json()["items"])

            _wait_for(lambda: sum(r["requests"] for r in rows()) == 3, "the ledger")
            assert [r["requests"] for r in rows()] == [3], "one row for the session"
        second = _forwarded_messages(up)[1]
    # Request 1's tracker was found: its messages were stable, so request 2 marks them.
    assert count_cache_control(second["messages"]) >= 1
    assert up.rejections == []


def test_the_proxys_own_4xx_are_logged_counted_and_not_retried(tmp_path: Path) -> None:
    with ScriptedUpstream() as up, ProxyProcess(tmp_path, up.base_url, admin=ADMIN) as px:
        secret = "do-not-log-this-content"
        bad = httpx.post(
            f"{px.base_url}/chat/completions",
            json={"model": "m", "messages": [{"role": "wizard", "content": secret}]},
        )
        assert bad.status_code == 400 and bad.headers["x-should-retry"] == "false"
        nojson = httpx.post(f"{px.base_url}/messages", content=b"{nope")
        assert nojson.status_code == 400 and nojson.headers["x-should-retry"] == "false"
        missing = httpx.get(f"{px.root}/nowhere")
        assert missing.status_code == 404 and missing.headers["x-should-retry"] == "false"
        method = httpx.post(f"{px.root}/healthz")
        assert method.status_code == 405 and method.headers["x-should-retry"] == "false"
        client = openai.OpenAI(base_url=px.base_url, api_key="sk-test", max_retries=2)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}])  # type: ignore[misc,list-item]
        name = "compaction_proxy_rejected_requests_total"
        assert _metric(px.root, name, route="chat.completions", reason="invalid_request") == 2
        assert _metric(px.root, name, route="messages", reason="invalid_request") == 1
        assert _metric(px.root, name, route="unknown", reason="not_found") == 1
        assert _metric(px.root, name, route="other", reason="method_not_allowed") == 1
        logs = px.logs()
    rejected = [orjson.loads(line) for line in logs.splitlines() if '"rejected"' in line]
    assert len(rejected) == 5
    assert all(r["status"] in (400, 404, 405) and r["reason"] for r in rejected)
    assert secret not in logs
    # The proxy answered these itself: nothing reached the upstream.
    assert up.requests == []


def test_bypass_forwards_the_body_exactly_as_sent(tmp_path: Path) -> None:
    body = {
        "model": "gpt-4o-mini",
        "stream": True,
        "messages": [{"role": "user", "content": "hello"}],
    }
    raw = orjson.dumps(body)
    with ScriptedUpstream() as up, ProxyProcess(tmp_path, up.base_url) as px:
        headers = {"content-type": "application/json", "x-compaction": "off"}
        r = httpx.post(f"{px.base_url}/chat/completions", content=raw, headers=headers)
        assert r.status_code == 200 and "[DONE]" in r.text
        client = openai.OpenAI(base_url=px.base_url, api_key="sk-test", max_retries=0)
        chunks = list(
            client.chat.completions.create(
                model="gpt-4o-mini",
                messages=[{"role": "user", "content": "hello"}],
                stream=True,
                extra_headers={"x-compaction": "off"},
            )
        )
        assert chunks
        received = up.chat_requests()
    assert received[0].body == raw
    assert "stream_options" not in received[1].json
    assert up.rejections == []


def test_one_date_and_one_server_header(tmp_path: Path) -> None:
    with ScriptedUpstream() as up, ProxyProcess(tmp_path, up.base_url) as px:
        msgs = [{"role": "user", "content": "hello"}]
        responses = [
            httpx.post(f"{px.base_url}/chat/completions", json={"model": "m", "messages": msgs}),
            httpx.post(
                f"{px.base_url}/chat/completions",
                json={"model": "m", "messages": msgs, "stream": True},
            ),
            httpx.get(f"{px.base_url}/models"),
            httpx.get(f"{px.root}/healthz"),
            httpx.get(f"{px.root}/nowhere"),
        ]
    for r in responses:
        assert len(r.headers.get_list("date")) == 1, (r.url, r.headers)
        assert len(r.headers.get_list("server")) == 1, (r.url, r.headers)


def test_tokenizers_are_built_before_the_health_check_answers(tmp_path: Path) -> None:
    with ScriptedUpstream() as up, ProxyProcess(tmp_path, up.base_url) as px:
        # ProxyProcess.start() returned: /healthz answered ok. The encodings were built by
        # then (the start-up line is logged once they are).
        warmed = [line for line in px.logs().splitlines() if "tokenizers ready" in line]
        assert len(warmed) == 1
        assert set(orjson.loads(warmed[0])["encodings"]) >= {"o200k_base", "cl100k_base"}
