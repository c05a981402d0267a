"""Bad input and failures: a clear OpenAI-style error or a safe fallback, never a crash."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.checks import INLINE, assert_forwarded_faithful, summary_index, tokens
from tests.conversations import drive_conversation
from tests.proxyproc import ProxyProcess, free_port
from tests.upstream import ScriptedUpstream, filler_sentence

MODEL = "gpt-4o-mini"
SYSTEM = "You are a coding assistant."


@pytest.fixture(scope="module")
def upstream() -> Any:
    with ScriptedUpstream(slow_seconds=8.0) as up:
        yield up


@pytest.fixture(scope="module")
def proxy(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("errors")
    with ProxyProcess(
        tmp,
        upstream.base_url,
        upstream={"timeout_s": 2},
        limits={"max_body_mb": 0.25},
        compaction={"trigger_tokens": 4000, "verbatim_window_tokens": 1200},
    ) as px:
        yield px


def _assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert "code" in error
    return error


def _chat(proxy: ProxyProcess, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{proxy.base_url}/chat/completions", timeout=20, **kwargs, json=body)


def test_malformed_json_is_a_400(proxy: ProxyProcess) -> None:
    r = httpx.post(
        f"{proxy.base_url}/chat/completions",
        content=b'{"model": "x", "messages": [',
        headers={"content-type": "application/json"},
    )
    error = _assert_openai_error(r, 400)
    assert "JSON" in error["message"]
    assert r.headers["x-should-retry"] == "false"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ([1, 2], "object"),
        ({"model": 3, "messages": [{"role": "user", "content": "hi"}]}, "model"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}, "role"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "content"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"},
            "stream",
        ),
        ({"model": "m", "messages": [{"role": "assistant", "tool_calls": "x"}]}, "tool_calls"),
    ],
)
def test_wrong_types_are_a_400_naming_the_field(proxy: ProxyProcess, body: Any, field: str) -> None:
    error = _assert_openai_error(_chat(proxy, body), 400)
    assert field in error["message"]


def test_body_over_the_limit_is_a_413(proxy: ProxyProcess, upstream: ScriptedUpstream) -> None:
    before = len(upstream.requests)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 300_000}]}
    _assert_openai_error(_chat(proxy, body), 413)
    assert len(upstream.requests) == before, "an oversize body reached the upstream"


def test_unknown_route_is_a_404(proxy: ProxyProcess) -> None:
    error = _assert_openai_error(httpx.get(f"{proxy.root}/nope"), 404)
    assert "/nope" in error["message"]
    # GET /v1/chat/completions is OpenAI's stored-completions list: it passes through.
    assert httpx.get(f"{proxy.base_url}/chat/completions").json()["method"] == "GET"


@pytest.mark.parametrize("status", [400, 401, 429, 500, 503])
def test_upstream_errors_are_relayed_as_they_are(proxy: ProxyProcess, status: int) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    r = _chat(proxy, body, headers={"x-test-status": str(status)})
    error = _assert_openai_error(r, status)
    assert error["code"] == f"scripted_{status}"


def test_upstream_error_on_a_stream_is_relayed(proxy: ProxyProcess) -> None:
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    error = _assert_openai_error(_chat(proxy, body, headers={"x-test-status": "429"}), 429)
    assert error["code"] == "scripted_429"


def test_upstream_timeout_is_a_504(proxy: ProxyProcess) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    error = _assert_openai_error(_chat(proxy, body, headers={"x-test-delay": "4"}), 504)
    assert error["code"] == "upstream_timeout"


def test_unreachable_upstream_is_a_502(tmp_path: Path) -> None:
    closed = free_port()
    with ProxyProcess(tmp_path, f"http://127.0.0.1:{closed}/v1") as px:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        error = _assert_openai_error(_chat(px, body), 502)
        assert error["code"] == "upstream_unreachable"  # connection refused: never retried
        r = httpx.get(f"{px.base_url}/models")
        assert _assert_openai_error(r, 502)["code"] == "upstream_unreachable"


def test_openai_client_sees_errors_as_typed_exceptions(proxy: ProxyProcess) -> None:
    client = openai.OpenAI(base_url=proxy.base_url, api_key="k", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"x-test-status": "429"},
        )


def test_other_paths_pass_through_unchanged(
    proxy: ProxyProcess, upstream: ScriptedUpstream
) -> None:
    client = openai.OpenAI(base_url=proxy.base_url, api_key="sk-pass", max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == ["scripted-large", "scripted-small"]
    embedding = client.embeddings.create(model="e", input=["a", "b"])
    assert len(embedding.data) == 2
    r = httpx.put(
        f"{proxy.base_url}/files/abc?purpose=x",
        content=b"raw-bytes",
        headers={"x-custom": "1", "authorization": "Bearer sk-pass"},
    )
    assert r.status_code == 200
    echoed = r.json()
    assert echoed["method"] == "PUT" and echoed["path"] == "/v1/files/abc"
    assert "purpose=x" in echoed["query"]
    last = upstream.requests[-1]
    assert last.body == b"raw-bytes"
    assert last.headers["x-custom"] == "1"
    assert last.headers["authorization"] == "Bearer sk-pass"


def test_healthz(proxy: ProxyProcess) -> None:
    assert httpx.get(f"{proxy.root}/healthz").json() == {"status": "ok"}


def test_streaming_keeps_usage_only_when_asked(
    proxy: ProxyProcess, upstream: ScriptedUpstream
) -> None:
    client = openai.OpenAI(base_url=proxy.base_url, api_key="k", max_retries=0)
    messages = [{"role": "user", "content": "hello"}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True))
    assert chunks and all(c.usage is None for c in chunks)
    assert upstream.chat_requests()[-1].json["stream_options"] == {"include_usage": True}
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0


def test_a_stream_sent_an_event_a_write_arrives_whole_and_its_usage_is_read(
    proxy: ProxyProcess, upstream: ScriptedUpstream
) -> None:
    """The relay passes a read's events on in one piece and looks at them one by one only
    where usage or the end may be (#28): with the upstream writing an event at a time, the
    official client gets the same answer as from one write, without the usage event it did
    not ask for (with it when it asks), and the proxy reads the usage all the same."""
    client = openai.OpenAI(base_url=proxy.base_url, api_key="k-drip", max_retries=0)
    long = " ".join(filler_sentence(n) for n in range(40))  # past the 1,024-token cache minimum
    messages = [{"role": "user", "content": f"dripped {long}"}]

    def answer(**kwargs: Any) -> tuple[str, list[Any]]:
        chunks = list(
            client.chat.completions.create(model=MODEL, messages=messages, stream=True, **kwargs)
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, chunks

    def request_lines() -> list[dict[str, Any]]:
        lines = proxy.logs().splitlines()
        return [orjson.loads(x) for x in lines if x.startswith("{") and '"msg":"request"' in x]

    before = len(request_lines())
    whole, _ = answer()
    dripped, chunks = answer(extra_headers={"x-test-stream-delay": "0.01"})
    assert dripped == whole and dripped
    assert all(c.usage is None for c in chunks)  # the proxy asked for it, the client did not
    assert upstream.chat_requests()[-1].json["stream_options"] == {"include_usage": True}
    _, asked = answer(
        extra_headers={"x-test-stream-delay": "0.01"}, stream_options={"include_usage": True}
    )
    assert asked[-1].usage is not None and asked[-1].usage.prompt_tokens > 0
    # Each request's log line (written once the client has its answer) holds the usage read
    # from the dripped events: the same prompt again, so the upstream reports it cached.
    limit = time.monotonic() + 60  # a guard against a hang, not a measure
    while len(request_lines()) < before + 3:
        assert time.monotonic() < limit, "the requests' log lines never came"
        time.sleep(0.05)
    dripped_lines = request_lines()[before + 1 : before + 3]
    assert [line["upstream_status"] for line in dripped_lines] == [200, 200]
    assert all(line["cached_tokens"] > 0 for line in dripped_lines), dripped_lines


def test_client_disconnect_cancels_the_upstream_stream(
    proxy: ProxyProcess, upstream: ScriptedUpstream
) -> None:
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "slow"}]}
    with httpx.stream(
        "POST",
        f"{proxy.base_url}/chat/completions",
        json=body,
        headers={"x-test-stream-delay": "0.5"},
        timeout=10,
    ) as r:
        for _ in r.iter_bytes():
            break
    # The proxy stays healthy and serves the next request at once.
    ok = _chat(proxy, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200


def test_bypass_header_forwards_unchanged(proxy: ProxyProcess, upstream: ScriptedUpstream) -> None:
    client = openai.OpenAI(base_url=proxy.base_url, api_key="k-bypass", max_retries=0)
    history = _long_history(client, bypass=True)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=history, extra_headers={"x-compaction": "off"}
    )
    assert raw.headers["x-compaction-case"] == "off"
    assert upstream.chat_requests()[-1].json["messages"] == history
    assert "x-compaction" not in upstream.chat_requests()[-1].headers


def _long_history(client: openai.OpenAI, bypass: bool = False) -> list[dict[str, Any]]:
    headers = {"x-compaction": "off"} if bypass else {}

    def send(messages: list[dict[str, Any]]) -> Any:
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, extra_headers=headers
        )
        return reply.choices[0].message.model_dump(exclude_none=True)

    return drive_conversation(send, 24, SYSTEM)


@pytest.mark.parametrize(
    ("detector", "summarizer"),
    [("error500", "error500"), ("garbage", "empty"), ("slow", "slow"), ("ok", "error500")],
)
def test_failing_summarizer_never_fails_the_request(
    upstream: ScriptedUpstream, tmp_path: Path, detector: str, summarizer: str
) -> None:
    upstream.reset()
    upstream.summarizer_mode = summarizer
    upstream.detector_mode = detector
    with ProxyProcess(
        tmp_path,
        upstream.base_url,
        compaction={
            "trigger_tokens": 4000,
            "verbatim_window_tokens": 1200,
            "mode": "inline",
            "emergency_factor": 50.0,
            "llm_timeout_s": 1.0,
        },
    ) as px:
        client = openai.OpenAI(base_url=px.base_url, api_key="k-fail", max_retries=0)
        history = _long_history(client)
        calls_after_first_failure = len(upstream.chat_requests("summarizer"))
        # One attempt: the call in the client's shape, and the standalone one only when that
        # answer was no usable summary (a failing upstream gets no second call).
        once = 2 if summarizer in ("empty", "garbage") else 1
        assert calls_after_first_failure <= once, "retry storm: summarizer called in cooldown"
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=history)
        assert raw.headers["x-compaction-case"] == "none"
        assert upstream.chat_requests()[-1].json["messages"] == history
        assert len(upstream.chat_requests("summarizer")) == calls_after_first_failure
    upstream.reset()


def test_detector_garbage_still_summarizes(upstream: ScriptedUpstream, tmp_path: Path) -> None:
    upstream.reset()
    upstream.detector_mode = "garbage"
    with ProxyProcess(
        tmp_path,
        upstream.base_url,
        compaction=INLINE,
    ) as px:
        client = openai.OpenAI(base_url=px.base_url, api_key="k-garbage", max_retries=0)
        history = _long_history(client)
        forwarded = upstream.chat_requests()[-1].json["messages"]
        assert summary_index(forwarded) is not None
        assert_forwarded_faithful(history[:-1], forwarded)  # the last reply was not sent
        assert len(upstream.chat_requests("detector")) >= 1
    upstream.reset()


def test_failing_llm_over_the_emergency_limit_truncates_oldest_turns(
    upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    upstream.reset()
    upstream.summarizer_mode = "error500"
    with ProxyProcess(
        tmp_path,
        upstream.base_url,
        compaction={
            "trigger_tokens": 3000,
            "verbatim_window_tokens": 1000,
            "mode": "background",
            "emergency_factor": 2.0,
        },
    ) as px:
        client = openai.OpenAI(base_url=px.base_url, api_key="k-emergency", max_retries=0)
        history = _long_history(client)
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=history)
        forwarded = upstream.chat_requests()[-1].json["messages"]
        assert raw.headers["x-compaction-case"] == "emergency"
        assert tokens(forwarded) <= 6000
        at = summary_index(forwarded)
        assert at is not None and "omitted" in forwarded[at]["content"]
        assert_forwarded_faithful(history, forwarded)
    upstream.reset()


def test_corrupt_store_falls_back_safely(upstream: ScriptedUpstream, tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    (store / "cache.db").write_bytes(b"this is not a sqlite database" * 100)
    with ProxyProcess(tmp_path, upstream.base_url) as px:
        r = _chat(px, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        assert "corrupt" in px.logs()


def test_bad_config_stops_start_up_naming_the_key(tmp_path: Path) -> None:
    px = ProxyProcess(tmp_path, "http://127.0.0.1:9/v1", compaction={"mode": "sideways"})
    with pytest.raises(RuntimeError, match="compaction.mode"):
        px.start()
    px = ProxyProcess(tmp_path, "http://127.0.0.1:9/v1", compaction={"trigger_tokenz": 5})
    with pytest.raises(RuntimeError, match="compaction.trigger_tokenz: unknown key"):
        px.start()
