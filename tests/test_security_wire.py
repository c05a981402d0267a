"""Security on the wire (issue #13): nothing leaves the upstream base, a broken body is never
a clean success, only the headers that should go upstream do, deep bodies are a 400, deadlines
bound whole calls, and server-sent events are relayed byte for byte.

The upstream is a raw socket server (tests/rawupstream.py) so the request line is recorded
exactly as the proxy sent it; requests with dot segments go out over raw sockets too, since
HTTP clients remove dot segments before sending.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.checks import INLINE
from tests.proxyproc import ProxyProcess
from tests.rawupstream import (
    BIG_ANSWER_CHARS,
    TRUNCATED_SENT,
    TRUNCATED_TOTAL,
    RawUpstream,
    raw_request,
    sse_crlf_events,
)

ADMIN = {"token": "test-admin-token"}


@pytest.fixture(scope="module")
def upstream() -> Any:
    with RawUpstream() as up:
        yield up


@pytest.fixture(scope="module")
def proxy(upstream: RawUpstream, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("wire")
    with ProxyProcess(tmp, upstream.url("/base/v1"), admin=ADMIN) as px:
        yield px


@pytest.fixture(scope="module")
def keyed(upstream: RawUpstream, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A proxy with its own upstream key: the client's credentials never go upstream."""
    tmp = tmp_path_factory.mktemp("keyed")
    with ProxyProcess(
        tmp, upstream.url("/base/v1"), upstream={"api_key": "sk-configured"}, admin=ADMIN
    ) as px:
        yield px


def _openai_error(status: int, body: bytes, expected: int = 400) -> dict[str, Any]:
    assert status == expected, body
    error = json.loads(body)["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    return dict(error)


# ---- 1. no path escapes the base ---------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        "/v1/%2e%2e/%2e%2e/secret",
        "/v1/%2E%2E/%2e%2E/secret?x=1",
        "/v1/..%2f..%2fsecret",
        "/v1/../../secret",
        "/v1/../admin/api/stats",
        "/v1/models/./../../../secret",
        "/v1/models/.%2e/.%2e/.%2e/secret",
        "/v1/files%5c..%5c..%5csecret",
        "/v1/chat/../../secret",
    ],
)
def test_no_path_escapes_the_upstream_base(
    proxy: ProxyProcess, upstream: RawUpstream, target: str
) -> None:
    before = len(upstream.seen)
    status, _, body = raw_request(proxy.port, "GET", target, {"authorization": b"Bearer sk-client"})
    error = _openai_error(status, body)
    assert "path" in error["message"]
    assert len(upstream.seen) == before, f"{target} reached {upstream.seen[-1].target}"


@pytest.mark.parametrize("name", ["meta-llama%2FLlama-3.1-8B", "org%2fmodel%5cv2"])
def test_encoded_slashes_in_a_name_are_relayed_encoded(
    proxy: ProxyProcess, upstream: RawUpstream, name: str
) -> None:
    """A model named ``org/model`` (vLLM) is sent as ``org%2Fmodel``: data, not a separator."""
    status, _, body = raw_request(proxy.port, "GET", f"/v1/models/{name}")
    assert status == 200, body
    assert upstream.seen[-1].target == f"/base/v1/models/{name}"


def test_the_official_client_retrieves_a_model_with_a_slash(
    proxy: ProxyProcess, upstream: RawUpstream
) -> None:
    client = openai.OpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0)
    client.models.retrieve("meta-llama/Llama-3.1-8B")  # the client sends the "/" as %2F
    assert upstream.seen[-1].target == "/base/v1/models/meta-llama%2FLlama-3.1-8B"


def test_plain_paths_still_map_under_the_base(proxy: ProxyProcess, upstream: RawUpstream) -> None:
    status, _, body = raw_request(proxy.port, "GET", "/v1/models/gpt-4o%3Amini?limit=2")
    assert status == 200, body
    assert upstream.seen[-1].target == "/base/v1/models/gpt-4o%3Amini?limit=2"
    for seen in upstream.seen:
        assert seen.target.startswith("/base/v1/"), seen.target


# ---- 2. a broken upstream body is never a clean success ----------------------------------


def test_a_broken_passthrough_body_is_not_a_clean_200(proxy: ProxyProcess) -> None:
    with pytest.raises(httpx.HTTPError) as caught:
        with httpx.stream("GET", f"{proxy.base_url}/files/truncate", timeout=20) as response:
            assert response.headers["content-length"] == str(TRUNCATED_TOTAL)
            received = b"".join(response.iter_raw())
            pytest.fail(f"clean end after {len(received)} of {TRUNCATED_TOTAL} bytes")
    assert "incomplete" in str(caught.value) or "closed" in str(caught.value)
    # The proxy logged the break once as a warning (never the body).
    assert "upstream passthrough broke" in proxy.logs()
    assert TRUNCATED_SENT < TRUNCATED_TOTAL


def test_whole_passthrough_bodies_carry_their_length(proxy: ProxyProcess) -> None:
    response = httpx.get(f"{proxy.base_url}/models", timeout=20)
    assert response.status_code == 200
    assert int(response.headers["content-length"]) == len(response.content)


# ---- 3. request headers ------------------------------------------------------------------


@pytest.mark.parametrize("target", ["/v1/models", "/v1/chat/completions"])
def test_a_non_ascii_header_is_never_a_500(
    proxy: ProxyProcess, upstream: RawUpstream, target: str
) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    status, _, answer = raw_request(
        proxy.port,
        "POST" if "chat" in target else "GET",
        target,
        {"x-note": "café ☕".encode(), "content-type": b"application/json"},
        body if "chat" in target else b"",
    )
    assert status == 200, answer
    assert upstream.seen[-1].header("x-note") == "café ☕".encode()


def test_only_the_clients_own_headers_go_upstream(
    proxy: ProxyProcess, upstream: RawUpstream
) -> None:
    headers = {
        "authorization": b"Bearer sk-client",
        "cookie": b"compaction_proxy_admin=secret-session",
        "connection": b"close, x-hop-secret",
        "x-hop-secret": b"1",
        "x-forwarded-for": b"10.9.8.7",
        "x-forwarded-host": b"evil.example",
        "forwarded": b"for=10.9.8.7",
        "via": b"1.1 somewhere",
        "x-compaction-purpose": b"summarizer",
        "x-compaction-anything": b"1",
        "x-custom": b"kept",
    }
    for target in ("/v1/models", "/v1/chat/completions"):
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        method = "POST" if "chat" in target else "GET"
        raw_request(proxy.port, method, target, headers, body.encode() if method == "POST" else b"")
        seen = upstream.seen[-1]
        assert seen.target.endswith(target[3:])
        dropped = {
            "cookie", "x-hop-secret", "x-forwarded-for", "x-forwarded-host", "forwarded", "via",
            "x-compaction-purpose", "x-compaction-anything",
        }  # fmt: skip
        assert not dropped & seen.names(), dropped & seen.names()
        assert seen.header("x-custom") == b"kept"
        assert seen.header("authorization") == b"Bearer sk-client"


@pytest.mark.parametrize("target", ["/v1/models", "/v1/chat/completions", "/v1/messages"])
def test_a_configured_key_replaces_every_client_credential(
    keyed: ProxyProcess, upstream: RawUpstream, target: str
) -> None:
    headers = {
        "authorization": b"Bearer sk-client",
        "x-api-key": b"sk-client",
        "api-key": b"sk-client-azure",
        "content-type": b"application/json",
    }
    if target == "/v1/messages":
        body = {"model": "claude", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    else:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    method = "GET" if target == "/v1/models" else "POST"
    payload = json.dumps(body).encode() if method == "POST" else b""
    raw_request(keyed.port, method, target, headers, payload)
    seen = upstream.seen[-1]
    values = [v for _, v in seen.headers]
    assert not any(b"sk-client" in v for v in values), seen.headers
    assert b"sk-configured" in (seen.header("authorization") or seen.header("x-api-key") or b"")


# ---- 4. nesting --------------------------------------------------------------------------


def _nested(levels: int) -> list[Any]:
    """``levels`` pairs of array and object around one text part."""
    part: Any = {"type": "text", "text": "deep"}
    for _ in range(levels):
        part = {"type": "text", "text": "x", "parts": [part]}
    return [part]


@pytest.mark.parametrize("stream", [True, False])
def test_bodies_deeper_than_the_encoder_writes_are_a_400(
    proxy: ProxyProcess, upstream: RawUpstream, stream: bool
) -> None:
    before = len(upstream.seen)
    body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": _nested(130)}]}
    response = httpx.post(f"{proxy.base_url}/chat/completions", json=body, timeout=20)
    assert response.status_code == 400, response.text
    assert "200 levels" in response.json()["error"]["message"]
    assert len(upstream.seen) == before


def test_nesting_within_the_limit_still_streams(proxy: ProxyProcess) -> None:
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": _nested(90)}]}
    response = httpx.post(f"{proxy.base_url}/chat/completions", json=body, timeout=20)
    assert response.status_code == 200, response.text


# ---- 10. server-sent events byte for byte ------------------------------------------------


def test_sse_is_relayed_byte_exact_with_crlf(proxy: ProxyProcess) -> None:
    """The client asked for usage itself, so nothing is dropped: every byte as sent."""
    body = {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}],
    }
    with httpx.stream(
        "POST", f"{proxy.base_url}/chat/completions", json=body, timeout=20
    ) as response:
        received = b"".join(response.iter_raw())
    assert received == b"".join(sse_crlf_events())


def test_the_official_client_reads_a_crlf_stream(proxy: ProxyProcess) -> None:
    client = openai.OpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0)
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "hi"


# ---- 7. deadlines are deadlines ----------------------------------------------------------


def test_llm_timeout_bounds_the_whole_summarizer_call(tmp_path: Path) -> None:
    """A detector/summarizer dripping a byte at a time (each read well inside the timeout)
    is cut off at llm_timeout_s; the inline request goes on uncompacted."""
    with RawUpstream(llm_mode="drip", drip_s=120.0) as slow:
        with ProxyProcess(
            tmp_path, slow.url("/v1"), admin=ADMIN, compaction={**INLINE, "llm_timeout_s": 1}
        ) as px:
            client = openai.OpenAI(base_url=px.base_url, api_key="sk-client", max_retries=0)
            messages: list[dict[str, Any]] = [{"role": "system", "content": "You help."}]
            for i in range(40):
                messages.append({"role": "user", "content": f"Question {i}: " + "word " * 120})
                messages.append({"role": "assistant", "content": f"Answer {i}: " + "text " * 120})
            messages.append({"role": "user", "content": "And now?"})
            reply = client.chat.completions.with_raw_response.create(model="m", messages=messages)
            assert reply.parse().choices[0].message.content == "ok"
            assert reply.headers["x-compaction-case"] != "summarize"
            assert any(s.header("x-compaction-purpose") for s in slow.seen), "no LLM call made"
            # Ordering, not a stopwatch: the client had its answer while every drip was
            # still going (each takes 120 s).
            assert slow.drips_finished == 0
            assert "timed out after 1 s" in px.logs()


def test_upstream_timeout_bounds_a_whole_non_streaming_request(tmp_path: Path) -> None:
    """upstream.timeout_s is the whole request when not streaming: a dripping answer is a
    504 at the deadline, not a request held for as long as the drip lasts."""
    with RawUpstream(llm_mode="drip", drip_s=120.0) as slow:
        with ProxyProcess(
            tmp_path, slow.url("/drip/v1"), upstream={"timeout_s": 1}, admin=ADMIN
        ) as px:
            response = httpx.post(
                f"{px.base_url}/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                timeout=60,
            )
            assert response.status_code == 504, response.text
            assert response.json()["error"]["code"] == "upstream_timeout"
            assert slow.drips_finished == 0


# ---- 10. big answers are relayed, not held ------------------------------------------------


def _peak_rss_kb(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("VmHWM:")).split()[1])


def test_big_answers_are_relayed_as_they_arrive(tmp_path: Path) -> None:
    """Two 20 MB non-streamed answers: each arrives whole with its length, its usage is
    counted, and the proxy never held one whole (its peak memory grows by much less)."""
    with RawUpstream() as up:
        with ProxyProcess(tmp_path, up.url("/v1"), admin=ADMIN) as px:
            assert px.proc is not None
            url = f"{px.base_url}/chat/completions"
            small = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            assert httpx.post(url, json=small, timeout=30).status_code == 200  # warm up
            before = _peak_rss_kb(px.proc.pid)
            for _ in range(2):
                big = {"model": "m", "messages": [{"role": "user", "content": "big please"}]}
                response = httpx.post(url, json=big, timeout=120)
                assert response.status_code == 200
                assert int(response.headers["content-length"]) == len(response.content)
                assert len(response.json()["choices"][0]["message"]["content"]) == BIG_ANSWER_CHARS
            grown_mb = (_peak_rss_kb(px.proc.pid) - before) / 1024
            stats = httpx.get(
                f"{px.root}/admin/api/stats",
                headers={"authorization": f"Bearer {ADMIN['token']}"},
                timeout=10,
            ).json()
            assert stats["totals"]["prompt_tokens"] == 30  # usage read from the answers' ends
            # Holding one answer whole costs at least its 20 MB (the bytes) again as a str
            # while parsing it; relayed in chunks the peak stays far below that.
            assert grown_mb < 20, grown_mb
