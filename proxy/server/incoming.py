"""Reading a client's request: its body within the limit, its key, and its description for
the service (``proxy.engine.service.Incoming``)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request

from proxy.config import Limits
from proxy.core.errors import BadRequest, BodyTimeout, PayloadTooLarge
from proxy.core.fingerprint import tenant_id
from proxy.core.tokens import TokenCounter
from proxy.engine.service import Incoming
from proxy.server.surfaces import Surface
from proxy.server.validation import parse_json_object


def credential_of(request: Request) -> str | None:
    """The client's API key as sent (Bearer token or x-api-key); only ever hashed or relayed."""
    auth = request.headers.get("authorization")
    if auth:
        return auth[7:].strip() if auth.lower().startswith("bearer ") else auth.strip()
    return request.headers.get("x-api-key")


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The body, refusing more than ``limit`` bytes without reading them all, and a body
    not complete within ``timeout_s`` (None: the app's ``limits.body_timeout_s``): a client
    that stops sending half-way never holds a connection and its memory for good."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is over the limit of {limit} bytes")
    if timeout_s is None:
        timeout_s = _body_timeout(request)
    chunks = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"request body is over the limit of {limit} bytes")
                chunks.append(chunk)
    except ClientDisconnect as exc:
        raise BadRequest("client disconnected while sending the body") from exc
    except TimeoutError as exc:
        raise BodyTimeout(f"the request body did not arrive within {timeout_s:g} s") from exc
    return b"".join(chunks)


def _body_timeout(request: Request) -> float:
    service = getattr(request.app.state, "res", None)
    config = getattr(service, "config", None)
    return config.limits.body_timeout_s if config is not None else Limits.body_timeout_s


def parse_and_validate(raw: bytes, surface: Surface) -> dict[str, Any]:
    """The body as a JSON object the surface accepts, or ``BadRequest``."""
    body = parse_json_object(raw)
    surface.validate(body)
    return body


def reserve_tokens(body: dict[str, Any], counter: TokenCounter) -> int:
    """What a request needs besides its messages: tool schemas and the requested reply."""
    reserve = 0
    tools = body.get("tools")
    if tools:
        reserve += counter.count_text(orjson.dumps(tools).decode(), str(body.get("model", "")))
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            reserve += value
            break
    return reserve


def describe(
    request: Request, surface: Surface, body: dict[str, Any], counter: TokenCounter, big: bool
) -> Incoming:
    """The validated request as the service sees it (the surface's neutral view)."""
    credential = credential_of(request)
    tenant_name = request.headers.get("x-compaction-tenant")
    return Incoming(
        messages=surface.to_view(body),
        model=body["model"],
        tenant=tenant_id(credential, tenant_name),
        tenant_name=tenant_name,
        credential=credential,
        compaction_header=request.headers.get("x-compaction"),
        conversation_header=request.headers.get("x-conversation-id"),
        stateful=surface.stateful(body),
        summary_role=surface.summary_role,
        summary_joins=surface.summary_joins,
        outside_cache_marks=surface.outside_cache_marks(body),
        reserve_tokens=reserve_tokens(body, counter),
        offload=big,
    )
