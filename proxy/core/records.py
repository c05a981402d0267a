"""Compaction records, checkpoints and substitution (DESIGN §4). Pure: data in, data out.

A record says "the exact prefix h[k] may be forwarded as R". The client keeps sending its
full history; the proxy forwards ``R + m[k:]`` for the largest k whose h[k] has a record. An
edit anywhere in the first k messages changes h[k], so a stale record can never be applied.

R is a list of entries (``prefix``): an integer i forwards the client's own ``m[i]`` in place
(head, pinned messages, rounds kept verbatim), a message forwards stored bytes (a summary, a
pruned tool result, a pin stripped of tool results). Stored bytes never change, so the
forwarded prefix stays byte-stable until the next record. Records written before ``prefix``
existed (head + summary) are still read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from proxy.core.messages import Message
from proxy.core.recent import Recent
from proxy.core.types import COMPACTION_CASES, CaseName

MAX_CHECKPOINTS = 64

Entry = int | Message  # an original index forwarded in place, or a stored message


def conv_key(kind: str, tenant: str, conversation: str) -> str:
    """Every per-conversation key is namespaced by tenant: tenants never share state."""
    return f"{kind}:{tenant}:{conversation}"


@dataclass(frozen=True)
class Checkpoint:
    k: int
    prefix_hash: str
    # The record's ``created_at`` (checkpoints written since #28): which record it names, so
    # one read before need not be read again (``KnownRecords``).
    created: float | None = None
    # The record's ``llm_request_len`` (written since #25's edited-history fix): the no-treadmill
    # rule reads it from the conversation's newest checkpoint, whether or not its record
    # still matches the client's history. 0: none, or a checkpoint from before.
    llm_len: int = 0


@dataclass(frozen=True)
class CompactionRecord:
    """What replaces the original prefix ``m[:k]``: ``prefix`` when set, else head + summary."""

    k: int
    prefix_hash: str
    head_len: int
    summary: Message | None
    case: CaseName  # one of COMPACTION_CASES
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
    # Of llm_tokens, the prompt tokens the provider read from its prompt cache: most of a
    # summary asked in the client's shape (``summary_reads_cache``: the conversation's own
    # cache); a standalone call's only when its prompt's start was cached. 0: none.
    llm_cached_tokens: int = 0
    prefix: list[Entry] | None = None
    pruned: list[str] = field(default_factory=list)  # what pruning cleared (placeholders)
    pinned: list[str] = field(default_factory=list)  # pins kept in place, and why
    unpinned: list[str] = field(default_factory=list)  # pins too large: handled as content
    # The span's anchors by category and fate, and the dropped ones (anchors.AnchorReport).
    anchors: dict[str, Any] = field(default_factory=dict)
    request_len: int = 0  # messages in the request it was made for: what came later is new
    # The same for the last LLM compaction (summary or truncation) this record carries on
    # (a pruning or emergency cut keeps its predecessor's): the no-treadmill rule measures
    # the requests and growth since then. 0: none, or a record stored before this field.
    llm_request_len: int = 0

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
        if record.prefix is not None and not _valid_prefix(record.prefix, record.k):
            return None
        if record.case not in COMPACTION_CASES:
            return None
        return record


LLM_CASES = ("summarize", "truncate")  # the compactions that call the detector and summarizer


def llm_request_len(record: CompactionRecord | None) -> int:
    """Messages in the request of the last LLM compaction ``record`` carries on (0: none)."""
    if record is None:
        return 0
    if record.llm_request_len:
        return record.llm_request_len
    return record.request_len if record.case in LLM_CASES else 0


def llm_since(record: CompactionRecord | None, newest: int, length: int) -> int:
    """Messages in the request of the conversation's last LLM compaction (0: none): the one
    ``record`` carries on, or the conversation's newest (``newest``, from its checkpoints,
    ``lookup.checkpoints_found``) when that one is later. It is when the client edited its history
    before that compaction's cut (cleared old tool results, say): its record no longer
    matches, and the history from that request on is still what grew since. One past the
    history's length is a history that shrank (the client's own compaction, a branch from
    earlier): a new start, measured from ``record`` alone."""
    since = llm_request_len(record)
    return newest if since < newest <= length else since


def _valid_prefix(prefix: Any, k: int) -> bool:
    if not isinstance(prefix, list):
        return False
    for entry in prefix:
        if isinstance(entry, bool):
            return False
        if isinstance(entry, int):
            if not 0 <= entry < k:
                return False
        elif not (isinstance(entry, dict) and isinstance(entry.get("role"), str)):
            return False
    return True


def entries(record: CompactionRecord) -> list[Entry]:
    """The record's forwarded prefix as entries (legacy records: head indices + summary)."""
    if record.prefix is not None:
        return list(record.prefix)
    out: list[Entry] = list(range(record.head_len))
    if record.summary is not None:
        out.append(record.summary)
    return out


def parse_checkpoints(raw: Any) -> list[Checkpoint]:
    out = []
    if isinstance(raw, list):
        for item in raw:
            if isinstance(item, dict) and isinstance(item.get("k"), int):
                h, t, n = item.get("h"), item.get("t"), item.get("n")
                if isinstance(h, str):
                    created = float(t) if isinstance(t, int | float) else None
                    llm_len = n if type(n) is int and n > 0 else 0
                    out.append(Checkpoint(item["k"], h, created, llm_len))
    return out


def find_checkpoint(checkpoints: Sequence[Checkpoint], chain: Sequence[bytes]) -> Checkpoint | None:
    """The checkpoint with the largest k whose hash equals ``chain[k]`` exactly (the latest
    of those, which names the record stored last under that prefix)."""
    best: Checkpoint | None = None
    for cp in checkpoints:
        if 0 < cp.k < len(chain) and chain[cp.k].hex() == cp.prefix_hash:
            if best is None or cp.k >= best.k:
                best = cp
    return best


class KnownRecords:
    """Records read lately, by store key (#28): a compacted conversation's every request
    forwards its record, and reading and decoding it again (~12 KB of JSON) was ~7 % of
    such a request's CPU. A record is used from here only when the checkpoint the store
    gives names it (its ``created_at``: another worker's record for the same prefix names
    another) and its retention has not run out, so the store stays the truth: a deleted
    conversation has no checkpoints, a refused one is dropped by its own flag. Bounded;
    thread-safe (flows of huge histories run in worker threads)."""

    def __init__(self, retention_s: float | None = None, size: int = 128) -> None:
        self.retention_s = retention_s
        self.size = size
        self._by_key: Recent[str, CompactionRecord] = Recent(size)

    def get(self, key: str, cp: Checkpoint, now: float | None) -> CompactionRecord | None:
        if cp.created is None:
            return None  # a checkpoint from before: it names no record in particular
        record = self._by_key.get(key)
        if record is None or record.created_at != cp.created:
            return None
        if record.k != cp.k or record.prefix_hash != cp.prefix_hash:
            return None
        if self.retention_s is not None and (now is None or now >= cp.created + self.retention_s):
            return None  # (the store no longer keeps it: it is read, and found gone)
        return record

    def put(self, key: str, record: CompactionRecord) -> None:
        self._by_key.put(key, record)


def substitute(messages: Sequence[Message], record: CompactionRecord) -> list[Message]:
    """``R + m[k:]``: the client's own bytes for index entries, stored bytes for the rest."""
    out = [messages[e] if isinstance(e, int) else e for e in entries(record)]
    return out + list(messages[record.k :])


def origins(record: CompactionRecord | None, n: int) -> list[int | None]:
    """For each forwarded position, the original index it forwards (None: stored bytes)."""
    if record is None:
        return list(range(n))
    out: list[int | None] = [e if isinstance(e, int) else None for e in entries(record)]
    return out + list(range(record.k, n))


def body_start(record: CompactionRecord | None) -> int:
    """Index in the forwarded list where the original messages ``m[k:]`` begin."""
    if record is None:
        return 0
    return len(entries(record))
