"""What a request forwards under a compaction record, with its token counts (DESIGN §3).

Pure: substitution (``records.substitute``) plus counting the messages the record stored.
"""

from __future__ import annotations

from proxy.core import layout, planner
from proxy.core.fingerprint import fingerprint
from proxy.core.messages import Message
from proxy.core.prepared import Env, Prepared
from proxy.core.records import CompactionRecord, llm_request_len, origins, substitute
from proxy.core.tokens import TOKENS_PER_MESSAGE
from proxy.core.types import Case


def view(
    env: Env,
    messages: list[Message],
    counts: list[int],
    chain: list[bytes],
    *,
    model: str,
    tenant: str,
    credential: str | None,
    conversation: str,
    record: CompactionRecord | None,
    summary_joins: bool = False,
) -> Prepared:
    """The request as forwarded under ``record`` (as sent when there is none)."""
    where = origins(record, len(messages))
    if record is None:
        forwarded, fwd_counts = list(messages), list(counts)
    else:
        forwarded = substitute(messages, record)
        fwd_counts = [
            counts[o] if o is not None else env.counter.count_message(m, model, fingerprint(m))
            for o, m in zip(where, forwarded, strict=True)
        ]
        if summary_joins:
            fwd_counts = joined_counts(env, forwarded, fwd_counts, model)
    return Prepared(
        tenant=tenant,
        conversation=conversation,
        model=model,
        credential=credential,
        original=messages,
        original_counts=counts,
        chain=chain,
        forwarded=forwarded,
        forwarded_counts=fwd_counts,
        original_tokens=sum(counts) + 3,
        forwarded_tokens=sum(fwd_counts) + 3,
        record=record,
        decision=planner.Decision("forward", "not decided"),
        case=record.case if record else Case.NONE,
        summary_joins=summary_joins,
        origins=where,
        llm_since=llm_request_len(record),  # (``flow_prepare`` adds the conversation's newest)
    )


def reviewed(env: Env, p: Prepared, record: CompactionRecord) -> Prepared:
    """``p`` as forwarded under a record made just now."""
    fresh = view(
        env,
        p.original,
        p.original_counts,
        p.chain,
        model=p.model,
        tenant=p.tenant,
        credential=p.credential,
        conversation=p.conversation,
        record=record,
        summary_joins=p.summary_joins,
    )
    return p.but(
        forwarded=fresh.forwarded,
        forwarded_counts=fresh.forwarded_counts,
        forwarded_tokens=fresh.forwarded_tokens,
        record=record,
        case=fresh.case,
        origins=fresh.origins,
        compacted_now=True,
        llm_since=max(p.llm_since, llm_request_len(record)),
    )


def joined_counts(env: Env, forwarded: list[Message], counts: list[int], model: str) -> list[int]:
    """Counts when user turns side by side (the summary, the pins beside it, the next user
    turn) are forwarded as one user turn (``layout.joined_runs``): one message's framing for
    all of them."""
    runs = layout.joined_runs(forwarded)
    if not runs:
        return counts
    out = list(counts)
    for run in runs:
        for i in run[:-1]:
            role = str(forwarded[i].get("role", ""))
            out[i] = max(0, out[i] - TOKENS_PER_MESSAGE - env.counter.count_text(role, model))
    return out
