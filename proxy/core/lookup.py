"""Finding a conversation's compaction record for a request's history (DESIGN §3), as a flow.

Records are stored per conversation under the prefix they replace; the conversation's
checkpoint list says which prefixes have one. The record for a request is the one of the
longest checkpoint its prefix chain contains. Records made under the session's earlier id
(its first request, before any reply: ``fingerprint.conversation_id``) count too: they name
exact prefixes, so they apply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from proxy.core.commands import Flow, Read
from proxy.core.records import Checkpoint, CompactionRecord, conv_key, find_checkpoint
from proxy.core.records import parse_checkpoints as _parse


def checkpoint_keys(tenant: str, conversation: str, earlier: str | None) -> tuple[str, ...]:
    return tuple(conv_key("ck", tenant, c) for c in (conversation, earlier) if c is not None)


def best_checkpoint(
    lists: Mapping[str, Any],
    tenant: str,
    conversation: str,
    earlier: str | None,
    chain: Sequence[bytes],
) -> tuple[Checkpoint, str] | None:
    """The longest checkpoint on ``chain`` among the conversation's and the earlier id's."""
    return checkpoints_found(lists, tenant, conversation, earlier, chain)[0]


def checkpoints_found(
    lists: Mapping[str, Any],
    tenant: str,
    conversation: str,
    earlier: str | None,
    chain: Sequence[bytes],
) -> tuple[tuple[Checkpoint, str] | None, int]:
    """From one parse of the conversation's and the earlier id's checkpoints: the longest on
    ``chain`` (``best_checkpoint``), and the ``llm_request_len`` of the newest, whether or not
    its prefix is on ``chain`` (0: none)."""
    best: tuple[Checkpoint, str] | None = None
    newest: Checkpoint | None = None
    for conv in (conversation, earlier):
        if conv is None:
            continue
        parsed = _parse(lists.get(conv_key("ck", tenant, conv)) or [])
        cp = find_checkpoint(parsed, chain)
        if cp is not None and (best is None or cp.k > best[0].k):
            best = (cp, conv)
        for cp in parsed:
            # Appended in order: the last one of equal (or unknown) time is the newest.
            if newest is None or (cp.created or 0.0) >= (newest.created or 0.0):
                newest = cp
    return best, newest.llm_len if newest is not None else 0


def record_key(tenant: str, conversation: str, cp: Checkpoint) -> str:
    return conv_key("rec", tenant, conversation) + ":" + cp.prefix_hash


def checked_record(raw: Any, cp: Checkpoint) -> CompactionRecord | None:
    """The stored record, if it is the one the checkpoint names (else a stale or torn write)."""
    record = CompactionRecord.from_json(raw)
    if record is None or record.k != cp.k or record.prefix_hash != cp.prefix_hash:
        return None
    return record


def record_from(
    lists: Mapping[str, Any],
    tenant: str,
    conversation: str,
    earlier: str | None,
    chain: Sequence[bytes],
) -> Flow[CompactionRecord | None]:
    """Given the checkpoint lists already read: the record, reading it (one more ``Read``)."""
    best = best_checkpoint(lists, tenant, conversation, earlier, chain)
    if best is None:
        return None
    cp, conv = best
    key = record_key(tenant, conv, cp)
    got = yield Read(values=(key,))
    return checked_record(got.get(key), cp)


def lookup(
    tenant: str, conversation: str, earlier: str | None, chain: Sequence[bytes]
) -> Flow[CompactionRecord | None]:
    """The record for the longest stored prefix of ``chain`` (two reads at most)."""
    got = yield Read(lists=checkpoint_keys(tenant, conversation, earlier))
    return (yield from record_from(got, tenant, conversation, earlier, chain))
