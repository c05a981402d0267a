"""Compaction inside a LiteLLM proxy: ``callbacks: hooks.litellm_compaction.compaction_hook``.

A thin adapter (DESIGN §2, §9): ``Service.begin`` before a chat call, ``Service.finish`` after
it, as in the standalone server; fails open. ``litellm_service``: settings, start-up, /metrics;
``litellm_llm``: detector and summarizer calls; ``litellm_payload``: what LiteLLM hands us."""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

from litellm.integrations.custom_logger import CustomLogger
from litellm.proxy._types import ProxyException

from hooks.litellm_payload import (
    ROUTE,
    describe,
    failure_status,
    is_client_chat,
    response_model,
    seconds,
    usage_of,
)
from hooks.litellm_service import Calls, Starter
from proxy.config import Config
from proxy.engine.service import Service, record_rejection, too_long

log = logging.getLogger("compaction_proxy.litellm")  # as hooks.litellm_service logs


class CompactionHook(CustomLogger):
    """The LiteLLM callback (LiteLLM passes arguments by name: the names are its own).
    ``config`` and ``service`` are for tests."""

    def __init__(self, config: Config | None = None, *, service: Service | None = None):
        super().__init__()
        self.starter, self.calls = Starter(config, service), Calls()

    async def async_pre_call_hook(
        self, user_api_key_dict: Any, cache: Any, data: dict[str, Any], call_type: Any
    ) -> dict[str, Any]:
        t0 = time.perf_counter()  # the proxy's overhead counts from here
        if not is_client_chat(data, call_type) or (service := await self.starter.service()) is None:
            return data
        call = await service.begin(ROUTE, partial(describe, data, user_api_key_dict), started=t0)
        error = too_long(call.prepared, str(data.get("model", "")))
        if error is not None:
            # Not forwarded: the provider would reject it. A 400 in OpenAI's shape, as the
            # standalone server answers (LiteLLM relays a ProxyException as it is).
            reason = error.code or error.type
            record_rejection(log, service.metrics, ROUTE, error.status, reason)
            raise ProxyException(message=str(error), type=error.type, param=None, code=error.status)
        if call.prepared is not None and call.prepared.changed:
            data["messages"] = call.prepared.forwarded
        if trace_headers := call.trace_headers():  # traced: the upstream joins the trace
            data["extra_headers"] = {**(data.get("extra_headers") or {}), **trace_headers}
        self.calls.add(data, call)
        return data

    async def async_post_call_response_headers_hook(
        self, data: dict[str, Any], user_api_key_dict: Any, response: Any, *args: Any, **kw: Any
    ) -> dict[str, str] | None:
        return self.calls.headers(data)

    async def async_log_success_event(
        self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        upstream_s, usage = seconds(start_time, end_time), usage_of(response_obj)
        model = response_model(response_obj)
        self.calls.finish(kwargs, self.starter.current, usage, 200, upstream_s, model)

    async def async_log_failure_event(
        self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        status, upstream_s = failure_status(kwargs), seconds(start_time, end_time)
        self.calls.finish(kwargs, self.starter.current, None, status, upstream_s)


compaction_hook = CompactionHook()
