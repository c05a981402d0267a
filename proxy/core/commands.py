"""The I/O a compaction flow asks for, as plain values (sans-I/O, in the manner of httpx's auth
flows and mitmproxy's layers: commands out, results in).

A flow is a generator: it yields a command and is sent its result. A failed command is thrown
into the flow at the ``yield``: ``StoreError`` for the store commands, ``CompactionFailed``
for ``Complete``. ``proxy.engine.compactor`` runs flows against the real store and LLM
client; tests step them by hand with plain values.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from proxy.core.messages import Message
from proxy.core.prepared import Outcome, Prepared
from proxy.core.records import CompactionRecord
from proxy.core.sharedcall import SharedCall
from proxy.core.types import Event, QualityEvent

T = TypeVar("T")


@dataclass(frozen=True)
class Read:
    """Store values (``values``) and lists (``lists``) by key; the result maps each key to
    its value (None when absent) or its list (empty when absent), in one round trip."""

    values: tuple[str, ...] = ()
    lists: tuple[str, ...] = ()


@dataclass(frozen=True)
class Compute:
    """CPU work that grows with the request (hashing and counting a huge history): the driver
    runs it off the event loop, so other requests are answered meanwhile. Result: its value."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]

    def run(self) -> Any:
        return self.fn(*self.args)


class Reply(Protocol):
    """What a ``Complete`` command is answered with (``proxy.adapters.llm.LLMReply``)."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    model: str


@dataclass(frozen=True)
class Complete:
    """One detector or summarizer call. Result: a ``Reply``."""

    model: str
    messages: list[Message]
    max_tokens: int
    purpose: str  # "detector" | "summarizer"
    credential: str | None


@dataclass(frozen=True)
class CompleteShared:
    """One summarizer call in the client's own shape, reading the conversation's cache
    (``proxy.core.sharedcall``). Result: a ``SharedReply``; ``CompactionFailed`` when the
    call fails or its answer is not of the surface's shape."""

    call: SharedCall
    body: dict[str, Any]
    purpose: str  # "summarizer"


@dataclass(frozen=True)
class Persist:
    """Store a new compaction record, its checkpoint and the ledger's charge for it."""

    tenant: str
    conversation: str
    record: CompactionRecord


@dataclass(frozen=True)
class Cooldown:
    """Put the conversation on cooldown for ``seconds`` (after a failed attempt)."""

    tenant: str
    conversation: str
    seconds: float


@dataclass(frozen=True)
class Emit:
    """Report an event: metrics, and the conversation's event list in the store."""

    tenant: str
    conversation: str
    event: Event | QualityEvent


@dataclass(frozen=True)
class CompactNow:
    """Run a compaction of ``prepared`` under the conversation's lock (the driver owns locks
    and joins concurrent attempts). Result: an ``Outcome``."""

    prepared: Prepared


@dataclass(frozen=True)
class Remember:
    """Store one per-conversation value (the agent's behaviour, the loop breaker's decision)
    with the store's retention."""

    key: str
    value: Any


Command = (
    Read | Compute | Complete | CompleteShared | Persist | Cooldown | Emit | CompactNow | Remember
)
Flow = Generator[Command, Any, T]
__all__ = [
    "Command",
    "CompactNow",
    "Complete",
    "CompleteShared",
    "Compute",
    "Cooldown",
    "Emit",
    "Flow",
    "Outcome",
    "Persist",
    "Read",
    "Remember",
    "Reply",
]
