"""The detector/summarizer client: OpenAI-compatible over httpx, LiteLLM for other providers."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from proxy.adapters import llm as llm_module
from proxy.adapters.llm import HttpLLM, LLMReply
from proxy.core.errors import CompactionFailed
from proxy.core.flow_compact import Spent
from tests.upstream import ScriptedUpstream

MESSAGES = [{"role": "system", "content": "x"}, {"role": "user", "content": "FACT: a.\nhello"}]


@pytest.fixture(scope="module")
def upstream() -> Any:
    with ScriptedUpstream(slow_seconds=5) as up:
        yield up


async def _complete(up: ScriptedUpstream, model: str = "gpt-4o-mini", **kw: Any) -> LLMReply:
    async with httpx.AsyncClient() as client:
        llm = HttpLLM(client, up.base_url, timeout_s=kw.pop("timeout_s", 10), **kw)
        return await llm.complete(
            model, MESSAGES, max_tokens=50, purpose="summarizer", credential="sk-client"
        )


async def test_calls_the_upstream_with_the_clients_key_and_no_tools(
    upstream: ScriptedUpstream,
) -> None:
    upstream.reset()
    reply = await _complete(upstream)
    assert reply.text == "FACT: a." and reply.finish_reason == "stop"
    assert reply.prompt_tokens > 0
    sent = upstream.chat_requests("summarizer")[-1]
    assert sent.headers["authorization"] == "Bearer sk-client"
    assert "tools" not in sent.json and sent.json["temperature"] == 0
    assert sent.json["max_tokens"] == 50 and sent.json["stream"] is False


def test_a_standalone_calls_cache_reads_are_kept_and_priced() -> None:
    # A provider may read a standalone call's prompt start from its cache: the reply says so,
    # and the compaction's spend prices those tokens as cache reads.
    body = {
        "choices": [{"message": {"content": "memo"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 4000, "completion_tokens": 100,
                  "prompt_tokens_details": {"cached_tokens": 3072}},
    }  # fmt: skip
    reply = llm_module.reply_from(body, "gpt-4o")
    assert (reply.text, reply.prompt_tokens, reply.cached_tokens) == ("memo", 4000, 3072)
    cold = llm_module.reply_from({**body, "usage": {**body["usage"], "prompt_tokens_details": {}}},
                                 "gpt-4o")  # fmt: skip
    assert cold.cached_tokens == 0
    warm_spent, cold_spent = Spent(), Spent()
    warm_spent.add(reply)
    cold_spent.add(cold)
    assert warm_spent.cached == 3072 and cold_spent.cached == 0
    assert warm_spent.usd < cold_spent.usd
    with pytest.raises(CompactionFailed):
        llm_module.reply_from({"choices": []}, "gpt-4o")


async def test_a_configured_key_wins(upstream: ScriptedUpstream) -> None:
    upstream.reset()
    await _complete(upstream, api_key="sk-configured")
    assert upstream.chat_requests("summarizer")[-1].headers["authorization"] == (
        "Bearer sk-configured"
    )


@pytest.mark.parametrize("mode", ["error500", "slow"])
async def test_failures_become_compaction_failed(upstream: ScriptedUpstream, mode: str) -> None:
    upstream.reset()
    upstream.summarizer_mode = mode
    with pytest.raises(CompactionFailed):
        await _complete(upstream, timeout_s=1)
    upstream.reset()


async def test_unreachable_upstream_is_compaction_failed() -> None:
    async with httpx.AsyncClient() as client:
        llm = HttpLLM(client, "http://127.0.0.1:9/v1", timeout_s=2)
        with pytest.raises(CompactionFailed) as raised:
            await llm.complete("m", MESSAGES, max_tokens=5, purpose="detector", credential=None)
    # The log line says where and why, in words.
    assert "http://127.0.0.1:9/v1/chat/completions unreachable: connection refused" in str(
        raised.value
    )


def test_only_known_providers_go_through_litellm() -> None:
    assert llm_module._needs_litellm("anthropic/claude-haiku-4-5")
    assert llm_module._needs_litellm("bedrock/anthropic.claude-3")
    # The upstream's own model names, slashes and all, stay on the OpenAI-compatible path.
    assert not llm_module._needs_litellm("meta-llama/Llama-3.1-8B-Instruct")
    assert not llm_module._needs_litellm("openai/gpt-4o")
    assert not llm_module._needs_litellm("gpt-4o-mini")
    assert not llm_module._needs_litellm("/models/smollm2.gguf")


async def test_litellm_path_maps_replies_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    import litellm

    calls: list[dict[str, Any]] = []

    async def fake(**kwargs: Any) -> dict[str, Any]:
        calls.append(kwargs)
        return {
            "choices": [{"message": {"content": "summary"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 2},
        }

    monkeypatch.setattr(litellm, "acompletion", fake)
    async with httpx.AsyncClient() as client:
        llm = HttpLLM(client, "http://127.0.0.1:9/v1")
        reply = await llm.complete(
            "anthropic/claude-haiku-4-5",
            MESSAGES,
            max_tokens=9,
            purpose="summarizer",
            credential=None,
        )
        assert reply.text == "summary" and reply.prompt_tokens == 7
        assert calls[0]["model"] == "anthropic/claude-haiku-4-5" and calls[0]["max_tokens"] == 9

        async def broken(**kwargs: Any) -> Any:
            raise RuntimeError("provider down")

        monkeypatch.setattr(litellm, "acompletion", broken)
        with pytest.raises(CompactionFailed):
            await llm.complete(
                "anthropic/claude-haiku-4-5",
                MESSAGES,
                max_tokens=9,
                purpose="detector",
                credential=None,
            )
