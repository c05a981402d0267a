"""The LiteLLM hook as users run it: a real ``litellm --config`` process built from the shipped
``config/litellm.yaml``, the official openai client, and a recording upstream behind it.

Asserted on what the upstream received, with the same checks as the standalone proxy's tests
(``tests/checks.py``). A few in-process tests pin the hook's own seams (fail open, no
recursion on its internal calls, where settings come from).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

# Importing the hook imports litellm, which would try to download its model map: no network.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from hooks.litellm_compaction import CompactionHook  # noqa: E402
from hooks.litellm_llm import INTERNAL_FLAG, underlying_model  # noqa: E402
from hooks.litellm_payload import is_internal, tenant_of  # noqa: E402
from hooks.litellm_service import hook_config  # noqa: E402
from proxy.adapters.llm import LLMReply  # noqa: E402
from proxy.adapters.store import DiskStore  # noqa: E402
from proxy.config import Config, load_config  # noqa: E402
from proxy.core.settings import CompactionSettings  # noqa: E402
from proxy.engine.service import build_service  # noqa: E402
from tests.checks import (  # noqa: E402
    LOW_TRIGGER,
    assert_facts_present,
    assert_forwarded_faithful,
    assert_prefix_stable,
    summary_index,
    tokens,
)
from tests.conversations import drive_conversation  # noqa: E402
from tests.litellmproc import SHIPPED_CONFIG, LiteLLMProcess, running  # noqa: E402
from tests.proxyproc import free_port  # noqa: E402
from tests.upstream import ScriptedUpstream  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are a careful coding assistant for the billing service."
MODEL = "gpt-4o-mini"
COMPACTION = LOW_TRIGGER
EMERGENCY_TOKENS = 8000  # trigger_tokens x the default emergency_factor 2.0


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream() as up:
        yield up


@pytest.fixture(scope="module", params=["inline", "background"])
def litellm_proc(
    request: pytest.FixtureRequest,
    upstream: ScriptedUpstream,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LiteLLMProcess]:
    """One LiteLLM process per mode; inline reads $COMPACTION_PROXY_CONFIG, background
    reads the ``compaction_proxy:`` section of LiteLLM's own config."""
    mode = request.param
    tmp = tmp_path_factory.mktemp(f"litellm-{mode}")
    via = "env" if mode == "inline" else "litellm"
    store_url = f"diskcache://{tmp / 'store'}"
    with running(tmp, upstream, {**COMPACTION, "mode": mode}, store_url, via) as proc:
        yield proc


def settle(upstream: ScriptedUpstream, quiet_s: float = 0.6, timeout: float = 15.0) -> None:
    """Let background compactions of an earlier test finish, then reset the upstream."""
    deadline = time.monotonic() + timeout
    seen = len(upstream.requests)
    quiet_since = time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - quiet_since < quiet_s:
        time.sleep(0.05)
        if len(upstream.requests) != seen:
            seen, quiet_since = len(upstream.requests), time.monotonic()
    upstream.reset()


def _message_dict(message: Any) -> dict[str, Any]:
    return message if isinstance(message, dict) else message.model_dump(exclude_none=True)


def _stream_to_message(stream: Any) -> dict[str, Any]:
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for chunk in stream:
        assert chunk.usage is None, "a usage chunk the client did not ask for leaked through"
        for choice in chunk.choices:
            delta = choice.delta
            content.append(delta.content or "")
            for tc in delta.tool_calls or []:
                slot = calls.setdefault(
                    tc.index,
                    {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                )
                slot["id"] = tc.id or slot["id"]
                if tc.function and tc.function.name:
                    slot["function"]["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot["function"]["arguments"] += tc.function.arguments
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def on_the_wire(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The client's messages as LiteLLM itself forwards them, hook or not: without null
    fields (an assistant tool-call turn's ``"content": null`` is dropped)."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def _ledger_totals(store_url: str) -> dict[str, Any]:
    store = DiskStore(store_url.removeprefix("diskcache://"))
    try:
        totals = store.get("totals")
        return totals if isinstance(totals, dict) else {}
    finally:
        store.close()


def _wait_for(condition: Any, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return bool(condition())


# ---- the acceptance run: 40 tool-using turns through LiteLLM ---------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_long_tool_conversation_is_compacted_through_litellm(
    litellm_proc: LiteLLMProcess, upstream: ScriptedUpstream, stream: bool, request: Any
) -> None:
    settle(upstream)
    mode = "background" if "background" in request.node.callspec.id else "inline"
    client = litellm_proc.client(tenant=request.node.name)
    requests_before = _ledger_totals(litellm_proc.store_url).get("requests", 0)
    sent: list[list[dict[str, Any]]] = []
    headers: list[dict[str, str]] = []

    def send(messages: list[dict[str, Any]]) -> dict[str, Any]:
        sent.append(messages)
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, stream=stream
        )
        headers.append({k.lower(): v for k, v in raw.headers.items()})
        parsed = raw.parse()
        return _stream_to_message(parsed) if stream else _message_dict(parsed.choices[0].message)

    with litellm_proc.logs_on_failure():
        final = drive_conversation(send, 40, SYSTEM)
        assert sum(1 for m in final if m["role"] == "user") == 40
        assert any(m.get("tool_calls") for m in final)

        forwarded = [r.json["messages"] for r in upstream.chat_requests()]
        assert len(forwarded) == len(sent)
        for client_messages, fwd in zip(sent, forwarded, strict=True):
            # System first, at most one summary, tool calls intact, the tail verbatim.
            assert_forwarded_faithful(on_the_wire(client_messages), fwd)
        assert tokens(forwarded[-1]) <= 0.4 * tokens(sent[-1]), (
            f"last turn forwarded {tokens(forwarded[-1])} of {tokens(sent[-1])} tokens"
        )
        assert_facts_present(forwarded[-1])
        assert assert_prefix_stable(forwarded) >= 5
        # Internal calls went through LiteLLM's router, tagged for the upstream.
        assert len(upstream.chat_requests("detector")) >= 1
        assert len(upstream.chat_requests("summarizer")) >= 2
        if mode == "background":
            # The first summary arrived below the inline limit: a background compaction made it.
            first = next(i for i, f in enumerate(forwarded) if summary_index(f) is not None)
            assert tokens(sent[first]) < EMERGENCY_TOKENS

        for h in headers:
            assert h["x-compaction-case"] in {"none", "summarize", "truncate", "emergency"}
            assert int(h["x-compaction-original-tokens"]) >= int(h["x-compaction-forwarded-tokens"])
        assert any(h["x-compaction-case"] == "summarize" for h in headers)

        # Every request found its way to the ledger, with the upstream's usage.
        def ledger_done() -> bool:
            totals = _ledger_totals(litellm_proc.store_url)
            return totals.get("requests", 0) - requests_before >= len(sent)

        assert _wait_for(ledger_done), _ledger_totals(litellm_proc.store_url)
        assert _ledger_totals(litellm_proc.store_url).get("prompt_tokens", 0) > 0


def test_over_the_context_window_is_a_clear_400_not_a_forward(
    litellm_proc: LiteLLMProcess, upstream: ScriptedUpstream, request: Any
) -> None:
    """One user message over the model's window (gpt-4o-mini: 128k) leaves nothing to drop:
    the hook answers a 400 in OpenAI's shape, as the standalone server does, instead of
    letting LiteLLM forward what the provider would reject."""
    settle(upstream)
    client = litellm_proc.client(tenant=request.node.name)
    with litellm_proc.logs_on_failure():
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "word " * 130_000}]
            )
        assert caught.value.status_code == 400
        assert caught.value.type == "invalid_request_error"  # (LiteLLM puts the status in code)
        assert "context window" in caught.value.message
        assert upstream.chat_requests() == []  # nothing went upstream
        # A request that fits still goes through.
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a short question"}]
        )
        assert reply.choices[0].message.content
        assert len(upstream.chat_requests()) == 1


def test_compaction_off_header_forwards_unchanged(
    litellm_proc: LiteLLMProcess, upstream: ScriptedUpstream, request: Any
) -> None:
    settle(upstream)
    client = litellm_proc.client(tenant=request.node.name)
    sent: list[list[dict[str, Any]]] = []

    def send(messages: list[dict[str, Any]]) -> dict[str, Any]:
        sent.append(messages)
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, extra_headers={"x-compaction": "off"}
        )
        return _message_dict(reply.choices[0].message)

    with litellm_proc.logs_on_failure():
        drive_conversation(send, 14, SYSTEM)
        assert tokens(sent[-1]) > COMPACTION["trigger_tokens"]
        forwarded = [r.json["messages"] for r in upstream.chat_requests()]
        assert forwarded == [on_the_wire(m) for m in sent]
        assert upstream.chat_requests("summarizer") == []


def test_shadow_header_forwards_unchanged_and_measures_through_litellm(
    litellm_proc: LiteLLMProcess, upstream: ScriptedUpstream, request: Any
) -> None:
    settle(upstream)
    client = litellm_proc.client(tenant=request.node.name)
    sent: list[list[dict[str, Any]]] = []
    cases: list[str] = []

    def send(messages: list[dict[str, Any]]) -> dict[str, Any]:
        sent.append(messages)
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, extra_headers={"x-compaction": "shadow"}
        )
        cases.append(raw.headers.get("x-compaction-case", ""))
        return _message_dict(raw.parse().choices[0].message)

    with litellm_proc.logs_on_failure():
        start = len(upstream.chat_requests())
        drive_conversation(send, 14, SYSTEM)
        assert tokens(sent[-1]) > COMPACTION["trigger_tokens"]
        forwarded = [r.json["messages"] for r in upstream.chat_requests()[start:]]
        assert forwarded == [on_the_wire(m) for m in sent]
        assert set(cases) == {"shadow"}
        assert _wait_for(
            lambda: _ledger_totals(litellm_proc.store_url).get("shadow", {}).get("saved_tokens")
        ), "no would-be saving recorded"


# ---- failing open ----------------------------------------------------------------------------


def _run_unchanged(proc: LiteLLMProcess, upstream: ScriptedUpstream, tenant: str) -> None:
    """Drive past the trigger (below the inline limit) and see every request go through as sent."""
    client = proc.client(tenant=tenant)
    sent: list[list[dict[str, Any]]] = []

    def send(messages: list[dict[str, Any]]) -> dict[str, Any]:
        sent.append(messages)
        reply = client.chat.completions.create(model=MODEL, messages=messages)
        return _message_dict(reply.choices[0].message)

    with proc.logs_on_failure():
        drive_conversation(send, 12, SYSTEM)
        assert COMPACTION["trigger_tokens"] < tokens(sent[-1]) < EMERGENCY_TOKENS
        forwarded = [r.json["messages"] for r in upstream.chat_requests()]
        assert forwarded == [on_the_wire(m) for m in sent]


@pytest.mark.parametrize(
    "store,logged",
    [
        ("file-in-the-way", "compaction hook cannot start"),
        ("redis-closed-port", "store lookup failed"),
    ],
)
def test_unusable_store_serves_requests_unchanged(
    upstream: ScriptedUpstream, tmp_path: Path, store: str, logged: str
) -> None:
    settle(upstream)
    upstream.detector_mode = upstream.summarizer_mode = "garbage"
    if store == "file-in-the-way":
        blocker = tmp_path / "not-a-directory"
        blocker.write_text("a file where the store's folder should be")
        store_url = f"diskcache://{blocker / 'store'}"
    else:
        store_url = f"redis://127.0.0.1:{free_port()}/0"
    compaction = {**COMPACTION, "mode": "inline"}
    try:
        with running(tmp_path, upstream, compaction, store_url, "env") as proc:
            _run_unchanged(proc, upstream, tenant=store)
            with proc.logs_on_failure():
                assert any(logged in line for line in proc.hook_log_lines())
    finally:
        upstream.reset()


@pytest.mark.parametrize(
    "detector_mode,summarizer_mode", [("garbage", "empty"), ("error500", "error500")]
)
def test_failing_detector_and_summarizer_serve_requests_unchanged(
    litellm_proc: LiteLLMProcess,
    upstream: ScriptedUpstream,
    detector_mode: str,
    summarizer_mode: str,
    request: Any,
) -> None:
    settle(upstream)
    upstream.detector_mode, upstream.summarizer_mode = detector_mode, summarizer_mode
    try:
        _run_unchanged(litellm_proc, upstream, tenant=request.node.name)
        with litellm_proc.logs_on_failure():
            assert _wait_for(lambda: len(upstream.chat_requests("summarizer")) >= 1)
            time.sleep(0.5)
            # No retries of a failed call, then the conversation cools down: no retry storm.
            # (Background mode: a request prepared while the first attempt was still running
            # may schedule one more, since the core does not re-check the cooldown then.)
            assert len(upstream.chat_requests("detector")) <= 2
            assert len(upstream.chat_requests("summarizer")) <= 2
    finally:
        upstream.reset()


# ---- the hook's seams, in process ------------------------------------------------------------


class _BrokenStore:
    """A store whose every call raises something the core does not expect."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("disk on fire")

        return fail


class _NoLLM:
    async def complete(self, *args: Any, **kwargs: Any) -> LLMReply:
        raise AssertionError("no LLM call expected")


def _hook_with(store: Any, settings: CompactionSettings | None = None) -> CompactionHook:
    config = Config(compaction=settings or CompactionSettings())
    return CompactionHook(service=build_service(config, _NoLLM(), store=store))


class _Key:
    def __init__(self, api_key: str | None, team_id: str | None = None) -> None:
        self.api_key, self.team_id = api_key, team_id


def _chat_data(n: int = 6) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    for i in range(n):
        messages.append({"role": "user", "content": f"question {i} " + "words " * 40})
        messages.append({"role": "assistant", "content": f"answer {i} " + "words " * 40})
    messages.append({"role": "user", "content": "last question"})
    return {"model": MODEL, "messages": messages, "litellm_call_id": "call-1"}


def test_hook_exception_forwards_the_original_request(caplog: pytest.LogCaptureFixture) -> None:
    hook = _hook_with(_BrokenStore())
    data = _chat_data()
    original = [dict(m) for m in data["messages"]]
    out = asyncio.run(hook.async_pre_call_hook(_Key("hashed"), None, data, "acompletion"))
    assert out is data and out["messages"] == original
    assert any("forwarding unchanged" in r.getMessage() for r in caplog.records)


def test_hook_that_cannot_start_forwards_the_original_request(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    (tmp_path / "c.yaml").write_text(
        yaml.safe_dump({"store": {"url": f"diskcache://{blocker / 'store'}"}})
    )
    hook = CompactionHook(config=load_config(tmp_path / "c.yaml"))
    data = _chat_data()
    original = [dict(m) for m in data["messages"]]
    out = asyncio.run(hook.async_pre_call_hook(_Key("hashed"), None, data, "acompletion"))
    assert out["messages"] == original


def test_hook_skips_its_own_calls_and_other_call_types(tmp_path: Path) -> None:
    hook = _hook_with(DiskStore(tmp_path / "store"))
    internal = {**_chat_data(), "metadata": {INTERNAL_FLAG: True}}
    assert is_internal(internal)
    before = list(internal["messages"])
    asyncio.run(hook.async_pre_call_hook(_Key("k"), None, internal, "acompletion"))
    assert internal["messages"] == before and len(hook.calls) == 0
    embedding = {"model": MODEL, "input": "x", "litellm_call_id": "e"}
    asyncio.run(hook.async_pre_call_hook(_Key("k"), None, embedding, "aembedding"))
    assert len(hook.calls) == 0
    # A logging event for an internal call never touches a pending client request.
    asyncio.run(hook.async_pre_call_hook(_Key("k"), None, _chat_data(), "acompletion"))
    assert "call-1" in hook.calls
    event = {"litellm_call_id": "call-1", "litellm_params": {"metadata": {INTERNAL_FLAG: True}}}
    asyncio.run(hook.async_log_success_event(event, None, None, None))
    assert "call-1" in hook.calls
    asyncio.run(hook.async_log_success_event({"litellm_call_id": "call-1"}, None, None, None))
    assert "call-1" not in hook.calls


def test_tenant_is_the_team_else_the_key() -> None:
    assert tenant_of(_Key("a", "team-1"), {}) == tenant_of(_Key("b", "team-1"), {})
    assert tenant_of(_Key("a"), {}) != tenant_of(_Key("b"), {})
    assert tenant_of(_Key("a"), {}) != tenant_of(_Key("a"), {"x-compaction-tenant": "t"})
    assert tenant_of(_Key("a", "team-1"), {}) != tenant_of(_Key("a"), {})


def test_settings_come_from_env_then_litellm_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    litellm_config = tmp_path / "litellm.yaml"
    litellm_config.write_text(
        yaml.safe_dump(
            {
                "model_list": [],
                "compaction_proxy": {"compaction": {"trigger_tokens": 5555, "mode": "inline"}},
            }
        )
    )
    monkeypatch.delenv("COMPACTION_PROXY_CONFIG", raising=False)
    config = hook_config(litellm_config)
    assert config.compaction.trigger_tokens == 5555 and config.compaction.mode == "inline"
    own = tmp_path / "compaction.yaml"
    own.write_text(yaml.safe_dump({"compaction": {"trigger_tokens": 9999}}))
    monkeypatch.setenv("COMPACTION_PROXY_CONFIG", str(own))
    assert hook_config(litellm_config).compaction.trigger_tokens == 9999
    monkeypatch.delenv("COMPACTION_PROXY_CONFIG")
    litellm_config.write_text(yaml.safe_dump({"compaction_proxy": {"compaction": {"nope": 1}}}))
    with pytest.raises(ValueError, match="compaction_proxy.compaction.nope"):
        hook_config(litellm_config)
    shipped = hook_config(SHIPPED_CONFIG)
    assert shipped.compaction == CompactionSettings()


def test_model_groups_resolve_to_the_underlying_model() -> None:
    """Token counts, context windows and prices come from the provider model behind a group."""

    class Router:
        def get_model_list(self, model_name: str) -> list[dict[str, Any]]:
            table = {"smart": [{"litellm_params": {"model": "anthropic/claude-sonnet-4-5"}}]}
            return table.get(model_name, [])

    assert underlying_model("smart", Router()) == "anthropic/claude-sonnet-4-5"
    assert underlying_model("unknown-group", Router()) == "unknown-group"

    class Broken:
        def get_model_list(self, model_name: str) -> list[dict[str, Any]]:
            raise RuntimeError("router not ready")

    assert underlying_model("smart", Broken()) == "smart"
