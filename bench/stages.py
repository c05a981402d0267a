"""Where the proxy's added time goes, stage by stage, for one request of the overhead table.

    python -m bench.stages [--smoke] [--reps N] [--json PATH]

In one process, the proxy's real app (``proxy.server.app.create_app``, its lifespan run, a
diskcache store); the fast upstream (``bench.upstream_fast``) in its own process.
Substitution rows find a compaction record written as ``bench.core`` writes one. Each
repetition runs the request path of ``proxy.server.app._serve`` piece by piece, timed with
``time.perf_counter``:

- ``parse``: the body into a dict as the chat routes parse it: from the body it resends
  when that one was remembered (``proxy.core.reparse``: every repetition after the first),
  else whole (``validation.parse_json_object``) and remembered;
- ``validate``: the surface's schema checks;
- ``view``: the neutral view, the tenant id and the request controls;
- ``fingerprint`` (the fingerprints and the prefix chain, taken from the resent body's for
  what the two share: ``reprint.fingerprinted``), ``chain`` (the conversation ids),
  ``count`` (warm token count): ``proxy.core.flow_prepare.identify``'s parts;
- ``lookup+decide``: the rest of ``Compactor.prepare`` (store read, substitution, decision,
  stability tracking) - ``prepare`` minus the three parts above, which it runs again (from
  1,000 messages in a worker thread: the hop is in here too);
- ``serialize``: the forwarded body (``from_view``, ``orjson.dumps``), headers, URL;
- ``forward+relay``: sending it as the proxy does (``forward.Forwarder`` over the transport)
  and reading the whole answer (the SSE relay's splitting for a stream), minus ``wire``;
  once per forwarder compared (``upstream.transport``: ``h1``, ``aiohttp`` or ``httpx``, and
  the ``httpx-aiohttp`` package's transport when it is installed), interleaved;
- ``wire``: the same bytes sent and answered over a bare ``asyncio.Protocol`` connection
  (``bench.loadgen``), which is what the direct row pays: the upstream's own time;
- ``ledger``: ``Service.finish`` (log line, metrics, the ledger write queued, background
  check); the proxy runs it once the client has its answer, so it is CPU the request costs
  but not time the client waits.

The server's own HTTP handling (uvicorn, Starlette routing, the response) is not in here:
it is what ``bench.overhead``'s added p50 has on top of these stages. Figures are medians of
``--reps`` repetitions, sizes and forwarders interleaved; ``sum`` is the median of each
repetition's total (above the sum of the medians when pauses, such as the garbage
collector's, hit some repetitions). Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.core import _store_record
from bench.loadgen import ResponseProtocol, build_request
from bench.overhead import (
    MEASURE_COMPACTION,
    PLAIN_KEY,
    SUBST_KEY,
    FastUpstream,
    request_body,
)
from proxy.adapters.forward import (
    Forwarder,
    make_client,
    make_transport,
    set_pair,
    upstream_pairs,
)
from proxy.adapters.store import DiskStore
from proxy.config import parse_config
from proxy.core.controls import request_controls
from proxy.core.fingerprint import (
    conversation_id,
    earlier_conversation_id,
    tenant_id,
)
from proxy.core.headers import compaction_headers
from proxy.core.reparse import Reparser
from proxy.core.reprint import fingerprinted
from proxy.core.surfaces import OPENAI_CHAT
from proxy.core.validation import parse_json_object
from proxy.engine.chat import chat_url
from proxy.engine.service import Call, Service
from proxy.logs import JsonFormatter
from proxy.server import app as srv
from proxy.server.sse import EventSplitter

STAGES = (
    "parse",
    "validate",
    "view",
    "fingerprint",
    "chain",
    "count",
    "lookup+decide",
    "serialize",
    "forward+relay",
    "ledger",
)
# (label, history, key): below trigger (no record) and with a stored compaction.
CASES = (("50, below trigger", 50, PLAIN_KEY), ("2,000, substitution", 2000, SUBST_KEY))
SMOKE_CASES = (("20, below trigger", 20, PLAIN_KEY), ("60, substitution", 60, SUBST_KEY))


def _httpx_aiohttp(upstream: Any) -> httpx.AsyncBaseTransport:
    """The ``httpx-aiohttp`` package's transport, when installed (the proxy does not use it:
    its error mapping reports a refused connection as a connect timeout)."""
    from httpx_aiohttp import AiohttpTransport

    return AiohttpTransport()  # type: ignore[no-any-return]


# The forwarders compared side by side (the wire under the proxy's ``Forwarder``); the client
# interface is httpx in all of them.
TRANSPORTS: dict[str, Any] = {
    "h1 (proxy.adapters.h1)": lambda u: make_transport(replace(u, transport="h1")),
    "aiohttp (proxy.aiotransport)": lambda u: make_transport(replace(u, transport="aiohttp")),
    "httpx": lambda u: make_transport(replace(u, transport="httpx")),
}
if importlib.util.find_spec("httpx_aiohttp"):
    TRANSPORTS["httpx-aiohttp package"] = _httpx_aiohttp


class Wire:
    """One keep-alive raw connection to the upstream: the direct path's own cost."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: ResponseProtocol | None = None

    async def send(self, payload: bytes) -> None:
        if self.conn is None or self.conn.closed:
            loop = asyncio.get_running_loop()
            _, self.conn = await loop.create_connection(ResponseProtocol, "127.0.0.1", self.port)
        request = build_request("127.0.0.1", self.port, "/v1/chat/completions", [], payload)
        await self.conn.request(request)


# As the app keeps one (``proxy.server.app``): the repetitions resend the same bodies.
REPARSER = Reparser()


async def one(
    res: Service, raw: bytes, key: str, wire: Wire, client: Forwarder
) -> dict[str, float]:
    """One request through the stages of ``_serve``; seconds per stage."""
    surface = OPENAI_CHAT
    clock = time.perf_counter
    t: dict[str, float] = {}
    t0 = clock()
    found = REPARSER.parse(raw, surface.history_key)
    body = found.body if found is not None else parse_json_object(raw)
    t1 = clock()
    surface.validate(body, found.shared if found is not None else 0)
    if found is not None:
        REPARSER.accept(found)
        reuse = found.reuse
    else:
        reuse = REPARSER.remember(raw, body, surface.history_key)
    t2 = clock()
    tenant = tenant_id(key, None)
    view = surface.to_view(body)
    controls = request_controls(
        res.config.compaction,
        header=None,
        tenant=tenant,
        tenant_name=None,
        model=body["model"],
        messages=view,
        stateful=surface.stateful(body),
    )
    t3 = clock()
    fps, chain, _ = fingerprinted(tenant, view, reuse)  # (the chain's share is small)
    t4 = clock()
    conversation_id(chain, view, None)
    earlier_conversation_id(chain, view, None)
    t5 = clock()
    res.compactor.counter.count_messages(view, body["model"], fps)
    t6 = clock()
    prepared = await res.compactor.prepare(
        view,
        model=body["model"],
        tenant=tenant,
        credential=key,
        controls=controls,
        summary_role=surface.summary_role,
        outside_cache_marks=surface.outside_cache_marks(body),
        reuse=reuse,
    )
    t7 = clock()
    stream = body.get("stream") is True
    out = surface.from_view(body, prepared.forwarded) if prepared.changed else body
    if stream:
        out = dict(out)
        out["stream_options"] = {"include_usage": True}
    payload = raw if out is body else orjson.dumps(out)
    headers = upstream_pairs(
        [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")],
        res.config.upstream.api_key,
        drop=frozenset({"accept-encoding"}),
    )
    set_pair(headers, "content-type", "application/json")
    url = chat_url(res.config.upstream.base_url, surface.path)
    compaction_headers(prepared)
    t8 = clock()
    upstream = await client.send(client.request("POST", url, payload, headers))
    if stream:
        splitter = EventSplitter()
        async for chunk in upstream.chunks():
            for _event in splitter.feed(chunk):
                pass
    else:
        await upstream.aread()
    await upstream.aclose()
    t9 = clock()
    await wire.send(payload)
    t10 = clock()
    res.finish(Call(surface.name, prepared, t0, t8 - t0), None, 200)
    t11 = clock()
    t["parse"], t["validate"], t["view"] = t1 - t0, t2 - t1, t3 - t2
    t["fingerprint"], t["chain"], t["count"] = t4 - t3, t5 - t4, t6 - t5
    t["lookup+decide"] = max((t7 - t6) - (t6 - t3), 0.0)
    t["serialize"] = t8 - t7
    t["wire"] = t10 - t9
    t["forward+relay"] = (t9 - t8) - t["wire"]
    t["ledger"] = t11 - t10
    return t


async def measure(upstream_url_: str, store: Path, cases: Any, reps: int, port: int) -> Any:
    config = parse_config(
        {
            "upstream": {"base_url": upstream_url_, "timeout_s": 30},
            "store": {"url": f"diskcache://{store}"},
            "compaction": MEASURE_COMPACTION,
        }
    )
    app = srv.create_app(config)
    bodies = {
        (label, stream): request_body(history, stream)
        for label, history, _ in cases
        for stream in (False, True)
    }
    samples: dict[tuple[str, bool, str], list[dict[str, float]]] = {}
    async with app.router.lifespan_context(app):
        res: Service = app.state.res
        clients = {}
        for name, make in TRANSPORTS.items():
            wire_ = make(config.upstream)
            clients[name] = Forwarder(make_client(config.upstream, wire_), wire_)
        wire = Wire(port)
        for rep in range(reps + 3):  # the first three warm the pool, memo and caches
            for label, _history, key in cases:
                for stream in (False, True):
                    for name, client in clients.items():
                        t = await one(res, bodies[(label, stream)], key, wire, client)
                        if rep >= 3:
                            samples.setdefault((label, stream, name), []).append(t)
        for forwarder in clients.values():
            await forwarder.client.aclose()
    rows = []
    for (label, stream, name), runs in samples.items():
        med = {s: statistics.median(r[s] for r in runs) * 1000 for s in (*STAGES, "wire")}
        total = statistics.median(sum(r[s] for s in STAGES) for r in runs) * 1000
        rows.append(
            {"case": label, "stream": stream, "transport": name, "ms": med, "total_ms": total}
        )
    return rows


def seed(store_dir: Path, cases: Any) -> None:
    """A compaction record for each substitution case's history, as ``bench.core`` writes
    it (the product's own seeding, as in ``bench.overhead``, takes minutes for 2,000
    messages on a busy machine; the lookup and substitution cost the same)."""
    store = DiskStore(store_dir)
    try:
        for _label, history, key in cases:
            if key == SUBST_KEY:
                body = orjson.loads(request_body(history, False))
                _store_record(store, tenant_id(key, None), OPENAI_CHAT.to_view(body))
    finally:
        store.close()


def run(smoke: bool = False, reps: int = 300) -> dict[str, Any]:
    cases = SMOKE_CASES if smoke else CASES
    work = Path(tempfile.mkdtemp(prefix="bench-stages-"))
    # The log lines go where a server's would (a file), not to the terminal.
    handler = logging.StreamHandler(open(os.devnull, "w"))  # noqa: SIM115 - lives as long as we do
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("compaction_proxy")
    root.handlers[:] = [handler]
    root.setLevel("INFO")
    root.propagate = False
    upstream = FastUpstream(work / "upstream.log").start()
    try:
        store = work / "store"
        seed(store, cases)
        try:
            import uvloop

            runner: Any = uvloop.run
        except ImportError:
            runner = asyncio.run
        rows = runner(measure(upstream.base_url, store, cases, reps, upstream.port))
    finally:
        upstream.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {"reps": reps, "rows": rows}


def markdown(results: dict[str, Any]) -> str:
    head = "| request | stream | forwarder | " + " | ".join(STAGES)
    head += " | **sum** | wire (direct's own) |"
    out = [head, "|---|---|---|" + "---:|" * (len(STAGES) + 2)]
    for r in results["rows"]:
        cells = " | ".join(f"{r['ms'][s]:.3f}" for s in STAGES)
        out.append(
            f"| {r['case']} msgs | {'yes' if r['stream'] else 'no'} | {r['transport']} | {cells} | "
            f"**{r['total_ms']:.2f}** | {r['ms']['wire']:.3f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stages", description=__doc__)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    results = run(args.smoke, 20 if args.smoke else args.reps)
    print(markdown(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
