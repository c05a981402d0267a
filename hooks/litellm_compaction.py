"""Compaction inside a LiteLLM proxy: a thin hook over the shared core (DESIGN §2, §9).

One line of LiteLLM config enables it::

    litellm_settings:
      callbacks: hooks.litellm_compaction.compaction_hook

- ``async_pre_call_hook`` puts the stored compaction of a chat request's history into
  ``data["messages"]`` and, when the decision says so, compacts inline first.
- ``async_log_success_event`` (LiteLLM calls it once per completion, streamed or not, after
  the last chunk) records usage in the ledger and schedules background compaction;
  ``async_log_failure_event`` records the failure.
- ``async_post_call_response_headers_hook`` adds the ``x-compaction-*`` response headers.

Detector and summarizer calls go through LiteLLM itself (its router and model list), so any
provider LiteLLM serves works. They carry ``metadata={"compaction_internal": True}`` and the
header ``x-compaction-purpose``; the hook skips its own calls, so it never recurses.

Settings are the standalone proxy's ``compaction:`` and ``store:`` blocks, read from the file
named by ``$COMPACTION_PROXY_CONFIG``, else from a ``compaction_proxy:`` section of LiteLLM's
own config file, else the defaults. The hook fails open: any exception is logged and the
request goes through exactly as the client sent it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from litellm.integrations.custom_logger import CustomLogger

from proxy.adapters.llm import LLMReply, reply_from
from proxy.adapters.store import open_store
from proxy.config import ENV_VAR, Config, ConfigError, load_config, load_prompt, parse_config
from proxy.core.controls import request_controls
from proxy.core.errors import CompactionFailed, StoreError
from proxy.core.fingerprint import tenant_id
from proxy.core.headers import compaction_headers
from proxy.core.messages import Message
from proxy.engine.compactor import Compactor, Prepared, Prompts
from proxy.logs import setup_logging
from proxy.operators import ledger

log = logging.getLogger("compaction_proxy.litellm")

INTERNAL_FLAG = "compaction_internal"  # metadata mark of the hook's own LLM calls
PURPOSE_HEADER = "x-compaction-purpose"
LITELLM_SECTION = "compaction_proxy"  # the section of LiteLLM's config file we read
ROUTE = "litellm.chat.completions"
_CHAT_CALL_TYPES = frozenset({"completion", "acompletion"})
_MAX_PENDING = 1024  # requests between pre-call and success/failure event, per process
_RETRY_START_S = 60.0  # after the engine failed to start, pass requests through this long


# ---- settings -----------------------------------------------------------------------------


def _litellm_config_path() -> str | None:
    """The config file the running LiteLLM proxy was started with, if it has one."""
    try:
        from litellm.proxy import proxy_server

        path = getattr(proxy_server, "user_config_file_path", None)
    except Exception:  # not inside a LiteLLM proxy (a script, a test)
        path = None
    for candidate in (path, os.environ.get("CONFIG_FILE_PATH"), os.environ.get("WORKER_CONFIG")):
        if isinstance(candidate, str) and candidate and os.path.isfile(candidate):
            return candidate
    return None


def hook_config(litellm_config: str | os.PathLike[str] | None = None) -> Config:
    """``$COMPACTION_PROXY_CONFIG``; else ``compaction_proxy:`` of LiteLLM's config; else defaults.

    Raises ``ConfigError`` naming the bad key, as the standalone proxy does.
    """
    if os.environ.get(ENV_VAR):
        return load_config()
    path = litellm_config or _litellm_config_path()
    if path is not None:
        raw = yaml.safe_load(Path(path).read_text())
        section = raw.get(LITELLM_SECTION) if isinstance(raw, dict) else None
        if section is not None:
            try:
                return parse_config(section)
            except ConfigError as exc:
                raise ConfigError(f"{path}: {LITELLM_SECTION}.{exc}") from exc
    return load_config()


# ---- detector and summarizer calls through LiteLLM ------------------------------------------


def _proxy_router() -> Any:
    try:
        from litellm.proxy.proxy_server import llm_router
    except Exception:
        return None
    return llm_router


def _routable(router: Any, model: str) -> bool:
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
            "extra_headers": {PURPOSE_HEADER: purpose},
        }
        router = self._router if self._router is not None else _proxy_router()
        try:
            # The whole call within timeout_s: LiteLLM's own timeout bounds each read, so a
            # provider dripping bytes would otherwise hold an inline request for ever.
            async with asyncio.timeout(self._timeout):
                if router is not None and _routable(router, model):
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
    router = router if router is not None else _proxy_router()
    if router is None:
        return model
    try:
        deployments = router.get_model_list(model_name=model) or []
        params = deployments[0].get("litellm_params") or {}
        resolved = params.get("model")
    except Exception:
        return model
    return resolved if isinstance(resolved, str) and resolved else model


# ---- what LiteLLM hands us -----------------------------------------------------------------


def request_headers(data: Mapping[str, Any]) -> dict[str, str]:
    """The client's request headers (lower-case) as LiteLLM records them in ``data``."""
    server_request = data.get("proxy_server_request")
    metadata = data.get("metadata")
    for source in (
        server_request.get("headers") if isinstance(server_request, dict) else None,
        metadata.get("headers") if isinstance(metadata, dict) else None,
    ):
        if isinstance(source, dict):
            return {str(k).lower(): str(v) for k, v in source.items()}
    return {}


def tenant_of(user_api_key_dict: Any, headers: Mapping[str, str]) -> str:
    """The key's team when it has one, else the key (LiteLLM hands us its hash, never the key)."""
    team = getattr(user_api_key_dict, "team_id", None)
    key = getattr(user_api_key_dict, "api_key", None)
    credential = f"team:{team}" if team else f"key:{key or ''}"
    return tenant_id(credential, headers.get("x-compaction-tenant"))


def is_internal(payload: Mapping[str, Any]) -> bool:
    """Whether a request or a logging payload is one of the hook's own detector/summarizer calls."""
    params = payload.get("litellm_params")
    for metadata in (
        payload.get("metadata"),
        params.get("metadata") if isinstance(params, dict) else None,
    ):
        if isinstance(metadata, dict) and metadata.get(INTERNAL_FLAG):
            return True
    return False


def _usage_of(response: Any) -> dict[str, Any] | None:
    usage = getattr(response, "usage", None)
    if usage is None and isinstance(response, dict):
        usage = response.get("usage")
    if usage is not None and hasattr(usage, "model_dump"):
        usage = usage.model_dump()
    return usage if isinstance(usage, dict) else None


def _seconds(start: Any, end: Any) -> float:
    try:
        delta = end - start
        return float(delta.total_seconds() if hasattr(delta, "total_seconds") else delta)
    except Exception:
        return 0.0


@dataclass(frozen=True)
class _Pending:
    """A prepared request waiting for its success or failure event."""

    prepared: Prepared
    overhead_s: float


# ---- the hook ------------------------------------------------------------------------------


class CompactionHook(CustomLogger):
    """LiteLLM callback that runs the shared compaction core on chat completion requests.

    ``config`` and ``compactor`` are for tests; by default the engine is built on the first
    chat request (after LiteLLM has loaded its config and router).
    """

    def __init__(self, config: Config | None = None, *, compactor: Compactor | None = None):
        super().__init__()
        self._config = config
        self._compactor = compactor
        self._start_lock = asyncio.Lock()
        self._retry_at = 0.0
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._headers: OrderedDict[str, dict[str, str]] = OrderedDict()

    # -- the engine, built once per process --

    def _build(self) -> Compactor:
        # Our JSON log lines on stderr, unless the host process set up logging itself.
        if not logging.getLogger("compaction_proxy").handlers and not logging.getLogger().handlers:
            setup_logging(os.environ.get("COMPACTION_PROXY_LOG_LEVEL", "INFO"))
        config = self._config or hook_config()
        store = open_store(config.store.url)
        prompts = Prompts(
            detector=load_prompt("detector", config.compaction),
            summarizer=load_prompt("summarizer", config.compaction),
        )
        llm = LiteLLMRouterLLM(timeout_s=config.compaction.llm_timeout_s)
        if config.compaction.summary_base_url:
            log.warning(
                "compaction.summary_base_url is ignored inside LiteLLM: the detector and "
                "summarizer calls go through LiteLLM's router (set detection_model/summary_model)"
            )
        log.info("compaction hook started", extra={"store": config.store.url.split("://")[0]})
        return Compactor(config.compaction, store, llm, prompts, retention_s=config.retention_s)

    async def engine(self) -> Compactor | None:
        """The compactor, or None while it cannot be built (then requests pass unchanged)."""
        if self._compactor is not None or time.monotonic() < self._retry_at:
            return self._compactor
        async with self._start_lock:
            if self._compactor is None and time.monotonic() >= self._retry_at:
                try:
                    self._compactor = await asyncio.to_thread(self._build)
                except Exception:
                    log.exception("compaction hook cannot start; requests go through unchanged")
                    self._retry_at = time.monotonic() + _RETRY_START_S
        return self._compactor

    @staticmethod
    def _remember(table: OrderedDict[str, Any], key: str, value: Any) -> None:
        table[key] = value
        while len(table) > _MAX_PENDING:
            table.popitem(last=False)

    # -- before the call --

    async def async_pre_call_hook(
        self, user_api_key_dict: Any, cache: Any, data: dict[str, Any], call_type: Any
    ) -> dict[str, Any]:
        messages, model = data.get("messages"), data.get("model")
        if (
            call_type not in _CHAT_CALL_TYPES
            or not isinstance(messages, list)
            or not messages
            or not isinstance(model, str)
            or is_internal(data)
        ):
            return data
        started = time.perf_counter()
        try:
            compactor = await self.engine()
            if compactor is None:
                return data
            headers = request_headers(data)
            tenant = tenant_of(user_api_key_dict, headers)
            controls = request_controls(
                compactor.settings,
                header=headers.get("x-compaction"),
                tenant=tenant,
                tenant_name=headers.get("x-compaction-tenant"),
                model=model,
                messages=messages,
            )
            prepared = await compactor.prepare(
                messages,
                model=underlying_model(model),
                llm_model=model,
                tenant=tenant,
                conversation_header=headers.get("x-conversation-id"),
                controls=controls,
            )
        except Exception:  # fail open: the request goes through as the client sent it
            log.exception("compaction hook failed; forwarding unchanged")
            return data
        if prepared.changed:
            data["messages"] = prepared.forwarded
        call_id = data.get("litellm_call_id")
        if isinstance(call_id, str):
            pending = _Pending(prepared, time.perf_counter() - started)
            self._remember(self._pending, call_id, pending)
            self._remember(self._headers, call_id, compaction_headers(prepared))
        return data

    async def async_post_call_response_headers_hook(
        self,
        data: dict[str, Any],
        user_api_key_dict: Any,
        response: Any,
        request_headers: dict[str, str] | None = None,
        litellm_call_info: dict[str, Any] | None = None,
    ) -> dict[str, str] | None:
        call_id = data.get("litellm_call_id")
        return self._headers.pop(call_id, None) if isinstance(call_id, str) else None

    # -- after the call --

    async def async_log_success_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        await self._finish(kwargs, _usage_of(response_obj), 200, _seconds(start_time, end_time))

    async def async_log_failure_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        status = getattr(kwargs.get("exception"), "status_code", None)
        status = status if isinstance(status, int) and status >= 400 else 500
        await self._finish(kwargs, None, status, _seconds(start_time, end_time))

    async def _finish(
        self, kwargs: dict[str, Any], usage: dict[str, Any] | None, status: int, latency: float
    ) -> None:
        """Schedule background compaction and write the ledger entry (never raises)."""
        try:
            call_id = kwargs.get("litellm_call_id")
            if is_internal(kwargs) or not isinstance(call_id, str):
                return
            pending = self._pending.pop(call_id, None)
            self._headers.pop(call_id, None)
            compactor = self._compactor
            if pending is None or compactor is None:
                return
            prepared = pending.prepared
            if status == 200:
                compactor.schedule(prepared)
            entry = ledger.RequestEntry.of(
                prepared,
                route=ROUTE,
                status=status,
                usage=usage,
                latency_s=latency,
                overhead_s=pending.overhead_s,
            )
            log.debug(
                "request",
                extra={
                    "route": ROUTE,
                    "conversation": prepared.conversation,
                    "case": prepared.case,
                    "tokens_before": prepared.original_tokens,
                    "tokens_after": prepared.forwarded_tokens,
                    "upstream_status": status,
                },
            )
            await asyncio.to_thread(
                ledger.record_request,
                compactor.store,
                entry,
                prepared.original,
                compactor.retention_s,
            )
        except StoreError as exc:
            log.warning("ledger write failed", extra={"error": str(exc)})
        except Exception:
            log.exception("compaction hook: after-call handling failed")


compaction_hook = CompactionHook()
