"""The summarizer call that reads the conversation's own prompt cache (#25,
``proxy.core.sharedcall``): what goes upstream, through a real proxy process in front of the
strict scripted upstream, with the official clients; and the pure parts by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest

from proxy.core import sharedcall, timing
from proxy.core.costs import prices_for
from proxy.core.flow_compact import Spent
from proxy.core.settings import CompactionSettings
from proxy.core.sharedcall import MARK, SharedCall, SharedReply
from proxy.core.surfaces import ANTHROPIC_MESSAGES, OPENAI_CHAT, OPENAI_RESPONSES
from proxy.operators import stats_cli
from tests.agentclients import wait_for
from tests.checks import INLINE, assert_facts_present
from tests.conversations import drive_conversation
from tests.proxyproc import ProxyProcess
from tests.test_anthropic_route import MODEL, SYSTEM, _drive, _plain
from tests.upstream import SHARED_MARK, ScriptedUpstream, default_summarizer, strip_marks

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
BUDGET = INLINE["summary_budget_tokens"]
TOKEN = "admin-secret-for-shared-summaries"


def _shared(up: ScriptedUpstream, path: str) -> list[Any]:
    return [r for r in up.requests if r.path == path and r.purpose == "summarizer"]


def _turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turns without cache marks (a marked string is a one-block list: the same content)."""
    return [{**m, "content": _plain(m["content"])} for m in messages]


def _last_text(message: dict[str, Any]) -> str:
    content = message["content"]
    if isinstance(content, str):
        return content
    return str(content[-1].get("text", ""))


def test_claude_summaries_read_the_conversations_cache(tmp_path: Path) -> None:
    """On Claude's prices the summarizer is asked in the client's own shape: the body the
    proxy forwarded (system, model, history as the cache holds it) plus one instruction, with
    the client's key; its answer is the summary forwarded next. No standalone call is made."""
    admin = {"token": TOKEN}
    with ScriptedUpstream() as up:
        with ProxyProcess(tmp_path, up.base_url, compaction=INLINE, admin=admin) as px:
            client = anthropic.Anthropic(base_url=px.root, api_key="sk-ant-own", max_retries=0)
            sent = _drive(client, 30, stream=False)
            seen = _operators_view(px.root)
        calls = _shared(up, "/v1/messages")
        assert len(calls) >= 5
        assert up.chat_requests("summarizer") == [], "a standalone summarizer call was made"
        forwarded = [r for r in up.requests if r.path == "/v1/messages" and r.purpose is None]
        assert len(forwarded) == len(sent)
        for call in calls:
            body = call.json
            # The request forwarded just before it: the prefix the provider has cached.
            previous = [r for r in forwarded if r.at < call.at][-1]
            before = previous.json
            # The client's key and headers, as its own requests were forwarded with them.
            key = call.headers.get("x-api-key") or call.headers["authorization"]
            assert key.endswith("sk-ant-own")
            assert call.headers["anthropic-version"] == previous.headers["anthropic-version"]
            assert body["model"] == MODEL and body["stream"] is False
            assert body["max_tokens"] == BUDGET
            # Marks may sit elsewhere (an inline compaction runs before the request's own
            # are placed), but there is one: a Messages API cache is read at a breakpoint.
            assert _plain(body["system"]) == _plain(before["system"])
            prefix = _turns(before["messages"])
            assert _turns(body["messages"][: len(prefix) - 1]) == prefix[:-1]
            assert 1 <= orjson.dumps(body).count(b'"cache_control"') <= 4
            last = body["messages"][-1]
            assert last["role"] == "user" and _last_text(last).startswith(MARK)
            # The scripted summary of that call is what the next request forwards.
            summary = default_summarizer({"messages": strip_marks(body["messages"])})
            after = [r for r in forwarded if r.at > call.at][0].json
            assert summary.splitlines()[0] in orjson.dumps(after["messages"]).decode()
        assert_facts_present(strip_marks(forwarded[-1].json["messages"]))
        assert up.rejections == []
    # Operators see what the provider read from the cache: per compaction and in total.
    detail, page, metrics, stats = seen
    summarized = [c for c in detail["compactions"] if c["case"] == "summarize"]
    assert len(summarized) == len(calls)
    for c in summarized:  # the scripted upstream reads every shared call's prefix from cache
        assert 0 < c["llm_cached_tokens"] < c["llm_tokens"]
    for c in summarized:  # the dashboard's timeline, per compaction
        assert f"({c['llm_cached_tokens']:,} read from the provider's cache)" in page
    total = sum(c["llm_cached_tokens"] for c in detail["compactions"])
    assert f"compaction_proxy_compaction_llm_cached_tokens {float(total)!r}" in metrics
    assert f"{total:,} read from the cache" in stats


def _operators_view(root: str) -> tuple[dict[str, Any], str, str, str]:
    """The conversation's admin detail, its dashboard page, /metrics and the stats report."""
    auth = {"authorization": f"Bearer {TOKEN}"}
    listing = httpx.get(f"{root}/admin/api/conversations", headers=auth, timeout=10).json()
    conv = listing["items"][0]["id"]
    detail = httpx.get(f"{root}/admin/api/conversations/{conv}", headers=auth, timeout=10)
    page = httpx.get(f"{root}/dashboard/conversations/{conv}", headers=auth, timeout=10)
    metrics = httpx.get(f"{root}/metrics", headers=auth, timeout=10).text
    totals = httpx.get(f"{root}/admin/api/stats", headers=auth, timeout=10).json()["totals"]
    return detail.json(), page.text, metrics, stats_cli.render(totals, [], "test")


def test_a_shared_answer_that_is_no_summary_falls_back_to_the_standalone_call(
    tmp_path: Path,
) -> None:
    """The model answers the call in the client's shape with nothing usable: the standalone
    summarizer is asked in the same attempt, and the compaction still happens."""

    def summarizer(body: dict[str, Any]) -> str:
        if SHARED_MARK in orjson.dumps(body).decode():
            return ""  # (as a model that answered with a tool call would give no text)
        return default_summarizer(body)

    with ScriptedUpstream(summarizer=summarizer) as up:
        with ProxyProcess(tmp_path, up.base_url, compaction=INLINE) as px:
            client = anthropic.Anthropic(base_url=px.root, api_key="sk-ant-own", max_retries=0)
            _drive(client, 30, stream=False)
        shared, alone = _shared(up, "/v1/messages"), up.chat_requests("summarizer")
        assert shared and len(alone) == len(shared)
        forwarded = [r.json for r in up.requests if r.path == "/v1/messages" and r.purpose is None]
        assert "[History Summary - " in orjson.dumps(forwarded[-1]).decode()
        assert up.rejections == []


def test_summary_reads_cache_off_asks_the_standalone_summarizer(tmp_path: Path) -> None:
    with ScriptedUpstream() as up:
        with ProxyProcess(
            tmp_path, up.base_url, compaction={**INLINE, "summary_reads_cache": "off"}
        ) as px:
            client = anthropic.Anthropic(base_url=px.root, api_key="sk-ant-own", max_retries=0)
            _drive(client, 30, stream=False)
        assert _shared(up, "/v1/messages") == []
        assert up.chat_requests("summarizer")
        assert up.rejections == []


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_completions_shared_call_is_the_conversation_plus_one_ask(
    tmp_path: Path, stream: bool
) -> None:
    """``on``: the chat route's call is the client's body with its history as forwarded and
    one user message more, not streamed (no stream_options, which a non-streamed request
    must not carry), accepted by the strict upstream."""
    with ScriptedUpstream() as up:
        settings = {**INLINE, "summary_reads_cache": "on"}
        with ProxyProcess(tmp_path, up.base_url, compaction=settings) as px:
            client = openai.OpenAI(base_url=px.base_url, api_key="sk-chat", max_retries=0)

            def send(messages: list[dict[str, Any]]) -> Any:
                if stream:
                    chunks = list(
                        client.chat.completions.create(
                            model="scripted-large",
                            messages=messages,
                            stream=True,  # type: ignore[arg-type]
                        )
                    )
                    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                    return {"role": "assistant", "content": text}
                reply = client.chat.completions.create(model="scripted-large", messages=messages)  # type: ignore[arg-type]
                return reply.choices[0].message.model_dump()

            drive_conversation(send, 30, "You are a careful assistant.", facts_every=3)
        calls = [r for r in up.chat_requests("summarizer") if SHARED_MARK in r.body.decode()]
        assert calls, "no summarizer call in the client's shape"
        for call in calls:
            body = call.json
            assert call.headers["authorization"] == "Bearer sk-chat"
            assert body["stream"] is False and "stream_options" not in body
            assert body["max_tokens"] == BUDGET
            assert body["messages"][0] == {
                "role": "system",
                "content": "You are a careful assistant.",
            }
            assert body["messages"][-1]["role"] == "user"
            assert body["messages"][-1]["content"].startswith(MARK)
        assert up.rejections == []


def test_responses_shared_call_is_not_stored(tmp_path: Path) -> None:
    from tests.test_responses_route import _drive as drive_responses

    with ScriptedUpstream() as up:
        settings = {**INLINE, "summary_reads_cache": "on"}
        with ProxyProcess(tmp_path, up.base_url, compaction=settings) as px:
            client = openai.OpenAI(base_url=px.base_url, api_key="sk-resp", max_retries=0)
            drive_responses(client, 30, False)
        calls = _shared(up, "/v1/responses")
        assert calls
        for call in calls:
            body = call.json
            assert body["store"] is False and body["stream"] is False
            assert body["max_output_tokens"] == BUDGET
            last = body["input"][-1]
            assert last["type"] == "message" and last["content"].startswith(MARK)
        assert up.rejections == []


# ---- the pure parts ----------------------------------------------------------------------


def _call(surface: Any, **body: Any) -> SharedCall:
    return SharedCall(surface, {"model": "m", **body}, "http://up/v1/x", ((b"x-api-key", b"k"),))


def test_usable_only_when_the_model_may_answer_in_prose() -> None:
    assert sharedcall.usable(_call(OPENAI_CHAT, tool_choice="auto"))
    assert not sharedcall.usable(_call(OPENAI_CHAT, tool_choice="required"))
    assert not sharedcall.usable(
        _call(OPENAI_CHAT, tool_choice={"type": "function", "function": {"name": "f"}})
    )
    assert not sharedcall.usable(_call(OPENAI_CHAT, response_format={"type": "json_object"}))
    assert sharedcall.usable(_call(OPENAI_CHAT, response_format={"type": "text"}))
    assert not sharedcall.usable(_call(OPENAI_CHAT, n=2))
    assert not sharedcall.usable(_call(OPENAI_CHAT, modalities=["text", "audio"]))
    assert not sharedcall.usable(
        _call(ANTHROPIC_MESSAGES, output_format={"type": "json_schema", "schema": {}})
    )
    assert sharedcall.usable(_call(ANTHROPIC_MESSAGES, tool_choice={"type": "auto"}))
    assert not sharedcall.usable(_call(ANTHROPIC_MESSAGES, tool_choice={"type": "any"}))
    assert not sharedcall.usable(
        _call(OPENAI_RESPONSES, text={"format": {"type": "json_schema", "name": "x"}})
    )
    assert "k" not in repr(_call(OPENAI_CHAT)), "the headers (the client's key) in a repr"


def test_request_body_keeps_the_cache_key_and_changes_only_the_reply() -> None:
    thinking = {"type": "enabled", "budget_tokens": 2000}
    call = _call(
        ANTHROPIC_MESSAGES, system="S", tools=[{"name": "t"}], tool_choice={"type": "auto"},
        thinking=thinking, max_tokens=32000, stream=True, messages=[],
    )  # fmt: skip
    view = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]},
        {"role": "user", "content": "ask"},
    ]
    body = sharedcall.request_body(call, view, 500)
    assert body["system"] == "S" and body["tools"] == [{"name": "t"}]
    assert body["thinking"] == thinking, "a changed thinking budget would drop the cache"
    assert body["max_tokens"] == 2500 and body["stream"] is False
    # The ask joins the last user turn (turns alternate), after its blocks and their marks.
    assert body["messages"] == [
        {"role": "user", "content": [
            {"type": "text", "text": "hi", "cache_control": {}}, {"type": "text", "text": "ask"},
        ]},
    ]  # fmt: skip
    chat = sharedcall.request_body(
        _call(OPENAI_CHAT, stream=True, stream_options={"include_usage": True},
              max_completion_tokens=9000, n=1, messages=[]),
        [{"role": "user", "content": "ask"}], 300,
    )  # fmt: skip
    assert chat["max_completion_tokens"] == 300 and "max_tokens" not in chat
    assert "stream_options" not in chat and "n" not in chat
    resp = sharedcall.request_body(
        _call(OPENAI_RESPONSES, input=[], background=True), [{"role": "user", "content": "a"}], 9
    )
    assert resp["store"] is False and "background" not in resp
    assert resp["max_output_tokens"] == 9


def test_reply_of_each_surface() -> None:
    claude = sharedcall.reply_of(
        _call(ANTHROPIC_MESSAGES),
        {
            "content": [{"type": "thinking", "thinking": "x"}, {"type": "text", "text": "Memo."}],
            "stop_reason": "max_tokens",
            "usage": {"input_tokens": 10, "cache_read_input_tokens": 900,
                      "cache_creation_input_tokens": 90, "output_tokens": 7},
        },
        "claude-x",
    )  # fmt: skip
    assert claude == SharedReply("Memo.", "length", 1000, 7, "claude-x", 900, 90)
    tool = sharedcall.reply_of(
        _call(ANTHROPIC_MESSAGES),
        {"content": [{"type": "tool_use"}], "stop_reason": "tool_use"},
        "m",
    )
    assert tool is not None and tool.text == "" and tool.finish_reason == "tool_calls"
    chat = sharedcall.reply_of(
        _call(OPENAI_CHAT),
        {"choices": [{"message": {"content": "Memo."}, "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 50, "completion_tokens": 5,
                   "prompt_tokens_details": {"cached_tokens": 40}}},
        "m",
    )  # fmt: skip
    assert chat == SharedReply("Memo.", "stop", 50, 5, "m", 40, 0)
    resp = sharedcall.reply_of(
        _call(OPENAI_RESPONSES),
        {"output": [{"type": "message", "content": [{"type": "output_text", "text": "Memo."}]}],
         "incomplete_details": {"reason": "max_output_tokens"},
         "usage": {"input_tokens": 50, "output_tokens": 5,
                   "input_tokens_details": {"cached_tokens": 30}}},
        "m",
    )  # fmt: skip
    assert resp == SharedReply("Memo.", "length", 50, 5, "m", 30, 0)
    assert sharedcall.reply_of(_call(OPENAI_CHAT), {"choices": []}, "m") is None
    assert sharedcall.reply_of(_call(OPENAI_CHAT), ["not", "an", "answer"], "m") is None


def test_calls_are_priced_with_their_cache_reads() -> None:
    model = "claude-sonnet-4-5-20250929"
    prices = prices_for(model)
    spent = Spent()
    spent.add(SharedReply("Memo.", "stop", 40_000, 500, model, 39_000, 0))
    expected = 1_000 * prices.input + 39_000 * prices.cache_read + 500 * prices.output
    assert spent.usd == pytest.approx(expected)
    assert spent.tokens == 40_500


def test_cheaper_on_claude_prices_and_not_on_a_cold_cache() -> None:
    prices = prices_for("claude-sonnet-4-5-20250929")
    warm = dict(forwarded_tokens=40_000, cached_tokens=39_000, span_tokens=28_000)
    assert sharedcall.cheaper(prices, prices, **warm)
    assert not sharedcall.cheaper(prices, prices, **{**warm, "cached_tokens": 0})


def test_the_cost_policy_prices_the_summary_as_cache_reads() -> None:
    """A compaction the standalone calls would not pay for, on Claude's prices and a warm
    cache, pays when its summary reads the conversation's cache."""
    s = CompactionSettings(policy="cost")
    meta = {"requests": 90, "last_seen": 1000.0, "cached": 1}
    args = dict(forwarded_tokens=40_000, head_tokens=500, meta=meta, now=1010.0)
    alone = timing.judge(s, MODEL, **args)  # type: ignore[arg-type]
    shared = timing.judge(s, MODEL, **args, shared=True)  # type: ignore[arg-type]
    assert not alone.pays and shared.pays, (alone, shared)
    assert shared.net_usd > alone.net_usd
    off = CompactionSettings(policy="cost", summary_reads_cache="off")
    assert not timing.judge(off, MODEL, **args, shared=True).pays  # type: ignore[arg-type]
    other = CompactionSettings(policy="cost", summary_model="claude-haiku-4-5")
    assert not timing.shares_cache(other, MODEL, True)
    assert SYSTEM  # (the route's system prompt, shared with tests/test_anthropic_route.py)


def test_shadow_mode_asks_the_standalone_summarizer(tmp_path: Path) -> None:
    """In shadow mode the provider cached the client's requests as sent, not the would-be
    forwarded ones a call in the client's shape would carry: the standalone call is made."""
    with ScriptedUpstream() as up:
        with ProxyProcess(tmp_path, up.base_url, compaction={**INLINE, "mode": "shadow"}) as px:
            client = anthropic.Anthropic(base_url=px.root, api_key="sk-ant-own", max_retries=0)
            _drive(client, 30, stream=False)
            wait_for(lambda: bool(up.chat_requests("summarizer")), "a shadow compaction")
        assert _shared(up, "/v1/messages") == []
        assert up.rejections == []


def test_a_refused_shared_call_falls_back_and_a_failing_upstream_gets_no_second_call(
    tmp_path: Path,
) -> None:
    """The provider refuses the call in the client's shape (a 400): the standalone call is
    made in the same attempt. It answers 500: the attempt fails without a second call."""

    def refuse(body: dict[str, Any]) -> str | None:
        return "scripted refusal" if SHARED_MARK in orjson.dumps(body).decode() else None

    (tmp_path / "a").mkdir()
    with ScriptedUpstream(refuse=refuse, expect_rejections=True) as up:
        with ProxyProcess(tmp_path / "a", up.base_url, compaction=INLINE) as px:
            client = anthropic.Anthropic(base_url=px.root, api_key="sk-ant-own", max_retries=0)
            _drive(client, 30, stream=False)
        shared, alone = _shared(up, "/v1/messages"), up.chat_requests("summarizer")
        assert shared and len(alone) == len(shared)
        assert {r["path"] for r in up.rejections} == {"/v1/messages"}
        forwarded = [r.json for r in up.requests if r.path == "/v1/messages" and r.purpose is None]
        assert "[History Summary - " in orjson.dumps(forwarded[-1]).decode()
    (tmp_path / "b").mkdir()
    with ScriptedUpstream(summarizer_mode="error500") as up:
        with ProxyProcess(tmp_path / "b", up.base_url, compaction=INLINE) as px:
            client = anthropic.Anthropic(base_url=px.root, api_key="sk-ant-own", max_retries=0)
            _drive(client, 30, stream=False)
        assert _shared(up, "/v1/messages"), "no call in the client's shape"
        assert up.chat_requests("summarizer") == [], "a second call to a failing upstream"
