"""The standalone proxy: a Starlette app over the shared core (DESIGN §2, §9).

``create_app(config, transport=..., store=...)`` builds the app; its lifespan owns the httpx
client, the store and the metrics registry, so building two apps in one process is safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from proxy.adapters import health
from proxy.adapters.forward import (
    make_client,
    mapped_errors,
    request_headers,
    response_headers,
    upstream_url,
)
from proxy.adapters.health import StoreHealth, open_store_or_degraded
from proxy.adapters.llm import HttpLLM
from proxy.adapters.store import Store
from proxy.config import Config, load_prompt
from proxy.core.controls import request_controls
from proxy.core.errors import BadRequest, ContextTooLong, PayloadTooLarge, ProxyError, StoreError
from proxy.core.fingerprint import tenant_id
from proxy.core.headers import compaction_headers
from proxy.core.prepared import Prepared, Prompts
from proxy.core.tokens import TokenCounter, warm_tokenizers
from proxy.engine.compactor import Compactor
from proxy.operators import (
    admin,
    admintoken,
    dashboard,
    ledger,  # admin, dashboard: the operators' view
)
from proxy.operators.metrics import Metrics
from proxy.server.abort import AbortOnBrokenBody, BodyBroken
from proxy.server.bodies import TAIL_BYTES, WHOLE_BODY_BYTES, usage_in_tail
from proxy.server.sse import EventSplitter, event_json, is_terminal, is_usage_only
from proxy.server.surfaces import (
    ANTHROPIC_MESSAGES,
    OPENAI_CHAT,
    OPENAI_RESPONSES,
    Surface,
    anthropic_error,
    openai_error,
    usage_of,
)
from proxy.server.validation import parse_json_object

log = logging.getLogger("compaction_proxy.server")
# Bodies this big are parsed, validated, fingerprinted and counted in a worker thread.
OFFLOAD_BYTES = 256 * 1024
# Set by the server answering (uvicorn): relaying the upstream's too would send two of each.
SERVER_SET = frozenset({"date", "server"})


def error_response(exc: ProxyError, path: str = "") -> JSONResponse:
    """The error in the shape the route's clients parse (Anthropic's on /v1/messages)."""
    shape = anthropic_error if path == ANTHROPIC_MESSAGES.path else openai_error
    retry = exc.retry if exc.retry is not None else exc.status >= 500
    headers = {"x-should-retry": "true" if retry else "false"}
    return JSONResponse(
        shape(str(exc), exc.type, exc.code), status_code=exc.status, headers=headers
    )


_ROUTE_LABELS = {s.path: s.name for s in (OPENAI_CHAT, ANTHROPIC_MESSAGES, OPENAI_RESPONSES)}


def route_label(path: str, known: bool = True) -> str:
    """A bounded label for a request path (client paths never become metric labels)."""
    if path in _ROUTE_LABELS:
        return _ROUTE_LABELS[path]
    if not known:
        return "unknown"
    if path.startswith(("/admin", "/dashboard", "/metrics")):
        return "admin"
    return "passthrough" if path.startswith("/v1/") else "other"


def _rejected(request: Request, status: int, reason: str, known: bool = True) -> None:
    """Log and count one 4xx the proxy answered itself (route and reason, never content)."""
    route = route_label(request.url.path, known)
    log.info(
        "rejected",
        extra={"route": route, "status": status, "reason": reason, "method": request.method},
    )
    res: Resources | None = getattr(request.app.state, "res", None)
    if res is not None and res.metrics is not None:
        res.metrics.observe_rejection(route, reason)


@dataclass
class Resources:
    """What the lifespan owns; routes reach it through ``request.app.state.res``."""

    config: Config
    client: httpx.AsyncClient
    store: Store
    compactor: Compactor
    metrics: Any = None


def credential_of(request: Request) -> str | None:
    """The client's API key as sent (Bearer token or x-api-key); only ever hashed or relayed."""
    auth = request.headers.get("authorization")
    if auth:
        return auth[7:].strip() if auth.lower().startswith("bearer ") else auth.strip()
    return request.headers.get("x-api-key")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing more than ``limit`` bytes without reading them all."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is over the limit of {limit} bytes")
    chunks = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body is over the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect as exc:
        raise BadRequest("client disconnected while sending the body") from exc
    return b"".join(chunks)


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


async def chat_completions(request: Request) -> Response:
    return await _serve(request, OPENAI_CHAT)


async def anthropic_messages(request: Request) -> Response:
    return await _serve(request, ANTHROPIC_MESSAGES)


async def openai_responses(request: Request) -> Response:
    return await _serve(request, OPENAI_RESPONSES)


async def _serve(request: Request, surface: Surface) -> Response:
    """Parse, validate, identify, substitute, decide, forward, tee - for any surface."""
    res: Resources = request.app.state.res
    started = time.perf_counter()
    raw = await read_body(request, res.config.max_body_bytes)
    big = len(raw) >= OFFLOAD_BYTES
    if big:  # parsing and checking megabytes would stall every other request on the loop
        body = await asyncio.to_thread(parse_and_validate, raw, surface)
    else:
        body = parse_and_validate(raw, surface)
    credential = credential_of(request)
    tenant_name = request.headers.get("x-compaction-tenant")
    tenant = tenant_id(credential, tenant_name)
    prepared: Prepared | None
    try:
        view = surface.to_view(body)
        controls = request_controls(
            res.config.compaction,
            header=request.headers.get("x-compaction"),
            tenant=tenant,
            tenant_name=tenant_name,
            model=body["model"],
            messages=view,
            stateful=surface.stateful(body),
        )
        prepared = await res.compactor.prepare(
            view,
            model=body["model"],
            tenant=tenant,
            credential=credential,
            conversation_header=request.headers.get("x-conversation-id"),
            controls=controls,
            summary_role=surface.summary_role,
            offload=big,
            outside_cache_marks=surface.outside_cache_marks(body),
            summary_joins=surface.summary_joins,
            reserve_tokens=reserve_tokens(body, res.compactor.counter),
        )
    except Exception:  # fail open: a compaction problem never fails the request
        log.exception("compaction core failed; forwarding unchanged")
        prepared = None
    if prepared is not None and prepared.too_long:
        # Nothing left to drop: the provider would reject it; say so in the route's shape.
        raise ContextTooLong(
            f"the conversation needs {prepared.forwarded_tokens} tokens after compaction "
            f"(plus {prepared.reserve_tokens} for tools and the reply), more than the "
            f"context window of {body['model']}; start a new conversation or shorten it"
        )

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
        request.scope["headers"],
        res.config.upstream.api_key,
        drop=frozenset({"accept-encoding"}),
        key_header="x-api-key" if surface is ANTHROPIC_MESSAGES else "authorization",
    )
    headers["content-type"] = "application/json"
    url = upstream_url(res.config.upstream.base_url, surface.path, "")
    overhead = time.perf_counter() - started
    own = compaction_headers(prepared)
    relay_headers = frozenset({"content-encoding"}) | SERVER_SET

    if not stream:
        whole = Forwarded(res, surface, prepared, started, overhead)
        return await _forward_whole(whole, url, payload, headers, own, relay_headers)

    upstream_request = res.client.build_request("POST", url, content=payload, headers=headers)
    async with mapped_errors():
        upstream = await res.client.send(upstream_request, stream=True)
    if upstream.status_code != 200:
        try:
            async with mapped_errors():
                content = await upstream.aread()
        finally:
            await upstream.aclose()
        _finish(res, surface, prepared, None, upstream.status_code, started, overhead)
        return Response(
            content,
            status_code=upstream.status_code,
            headers=response_headers(upstream.headers, drop=relay_headers) | own,
        )
    return StreamingResponse(
        _relay(res, surface, upstream, prepared, drop_usage, started, overhead),
        status_code=200,
        headers=response_headers(upstream.headers, drop=relay_headers) | own,
    )


@dataclass
class Forwarded:
    """What ``_finish`` needs once a non-streamed answer has gone out."""

    res: Resources
    surface: Surface
    prepared: Prepared | None
    started: float
    overhead: float

    def finish(self, usage: Any, status: int) -> None:
        _finish(self.res, self.surface, self.prepared, usage, status, self.started, self.overhead)


async def _forward_whole(
    fwd: Forwarded,
    url: str,
    payload: bytes,
    headers: httpx.Headers,
    own: dict[str, str],
    relay_headers: frozenset[str],
) -> Response:
    """A non-streamed request: ``upstream.timeout_s`` bounds the whole of it. An answer up
    to ``WHOLE_BODY_BYTES`` is read whole (its usage parsed); a bigger one is relayed as it
    arrives, its usage read from its last bytes."""
    res = fwd.res
    loop = asyncio.get_running_loop()
    deadline = loop.time() + res.config.upstream.timeout_s
    request = res.client.build_request("POST", url, content=payload, headers=headers)
    async with mapped_errors(deadline_s=res.config.upstream.timeout_s):
        upstream = await res.client.send(request, stream=True)
        try:
            head, rest = await _read_up_to(upstream, WHOLE_BODY_BYTES)
        except BaseException:
            await upstream.aclose()
            raise
    out_headers = response_headers(upstream.headers, drop=relay_headers) | own
    if rest is None:
        await upstream.aclose()
        usage = None
        if upstream.status_code == 200:
            try:
                usage = usage_of(orjson.loads(head))
            except orjson.JSONDecodeError:
                usage = None
        fwd.finish(usage, upstream.status_code)
        return Response(head, status_code=upstream.status_code, headers=out_headers)
    length = upstream.headers.get("content-length")
    if length and length.isdigit() and "content-encoding" not in upstream.headers:
        out_headers["content-length"] = length  # a short body is then seen as short
    return StreamingResponse(
        _relay_whole(fwd, upstream, head, rest, deadline),
        status_code=upstream.status_code,
        headers=out_headers,
    )


async def _read_up_to(
    upstream: httpx.Response, limit: int
) -> tuple[bytes, AsyncIterator[bytes] | None]:
    """The body if it ends within ``limit`` bytes (and None); else what was read so far and
    the rest of the body still to come."""
    chunks: list[bytes] = []
    size = 0
    rest = upstream.aiter_bytes()
    async for chunk in rest:
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return b"".join(chunks), rest
    return b"".join(chunks), None


async def _relay_whole(
    fwd: Forwarded,
    upstream: httpx.Response,
    head: bytes,
    rest: AsyncIterator[bytes],
    deadline: float,
) -> AsyncIterator[bytes]:
    loop = asyncio.get_running_loop()
    tail = head[-TAIL_BYTES:]
    completed = False
    try:
        yield head
        while True:
            # The deadline wraps each read only, never a yield (the client's pace is not the
            # upstream's, and a timeout must not cancel the write in progress).
            async with asyncio.timeout(max(deadline - loop.time(), 0)):
                try:
                    chunk = await anext(rest)
                except StopAsyncIteration:
                    break
            tail = (tail + chunk)[-TAIL_BYTES:]
            yield chunk
        completed = True
    except (httpx.HTTPError, TimeoutError) as exc:
        log.warning("upstream body broke", extra={"error": type(exc).__name__})
        raise BodyBroken from exc
    finally:
        await upstream.aclose()
        status = upstream.status_code if completed else 499
        usage = usage_in_tail(tail) if completed and status == 200 else None
        fwd.finish(usage, status)


async def _relay(
    res: Resources,
    surface: Surface,
    upstream: httpx.Response,
    prepared: Prepared | None,
    drop_usage: bool,
    started: float,
    overhead: float,
) -> AsyncIterator[bytes]:
    """Relay SSE events as they complete; read usage from the events that carry it.

    The stream is complete once its terminal event (``[DONE]``, ``message_stop``,
    ``response.completed``...) has been relayed: the request counts as a success then and
    the rest of the upstream connection is not waited for (a client that closes right after
    the terminal event, as the openai SDK does, is not a disconnect).
    """
    splitter = EventSplitter()
    usage: dict[str, Any] = {}
    completed = False
    finished = False
    try:
        async for chunk in upstream.aiter_raw():
            # Every event completed by this read goes out at once, in one write: nothing
            # waits for later bytes, and the client is not sent one syscall per event.
            out = []
            terminal = False
            for event in splitter.feed(chunk):
                if b'"usage"' in event:
                    obj = event_json(event)
                    found = usage_of(obj)
                    if found:
                        # Anthropic splits usage over message_start and message_delta.
                        usage.update({k: v for k, v in found.items() if v is not None})
                        if drop_usage and is_usage_only(obj):
                            continue
                out.append(event)
                terminal = terminal or is_terminal(event)
            if terminal:
                # Recorded before the write: the client may close as soon as it has it.
                completed = finished = True
                _finish(res, surface, prepared, usage or None, 200, started, overhead)
            if out:
                yield b"".join(out)
            if terminal:
                break
        else:
            rest = splitter.flush()
            if rest:
                yield rest
            completed = True
    except httpx.HTTPError as exc:
        log.warning("upstream stream broke", extra={"error": type(exc).__name__})
        if not completed:
            message = surface.error_body(
                "upstream stream interrupted", "upstream_error", "upstream_error"
            )
            yield b"event: error\ndata: " + orjson.dumps(message) + b"\n\n"
    finally:
        # Recorded first: a client gone away cancels this generator, and the awaited close
        # below may not return.
        if not finished:
            status = 200 if completed else 499
            _finish(res, surface, prepared, usage or None, status, started, overhead)
        # Also runs when the client goes away: closing cancels the upstream request.
        await upstream.aclose()


def _finish(
    res: Resources,
    surface: Surface,
    prepared: Prepared | None,
    usage: Any,
    status: int,
    started: float,
    overhead: float,
) -> None:
    """After the response: the log line, the ledger, and any background compaction."""
    latency = time.perf_counter() - started
    _, cached, _, _ = ledger.usage_numbers(usage)
    log.info(
        "request",
        extra={
            "route": surface.name,
            "conversation": prepared.conversation if prepared else None,
            "case": prepared.case if prepared else "error",
            "tokens_before": prepared.original_tokens if prepared else None,
            "tokens_after": prepared.forwarded_tokens if prepared else None,
            "upstream_status": status,
            "latency_ms": round(latency * 1000, 2),
            "overhead_ms": round(overhead * 1000, 3),
            "cached_tokens": cached,
        },
    )
    if res.metrics is not None:
        res.metrics.observe_request(prepared, status, latency, overhead, cached, route=surface.name)
    if prepared is None:
        return
    if status == 200:
        res.compactor.schedule(prepared)
    entry = ledger.RequestEntry.of(
        prepared,
        route=surface.name,
        status=status,
        usage=usage,
        latency_s=latency,
        overhead_s=overhead,
    )
    res.compactor.writer.record(entry, prepared.original)


def raw_path(request: Request) -> str:
    """The path as the client sent it, still percent-encoded (``/v1/%2e%2e`` stays so)."""
    raw = request.scope.get("raw_path")
    return raw.decode("latin-1") if isinstance(raw, bytes) else request.url.path


async def passthrough(request: Request) -> Response:
    """Every other ``/v1/*`` path and method, relayed unchanged (bar hop-by-hop headers)."""
    res: Resources = request.app.state.res
    raw = await read_body(request, res.config.max_body_bytes)
    url = upstream_url(res.config.upstream.base_url, raw_path(request), request.url.query)
    headers = request_headers(request.scope["headers"], res.config.upstream.api_key)
    upstream_request = res.client.build_request(request.method, url, content=raw, headers=headers)
    async with mapped_errors():
        upstream = await res.client.send(upstream_request, stream=True)
    if upstream.status_code < 400 and _is_client_compaction(request):
        res.compactor.spawn_io(ledger.count_client_compaction, res.store)

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            log.warning("upstream passthrough broke", extra={"error": type(exc).__name__})
            # Ending the body normally would tell the client it got everything: raising
            # makes the server drop the connection, which is what a broken upstream did.
            raise BodyBroken from exc
        finally:
            await upstream.aclose()

    relayed = response_headers(upstream.headers, drop=SERVER_SET)
    length = upstream.headers.get("content-length")
    if length is not None and length.isdigit():
        # The raw bytes are relayed, so the upstream's length is ours; the client can tell
        # a short body from a whole one.
        relayed["content-length"] = length
    return StreamingResponse(body(), status_code=upstream.status_code, headers=relayed)


def _is_client_compaction(request: Request) -> bool:
    """OpenAI's compaction endpoint: the client compacts its own history (relayed as is)."""
    return request.method == "POST" and request.url.path.rstrip("/").endswith("/responses/compact")


async def not_found(request: Request) -> Response:
    raise HTTPException(404)


async def _proxy_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ProxyError)
    if exc.status >= 500:
        log.warning("upstream failure", extra={"error": str(exc), "status": exc.status})
    else:
        _rejected(request, exc.status, exc.code or exc.type)
    return error_response(exc, request.url.path)


async def _store_error(request: Request, exc: Exception) -> Response:
    """The store failed under an operator's read (the request path fails open on its own)."""
    log.error("store unavailable", extra={"error": str(exc), "path": request.url.path})
    return JSONResponse(
        openai_error(
            "the proxy's store is unavailable; its data cannot be shown until it is fixed "
            "(requests are still forwarded, uncompacted)",
            "server_error",
            "store_unavailable",
        ),
        status_code=503,
        headers={"retry-after": "10"},
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    no_retry = {"x-should-retry": "false"}
    if exc.status_code == 404:
        _rejected(request, 404, "not_found", known=False)
        message = f"unknown route: {request.method} {request.url.path}"
        return JSONResponse(
            openai_error(message, "invalid_request_error", "not_found"),
            status_code=404,
            headers=no_retry,
        )
    if exc.status_code == 405:
        _rejected(request, 405, "method_not_allowed")
        message = f"method {request.method} not allowed on {request.url.path}"
        return JSONResponse(
            openai_error(message, "invalid_request_error", "method_not_allowed"),
            status_code=405,
            headers=no_retry,
        )
    if exc.status_code < 500:
        _rejected(request, exc.status_code, "http_error")
    return JSONResponse(
        openai_error(str(exc.detail), "invalid_request_error", None),
        status_code=exc.status_code,
        headers=no_retry if exc.status_code < 500 else None,
    )


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error", exc_info=exc)
    return JSONResponse(
        openai_error("internal proxy error", "server_error", "internal_error"), status_code=500
    )


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
) -> Starlette:
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
        client = make_client(config.upstream, transport)
        # Without a usable store the proxy still serves, uncompacted (proxy.health).
        own_store = store or open_store_or_degraded(config.store.url)
        effective = admintoken.resolve(config)  # operators' surfaces never open
        llm = compaction_llm(config, client)
        prompts = Prompts(
            detector=load_prompt("detector", config.compaction),
            summarizer=load_prompt("summarizer", config.compaction),
        )
        metrics = Metrics()  # per app: never the global registry
        compactor = Compactor(
            config.compaction,
            own_store,
            llm,
            prompts,
            retention_s=config.retention_s,
            on_event=metrics.observe_event,
        )
        app.state.res = Resources(effective, client, own_store, compactor, metrics)
        app.state.health = StoreHealth(own_store, metrics.observe_store)
        watcher = asyncio.get_running_loop().create_task(app.state.health.watch())
        try:
            yield
        finally:
            watcher.cancel()
            await compactor.drain(timeout=30)
            await client.aclose()
            if store is None:
                own_store.close()

    routes = [
        Route("/healthz", health.healthz, methods=["GET"]),
        Route("/readyz", health.readyz, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/messages", anthropic_messages, methods=["POST"]),
        Route("/v1/responses", openai_responses, methods=["POST"]),
        *admin.routes(),  # operators' view: /metrics, /admin/api/*
        *dashboard.routes(),  # operators' view: /dashboard
        Route(
            "/v1/{path:path}",
            passthrough,
            methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"],
        ),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(AbortOnBrokenBody)],
        exception_handlers={
            ProxyError: _proxy_error,
            StoreError: _store_error,
            HTTPException: _http_error,
            Exception: _unexpected,
        },
    )
