"""The LLM client the detector and summarizer use (DESIGN §5).

OpenAI-compatible over httpx to the configured upstream by default, with the client's own
credential unless a key is configured; through ``litellm.acompletion`` when the model names
another provider (``anthropic/...``). It never raises anything but ``CompactionFailed``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import Any, Protocol

import httpx
import orjson

from proxy.adapters.reach import classify, safe_url
from proxy.core.errors import CallRefused, CompactionFailed
from proxy.core.messages import Message
from proxy.core.sharedcall import SharedCall, SharedReply, chat_reply, reply_of

log = logging.getLogger("compaction_proxy.llm")

# The W3C trace context (``traceparent``, ``tracestate``) of the detector/summarizer call in
# progress, set by the tracing wrapper (``proxy.engine.tracing.TracedLLM``) around each call:
# its request carries it, so a collector on the summarizer's side joins the proxy's trace.
TRACE_HEADERS: ContextVar[Mapping[str, str] | None] = ContextVar(
    "compaction_proxy_llm_trace", default=None
)

# Provider prefixes that the plain OpenAI-compatible path serves itself.
# LiteLLM provider prefixes whose APIs are not OpenAI-compatible chat completions at the
# configured upstream. Any other name, slashes included (``meta-llama/Llama-3.1-8B`` on vLLM,
# a llama.cpp model path), is the upstream's own model name and goes there over HTTP.
_LITELLM_PROVIDERS = frozenset(
    "anthropic bedrock bedrock_converse vertex_ai vertex_ai_beta gemini cohere cohere_chat "
    "mistral groq together_ai fireworks_ai deepseek xai perplexity ollama ollama_chat azure "
    "azure_ai openrouter replicate huggingface sagemaker databricks watsonx cerebras nvidia_nim "
    "deepinfra cloudflare ai21 dashscope moonshot".split()
)


# A standalone call's answer has the fields of a shared call's (its ``cached_tokens``: of
# ``prompt_tokens``, read from the provider's prompt cache; it reports no cache writes): one
# type for both, the flow prices them alike (``proxy.core.flow_compact``).
LLMReply = SharedReply


class LLM(Protocol):
    async def complete(
        self,
        model: str,
        messages: Sequence[Message],
        *,
        max_tokens: int,
        purpose: str,
        credential: str | None,
    ) -> LLMReply: ...


def _needs_litellm(model: str) -> bool:
    provider, slash, _ = model.partition("/")
    return bool(slash) and provider in _LITELLM_PROVIDERS


def reply_from(body: dict[str, Any], model: str) -> LLMReply:
    """An ``LLMReply`` from an OpenAI-shaped completion body, or ``CompactionFailed``."""
    try:
        return chat_reply(body, model)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
        raise CompactionFailed(f"malformed completion: {exc}") from exc


class HttpLLM:
    """Chat completions over the proxy's pooled httpx client."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        relay_credential: bool = True,
    ) -> None:
        """``relay_credential=False``: never send the client's key (a separate compaction
        endpoint must not receive keys meant for the upstream); only ``api_key``, if any."""
        self._client = client
        self._url = base_url.rstrip("/") + "/chat/completions"
        self._api_key = api_key
        self._timeout = timeout_s
        self._relay_credential = relay_credential

    async def complete(
        self,
        model: str,
        messages: Sequence[Message],
        *,
        max_tokens: int,
        purpose: str,
        credential: str | None,
    ) -> LLMReply:
        """One completion within ``timeout_s`` overall: httpx's timeouts bound each read,
        so a server dripping a byte at a time would otherwise hold the call for ever."""
        try:
            async with asyncio.timeout(self._timeout):
                return await self._complete(model, messages, max_tokens, purpose, credential)
        except TimeoutError as exc:
            raise CompactionFailed(f"{purpose} timed out after {self._timeout:g} s") from exc

    async def _complete(
        self,
        model: str,
        messages: Sequence[Message],
        max_tokens: int,
        purpose: str,
        credential: str | None,
    ) -> LLMReply:
        trace = TRACE_HEADERS.get()
        if _needs_litellm(model):
            return await _litellm_complete(model, messages, max_tokens, self._timeout, trace)
        headers = {"content-type": "application/json", "x-compaction-purpose": purpose}
        if trace:
            headers.update(trace)
        key = self._api_key or (credential if self._relay_credential else None)
        if key:
            headers["authorization"] = key if key.lower().startswith("bearer ") else f"Bearer {key}"
        payload = {
            "model": model.removeprefix("openai/"),
            "messages": list(messages),
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": False,
        }
        response = await self._post(self._url, orjson.dumps(payload), headers, purpose)
        if response.status_code != 200:
            raise CompactionFailed(f"{purpose} upstream status {response.status_code}")
        try:
            body = orjson.loads(response.content)
        except orjson.JSONDecodeError as exc:
            raise CompactionFailed(f"{purpose} reply is not JSON") from exc
        if not isinstance(body, dict):
            raise CompactionFailed(f"{purpose} reply is not an object")
        return reply_from(body, model)

    async def _post(self, url: str, content: bytes, headers: Any, purpose: str) -> httpx.Response:
        """One POST of the proxy's own; the wire's failures as ``CompactionFailed``."""
        try:
            return await self._client.post(
                url, content=content, headers=headers, timeout=self._timeout
            )
        except httpx.TimeoutException as exc:
            raise CompactionFailed(f"{purpose} timed out") from exc
        except httpx.HTTPError as exc:
            why = f"{safe_url(url)} unreachable: {classify(exc, url).reason}"
            raise CompactionFailed(f"{purpose}: {why}") from exc

    async def shared(self, call: SharedCall, body: dict[str, Any], *, purpose: str) -> SharedReply:
        """A call in the client's own shape to the upstream, with the headers the client's
        request was forwarded with (``proxy.core.sharedcall``): never to
        ``summary_base_url``, whose cache is not the conversation's."""
        # The call's own purpose and trace context replace any the client's request had.
        own = {"x-compaction-purpose": purpose, **(TRACE_HEADERS.get() or {})}
        names = {name.lower().encode() for name in own}
        headers = [(k, v) for k, v in call.headers if k.lower() not in names]
        headers.extend((name.encode(), value.encode()) for name, value in own.items())
        model = str(body.get("model", ""))
        try:
            async with asyncio.timeout(self._timeout):
                response = await self._post(call.url, orjson.dumps(body), headers, purpose)
        except TimeoutError as exc:
            raise CompactionFailed(f"{purpose} timed out") from exc
        status = response.status_code
        if status != 200:
            refused = 400 <= status < 500 and status not in (401, 403, 408, 429)
            raise (CallRefused if refused else CompactionFailed)(
                f"{purpose} upstream status {status}"
            )
        try:
            answer = orjson.loads(response.content)
        except orjson.JSONDecodeError as exc:
            raise CallRefused(f"{purpose} reply is not JSON") from exc
        reply = reply_of(call, answer, model)
        if reply is None:
            raise CallRefused(f"{purpose} reply is not a {call.surface.name} answer")
        return reply


async def _litellm_complete(
    model: str,
    messages: Sequence[Message],
    max_tokens: int,
    timeout: float,
    trace: Mapping[str, str] | None = None,
) -> LLMReply:
    # Importing litellm fetches its model map from the internet unless told not to; the
    # proxy makes no network calls but to the upstream (and here, the named provider).
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        import litellm

        response = await litellm.acompletion(
            model=model,
            messages=list(messages),
            max_tokens=max_tokens,
            temperature=0,
            timeout=timeout,
            # The provider's request carries the call's trace context (as the HTTP path's).
            **({"extra_headers": dict(trace)} if trace else {}),
        )
        body = response.model_dump() if hasattr(response, "model_dump") else dict(response)
    except Exception as exc:  # litellm raises many provider-specific types
        raise CompactionFailed(f"litellm call failed: {type(exc).__name__}") from exc
    return reply_from(body, model)
