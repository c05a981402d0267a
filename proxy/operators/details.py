"""One conversation for the operators: its totals, requests, compactions (with summaries and
loss reports) and failures, and the history the client last sent beside what the proxy
forwards for it now. Synchronous store reads (the API runs them in a thread)."""

from __future__ import annotations

import time
from typing import Any

from proxy.adapters.store import Store, get_list
from proxy.core.errors import NotFound
from proxy.core.fingerprint import fingerprints, prefix_chain
from proxy.core.records import (
    CompactionRecord,
    body_start,
    conv_key,
    find_checkpoint,
    parse_checkpoints,
    substitute,
)
from proxy.core.tokens import TokenCounter
from proxy.operators.queries import COMPACTION_CASES, FAILURE_CASES, _derive, conversation_id

KEY_REFERENCES = "\n\nKey references: "  # how proxy.keyfacts.guard appends lost facts


def _current_record(
    store: Store, tenant: str, conv: str, original: list[dict[str, Any]]
) -> CompactionRecord | None:
    """The record the proxy would apply to ``original`` now (the same lookup as the core)."""
    chain = prefix_chain(tenant, fingerprints(original))
    checkpoint = find_checkpoint(
        parse_checkpoints(get_list(store, conv_key("ck", tenant, conv))), chain
    )
    if checkpoint is None:
        return None
    record = CompactionRecord.from_json(
        store.get(conv_key("rec", tenant, conv) + ":" + checkpoint.prefix_hash)
    )
    if record is None or record.k != checkpoint.k or record.prefix_hash != checkpoint.prefix_hash:
        return None
    return record


def histories(store: Store, counter: TokenCounter, tenant: str, conv: str) -> dict[str, Any]:
    """The history the client last sent and what the proxy forwards for it now, side by side,
    with per-message token counts (counted as the proxy counts them)."""
    raw = store.get(conv_key("orig", tenant, conv))
    original: list[dict[str, Any]] = (
        [m for m in raw if isinstance(m, dict)] if isinstance(raw, list) else []
    )
    meta = store.get(conv_key("conv", tenant, conv))
    model = str(meta.get("model") or "") if isinstance(meta, dict) else ""
    record = _current_record(store, tenant, conv, original) if original else None
    forwarded = substitute(original, record) if record else list(original)

    def side(messages: list[dict[str, Any]]) -> dict[str, Any]:
        counts = counter.count_messages(messages, model, fingerprints(messages))
        return {
            "messages": messages,
            "tokens": counts,
            "total_tokens": sum(counts) + 3 if messages else 0,
            "count": len(messages),
        }

    return {
        "id": conversation_id(tenant, conv),
        "model": model,
        "original": side(original),
        "forwarded": side(forwarded),
        "record": None
        if record is None
        else {
            "k": record.k,
            "head_len": record.head_len,
            "has_summary": record.summary is not None,
            # Where the client's own tail begins in the forwarded list (after the head, pins,
            # the summary and pruned placeholders).
            "body_start": body_start(record),
            "case": record.case,
            "prefix_hash": record.prefix_hash,
        },
    }


def key_references(summary: str) -> list[str]:
    """The facts the key-facts guard appended to a summary (its ``Key references:`` line)."""
    at = summary.rfind(KEY_REFERENCES)
    if at < 0:
        return []
    return [f for f in summary[at + len(KEY_REFERENCES) :].strip().split("; ") if f]


def loss_report(
    summary: str | None,
    kept: list[str],
    dropped: list[str],
    elsewhere: list[str] | None = None,
) -> dict[str, Any]:
    """Key facts of the replaced span: kept by the summary in its own words, appended to it as
    key references, still in the rest of the forwarded context (head, pins, verbatim part),
    and dropped (found nowhere in what was forwarded when the compaction was made)."""
    text = summary or ""
    appended = key_references(text)
    return {
        "facts_kept": kept,
        "facts_appended": appended,
        "facts_elsewhere": list(elsewhere or []),
        "facts_dropped": [f for f in dropped if f not in text],
    }


def _compaction(store: Store, tenant: str, conv: str, event: dict[str, Any]) -> dict[str, Any]:
    record: dict[str, Any] = {}
    prefix_hash = event.get("prefix_hash")
    if isinstance(prefix_hash, str):
        raw = store.get(conv_key("rec", tenant, conv) + ":" + prefix_hash)
        record = raw if isinstance(raw, dict) else {}
    summary = record.get("summary")
    text = summary.get("content") if isinstance(summary, dict) else None
    return {
        "ts": event.get("ts"),
        "case": event.get("case"),
        "model": event.get("model"),
        "k": event.get("k"),
        "covered": event.get("covered"),
        "tokens_before": event.get("tokens_before"),
        "tokens_after": event.get("tokens_after"),
        "duration_s": event.get("duration_s"),
        "llm_tokens": event.get("llm_tokens"),
        "reason": event.get("reason"),
        "boundary_reason": record.get("boundary_reason", ""),
        "confidence": record.get("confidence", event.get("confidence")),
        "summary": text,
        "summary_role": summary.get("role") if isinstance(summary, dict) else None,
        **loss_report(
            text,
            list(record.get("facts_kept") or []),
            list(record.get("facts_dropped") or []),
            list(record.get("facts_elsewhere") or []),
        ),
        # Agent sessions: what pruning cleared, what stayed pinned, what was too large to pin.
        "pruned": list(record.get("pruned") or []),
        "pinned": list(record.get("pinned") or []),
        "unpinned": list(record.get("unpinned") or []),
        "record_available": bool(record),
        "prefix_hash": prefix_hash,
    }


def conversation_detail(store: Store, tenant: str, conv: str) -> dict[str, Any]:
    """A conversation's totals, its requests (original vs forwarded messages and tokens), its
    compactions with their summaries and loss reports (facts kept and dropped), and its
    failures. Raises ``NotFound``."""
    meta = store.get(conv_key("conv", tenant, conv))
    if not isinstance(meta, dict):
        raise NotFound(f"no conversation {conversation_id(tenant, conv)!r}")
    # Ledger writes run after each response and may land out of order: sort by time.
    requests = [r for r in get_list(store, conv_key("req", tenant, conv)) if isinstance(r, dict)]
    requests.sort(key=lambda r: r.get("ts") or 0)
    events = [e for e in get_list(store, conv_key("ev", tenant, conv)) if isinstance(e, dict)]
    events.sort(key=lambda e: e.get("ts") or 0)
    compactions = [
        _compaction(store, tenant, conv, e) for e in events if e.get("case") in COMPACTION_CASES
    ]
    failures = [
        {
            "ts": e.get("ts"),
            "case": e.get("case"),
            "error": e.get("error"),
            "soft": bool(e.get("soft")),
            "model": e.get("model"),
        }
        for e in events
        if e.get("case") in FAILURE_CASES
    ]
    summary = _derive(meta)
    summary.update(compactions=len(compactions), failures=len(failures))
    summary["paused"] = store.get(conv_key("pause", tenant, conv)) is not None
    return {
        "id": conversation_id(tenant, conv),
        "tenant": tenant,
        "conversation": conv,
        "meta": summary,
        "requests": [
            {
                k: r.get(k)
                for k in (
                    "ts",
                    "case",
                    "status",
                    "model",
                    "route",
                    "original_messages",
                    "forwarded_messages",
                    "original_tokens",
                    "forwarded_tokens",
                    "saved_tokens",
                    "prompt_tokens",
                    "cached_tokens",
                    "completion_tokens",
                    "latency_s",
                    "overhead_s",
                    "shadow",
                )
            }  # fmt: skip
            for r in requests
        ],
        "compactions": compactions,
        "failures": failures,
    }


def set_paused(store: Store, tenant: str, conv: str, paused: bool, ttl: float | None) -> None:
    """Pause (or resume) compaction of one conversation: its requests then pass as sent."""
    key = conv_key("pause", tenant, conv)
    if paused:
        store.set(key, time.time(), ttl)
    else:
        store.delete(key)

    def mark(meta: Any) -> Any:
        if isinstance(meta, dict):
            meta["paused"] = paused
        return meta

    store.update(conv_key("conv", tenant, conv), mark, ttl)
