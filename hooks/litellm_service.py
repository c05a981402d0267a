"""The service as the LiteLLM hook runs it: its settings, one start per process, its metrics
on LiteLLM's ``/metrics``, and the calls waiting between LiteLLM's pre-call and log events.

Settings are the standalone proxy's ``compaction:`` and ``store:`` blocks, read from the file
named by ``$COMPACTION_PROXY_CONFIG``, else from a ``compaction_proxy:`` section of LiteLLM's
own config file, else the defaults.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry

from hooks.litellm_llm import LiteLLMRouterLLM
from hooks.litellm_payload import is_internal
from proxy.config import ENV_VAR, Config, ConfigError, load_config, parse_config
from proxy.core.headers import compaction_headers
from proxy.engine.service import Call, Service, build_service
from proxy.logs import setup_logging

log = logging.getLogger("compaction_proxy.litellm")

LITELLM_SECTION = "compaction_proxy"  # the section of LiteLLM's config file we read
MAX_PENDING = 1024  # requests between pre-call and success/failure event, per process
RETRY_START_S = 60.0  # after the service failed to start, pass requests through this long


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


class _Shown(Collector):
    """Shows a registry's metrics in another one (the service's in LiteLLM's default)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        return self._registry.collect()


def expose_metrics(service: Service) -> None:
    """Show the service's ``compaction_proxy_*`` metrics on prometheus-client's default
    registry, which LiteLLM's ``/metrics`` serves when its ``prometheus`` callback is on.
    In multiprocess mode every worker's values are in the shared folder LiteLLM reads already."""
    if service.metrics.multiprocess:
        return
    try:
        REGISTRY.register(_Shown(service.metrics.registry))
    except ValueError as exc:  # a second service in this process: the first one stays shown
        log.warning("compaction metrics already registered", extra={"error": str(exc)})


def start_service(config: Config | None = None) -> Service:
    """The hook's service (synchronous: opens the store, reads the prompts). Raises when the
    store cannot be opened or the settings are invalid."""
    # Our JSON log lines on stderr, unless the host process set up logging itself.
    if not logging.getLogger("compaction_proxy").handlers and not logging.getLogger().handlers:
        setup_logging(os.environ.get("COMPACTION_PROXY_LOG_LEVEL", "INFO"))
    config = config or hook_config()
    if config.compaction.summary_base_url:
        log.warning(
            "compaction.summary_base_url is ignored inside LiteLLM: the detector and "
            "summarizer calls go through LiteLLM's router (set detection_model/summary_model)"
        )
    llm = LiteLLMRouterLLM(timeout_s=config.compaction.llm_timeout_s)
    service = build_service(config, llm, degraded_store=False)
    expose_metrics(service)
    log.info("compaction hook started", extra={"store": config.store.url.split("://")[0]})
    return service


class Starter:
    """The service, built on the first chat request (after LiteLLM has loaded its config and
    router). While it cannot be built, requests pass unchanged; it is tried again after
    ``RETRY_START_S``."""

    def __init__(self, config: Config | None = None, service: Service | None = None) -> None:
        self.current = service
        self._config = config
        self._lock = asyncio.Lock()
        self._retry_at = 0.0

    async def service(self) -> Service | None:
        """The service, or None while it cannot be built (never raises)."""
        if self.current is not None or time.monotonic() < self._retry_at:
            return self.current
        async with self._lock:
            if self.current is None and time.monotonic() >= self._retry_at:
                try:
                    self.current = await asyncio.to_thread(start_service, self._config)
                except Exception:
                    log.exception("compaction hook cannot start; requests go through unchanged")
                    self._retry_at = time.monotonic() + RETRY_START_S
        return self.current


class Calls:
    """Calls between LiteLLM's pre-call hook and its log event, by ``litellm_call_id``, with
    their response headers; at most ``MAX_PENDING`` each (the oldest are forgotten)."""

    def __init__(self) -> None:
        self._calls: OrderedDict[str, Call] = OrderedDict()
        self._headers: OrderedDict[str, dict[str, str]] = OrderedDict()

    def add(self, data: Mapping[str, Any], call: Call) -> None:
        """Remember a call begun for LiteLLM's request ``data``."""
        call_id = data.get("litellm_call_id")
        if isinstance(call_id, str):
            self._calls[call_id] = call
            self._headers[call_id] = compaction_headers(call.prepared)
            while len(self._calls) > MAX_PENDING:
                self._calls.popitem(last=False)
            while len(self._headers) > MAX_PENDING:
                self._headers.popitem(last=False)

    def headers(self, data: Mapping[str, Any]) -> dict[str, str] | None:
        """The ``x-compaction-*`` headers of the call (once)."""
        call_id = data.get("litellm_call_id")
        return self._headers.pop(call_id, None) if isinstance(call_id, str) else None

    def pop(self, kwargs: Mapping[str, Any]) -> Call | None:
        """The call a log event ends; None for the hook's own calls and unknown ids."""
        call_id = kwargs.get("litellm_call_id")
        if is_internal(kwargs) or not isinstance(call_id, str):
            return None
        self._headers.pop(call_id, None)
        return self._calls.pop(call_id, None)

    def finish(
        self,
        kwargs: Mapping[str, Any],
        service: Service | None,
        usage: Any,
        status: int,
        upstream_s: float | None,
        model: str | None = None,
    ) -> None:
        """End the call of LiteLLM's log event ``kwargs`` (never raises)."""
        call = self.pop(kwargs)
        if call is not None and service is not None:
            service.finish(call, usage, status, upstream_s=upstream_s, response_model=model)

    def __contains__(self, call_id: object) -> bool:
        return call_id in self._calls

    def __len__(self) -> int:
        return len(self._calls)
