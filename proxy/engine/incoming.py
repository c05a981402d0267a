"""One chat request as a front door describes it to the service (``Service.begin``)."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.core.frozen import quick_init
from proxy.core.messages import Message
from proxy.core.reprint import Reuse
from proxy.core.sharedcall import SharedCall


@quick_init
@dataclass(frozen=True)
class Incoming:
    """One chat request as a front door describes it (plain values, no HTTP)."""

    messages: list[Message]
    model: str  # as the client named it: opt-outs, detector and summarizer calls
    tenant: str
    tenant_name: str | None = None  # x-compaction-tenant
    credential: str | None = None  # the client's key, relayed to the LLM (never logged)
    compaction_header: str | None = None  # x-compaction: off | shadow
    conversation_header: str | None = None  # x-conversation-id
    # The provider model behind ``model`` (a LiteLLM model group): token counts, the
    # context window and prices come from it. None: ``model`` itself.
    counted_model: str | None = None
    stateful: bool = False  # the provider keeps the conversation (never compacted)
    summary_role: str | None = None
    summary_joins: bool = False
    outside_cache_marks: int = 0
    reserve_tokens: int = 0  # tools and the requested reply, for the context-window guard
    offload: bool = False  # a big body: its heavy steps in a worker thread (``Reuse.light``)
    # The client's W3C trace context: the request's span continues its trace (when traced).
    traceparent: str | None = None
    tracestate: str | None = None
    # What the body it resends left for it (``proxy.core.reparse``): shared fingerprints.
    reuse: Reuse | None = None
    # The summarizer call that reads the conversation's cache, when this door can make it.
    shared: SharedCall | None = None
