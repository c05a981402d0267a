"""The spans of a relayed request (``proxy.server.passthrough``: ``/v1/models``, embeddings,
the reachability probes, every other ``/v1/*`` path): a server span for the request and a
client span (``upstream``) for the call it relays, whose ``traceparent`` goes upstream, in
the client's trace when the client sent one.

The GenAI attributes where the route names an operation and the body a model (embeddings,
text completions: ``{operation} {model}``, as a chat request's ``chat {model}``); else the
HTTP server conventions' name, ``{method} {path}``. No content is read but the model's name.
Like a chat request's, both spans are made from plain values when the relay ends (the answer's
last byte, or its failure) and handed to the exporter in one go.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from proxy.core.traceids import Root
from proxy.engine.spans import Backend, child_headers, provider_name

log = logging.getLogger("compaction_proxy.tracing")

# Relayed routes that are a GenAI operation (semantic conventions' gen_ai.operation.name).
OPERATIONS = {"/v1/embeddings": "embeddings", "/v1/completions": "text_completion"}
_NAME_LIMIT = 80  # characters of a path in a span name (client-chosen: ids, never content)


class RelayTrace:
    """The spans of one relayed request, from its arrival to the end of its answer."""

    __slots__ = (
        "backend", "root", "method", "path", "started_ns", "upstream_id", "upstream_ns",
        "attributes", "name", "done",
    )  # fmt: skip

    def __init__(self, backend: Backend, root: Root, method: str, path: str, tenant: str) -> None:
        self.backend, self.root, self.method, self.path = backend, root, method, path
        self.started_ns = time.time_ns()
        self.upstream_id: int | None = None
        self.upstream_ns: int | None = None
        self.name = f"{method} {path}" if len(path) <= _NAME_LIMIT else method
        self.attributes: dict[str, Any] = {
            "http.request.method": method,
            "url.path": path,
            "compaction_proxy.route": "passthrough",
            "compaction_proxy.tenant": tenant,  # the tenant's hash, as on a chat request's span
        }
        self.done = False

    def described(self, body: bytes) -> None:
        """The request's body: the GenAI operation and model, where the route names one."""
        operation = OPERATIONS.get(self.path.rstrip("/"))
        if operation is None or self.method != "POST":
            return
        try:
            parsed = orjson.loads(body) if body else None
            model = parsed.get("model") if isinstance(parsed, dict) else None
        except orjson.JSONDecodeError:
            model = None
        self.attributes["gen_ai.operation.name"] = operation
        if isinstance(model, str) and model:
            self.attributes["gen_ai.request.model"] = model
            self.attributes["gen_ai.provider.name"] = provider_name("", model)
            self.name = f"{operation} {model}"[:_NAME_LIMIT]

    def upstream_headers(self) -> dict[str, str]:
        """The ``traceparent`` (and ``tracestate``) of the upstream call's span, which starts
        now, for the relayed request."""
        try:
            root = self.root
            if self.upstream_id is None:
                self.upstream_id = self.backend.new_span_id()
                self.upstream_ns = time.time_ns()
            return child_headers(root, self.upstream_id)
        except Exception:
            log.warning("could not start a relayed request's upstream span", exc_info=True)
            return {}

    def finish(self, status: int, error: str | None = None) -> None:
        """Both spans, ended now (once; later calls are ignored). ``status``: the answer's
        (ours when the upstream was not reached); ``error``: why the relay failed, if it did."""
        if self.done:
            return
        self.done = True
        if not self.root.sampled:
            return
        try:
            self._emit(status, error)
        except Exception:
            log.warning("could not export a relayed request's spans", exc_info=True)

    def _emit(self, status: int, error: str | None) -> None:
        if error is None and status >= 400:
            error = str(status)
        attributes = {**self.attributes, "http.response.status_code": status}
        if error is not None:
            attributes["error.type"] = error
        backend, root, end = self.backend, self.root, time.time_ns()
        if self.upstream_id is not None and self.upstream_ns is not None:
            upstream = {"http.response.status_code": status}
            backend.emit(
                "upstream", "client", root.trace_id, self.upstream_id, root.span_id,
                self.upstream_ns, end, upstream, error,
            )  # fmt: skip
        backend.emit(
            self.name, "server", root.trace_id, root.span_id, root.parent_id,
            self.started_ns, end, attributes, error, remote_parent=True,
        )  # fmt: skip
