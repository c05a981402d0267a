"""One compaction of a prepared request, as a sans-I/O flow (DESIGN §4-§5).

The flow runs under the conversation's lock (the driver takes it). In order: reuse a record
another worker stored meanwhile; else ask the detector where the current topic began, choose
truncate or summarize, ask the summarizer (map-reduce for a long span), build the record and
let ``candidates.verdict`` judge it; on failure put the conversation on cooldown and, when the
request would not fit, fall back to the emergency cut. Every step that needs the world yields
a command (``proxy.core.commands``).
"""

from __future__ import annotations

import logging
import time

from proxy.core import (
    billing,
    candidates,
    costs,
    detector,
    keyfacts,
    lossreport,
    planner,
    sharedcall,
    summarizer,
    timing,
)
from proxy.core.commands import (
    Complete,
    CompleteShared,
    Cooldown,
    Emit,
    Flow,
    Persist,
    Read,
    Reply,
)
from proxy.core.errors import CallRefused, CompactionFailed, StoreError
from proxy.core.lookup import lookup
from proxy.core.messages import Message, render
from proxy.core.modelmap import context_window
from proxy.core.prepared import Env, Outcome, Prepared, nothing, unpinned
from proxy.core.records import CompactionRecord, conv_key
from proxy.core.sharedcall import SharedCall
from proxy.core.types import Case, CompactionEvent, DetectorFailedEvent, Event, FailureEvent

log = logging.getLogger("compaction_proxy.compactor")
NOTHING_TO_CUT = "nothing to cut"
TOO_SHALLOW = "no treadmill: no cut leaves the history below the target share of the trigger"


def compact(env: Env, p: Prepared, *, inline: bool, waited: bool = False) -> Flow[Outcome]:
    """A compaction of ``p.forwarded``, or why there is none. ``waited``: another worker held
    the lock until now; use what it stored, else only the fallback."""
    try:
        latest = yield from lookup(p.tenant, p.conversation, p.earlier_conversation, p.chain)
    except StoreError:
        latest = None
    if latest is not None:
        why = "reused a concurrent compaction" if waited else "reused a compaction stored meanwhile"
        reused = candidates.verdict(env, p, Outcome(latest.case, latest, why, reused=True))
        if reused.record is not None:
            return reused
    if waited:
        return (yield from fallback(env, p, "concurrent compaction gave nothing usable"))
    return (yield from attempt(env, p, inline=inline))


def attempt(env: Env, p: Prepared, *, inline: bool) -> Flow[Outcome]:
    """The LLM tiers, with the cooldown and the fallback when they give nothing."""
    started = time.monotonic()
    if not p.decision.use_llm:
        return (yield from fallback(env, p, "cooling down"))
    if not inline and (yield from _cooling(p)):
        # Prepared before an earlier attempt failed: that failure's cooldown holds.
        return nothing("cooling down")
    try:
        outcome = yield from llm_compaction(env, p, started)
    except (CompactionFailed, summarizer.SummaryRejected) as exc:
        # A rejected summary is a soft failure (the next one may pass): a short cooldown.
        # An unreachable or failing model is a hard one: the full cooldown.
        soft = isinstance(exc, summarizer.SummaryRejected)
        log.warning(
            "compaction failed",
            extra={"conversation": p.conversation, "error": str(exc), "soft": soft},
        )
        yield from cooldown(env, p, soft=soft)
        error = f"summary check failed: {exc}" if soft else str(exc)
        failed: FailureEvent = {
            "case": "failed", "error": error[:300], "soft": soft,
            "ts": time.time(), "model": p.model,
        }  # fmt: skip
        yield from emit(p, failed)
        return (yield from fallback(env, p, f"compaction failed: {error}"))
    if outcome.record is None:
        if outcome.reason not in (NOTHING_TO_CUT, TOO_SHALLOW):
            # The LLMs ran and nothing came of it: do not pay for it again soon.
            yield from cooldown(env, p, soft=True)
        return (yield from fallback(env, p, outcome.reason))
    return (yield from persist(p, outcome))


def fallback(env: Env, p: Prepared, reason: str) -> Flow[Outcome]:
    """Without an LLM result: the emergency cut when the request is over its limit."""
    limit = p.decision.limit_tokens
    if limit is not None and p.forwarded_tokens > limit:
        return (yield from persist(p, candidates.emergency(env, p, limit, reason)))
    return nothing(reason)


def llm_compaction(env: Env, p: Prepared, started: float) -> Flow[Outcome]:
    """Detector, then truncate or summarize; raises ``CompactionFailed`` / ``SummaryRejected``."""
    s = env.settings
    fwd = p.forwarded
    body, earlier_at = p.body_start()
    # Where the client edits its own history, a record reaching past it would not match its
    # next request (``Prepared.cut_limit``): an optional compaction ends before; a forced
    # one too when that gets it under the hard limit (else, the next request forced another).
    last = p.cut_limit()
    plan = planner.plan_cut(fwd, p.forwarded_counts, p.head_len, s, body, last)
    if not planner.over_limit(p.forwarded_tokens, p.decision):
        if plan is None:
            return nothing(NOTHING_TO_CUT)
        plan = candidates.widened(env, p, plan, relax=True)
        if plan is None:
            return nothing(TOO_SHALLOW)
    else:
        limit = p.decision.limit_tokens
        held = None
        if plan is not None and last is not None:
            held = candidates.widened(env, p, plan, bound=limit)
        if held is None and last is not None:
            plan = planner.plan_cut(fwd, p.forwarded_counts, p.head_len, s, body)
        if plan is None:
            return nothing(NOTHING_TO_CUT)
        # Forced: as near the target as the legal cuts allow (the latest one at worst, which
        # keeps min_verbatim_exchanges). Keeping the whole verbatim window instead left the
        # history near the trigger, and the hard limit forced the next one a request or two
        # later (a treadmill at the bound).
        plan = held or candidates.widened(env, p, plan) or planner.at_latest_cut(plan)
    offset, window = detector.detector_window(fwd, plan.body_start, s.detector_window_messages)
    detection = detector.SAFE_DEFAULT
    spent = Spent()
    try:
        request = detector.build_request(env.prompts.detector, window, s.detector_chars_per_message)
        reply = yield Complete(
            s.detection_model or p.llm_model or p.model, request, 400, "detector", p.credential
        )
        spent.add(reply)
        parsed = detector.parse_detection(reply.text, len(window))
        detection = detector.sane(parsed, offset, plan.body_start)
    except CompactionFailed as exc:
        # The detector is an optimisation: without it we still summarize.
        failed: DetectorFailedEvent = {
            "case": "detector_failed", "error": str(exc)[:300], "ts": time.time(), "model": p.model,
        }  # fmt: skip
        yield from emit(p, failed)
    boundary = None if detection.boundary_index is None else offset + detection.boundary_index
    case, cut = planner.choose_case(plan, boundary, detection.confidence, s)
    earlier = None
    if earlier_at is not None:
        earlier = summarizer.strip_summary_header(str(fwd[earlier_at].get("content", "")))
        # Its key references are the guard's to carry (with their labels, within their own
        # budget); the summarizer's budget goes to prose.
        earlier = lossreport.split_summary(earlier)[0]
    text: str | None = None
    if case == Case.TRUNCATE:
        if s.truncate_keeps_note:
            text = (
                detection.summary or f"An earlier topic was set aside: {detection.boundary_reason}"
            )
            if earlier:
                text = f"{earlier.strip()}\n\n{text}"
        span_text = lossreport.facts_text(fwd[p.head_len : cut])
        if not lossreport.note_keeps_all(
            span_text,
            text,
            lossreport.facts_text([*fwd[: p.head_len], *fwd[cut:]]),
            keyfacts.scaled_budget(s.key_references_max_chars, len(span_text)),
        ):
            # Truncation would lose facts the note cannot carry: summarize instead.
            case, cut = Case.SUMMARIZE, plan.verbatim_start
    if case == Case.SUMMARIZE:
        span = unpinned(fwd, candidates.pins_for(env, p, body, cut), body, cut)
        call = shared_call(env, p, span)
        if call is not None:
            text = yield from shared_summary(env, p, call, cut, spent)
    if case == Case.SUMMARIZE and text is None:
        model = s.summary_model or p.llm_model or p.model
        steps = summarizer.summarize(
            env.prompts.summarizer,
            span,
            earlier,
            s.summary_budget_tokens,
            transcript_chars(s.summary_model or p.model),
        )
        ask = next(steps)
        while True:
            reply = yield Complete(model, ask, s.summary_budget_tokens, "summarizer", p.credential)
            spent.add(reply)
            try:
                ask = steps.send((reply.text, reply.finish_reason))
            except StopIteration as done:
                text = done.value
                break
    built = candidates.build(
        env, p, cut, text, case, reason=detection.boundary_reason,
        confidence=detection.confidence, started=started,
        llm_tokens=spent.tokens, llm_usd=spent.usd, llm_cached_tokens=spent.cached,
    )  # fmt: skip
    return candidates.verdict(env, p, built)


def may_share(p: Prepared) -> bool:
    """Whether the request allows a summary from the call in the client's shape: the front
    door can make it, the model may answer in prose, the history hides no reasoning from the
    client, and it is not shadow mode (where the provider cached the client's requests, not
    what would be forwarded). The settings and prices are ``shared_call``'s to weigh."""
    call = p.shared
    if call is None or p.shadow or p.llm_model != p.model or not sharedcall.usable(call):
        return False
    return not sharedcall.hides_reasoning(p.forwarded)


def shared_call(env: Env, p: Prepared, span: list[Message]) -> SharedCall | None:
    """The summarizer call in the client's shape (``proxy.core.sharedcall``), when the
    settings, the request and (``auto``) the prices call for it. Only where the calls go to
    the upstream with the request's own model: another model or endpoint has another cache."""
    s = env.settings
    call = p.shared
    if call is None or not may_share(p) or not timing.shares_cache(s, p.model, True):
        return None
    if s.summary_reads_cache == "auto":
        # Warm: the conversation's last request was just forwarded (a background compaction)
        # or the cost policy found its cache warm; a cold one was dropped (flow_prepare).
        rules = billing.rules_for(p.model, s)
        prices = costs.prices_for(p.model)
        if not prices.known or not rules.caches:
            return None
        cached = billing.cached_prefix(rules, p.forwarded_tokens, 0.0)
        span_tokens = env.counter.count_total(span, p.model)
        if not sharedcall.cheaper(prices, prices, forwarded_tokens=p.forwarded_tokens,
                                  cached_tokens=cached, span_tokens=span_tokens):  # fmt: skip
            return None
    return call


def shared_summary(
    env: Env,
    p: Prepared,
    call: SharedCall,
    cut: int,
    spent: Spent,
) -> Flow[str | None]:
    """The checked summary from a call in the client's shape, or None (then the standalone
    summarizer is asked: a failed or rejected answer here costs one more call, not the
    compaction)."""
    s = env.settings
    budget = summarizer.target_tokens(s.summary_budget_tokens)
    ask = sharedcall.instruction(env.prompts.summarizer, budget, p.forwarded[cut:])
    history = sharedcall.cache_marked(call, p.forwarded, p.outside_cache_marks)
    view = [*history, {"role": "user", "content": ask}]
    body = sharedcall.request_body(call, view, s.summary_budget_tokens)
    try:
        reply = yield CompleteShared(call, body, "summarizer")
    except CallRefused as exc:
        # Refused (this shape, these fields) or answered otherwise: the standalone call may
        # do. A failing upstream (5xx, timeout) raises on: the attempt fails, the cooldown
        # holds, and no second call is sent to it now.
        log.info(
            "shared summarizer call refused",
            extra={"conversation": p.conversation, "error": str(exc)},
        )
        return None
    spent.add(reply)
    # The checks read what the model was shown, the whole history: a line copied from the
    # messages that stay is no invented turn, and the subject is the conversation's.
    seen = "\n\n".join(render(m) for m in p.forwarded)
    try:
        text = summarizer.accept(
            reply.text, reply.finish_reason, span_text=seen, prompt=ask,
            max_chars=s.summary_budget_tokens * 4,
        )  # fmt: skip
    except summarizer.SummaryRejected as exc:
        log.info(
            "shared summarizer answer rejected",
            extra={"conversation": p.conversation, "error": str(exc)},
        )
        return None
    log.info(
        "summary read the conversation's cache",
        extra={
            "conversation": p.conversation,
            "prompt_tokens": reply.prompt_tokens,
            "cached_tokens": getattr(reply, "cached_tokens", 0),
        },
    )
    return text


class Spent:
    """What the detector and summarizer calls of one attempt cost."""

    def __init__(self) -> None:
        self.tokens = 0
        self.usd = 0.0
        self.cached = 0  # prompt tokens read from the provider's cache

    def add(self, reply: Reply) -> None:
        self.tokens += reply.prompt_tokens + reply.completion_tokens
        prices = costs.prices_for(reply.model)
        # A call in the client's shape reads part of its input from the cache (and may
        # write some): priced as billed.
        cached = getattr(reply, "cached_tokens", 0)
        written = getattr(reply, "written_tokens", 0)
        self.cached += cached
        self.usd += costs.input_cost(prices, reply.prompt_tokens, cached, written)
        self.usd += reply.completion_tokens * prices.output


def persist(p: Prepared, outcome: Outcome) -> Flow[Outcome]:
    """Store a new record and report it; the result serves this request even if the store
    is down (it was made for it)."""
    record = outcome.record
    if record is None:
        return outcome
    try:
        yield Persist(p.tenant, p.conversation, record)
    except StoreError as exc:
        log.warning("could not store a compaction record", extra={"error": str(exc)})
    yield from emit(p, compaction_event(record, outcome.reason))
    log.info(
        "compacted",
        extra={
            "conversation": p.conversation,
            "case": record.case,
            "tokens_before": record.tokens_before,
            "tokens_after": record.tokens_after,
        },
    )
    return outcome


def compaction_event(record: CompactionRecord, reason: str) -> CompactionEvent:
    return {
        "case": record.case,  # type: ignore[typeddict-item]  # a COMPACTION_CASES member
        "k": record.k,
        "covered": record.covered,
        "tokens_before": record.tokens_before,
        "tokens_after": record.tokens_after,
        "reason": reason[:300],
        "confidence": record.confidence,
        "duration_s": record.duration_s,
        "llm_tokens": record.llm_tokens,
        "llm_cached_tokens": record.llm_cached_tokens,
        "prefix_hash": record.prefix_hash,
        "facts_kept": len(record.facts_kept)
        + len(record.facts_appended)
        + len(record.facts_elsewhere),
        "facts_dropped": len(record.facts_dropped),
        "anchors": record.anchors.get("counts", {}),
        "ts": time.time(),
        "model": record.model,
    }


def emit(p: Prepared, event: Event) -> Flow[None]:
    try:
        yield Emit(p.tenant, p.conversation, event)
    except StoreError:
        pass  # metrics saw it; the conversation's event list misses one line


def cooldown(env: Env, p: Prepared, *, soft: bool) -> Flow[None]:
    s = env.settings
    seconds = min(s.soft_cooldown_s, s.cooldown_s) if soft else s.cooldown_s
    if seconds <= 0:
        return
    try:
        yield Cooldown(p.tenant, p.conversation, seconds)
    except StoreError:
        pass  # without a cooldown the next request may try again: costly, not wrong


def _cooling(p: Prepared) -> Flow[bool]:
    key = conv_key("cool", p.tenant, p.conversation)
    try:
        got = yield Read(values=(key,))
    except StoreError:
        return False
    return got.get(key) is not None


def transcript_chars(model: str) -> int:
    """What the summary model can read: half its context window (~4 characters a token)."""
    window = context_window(model)
    if not window:
        return summarizer.DEFAULT_MAX_TRANSCRIPT_CHARS
    return max(8_000, window * 2)
