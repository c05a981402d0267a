"""The detector and summarizer calls of the LiteLLM hook, through LiteLLM itself.

They go through the running proxy's router (its model list, keys and providers), else plain
``litellm.acompletion``. They carry ``metadata={"compaction_internal": True}`` and the header
``x-compaction-purpose``; the hook skips its own calls, so it never recurses. When traced, the
call's span context too (``traceparent``: ``proxy.adapters.llm.TRACE_HEADERS``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from proxy.adapters.llm import TRACE_HEADERS, LLMReply, reply_from
from proxy.core.errors import CompactionFailed
from proxy.core.messages import Message

INTERNAL_FLAG = "compaction_internal"  # metadata mark of the hook's own LLM calls
PURPOSE_HEADER = "x-compaction-purpose"


def proxy_router() -> Any:
    """The running LiteLLM proxy's router, or None (not inside a LiteLLM proxy)."""
    try:
        from litellm.proxy.proxy_server import llm_router
    except Exception:
        return None
    return llm_router


def routable(router: Any, model: str) -> bool:
    """Whether the router serves ``model``: a model_list name, an alias or a wildcard."""
    try:
        if model in router.get_model_names() or model in (router.model_group_alias or {}):
            return True
        return bool(router.pattern_router.route(model))
    except Exception:
        return False


class LiteLLMRouterLLM:
    """The core's ``LLM``: chat completions through LiteLLM's router (else ``litellm``).

    Never raises anything but ``CompactionFailed``. ``credential`` is unused: LiteLLM holds
    the provider keys of its model list.
    """

    def __init__(self, *, timeout_s: float = 120.0, router: Any = None) -> None:
        self._timeout = timeout_s
        self._router = router

    async def complete(
        self,
        model: str,
        messages: Sequence[Message],
        *,
        max_tokens: int,
        purpose: str,
        credential: str | None,
    ) -> LLMReply:
        request: dict[str, Any] = {
            "model": model,
            "messages": list(messages),
            "max_tokens": max_tokens,
            "temperature": 0,
            "drop_params": True,  # models that refuse temperature=0 still answer
            "timeout": self._timeout,
            # One attempt, like the standalone proxy: a failure puts the conversation on
            # cooldown instead of keeping an inline request waiting on retries.
            "num_retries": 0,
            "metadata": {INTERNAL_FLAG: True, "compaction_purpose": purpose},
            "extra_headers": {PURPOSE_HEADER: purpose, **(TRACE_HEADERS.get() or {})},
        }
        router = self._router if self._router is not None else proxy_router()
        try:
            # The whole call within timeout_s: LiteLLM's own timeout bounds each read, so a
            # provider dripping bytes would otherwise hold an inline request for ever.
            async with asyncio.timeout(self._timeout):
                if router is not None and routable(router, model):
                    response = await router.acompletion(**request)
                else:
                    import litellm

                    response = await litellm.acompletion(**request)
            body = response.model_dump() if hasattr(response, "model_dump") else response
        except TimeoutError as exc:
            raise CompactionFailed(f"{purpose} timed out after {self._timeout:g} s") from exc
        except Exception as exc:  # LiteLLM raises many provider-specific types
            raise CompactionFailed(f"{purpose} call through LiteLLM failed: {exc!r}"[:300]) from exc
        if not isinstance(body, dict):
            raise CompactionFailed(f"{purpose} reply is not an object")
        return reply_from(body, model)


def underlying_model(model: str, router: Any = None) -> str:
    """The provider model behind a LiteLLM model group (``gpt-4o-mini`` -> ``openai/gpt-4o-mini``),
    so token counts, the context window and prices come from LiteLLM's map; else ``model``."""
    router = router if router is not None else proxy_router()
    if router is None:
        return model
    try:
        deployments = router.get_model_list(model_name=model) or []
        params = deployments[0].get("litellm_params") or {}
        resolved = params.get("model")
    except Exception:
        return model
    return resolved if isinstance(resolved, str) and resolved else model
