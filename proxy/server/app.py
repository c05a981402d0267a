"""The standalone proxy: a Starlette app over the shared service (DESIGN §2, §9).

``create_app(config, transport=..., store=...)`` builds the app (behind ``ChatFront``, which
sends the chat POSTs to their ``ChatRoute`` directly); its lifespan owns the httpx client,
the chat routes' ``Forwarder`` and the service (store, compactor, metrics registry, store
health), so building two apps in one process is safe. A chat request goes
``Service.begin`` -> forward (``proxy.server.relay``) -> ``Service.finish``, as it does in
the LiteLLM hook.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import time
from collections.abc import AsyncIterator

import httpx
import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from proxy.adapters.forward import (
    Forwarder,
    make_client,
    make_transport,
    request_headers,
    upstream_url,
)
from proxy.adapters.llm import HttpLLM
from proxy.adapters.store import Store
from proxy.config import Config
from proxy.core.errors import UpstreamError
from proxy.core.headers import compaction_headers
from proxy.core.tokens import warm_tokenizers
from proxy.engine.service import Service, build_service, too_long
from proxy.operators import admin, admintoken, dashboard  # the operators' view
from proxy.server import probes
from proxy.server.abort import AbortOnBrokenBody
from proxy.server.errors import HANDLERS
from proxy.server.front import ChatFront
from proxy.server.incoming import describe, header_map, parse_and_validate, receive_body
from proxy.server.passthrough import passthrough
from proxy.server.relay import forward_stream, forward_whole
from proxy.server.surfaces import ANTHROPIC_MESSAGES, OPENAI_CHAT, OPENAI_RESPONSES, Surface

log = logging.getLogger("compaction_proxy.server")
# Bodies this big are parsed, validated, fingerprinted and counted in a worker thread.
OFFLOAD_BYTES = 256 * 1024


class ChatRoute:
    """A chat route as a plain ASGI app rather than a Starlette endpoint: it writes its
    answer itself (``proxy.server.relay``), so a stream needs no anyio task group and the
    client gets a whole answer before the after-answer work. Errors raised before the answer
    starts go to the app's exception handlers as any route's do."""

    def __init__(self, surface: Surface) -> None:
        self.surface = surface

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _serve(scope, receive, self.surface, send)


async def _serve(scope: Scope, receive: Receive, surface: Surface, send: Send) -> None:
    """Parse, validate, begin (identify, substitute, decide), forward, relay - any surface.
    Straight on ASGI: the headers are read once (``header_map``), no ``Request`` is built."""
    state = scope["app"].state
    service: Service = state.res
    forwarder: Forwarder = state.forwarder
    config = service.config
    started = time.perf_counter()
    head = header_map(scope)
    raw = await receive_body(head, receive, config.max_body_bytes, config.limits.body_timeout_s)
    big = len(raw) >= OFFLOAD_BYTES
    if big:  # parsing and checking megabytes would stall every other request on the loop
        body = await asyncio.to_thread(parse_and_validate, raw, surface)
    else:
        body = parse_and_validate(raw, surface)
    counter = service.compactor.counter
    call = await service.begin(
        surface.name, lambda: describe(head, surface, body, counter, big), started=started
    )
    prepared = call.prepared
    error = too_long(prepared, body["model"])
    if error is not None:
        raise error  # the route's own shape (proxy.server.errors)

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
    payload = raw if out is body else orjson.dumps(out)
    headers = request_headers(
        scope["headers"],
        config.upstream.api_key,
        drop=frozenset({"accept-encoding"}),
        key_header="x-api-key" if surface is ANTHROPIC_MESSAGES else "authorization",
    )
    headers["content-type"] = "application/json"
    headers.update(call.trace_headers())  # traced: the upstream joins the request's trace
    url = chat_url(config.upstream.base_url, surface.path)
    upstream_request = forwarder.request("POST", url, payload, headers)
    call.forwarding()
    own = compaction_headers(prepared)

    async def client_body() -> httpx.Request | None:
        """The client's own body, when the upstream refused the one the compaction changed."""
        if out is body or not await service.send_as_sent(call):
            return None
        own.update(compaction_headers(call.prepared))
        return forwarder.request("POST", url, raw, headers)

    try:
        if not stream:
            await forward_whole(
                service, forwarder, call, upstream_request, own, send, receive, client_body
            )
            return
        await forward_stream(
            service, forwarder, call, surface, upstream_request, own, drop_usage, send, receive,
            client_body,
        )  # fmt: skip
    except UpstreamError as exc:
        # The client gets our 502/504: the ledger and metrics count it as any answer (#29).
        service.finish(call, None, exc.status)
        raise


@functools.lru_cache(maxsize=16)
def chat_url(base_url: str, path: str) -> httpx.URL:
    """A chat route's upstream URL (an immutable ``httpx.URL``): the same for every request
    of a route, and building it (parse, dot-segment check, parse again) was ~4 % of the
    worker's CPU under load (#28)."""
    return upstream_url(base_url, path, "")


def compaction_llm(config: Config, client: httpx.AsyncClient) -> HttpLLM:
    """The detector/summarizer client: the upstream with the client's key, or
    ``compaction.summary_base_url`` with ``summary_api_key`` only (never the client's key)."""
    c = config.compaction
    if c.summary_base_url:
        return HttpLLM(
            client,
            c.summary_base_url,
            api_key=c.summary_api_key,
            timeout_s=c.llm_timeout_s,
            relay_credential=False,
        )
    return HttpLLM(
        client, config.upstream.base_url, api_key=config.upstream.api_key, timeout_s=c.llm_timeout_s
    )


def create_app(
    config: Config,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    store: Store | None = None,
) -> ChatFront:
    """The ASGI app. ``transport`` and ``store`` swap the wire and the state in tests."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Before the first request (and before /healthz answers): building an encoding
        # takes from half a second to several under load.
        encodings = await asyncio.to_thread(warm_tokenizers)
        log.info("tokenizers ready", extra={"encodings": encodings})
        # What start-up loaded (LiteLLM's model map, tokenizers) lives as long as the process:
        # out of the collector's sight, a full collection no longer walks it while a request
        # waits.
        gc.freeze()
        wire = transport if transport is not None else make_transport(config.upstream)
        client = make_client(config.upstream, wire)
        effective = admintoken.resolve(config)  # operators' surfaces never open
        # Without a usable store the proxy still serves, uncompacted (proxy.adapters.health).
        service = build_service(effective, compaction_llm(config, client), store=store)
        app.state.res, app.state.client = service, client
        app.state.forwarder = Forwarder(client, wire)
        watcher = asyncio.get_running_loop().create_task(service.health.watch())
        try:
            yield
        finally:
            watcher.cancel()
            await service.close(timeout=30)
            await client.aclose()

    chat = {s.path: ChatRoute(s) for s in (OPENAI_CHAT, ANTHROPIC_MESSAGES, OPENAI_RESPONSES)}
    routes = [
        Route("/healthz", probes.healthz, methods=["GET"]),
        Route("/readyz", probes.readyz, methods=["GET"]),
        # Reached through ChatFront for POST; here for every other method's 405.
        *(Route(path, route, methods=["POST"]) for path, route in chat.items()),
        *admin.routes(),  # operators' view: /metrics, /admin/api/*
        *dashboard.routes(),  # operators' view: /dashboard
        Route(
            "/v1/{path:path}",
            passthrough,
            methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"],
        ),
        # Reachability probes (Claude Code sends HEAD /): the provider's answer, not ours.
        Route("/", passthrough, methods=["GET", "HEAD"]),
        Route("/v1", passthrough, methods=["GET", "HEAD"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(AbortOnBrokenBody)],
        exception_handlers=HANDLERS,  # type: ignore[arg-type]
    )
    return ChatFront(app, chat)
