"""One conversation for the operators: its totals, requests, compactions (with summaries and
loss reports) and failures, and the history the client last sent beside what the proxy
forwards for it now. Synchronous store reads (the API runs them in a thread)."""

from __future__ import annotations

import time
from typing import Any

from proxy.adapters.store import Store, get_list
from proxy.core.errors import NotFound
from proxy.core.fingerprint import chain_of, fingerprints
from proxy.core.records import (
    CompactionRecord,
    body_start,
    conv_key,
    find_checkpoint,
    parse_checkpoints,
    substitute,
)
from proxy.core.tokens import TokenCounter
from proxy.core.types import CompactionEvent, Failure
from proxy.operators import history, reqlog
from proxy.operators.events import Failed, read_events, split
from proxy.operators.figures import derive
from proxy.operators.queries import conversation_id


def _current_record(
    store: Store, tenant: str, conv: str, original: list[dict[str, Any]]
) -> CompactionRecord | None:
    """The record the proxy would apply to ``original`` now (the same lookup as the core)."""
    chain = chain_of(tenant, original)
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
    original = history.read(store, tenant, conv)
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


def _compaction(store: Store, tenant: str, conv: str, event: CompactionEvent) -> dict[str, Any]:
    """One compaction as the core recorded it: the event's figures, and from its record the
    summary, the loss report (facts kept by the summary, appended to it as key references,
    still elsewhere in the forwarded context, dropped) and the agent lists."""
    prefix_hash = event["prefix_hash"]
    record = (
        CompactionRecord.from_json(store.get(conv_key("rec", tenant, conv) + ":" + prefix_hash))
        if prefix_hash
        else None
    )
    summary = record.summary if record is not None else None
    return {
        "ts": event["ts"],
        "case": event["case"],
        "model": event["model"],
        "k": event["k"],
        "covered": event["covered"],
        "tokens_before": event["tokens_before"],
        "tokens_after": event["tokens_after"],
        "duration_s": event["duration_s"],
        "llm_tokens": event["llm_tokens"],
        "llm_cached_tokens": event.get("llm_cached_tokens", 0),
        "reason": event["reason"],
        "boundary_reason": record.boundary_reason if record else "",
        "confidence": record.confidence if record else event["confidence"],
        "summary": summary["content"] if summary else None,
        "summary_role": summary.get("role") if summary else None,
        "facts_kept": list(record.facts_kept) if record else [],
        "facts_appended": list(record.facts_appended) if record else [],
        "facts_elsewhere": list(record.facts_elsewhere) if record else [],
        "facts_dropped": list(record.facts_dropped) if record else [],
        # Agent sessions: what pruning cleared, what stayed pinned, what was too large to pin.
        "pruned": list(record.pruned) if record else [],
        "pinned": list(record.pinned) if record else [],
        "unpinned": list(record.unpinned) if record else [],
        # #26: anchors by category (artifact, recall, decision, continuation) and fate.
        "anchors": dict(record.anchors) if record else {},
        "record_available": record is not None,
        "prefix_hash": prefix_hash or None,
    }


def _failure(event: Failed) -> dict[str, Any]:
    soft = event["soft"] if event["case"] == Failure.FAILED else False
    return {
        "ts": event["ts"],
        "case": event["case"],
        "error": event["error"],
        "soft": soft,
        "model": event["model"],
    }


_REQUEST_FIELDS = (
    "ts", "case", "status", "model", "route", "original_messages", "forwarded_messages",
    "original_tokens", "forwarded_tokens", "saved_tokens", "prompt_tokens", "cached_tokens",
    "completion_tokens", "latency_s", "overhead_s", "shadow", "net_usd",
)  # fmt: skip


def conversation_detail(store: Store, tenant: str, conv: str) -> dict[str, Any]:
    """A conversation's totals, its requests (original vs forwarded messages and tokens), its
    compactions with their summaries and loss reports (facts kept and dropped), and its
    failures. Raises ``NotFound``."""
    meta = store.get(conv_key("conv", tenant, conv))
    if not isinstance(meta, dict):
        raise NotFound(f"no conversation {conversation_id(tenant, conv)!r}")
    # Ledger writes run after each response and may land out of order: sort by time.
    rows = reqlog.read(store, tenant, conv, meta.get("requests"))
    requests = [r for r in rows if isinstance(r, dict)]
    requests.sort(key=lambda r: r.get("ts") or 0)
    done, failed = split(read_events(store, tenant, conv))
    compactions = [_compaction(store, tenant, conv, e) for e in done]
    failures = [_failure(e) for e in failed]
    summary = derive(meta)
    summary.update(compactions=len(compactions), failures=len(failures))
    summary["paused"] = store.get(conv_key("pause", tenant, conv)) is not None
    # The upstream refused a compacted request of this conversation (Service.send_as_sent):
    # when, on which route, the refused record's case and prefix hash. Never content.
    refused = store.get(conv_key("refused", tenant, conv))
    summary["refused"] = refused if isinstance(refused, dict) else None
    return {
        "id": conversation_id(tenant, conv),
        "tenant": tenant,
        "conversation": conv,
        "meta": summary,
        "requests": [{k: r.get(k) for k in _REQUEST_FIELDS} for r in requests],
        "compactions": compactions,
        "failures": failures,
        # #26: the agent's behaviour after each compaction, and the loop breaker's decision.
        "behaviour": store.get(conv_key("behave", tenant, conv)),
        "loop": store.get(conv_key("loop", tenant, conv)),
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
