"""Compaction records, checkpoints and substitution (DESIGN §4). Pure: data in, data out.

A record says "the exact prefix h[k] may be forwarded as head + summary". The client keeps
sending its full history; the proxy forwards ``head + summary + m[k:]`` for the largest k
whose h[k] has a record. An edit anywhere in the first k messages changes h[k], so a stale
summary can never be applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .messages import Message

MAX_CHECKPOINTS = 64


def conv_key(kind: str, tenant: str, conversation: str) -> str:
    """Every per-conversation key is namespaced by tenant: tenants never share state."""
    return f"{kind}:{tenant}:{conversation}"


@dataclass(frozen=True)
class Checkpoint:
    k: int
    prefix_hash: str


@dataclass(frozen=True)
class CompactionRecord:
    """What replaces the original prefix ``m[:k]`` (after its head messages)."""

    k: int
    prefix_hash: str
    head_len: int
    summary: Message | None
    case: str
    covered: int
    created_at: float
    tokens_before: int = 0
    tokens_after: int = 0
    boundary_reason: str = ""
    confidence: float = 0.0
    facts_kept: list[str] = field(default_factory=list)
    facts_dropped: list[str] = field(default_factory=list)
    facts_appended: list[str] = field(default_factory=list)
    facts_elsewhere: list[str] = field(default_factory=list)  # in the head, pins or verbatim
    duration_s: float = 0.0
    model: str = ""
    llm_tokens: int = 0
    llm_usd: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> CompactionRecord | None:
        """A record from stored JSON, or None when it is not a well-formed record."""
        if not isinstance(data, dict):
            return None
        try:
            record = cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        except TypeError:
            return None
        summary = record.summary
        if not isinstance(record.k, int) or not isinstance(record.head_len, int):
            return None
        if summary is not None and not (
            isinstance(summary, dict) and isinstance(summary.get("content"), str)
        ):
            return None
        return record


def parse_checkpoints(raw: Any) -> list[Checkpoint]:
    out = []
    if isinstance(raw, list):
        for item in raw:
            if isinstance(item, dict) and isinstance(item.get("k"), int):
                h = item.get("h")
                if isinstance(h, str):
                    out.append(Checkpoint(item["k"], h))
    return out


def find_checkpoint(checkpoints: Sequence[Checkpoint], chain: Sequence[bytes]) -> Checkpoint | None:
    """The checkpoint with the largest k whose hash equals ``chain[k]`` exactly."""
    best: Checkpoint | None = None
    for cp in checkpoints:
        if 0 < cp.k < len(chain) and chain[cp.k].hex() == cp.prefix_hash:
            if best is None or cp.k > best.k:
                best = cp
    return best


def substitute(messages: Sequence[Message], record: CompactionRecord) -> list[Message]:
    """``head + summary + m[k:]``: the client's own head bytes, the stored summary bytes."""
    head = list(messages[: record.head_len])
    if record.summary is not None:
        head.append(record.summary)
    return head + list(messages[record.k :])


def body_start(record: CompactionRecord | None) -> int:
    """Index in the forwarded list where the original messages ``m[k:]`` begin."""
    if record is None:
        return 0
    return record.head_len + (1 if record.summary is not None else 0)
