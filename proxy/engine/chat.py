"""A chat request's one pass through the engine (#28).

The server reads the body and parses it once, and hands ``outgoing`` one ``ChatRequest``; the
engine answers with an ``Outgoing`` (the request to send upstream, the headers the client
gets, how to relay the answer) or raises the error to answer with (``ContextTooLong``, in the
route's own shape); the server relays the answer and ``Service.finish`` records it. Before,
the server ran pieces of this itself around calls into the engine (the context-window
guard, the body put back together, the upstream headers), and a request crossed the layers
back and forth a dozen times.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from proxy.adapters.forward import Forwarder, set_pair, upstream_pairs, upstream_url
from proxy.adapters.upstreamcall import UpstreamRequest
from proxy.core.fingerprint import tenant_id
from proxy.core.frozen import quick_init
from proxy.core.headers import compaction_headers
from proxy.core.reprint import Reuse
from proxy.core.sharedcall import SharedCall
from proxy.core.surfaces import ANTHROPIC_MESSAGES, Surface
from proxy.core.tokens import TokenCounter
from proxy.engine.incoming import Incoming
from proxy.engine.service import Call, Service, too_long

# Never relayed upstream: the proxy reads the answer, so it asks for it uncompressed.
_DROPPED = frozenset({"accept-encoding"})


@quick_init
@dataclass(frozen=True)
class ChatRequest:
    """One chat request as the server read it: parsed and validated once."""

    surface: Surface
    raw: bytes  # the body as the client sent it (forwarded as is when nothing changed)
    body: dict[str, Any]
    headers: Mapping[str, str]  # by lower-case name, the first of a repeated one
    raw_headers: Iterable[tuple[bytes, bytes]]  # as sent (the ones relayed upstream)
    started: float  # time.perf_counter() when the request arrived
    big: bool = False  # heavy steps in a worker thread (identify too unless ``reuse.light``)
    reuse: Reuse | None = None  # what the body it resends left (``proxy.core.reparse``)


@dataclass
class Outgoing:
    """What to send upstream for one chat request, and how to relay the answer."""

    call: Call
    request: UpstreamRequest
    own: dict[str, str]  # the proxy's own response headers (x-compaction-*)
    surface: Surface
    stream: bool
    drop_usage: bool  # usage events the proxy asked for, which the client did not
    service: Service
    forwarder: Forwarder
    headers: list[tuple[bytes, bytes]]  # what went upstream with ``request``
    client_body: bytes | None  # the client's own body, when the compaction changed it

    async def fallback(self) -> UpstreamRequest | None:
        """The client's own body, when the upstream refused (400) the one the compaction
        changed and the service agrees to send it once (``Service.send_as_sent``)."""
        if self.client_body is None or not await self.service.send_as_sent(self.call):
            return None
        self.own.update(compaction_headers(self.call.prepared))
        return self.forwarder.request("POST", self.request.url, self.client_body, self.headers)


async def outgoing(service: Service, forwarder: Forwarder, req: ChatRequest) -> Outgoing:
    """Controls, identify, substitute, decide (``Service.begin``); then the body and headers
    to forward. Raises ``ContextTooLong`` for a request that does not fit even compacted."""
    surface, body, config = req.surface, req.body, service.config
    counter = service.compactor.counter
    headers = upstream_pairs(
        req.raw_headers,
        config.upstream.api_key,
        drop=_DROPPED,
        key_header="x-api-key" if surface is ANTHROPIC_MESSAGES else "authorization",
    )
    set_pair(headers, "content-type", "application/json")
    url = chat_url(config.upstream.base_url, surface.path)
    # The summarizer call in the client's shape, should this request's compaction summarize.
    shared = SharedCall(surface, body, url_text(url), tuple(headers))
    call = await service.begin(
        surface.name,
        lambda: describe(req.headers, surface, body, counter, req.big, req.reuse, shared),
        started=req.started,
    )
    prepared = call.prepared
    error = too_long(prepared, body["model"])
    if error is not None:
        raise error
    stream = body.get("stream") is True
    out = body
    if prepared is not None and prepared.changed:
        out = surface.from_view(body, prepared.forwarded)
    drop_usage = False
    # Bypassed, opted-out and shadowed requests go upstream byte for byte as sent.
    as_sent = prepared is not None and prepared.as_sent
    if stream and surface.stream_usage_option and not as_sent:
        options = body.get("stream_options")
        if not (isinstance(options, dict) and options.get("include_usage")):
            # Ask for usage so the ledger sees it; the client did not, so it never sees it.
            out = dict(out)
            out["stream_options"] = {**(options or {}), "include_usage": True}
            drop_usage = True
    payload = req.raw if out is body else orjson.dumps(out)
    for name, value in call.trace_headers().items():  # traced: the upstream joins its trace
        set_pair(headers, name, value)
    request = forwarder.request("POST", url, payload, headers)
    changed = prepared is not None and prepared.changed
    call.forwarding()
    return Outgoing(
        call, request, compaction_headers(prepared), surface, stream, drop_usage, service,
        forwarder, headers, req.raw if changed else None,
    )  # fmt: skip


@functools.lru_cache(maxsize=16)
def chat_url(base_url: str, path: str) -> httpx.URL:
    """A chat route's upstream URL (an immutable ``httpx.URL``): the same for every request
    of a route, and building it (parse, dot-segment check, parse again) was ~4 % of the
    worker's CPU under load (#28)."""
    return upstream_url(base_url, path, "")


@functools.lru_cache(maxsize=16)
def url_text(url: httpx.URL) -> str:
    """A route's upstream URL as text, made once."""
    return str(url)


class WrittenOnce:
    """The JSON of the last few values written, by identity (#28). A body parsed from the one
    before it (``proxy.core.reparse``) holds that body's very ``tools`` list, and writing a
    coding agent's ~62 KB of tool schemas again cost ~20 us a request. The proxy never
    changes a parsed value in place (every step copies what it alters), so the same object
    writes the same bytes; each entry holds its object, so no other takes its ``id``. Used
    on the event loop only."""

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self._made: dict[int, tuple[Any, bytes]] = {}

    def __call__(self, value: Any) -> bytes:
        made = self._made.get(id(value))
        if made is not None and made[0] is value:
            return made[1]
        written = orjson.dumps(value)
        if len(self._made) >= self.size:
            del self._made[next(iter(self._made))]  # the oldest
        self._made[id(value)] = (value, written)
        return written


TOOLS_JSON = WrittenOnce()


def credential_of(headers: Mapping[str, str]) -> str | None:
    """The client's API key as sent (Bearer token or x-api-key); only ever hashed or relayed."""
    auth = headers.get("authorization")
    if auth:
        return auth[7:].strip() if auth.lower().startswith("bearer ") else auth.strip()
    return headers.get("x-api-key")


def reserve_tokens(
    body: dict[str, Any], counter: TokenCounter, tools_json: bytes | None = None
) -> int:
    """What a request needs besides its messages: tool schemas and the requested reply
    (``tools_json``: the tools' JSON, if made already)."""
    reserve = 0
    tools = body.get("tools")
    if tools:
        made = orjson.dumps(tools) if tools_json is None else tools_json
        reserve += counter.count_json(made, str(body.get("model", "")))
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            reserve += value
            break
    return reserve


def describe(
    headers: Mapping[str, str],
    surface: Surface,
    body: dict[str, Any],
    counter: TokenCounter,
    big: bool,
    reuse: Reuse | None = None,
    shared: SharedCall | None = None,
) -> Incoming:
    """The validated request as the service sees it (the surface's neutral view)."""
    credential = credential_of(headers)
    tenant_name = headers.get("x-compaction-tenant")
    tools = body.get("tools")
    tools_json = TOOLS_JSON(tools) if tools else None  # once, for the count and the marks
    return Incoming(
        messages=surface.to_view(body),
        model=body["model"],
        tenant=tenant_id(credential, tenant_name),
        tenant_name=tenant_name,
        credential=credential,
        compaction_header=headers.get("x-compaction"),
        conversation_header=headers.get("x-conversation-id"),
        stateful=surface.stateful(body),
        summary_role=surface.summary_role,
        summary_joins=surface.summary_joins,
        outside_cache_marks=surface.outside_cache_marks(body, tools_json),
        reserve_tokens=reserve_tokens(body, counter, tools_json),
        offload=big,
        traceparent=headers.get("traceparent"),
        tracestate=headers.get("tracestate"),
        reuse=reuse,
        shared=shared,
    )
