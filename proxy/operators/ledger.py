"""The ledger: what each request sent, forwarded and cost, kept per conversation and in total.

It is written after the response (never on the hot path) and read by the stats API, the
dashboard and ``compaction-proxy stats``. Numbers here and in /metrics are counted the same
way: the proxy's own token counts of the original and forwarded histories.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.adapters.store import Store
from proxy.core import billing, costs
from proxy.core.errors import StoreError
from proxy.core.prepared import Sent
from proxy.core.records import conv_key
from proxy.core.types import Case, CaseName
from proxy.operators import history, index, phantom, reqlog
from proxy.operators.adopt import adopt
from proxy.operators.entry import RequestEntry as RequestEntry
from proxy.operators.entry import usage_numbers as usage_numbers
from proxy.operators.events import as_event, split

log = logging.getLogger("compaction_proxy.ledger")

TOTALS_KEY = "totals"
_MAX_COMPACTIONS_TRACKED = 64
CLIENT_CLOSED = 499  # the status a stream the client abandoned is recorded with


def _add_saving(meta: dict[str, Any], saving: costs.RequestSaving) -> None:
    for key, zero in (("cache_tokens_lost", 0), ("actual_usd", 0.0), ("counterfactual_usd", 0.0)):
        meta[key] = meta.get(key, zero) + getattr(saving, key)


def net_usd(meta: dict[str, Any]) -> float:
    """Dollars saved net of cache misses, cache writes and detector/summarizer calls."""
    return (
        meta.get("counterfactual_usd", 0.0) - meta.get("actual_usd", 0.0) - meta.get("llm_usd", 0.0)
    )


def _add(totals: dict[str, Any], entry: RequestEntry) -> dict[str, Any]:
    totals["requests"] = totals.get("requests", 0) + 1
    totals["original_tokens"] = totals.get("original_tokens", 0) + entry.original_tokens
    totals["forwarded_tokens"] = totals.get("forwarded_tokens", 0) + entry.sent_tokens
    totals["saved_tokens"] = totals.get("saved_tokens", 0) + entry.saved_tokens
    totals["saved_usd"] = totals.get("saved_usd", 0.0) + entry.saved_usd()
    if entry.shadow:
        shadow = totals.setdefault("shadow", {})
        shadow["requests"] = shadow.get("requests", 0) + 1
        shadow["original_tokens"] = shadow.get("original_tokens", 0) + entry.original_tokens
        shadow["forwarded_tokens"] = shadow.get("forwarded_tokens", 0) + entry.forwarded_tokens
        shadow["saved_tokens"] = shadow.get("saved_tokens", 0) + entry.would_save_tokens
        shadow["saved_usd"] = shadow.get("saved_usd", 0.0) + entry.would_save_usd()
    if entry.over_window:
        totals["kept_within_window"] = totals.get("kept_within_window", 0) + 1
        totals["kept_window_tokens"] = totals.get("kept_window_tokens", 0) + entry.kept_tokens
    if entry.held and entry.status < 400:
        held = totals.setdefault("held", {})
        held[entry.held] = held.get(entry.held, 0) + 1
    if entry.case in (Case.OPT_OUT, Case.CLIENT_COMPACTION, Case.HEALED):
        keys = {Case.CLIENT_COMPACTION: "client_compactions", Case.HEALED: "healed"}
        key = keys.get(entry.case, "opted_out")
        totals[key] = totals.get(key, 0) + 1
    totals["prompt_tokens"] = totals.get("prompt_tokens", 0) + entry.prompt_tokens
    totals["cached_tokens"] = totals.get("cached_tokens", 0) + entry.cached_tokens
    totals["cache_write_tokens"] = totals.get("cache_write_tokens", 0) + entry.cache_write_tokens
    totals["completion_tokens"] = totals.get("completion_tokens", 0) + entry.completion_tokens
    if entry.status == CLIENT_CLOSED:
        # The client went away mid-stream (often on purpose: a user pressing stop); counted
        # apart so "errors" means requests that failed.
        totals["cancelled"] = totals.get("cancelled", 0) + 1
    elif entry.status >= 400:
        totals["errors"] = totals.get("errors", 0) + 1
    if not costs.prices_for(entry.model).known:
        # Dollars for these requests are unknown, not zero: the dashboard says "n/a".
        totals["unpriced_requests"] = totals.get("unpriced_requests", 0) + 1
    return totals


def record_request(
    store: Store,
    entry: RequestEntry,
    original: list[dict[str, Any]] | Sent | None,
    retention_s: float | None,
) -> None:
    """Write one request to the conversation, the totals and the hourly series (sync)."""
    record_batch(store, [(entry, original)], retention_s)


def _conv_apply(
    meta: Any, entry: RequestEntry, shadow_saving: list[costs.RequestSaving]
) -> tuple[dict[str, Any], costs.RequestSaving | None]:
    """``entry`` applied to its conversation's row, and what it saved as billed (None: not
    priced, being an error, in shadow mode or over the context window)."""
    meta = meta if isinstance(meta, dict) else {"first_seen": entry.ts}
    found: costs.RequestSaving | None = None
    if entry.status < 400 and entry.shadow:
        shadow_saving.append(_shadow_saving(meta, entry))
    elif entry.status < 400 and entry.over_window:
        # The client could not have sent it: no counterfactual, so no saving either, and
        # nothing of it in the counterfactual cache of the next request.
        meta.update(last_original_tokens=0, last_unchanged=False)
    elif entry.status < 400:
        rules = billing.rules_for(entry.model)
        if entry.cache_ttl_s is not None:
            rules = billing.with_ttl(rules, entry.cache_ttl_s)
        seen = billing.observed(rules, meta)  # (none, if the provider showed it caches none)
        last, previous = meta.get("last_seen"), meta.get("last_original_tokens", 0)
        idle = entry.ts - last if isinstance(last, int | float) else None
        # The cache holds what the client's own requests would have put there when the last
        # went as sent too (not assumed of rows older than this key), or has expired.
        before_as_sent = meta.get("last_unchanged", last is None)
        as_sent = entry.unchanged and (before_as_sent or not billing.warm(seen, idle))
        found = billing.request_saving(
            costs.prices_for(entry.model), seen, original_tokens=entry.original_tokens,
            forwarded_tokens=entry.forwarded_tokens, previous_original_tokens=previous,
            idle_s=idle, cached=entry.cached_tokens, written=entry.cache_write_tokens,
            as_sent=as_sent,
        )  # fmt: skip
        if as_sent:  # what the provider's cache did with the client's own bytes
            common = min(previous, entry.original_tokens)
            meta.update(billing.cache_check(rules, meta, common, idle, entry.cached_tokens))
        if entry.cached_tokens > 0:  # with whatever marks went upstream (``observed``)
            meta["forwarded_reads"] = meta.get("forwarded_reads", 0) + 1
        _add_saving(meta, found)
        meta.update(last_original_tokens=entry.original_tokens, last_unchanged=entry.unchanged)
        if entry.record:
            per = meta.setdefault("by_compaction", {}).setdefault(entry.record, {})
            per["requests"] = per.get("requests", 0) + 1
            per["gross_tokens"] = per.get("gross_tokens", 0) + found.gross_tokens
            _add_saving(per, found)
    meta.update(
        tenant=entry.tenant,
        conversation=entry.conversation,
        model=entry.model,
        last_seen=entry.ts,
        last_case=entry.case,
        messages=entry.original_messages,
    )
    return meta, found


def _merged(into: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """``into`` with ``delta``'s counters (``_add``'s, nested ones too) added to its own."""
    for key, value in delta.items():
        if isinstance(value, dict):
            inner = into.get(key)
            into[key] = _merged(inner if isinstance(inner, dict) else {}, value)
        else:
            into[key] = into.get(key, 0) + value
    return into


def request_net(entry: RequestEntry, found: costs.RequestSaving | None) -> float | None:
    """A request's net dollars as the ledger priced them (its own input against the client's,
    cache reads and writes as billed; compactions' detector/summarizer spend is charged to the
    conversation apart, by ``record_compaction``); None when unpriced."""
    return found.net_usd if found is not None and costs.prices_for(entry.model).known else None


def _shadow_saving(meta: dict[str, Any], entry: RequestEntry) -> costs.RequestSaving:
    """What compaction would have saved on this request, net of the cache effects the cost
    model predicts: the would-be prefix is read from cache while its compaction stays the
    same, and misses once after each new one (the upstream's own cache figures describe the
    original request, so they cannot be used)."""
    shadow = meta.setdefault("shadow", {})
    same = shadow.get("last_record") == entry.record
    previous = shadow.get("last_forwarded_tokens", 0) if same else 0
    found = costs.request_saving(
        costs.prices_for(entry.model),
        original_tokens=entry.original_tokens,
        forwarded_tokens=entry.forwarded_tokens,
        previous_original_tokens=meta.get("last_original_tokens", 0),
        cached=min(costs.cacheable(previous), entry.forwarded_tokens),
    )
    _add_saving(shadow, found)  # the token sums are added with the others (``_add``)
    shadow["last_record"] = entry.record
    shadow["last_forwarded_tokens"] = entry.forwarded_tokens
    meta["last_original_tokens"] = entry.original_tokens
    return found


def record_batch(
    store: Store,
    batch: list[tuple[RequestEntry, list[dict[str, Any]] | Sent | None]],
    retention_s: float | None,
) -> list[float | None]:
    """Write many requests with one store update per conversation, hour and the totals.

    Entries are applied in order; for each conversation only the newest original history is
    kept (the operator's "what the client last sent"). Returns each entry's net dollars
    (``request_net``, also in its ``req`` row), in ``batch``'s order.
    """
    by_conv: dict[tuple[str, str], list[tuple[RequestEntry, Any]]] = {}
    at: dict[tuple[str, str], list[int]] = {}  # each conversation's entries' places in batch
    # Each entry's counters are added once, into its conversation's and hour's sum, which the
    # rows of the conversation, the hour and the totals take (#28: was 3 ``_add``s an entry).
    added: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for i, (entry, original) in enumerate(batch):
        conv = (entry.tenant, entry.conversation)
        by_conv.setdefault(conv, []).append((entry, original))
        at.setdefault(conv, []).append(i)
        _add(added.setdefault(conv, {}).setdefault(_hour(entry.ts), {}), entry)
    nets: list[float | None] = [None] * len(batch)
    savings: list[costs.RequestSaving] = []
    shadow_savings: list[costs.RequestSaving] = []
    seen: list[index.Seen] = []
    adopted: set[tuple[str, str]] = set()  # rows merged into another: out of the index
    for (tenant, conversation), items in by_conv.items():
        earlier = items[0][0].earlier_conversation
        before: dict[str, Any] = {}
        found: list[costs.RequestSaving | None] = []
        shadow: list[costs.RequestSaving] = []

        def conv_update(
            meta: Any,
            items: list[tuple[RequestEntry, Any]] = items,
            before: Any = before,
            found: list[costs.RequestSaving | None] = found,
            shadow: list[costs.RequestSaving] = shadow,
            by_hour: dict[str, dict[str, Any]] = added[(tenant, conversation)],
        ) -> Any:
            # Run again when the store retries (Redis, on a concurrent change): start afresh.
            before.clear()
            before.update(meta if isinstance(meta, dict) else {})  # (the row before this write)
            found.clear()
            shadow.clear()
            for entry, _ in items:
                meta, saving = _conv_apply(meta, entry, shadow)
                found.append(saving)
            for delta in by_hour.values():
                meta = _merged(meta, delta)
            return meta

        try:
            if earlier and adopt(store, tenant, earlier, conversation, retention_s):
                adopted.add((tenant, earlier))
            meta = store.update(conv_key("conv", tenant, conversation), conv_update, retention_s)
            savings.extend(s for s in found if s is not None)
            shadow_savings.extend(shadow)
            priced = [request_net(e, s) for (e, _), s in zip(items, found, strict=True)]
            for i, net in zip(at[(tenant, conversation)], priced, strict=True):
                nets[i] = net
            model, last_seen = str(meta.get("model") or ""), float(meta["last_seen"])
            scores = index.sort_scores(meta)
            was = before.get("model"), scores, before.get("requests")
            seen.append(index.Seen(tenant, conversation, model, last_seen, *was))
            rows = [
                e.__dict__ | {"saved_tokens": e.saved_tokens, "net_usd": net}
                for (e, _), net in zip(items, priced, strict=True)
            ]
            reqlog.append(store, tenant, conversation, rows, meta["requests"], retention_s)
        except StoreError:
            raise
        except Exception:  # one conversation's bad values never cost the others theirs
            log.exception("ledger entry not written", extra={"conversation": conversation})
        # The newest history that can be written (one nested too deep for the encoder is
        # skipped, never the reason nothing is stored).
        for _, original in reversed(items):
            if original is None:
                continue
            try:
                history.write(store, tenant, conversation, original, retention_s)
                break
            except StoreError:
                raise
            except Exception as exc:
                log.warning(
                    "original history not stored",
                    extra={"conversation": conversation, "error": str(exc)},
                )

    # The batch's counters per hour: each hour's row takes its sum, the totals all of them.
    hours: dict[str, dict[str, Any]] = {}
    for by_hour in added.values():
        for hour, delta in by_hour.items():
            _merged(hours.setdefault(hour, {}), delta)

    def totals_update(totals: Any) -> dict[str, Any]:
        totals = totals if isinstance(totals, dict) else {}
        for delta in hours.values():
            totals = _merged(totals, delta)
        for saving in savings:
            _add_saving(totals, saving)
        for saving in shadow_savings:
            _add_saving(totals.setdefault("shadow", {}), saving)
        return totals

    totals = store.update(TOTALS_KEY, totals_update, None)
    phantom.warn(totals, len(batch))
    for hour, delta in hours.items():

        def hour_update(t: Any, hour: str = hour, delta: dict[str, Any] = delta) -> Any:
            return _merged(t if isinstance(t, dict) else {"hour": hour}, delta)

        store.update(f"hour:{hour}", hour_update, retention_s)
    # The operators' indexes (O(page) reads) once the batch is committed: one rolled back
    # (diskcache) leaves them as they were, which ``index._Indexed`` relies on.
    index.write(store, [s for s in seen if (s.tenant, s.conversation) not in adopted], retention_s)
    return nets


def count_client_compaction(store: Store) -> None:
    """One compaction the client ran itself through a route the proxy only relays
    (``/v1/responses/compact``): counted for the dashboard, nothing else is kept."""
    store.update(TOTALS_KEY, lambda t: _bump(t, {}, client_compactions=1), None)


def record_compaction(
    store: Store,
    tenant: str,
    conversation: str,
    *,
    record: str,
    case: CaseName,
    llm_tokens: int,
    llm_usd: float,
    retention_s: float | None,
    llm_cached_tokens: int = 0,
) -> None:
    """Charge a compaction's detector/summarizer spend to its conversation and the totals."""

    def charge(meta: Any, per_conversation: bool) -> dict[str, Any]:
        meta = meta if isinstance(meta, dict) else {}
        meta["compactions"] = meta.get("compactions", 0) + 1
        meta["llm_tokens"] = meta.get("llm_tokens", 0) + llm_tokens
        meta["llm_usd"] = meta.get("llm_usd", 0.0) + llm_usd
        if llm_cached_tokens:  # the provider read some of the calls' input from its cache
            meta["llm_cached_tokens"] = meta.get("llm_cached_tokens", 0) + llm_cached_tokens
        by_case = meta.setdefault("compactions_by_case", {})
        by_case[case] = by_case.get(case, 0) + 1
        if per_conversation:
            tracked = meta.setdefault("by_compaction", {})
            per = tracked.setdefault(record, {})
            per.update(case=case, llm_tokens=llm_tokens, llm_usd=llm_usd)
            while len(tracked) > _MAX_COMPACTIONS_TRACKED:
                tracked.pop(next(iter(tracked)))
        return meta

    meta = store.update(
        conv_key("conv", tenant, conversation), lambda m: charge(m, True), retention_s
    )
    if meta.get("requests"):  # its row is listed (else its first ledger write indexes it)
        name = index.member(tenant, conversation)
        store.zadd(index.by_sort("compactions"), {name: float(meta["compactions"])})
    store.update(TOTALS_KEY, lambda m: charge(m, False), None)
    hour = _hour(time.time())
    store.update(f"hour:{hour}", lambda t: _bump(t, {"hour": hour}, compactions=1), retention_s)


def record_events(
    store: Store,
    tenant: str,
    conversation: str,
    events: Sequence[Mapping[str, object]],
    retention_s: float | None,
) -> None:
    """Store a conversation's compaction events (the core's ``Emit``: ``proxy.core.types``
    shapes) in its ``ev:`` list, and count what the overview shows of them: failed attempts
    (conversation and totals) and the key facts each compaction kept and dropped (totals).
    The compactions themselves are counted by ``record_compaction``."""
    typed = [e for e in map(as_event, events) if e is not None]
    if not typed:
        return
    store.extend(conv_key("ev", tenant, conversation), list(events), retention_s, 500)
    done, failed = split(typed)
    kept = sum(e["facts_kept"] for e in done)
    dropped = sum(e["facts_dropped"] for e in done)
    if failed:
        store.update(
            conv_key("conv", tenant, conversation),
            lambda m: _bump(m, {}, compaction_failures=len(failed)),
            retention_s,
        )
    if failed or kept or dropped:
        store.update(
            TOTALS_KEY,
            lambda t: _bump(
                t, {}, compaction_failures=len(failed), facts_kept=kept, facts_dropped=dropped
            ),
            None,
        )


def _bump(meta: Any, new: dict[str, Any], **counts: int) -> dict[str, Any]:
    """Add ``counts`` to a stored dict (``new`` when there is none yet)."""
    return _merged(meta if isinstance(meta, dict) else new, counts)


def _hour(ts: float) -> str:
    return time.strftime("%Y%m%d%H", time.gmtime(ts))
