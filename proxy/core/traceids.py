"""A request span's identity (``Root``): plain values, drawn when the request arrives.

Here in the core because both sides of the tracing seam build or read it: the engine's span
logic (``proxy.engine.spans``) and the OpenTelemetry backend below it
(``proxy.adapters.otel``), which must not import the engine (#28, the layer order).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Root:
    """A request span's identity, drawn when the request arrives: the client's trace (or a
    new one), whether it is sampled, this span's id and the client's span it continues."""

    trace_id: int
    span_id: int
    parent_id: int | None
    sampled: bool
    tracestate: str | None = None
