"""What LiteLLM hands the hook, as plain values: the client's headers, the tenant, whether a
call is a client's chat request or one of the hook's own, the usage and the upstream's time."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hooks.litellm_llm import INTERNAL_FLAG, underlying_model
from proxy.core.fingerprint import tenant_id
from proxy.engine.incoming import Incoming

ROUTE = "litellm.chat.completions"  # the ledger's and the metrics' route label
_CHAT_CALL_TYPES = frozenset({"completion", "acompletion"})


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


def is_client_chat(data: Mapping[str, Any], call_type: Any) -> bool:
    """A client's chat completion with messages (not an embedding, not the hook's own call)."""
    messages, model = data.get("messages"), data.get("model")
    return (
        call_type in _CHAT_CALL_TYPES
        and isinstance(messages, list)
        and bool(messages)
        and isinstance(model, str)
        and not is_internal(data)
    )


def describe(data: Mapping[str, Any], user_api_key_dict: Any) -> Incoming:
    """A chat request (``is_client_chat``) as the service sees it."""
    headers = request_headers(data)
    model: str = data["model"]
    return Incoming(
        messages=data["messages"],
        model=model,
        tenant=tenant_of(user_api_key_dict, headers),
        tenant_name=headers.get("x-compaction-tenant"),
        compaction_header=headers.get("x-compaction"),
        conversation_header=headers.get("x-conversation-id"),
        counted_model=underlying_model(model),
        traceparent=headers.get("traceparent"),
        tracestate=headers.get("tracestate"),
    )


def usage_of(response: Any) -> dict[str, Any] | None:
    """The usage of a LiteLLM response (a pydantic object or a dict), or None."""
    usage = getattr(response, "usage", None)
    if usage is None and isinstance(response, dict):
        usage = response.get("usage")
    if usage is not None and hasattr(usage, "model_dump"):
        usage = usage.model_dump()
    return usage if isinstance(usage, dict) else None


def response_model(response: Any) -> str | None:
    """The model a LiteLLM response names, or None."""
    model = getattr(response, "model", None)
    if model is None and isinstance(response, dict):
        model = response.get("model")
    return model if isinstance(model, str) and model else None


def failure_status(kwargs: Mapping[str, Any]) -> int:
    """The upstream's error status of a failed call (500 when it has none)."""
    status = getattr(kwargs.get("exception"), "status_code", None)
    return status if isinstance(status, int) and status >= 400 else 500


def seconds(start: Any, end: Any) -> float | None:
    """LiteLLM's start and end times (datetimes or floats) as seconds; None if unusable."""
    try:
        delta = end - start
        return float(delta.total_seconds() if hasattr(delta, "total_seconds") else delta)
    except Exception:
        return None
