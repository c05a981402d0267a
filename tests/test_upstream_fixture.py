"""Self-tests for the scripted upstream and conversation scripts used by integration tests."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conversations import (
    FACTS,
    adrive_conversation,
    drive_conversation,
    tool_result,
    user_turns,
)
from tests.upstream import DEFAULT_DETECTOR_REPLY, MODEL_IDS, ScriptedUpstream


@pytest.fixture(scope="module")
def server():
    with ScriptedUpstream() as up:
        yield up


@pytest.fixture
def up(server):
    server.reset()
    return server


@pytest.fixture
def client(up):
    return openai.OpenAI(base_url=up.base_url, api_key="sk-test", max_retries=0, timeout=10)


def chat(up, messages, purpose=None, **extra):
    headers = {"x-compaction-purpose": purpose} if purpose else {}
    return httpx.post(
        f"{up.base_url}/chat/completions",
        headers=headers,
        json={"model": "m", "messages": messages, **extra},
        timeout=10,
    )


def test_non_streaming_reply_and_recording(up, client):
    resp = client.chat.completions.create(
        model="scripted-large", messages=[{"role": "user", "content": "hello"}]
    )
    assert resp.choices[0].message.content.startswith("Acknowledged turn 1. ")
    assert 30 < len(resp.choices[0].message.content.split()) < 60
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.prompt_tokens_details.cached_tokens == 0
    [rec] = up.chat_requests()
    assert rec.method == "POST" and rec.purpose is None
    assert rec.json["messages"][0]["content"] == "hello"
    assert rec.headers["authorization"] == "Bearer sk-test"
    assert up.chat_requests("detector") == []


def test_streaming_with_usage_chunk(up, client):
    messages = [{"role": "user", "content": "stream please"}]
    stream = client.chat.completions.create(
        model="m", messages=messages, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    full = client.chat.completions.create(model="m", messages=messages)
    assert text == full.choices[0].message.content

    raw = httpx.post(
        f"{up.base_url}/chat/completions",
        timeout=10,
        json={"model": "m", "messages": messages, "stream": True},
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.endswith("data: [DONE]\n\n")
    assert '"usage"' not in raw.text  # no usage unless include_usage was asked


def test_tool_call_reply_streaming_and_not(up, client):
    messages = [{"role": "user", "content": 'look [[tool:read_file:{"path": "src/app.py"}]]'}]
    msg = client.chat.completions.create(model="m", messages=messages).choices[0].message
    [call] = msg.tool_calls
    assert msg.content is None and call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "read_file"
    assert json.loads(call.function.arguments) == {"path": "src/app.py"}

    stream = client.chat.completions.create(model="m", messages=messages, stream=True)
    args, ids, finish = "", set(), None
    for c in stream:
        for tc in c.choices[0].delta.tool_calls or []:
            args += tc.function.arguments or ""
            ids.add(tc.id) if tc.id else None
        finish = c.choices[0].finish_reason or finish
    assert ids == {call.id} and args == call.function.arguments and finish == "tool_calls"


def test_detector_and_summarizer_purposes(up):
    r = chat(up, [{"role": "user", "content": "find a boundary"}], purpose="detector")
    assert r.json()["choices"][0]["message"]["content"] == DEFAULT_DETECTOR_REPLY
    transcript = (
        "user: FACT: a is 1. other words here.\nassistant: ok\n"
        "user: FACT: b is 2.\nsummary so far: FACT: a is 1."
    )
    r = chat(
        up,
        [{"role": "system", "content": "summarize"}, {"role": "user", "content": transcript}],
        purpose="summarizer",
    )
    assert r.json()["choices"][0]["message"]["content"] == (
        "user: FACT: a is 1.\nuser: FACT: b is 2.\nsummary so far: FACT: a is 1."
    )
    r = chat(up, [{"role": "user", "content": "no facts " * 40}], purpose="summarizer")
    assert r.json()["choices"][0]["message"]["content"] == ("no facts " * 40)[:200]
    assert len(up.chat_requests("detector")) == 1 and len(up.chat_requests("summarizer")) == 2
    assert up.chat_requests() == [] and up.cached_log == []  # internal calls are not client traffic


@pytest.mark.parametrize("mode,expected", [("garbage", "lol not json at all"), ("empty", "")])
def test_internal_modes(up, mode, expected):
    up.detector_mode = up.summarizer_mode = mode
    for purpose in ("detector", "summarizer"):
        r = chat(up, [{"role": "user", "content": "x"}], purpose=purpose)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected
    up.detector_mode = "error500"
    r = chat(up, [{"role": "user", "content": "x"}], purpose="detector")
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


def test_failure_injection(up, client):
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(
            model="m", messages=msgs, extra_headers={"x-test-status": "500"}
        )
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(
            model="m", messages=msgs, extra_headers={"x-test-status": "429"}
        )
    assert err.value.body["type"] == "rate_limit_error"
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.2).chat.completions.create(
            model="m", messages=msgs, extra_headers={"x-test-delay": "1", "x-test-status": "504"}
        )
    assert len(up.chat_requests()) == 3  # recorded even when the answer is an error/late

    up.error_mode = "malformed"
    r = chat(up, msgs)
    assert r.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        r.json()


def test_stream_delay(up):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    with httpx.stream(
        "POST",
        f"{up.base_url}/chat/completions",
        json=body,
        timeout=10,
        headers={"x-test-stream-delay": "0.05"},
    ) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.elapsed.total_seconds() >= 0.05 * (len(events) - 2)
    assert events[-1] == "data: [DONE]"


def test_cache_simulation(up, client):
    history = [{"role": "system", "content": "s"}] + [
        {"role": "user", "content": t} for t in user_turns(12)
    ]
    first = client.chat.completions.create(model="m", messages=history)
    assert first.usage.prompt_tokens > 2000
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # (the reply may be a tool call; a plain reply keeps the history valid for the strict
    # upstream without answering it)
    reply = first.choices[0].message.content or "noted"
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "next"}]
    second = client.chat.completions.create(model="m", messages=history)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 1024 <= cached <= second.usage.prompt_tokens and cached % 128 == 0
    # a rewritten prefix (what a compaction does) loses the cache
    third = client.chat.completions.create(
        model="m", messages=[{"role": "system", "content": "other"}] + history[1:]
    )
    assert third.usage.prompt_tokens_details.cached_tokens == 0
    # (a late request of an earlier test, a one-line history, may land in the log before,
    # between or after these: CI saw test_failure_injection's delayed request land last)
    assert [c for p, c in up.cached_log if p > 2000] == [0, cached, 0]


def test_models_embeddings_echo_slow(up, client):
    assert [m.id for m in client.models.list()] == list(MODEL_IDS)
    emb = client.embeddings.create(model="e", input=["a", "b"])
    assert [len(d.embedding) for d in emb.data] == [8, 8]
    assert emb.data[0].embedding == client.embeddings.create(model="e", input="a").data[0].embedding
    r = httpx.put(f"{up.base_url}/files/abc?purpose=x", content=b"payload", timeout=10)
    assert r.json() == {
        "method": "PUT",
        "path": "/v1/files/abc",
        "query": "purpose=x",
        "body": "payload",
    }
    r = httpx.get(f"{up.base_url}/slow", headers={"x-test-delay": "0.1"}, timeout=10)
    assert r.status_code == 200 and r.elapsed.total_seconds() >= 0.1


def test_user_turns_are_deterministic_and_plant_facts():
    turns = user_turns(40, seed=3)
    assert turns == user_turns(40, seed=3) and turns != user_turns(40, seed=4)
    assert [t.split("\n")[0] for t in turns[: len(FACTS)]] == FACTS
    assert all("FACT" not in t for t in turns[len(FACTS) :])
    assert all(("[[tool:" in t) == (i % 4 == 3) for i, t in enumerate(turns))
    spread = user_turns(40, facts_every=5)
    assert [i for i, t in enumerate(spread) if "FACT" in t] == list(range(0, 40, 5))
    call = {"id": "c", "function": {"name": "grep", "arguments": '{"pattern": "x"}'}}
    assert tool_result(call) == tool_result(call) and 80 < len(tool_result(call).split()) < 250


def _check_structure(messages):
    assert messages[0]["role"] == "system"
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            prev = [p for p in messages[:i] if p["role"] == "assistant"][-1]
            assert m["tool_call_id"] in {c["id"] for c in prev["tool_calls"]}


def test_drive_conversation_with_tool_rounds(up, client):
    def send(messages):
        resp = client.chat.completions.create(model="m", messages=messages)
        return resp.choices[0].message.model_dump(exclude_none=True)

    messages = drive_conversation(send, 6, "You are a coding assistant.")
    _check_structure(messages)
    assert sum(m["role"] == "user" for m in messages) == 6
    assert sum(m["role"] == "tool" for m in messages) == 1  # turn index 3 asks for a tool
    assert len(up.chat_requests()) == 7
    assert messages[-1]["content"].startswith("Acknowledged turn 6.")


async def test_adrive_conversation(up):
    aclient = openai.AsyncOpenAI(base_url=up.base_url, api_key="k", max_retries=0)

    async def asend(messages):
        resp = await aclient.chat.completions.create(model="m", messages=messages)
        return resp.choices[0].message

    messages = await adrive_conversation(asend, 8, "sys", seed=1)
    _check_structure(messages)
    assert sum(m["role"] == "tool" for m in messages) == 2
    await aclient.close()
