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
import gc
import logging
import time
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from proxy.adapters.forward import Forwarder, make_client, make_transport
from proxy.adapters.llm import HttpLLM
from proxy.adapters.store import Store
from proxy.config import Config
from proxy.core.reparse import Reparser
from proxy.core.reprint import FRESH_ON_LOOP_BYTES
from proxy.core.surfaces import ANTHROPIC_MESSAGES, OPENAI_CHAT, OPENAI_RESPONSES, Surface
from proxy.core.tokens import warm_tokenizers
from proxy.engine.chat import ChatRequest, outgoing
from proxy.engine.service import Service, build_service
from proxy.operators import admin, admintoken, dashboard  # the operators' view
from proxy.server import probes
from proxy.server.abort import AbortOnBrokenBody
from proxy.server.errors import HANDLERS
from proxy.server.front import ChatFront
from proxy.server.incoming import header_map, parse_and_validate, parse_extension, receive_body
from proxy.server.passthrough import passthrough
from proxy.server.relay import relay

log = logging.getLogger("compaction_proxy.server")
# Bodies this big are parsed, validated, fingerprinted and counted in a worker thread, unless
# they resend a recent body with less than this much new (``Reuse.light``).
OFFLOAD_BYTES = FRESH_ON_LOOP_BYTES


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
    """One pass down: read the body and parse it once, the engine answers with what to
    forward (``proxy.engine.chat.outgoing``; an error it raises goes to the app's handlers,
    in the route's own shape), the answer is relayed, ``Service.finish`` records it.
    Straight on ASGI: the headers are read once (``header_map``), no ``Request`` is built."""
    state = scope["app"].state
    service: Service = state.res
    config = service.config
    started = time.perf_counter()
    head = header_map(scope)
    raw = await receive_body(head, receive, config.max_body_bytes, config.limits.body_timeout_s)
    big = len(raw) >= OFFLOAD_BYTES
    # Parsing and checking megabytes would stall every other request on the loop: a big
    # body in a worker thread, unless it resends a recent one with a small new part (#28).
    parsed = parse_extension(raw, surface, state.reparser, OFFLOAD_BYTES) if big else None
    if parsed is None and big:
        parsed = await asyncio.to_thread(parse_and_validate, raw, surface, state.reparser)
    elif parsed is None:
        parsed = parse_and_validate(raw, surface, state.reparser)
    body, reuse = parsed
    request = ChatRequest(surface, raw, body, head, scope["headers"], started, big, reuse)
    out = await outgoing(service, state.forwarder, request)
    await relay(out, send, receive)


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
        # Recent bodies, so the next one of a conversation is parsed past what they share:
        # 128 bodies at least, more with more memory (50-message bodies are ~50 KB).
        memory = config.limits.reparse_memory_mb
        app.state.reparser = Reparser(
            max_entries=max(128, int(memory * 16)), max_bytes=int(memory * 2**20)
        )
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
