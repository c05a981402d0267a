"""Candidate compactions, built without I/O, and the one verdict on whether one stands.

Every tier (prune, truncate, summarize, emergency) builds a ``CompactionRecord`` here from
the forwarded list and what the LLMs answered; ``verdict`` alone decides whether it is used.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from proxy.core import anchors, behaviour, layout, lossreport, pins, planner, prune, references
from proxy.core.messages import Message
from proxy.core.prepared import Env, Outcome, Prepared, nothing, unpinned
from proxy.core.records import LLM_CASES, CompactionRecord
from proxy.core.settings import CompactionSettings
from proxy.core.types import Case, CaseName
from proxy.core.view import reviewed

EMERGENCY_NOTE = (
    "Earlier messages of this conversation were omitted so that it fits the model's context."
)


def verdict(env: Env, p: Prepared, outcome: Outcome, *, llm_next: bool = False) -> Outcome:
    """``outcome`` if its record may be forwarded for ``p``, else why not (the one place).

    - A record stored meanwhile (``outcome.reused``) stands unless it is the one ``p`` has.
    - A new record must forward fewer tokens than ``p`` does now.
    - A pruning must also leave room to grow when the summarizer could run next
      (``llm_next``): pruned to within ``prune_clear_at_least`` of the trigger, the next
      pruning is a round or two away, and each one breaks the cached prefix; one deeper
      break by the summary tier is cheaper.
    - No treadmill: an optional summary or truncation (under the hard limit) must leave at
      most ``planner.relaxed_target``: ``compact_to_share`` of the trigger, or more when it
      still frees the distance from the trigger to that share (``widened`` aims at the share
      first), plus what its note came out longer than ``widened`` counted (``overrun``).
    """
    record = outcome.record
    if record is None:
        return outcome
    if outcome.reused:
        return outcome if record != p.record else nothing(outcome.reason)
    if record.tokens_after >= p.forwarded_tokens:
        return nothing(f"{record.case} would not reduce tokens")
    s = env.settings
    optional = not planner.over_limit(p.forwarded_tokens, p.decision)
    target = planner.relaxed_target(s, p.forwarded_tokens) + overrun(env, p, record)
    if record.case in (Case.SUMMARIZE, Case.TRUNCATE) and optional and record.tokens_after > target:
        return nothing(f"{record.case} would leave {record.tokens_after} tokens (target {target})")
    room = s.trigger_tokens - s.prune_clear_at_least
    if record.case == Case.PRUNE and llm_next and record.tokens_after > room:
        return nothing("pruning would leave too little room; the summary tier goes instead")
    return outcome


def note_tokens(settings: CompactionSettings, counts: Sequence[int], earlier_at: int | None) -> int:
    """What ``widened`` counts for a summary before it is made: its budget, a ``Key
    references:`` line at the base budget, its header; and at least the earlier summary's
    size (at ``earlier_at``), whose references the next one carries (their budget grows with
    the span and never sheds what was carried)."""
    note = settings.summary_budget_tokens + settings.key_references_max_chars // 4 + 40
    return note if earlier_at is None else max(note, counts[earlier_at])


def overrun(env: Env, p: Prepared, record: CompactionRecord) -> int:
    """How much longer ``record``'s summary came out than ``note_tokens``: its references'
    budget grows with the span (up to 4x, ``references.budget``), which the cut, chosen before
    the calls, could not count. Refusing such a summary for it threw its two LLM calls away
    (1.01x forwarding unchanged on three replayed runs), and its cut still left the share."""
    if record.summary is None:
        return 0
    counted = note_tokens(env.settings, p.forwarded_counts, p.body_start()[1])
    made = env.counter.count_message(record.summary, p.model)
    return max(0, made - counted)


def pins_for(env: Env, p: Prepared, start: int, cut: int) -> pins.Pins:
    """Pins of the span ``[start, cut)`` plus the user turn a round cut falls in."""
    fwd = p.forwarded
    found = pins.find(
        fwd[:cut],
        p.forwarded_counts,
        p.origins,
        pins.first_user_index(p.original),
        env.settings,
        start,
    )
    opener = layout.turn_opener(fwd, cut, start)
    limit = env.settings.trigger_tokens * env.settings.pin_max_share
    if opener is not None and p.forwarded_counts[opener] <= limit:
        found = pins.with_pin(found, opener, "the instruction of the current turn")
    # The loop breaker's kept results (#26), whole rounds, within their own protect window.
    kept = behaviour.rounds(
        fwd, p.forwarded_counts, p.keep_results, start, cut, env.settings.prune_protect_tokens
    )
    for i, why in kept.items():
        found = pins.with_pin(found, i, why)
    return found


def widened(
    env: Env,
    p: Prepared,
    plan: planner.CutPlan,
    *,
    relax: bool = False,
    bound: int | None = None,
) -> planner.CutPlan | None:
    """``plan`` with a cut late enough that the result is at most ``compact_to_share`` of the
    trigger (``planner.widen``), counting the head, the pins and a full summary with its key
    references; with ``relax`` (an optional compaction), at most ``planner.relaxed_target``
    when no cut reaches the share; with ``bound``, under it when no cut reaches the share.
    None when no legal cut gets there (no LLM call is made)."""
    s = env.settings
    counts = p.forwarded_counts
    body, earlier_at = p.body_start()
    found = pins_for(env, p, body, plan.latest_cut)
    kept = [0] * (len(counts) + 1)
    for i in range(len(counts)):
        stays = i < p.head_len or (body <= i and i in found)
        kept[i + 1] = kept[i] + (counts[i] if stays else 0)
    note = note_tokens(s, counts, earlier_at)
    share = planner.target_tokens(s)
    widest = planner.widen(plan, counts, kept, note, share)
    relaxed = planner.relaxed_target(s, p.forwarded_tokens)
    if widest is None and relax and relaxed > share:
        widest = planner.widen(plan, counts, kept, note, relaxed)
    if widest is None and bound is not None and bound > share:
        widest = planner.widen(plan, counts, kept, note, bound - 1)
    return widest


def llm_can_go(env: Env, p: Prepared) -> bool:
    """Whether the summary tier could compact ``p`` now (decision aside): over the hard limit
    it must; under it only a cut that meets the no-treadmill target (``widened``) goes."""
    if planner.over_limit(p.forwarded_tokens, p.decision):
        return True
    body, _ = p.body_start()
    plan = planner.plan_cut(
        p.forwarded, p.forwarded_counts, p.head_len, env.settings, body, p.cut_limit()
    )
    return plan is not None and widened(env, p, plan, relax=True) is not None


def pruning(env: Env, p: Prepared, *, at_least: int, held: bool = False) -> Outcome:
    """The pruning tier: old tool results replaced by placeholders, when that frees enough.
    Optional (or ``held``), only the results before where the client edits its own history:
    its next request would not match a record reaching past it."""
    started = time.monotonic()
    held = held or not planner.over_limit(p.forwarded_tokens, p.decision)
    found = prune.plan(
        p.forwarded,
        env.settings,
        lambda text: env.counter.count_text(text, p.model),
        keep=p.keep_results,
        end=p.cut_limit() if held else None,
    )
    if not found.replacements or found.freed_tokens < max(1, at_least):
        return nothing("pruning would not free enough")
    new = layout.pruned(p.view(), found.replacements)
    after = [found.replacements.get(i, m) for i, m in enumerate(p.forwarded)]
    record = record_for(
        env,
        p,
        new,
        Case.PRUNE,
        summary=None,
        reason=f"cleared {len(found.cleared)} old tool results",
        started=started,
        loss=lossreport.report(found.cleared_text, None, lossreport.facts_text(after)),
        anchored=anchors.report(found.cleared_text, None, lossreport.facts_text(after)),
    )
    record = dataclasses.replace(record, pruned=found.cleared)
    return Outcome(Case.PRUNE, record, record.boundary_reason)


def record_for(
    env: Env,
    p: Prepared,
    new: layout.Layout,
    case: CaseName,
    *,
    summary: Message | None,
    reason: str,
    started: float,
    confidence: float = 0.0,
    loss: lossreport.LossReport | None = None,
    llm_tokens: int = 0,
    llm_usd: float = 0.0,
    llm_cached_tokens: int = 0,
    found: pins.Pins | None = None,
    anchored: anchors.AnchorReport | None = None,
) -> CompactionRecord:
    """The record of a new layout of ``p``'s forwarded list (``verdict`` judges it)."""
    tokens_after = sum(p.forwarded_counts[i] for i in new.kept) + 3
    tokens_after += sum(env.counter.count_message(m, p.model) for m in new.added)
    return CompactionRecord(
        k=new.k,
        prefix_hash=p.chain[new.k].hex(),
        head_len=p.head_len,
        summary=summary,
        case=case,
        covered=new.k - p.head_len,
        created_at=time.time(),
        tokens_before=p.forwarded_tokens,
        tokens_after=tokens_after,
        boundary_reason=reason,
        confidence=confidence,
        facts_kept=list(loss.kept) if loss else [],
        facts_dropped=list(loss.dropped) if loss else [],
        facts_appended=list(loss.appended) if loss else [],
        facts_elsewhere=list(loss.elsewhere) if loss else [],
        duration_s=round(time.monotonic() - started, 4),
        model=p.model,
        llm_tokens=llm_tokens,
        llm_usd=llm_usd,
        llm_cached_tokens=llm_cached_tokens,
        prefix=new.entries,
        pinned=pin_lines(p, found.reasons if found else {}),
        unpinned=pin_lines(None, found.oversized if found else {}, p.origins),
        anchors=anchored.to_json() if anchored else {},
        request_len=len(p.original),
        llm_request_len=len(p.original) if case in LLM_CASES else p.llm_since,
    )


def build(
    env: Env,
    p: Prepared,
    cut: int,
    text: str | None,
    case: CaseName,
    *,
    reason: str,
    confidence: float,
    started: float,
    llm_tokens: int = 0,
    llm_usd: float = 0.0,
    llm_cached_tokens: int = 0,
    refs_chars: int | None = None,
) -> Outcome:
    """Cutting the forwarded list at ``cut`` behind a note (``text``, None for none); pins
    of the replaced span stay in place.

    The ``Key references:`` budget grows with the span unless ``refs_chars`` fixes it (the
    emergency path, whose note size is counted in advance)."""
    fwd = p.forwarded
    body, _ = p.body_start()
    head_len = p.head_len
    found = pins_for(env, p, body, cut)
    covered = layout.replaced(p.view(), head_len, body, cut, found, None).k - head_len
    span_text = lossreport.facts_text(unpinned(fwd, found, head_len, cut))
    replaced = {i for i in range(head_len, cut) if i not in found}
    rest_text = lossreport.facts_text([m for i, m in enumerate(fwd) if i not in replaced])
    summary_msg = None
    if text is not None:
        budget = refs_chars
        if budget is None:
            budget = references.budget(env.settings.key_references_max_chars, span_text)
        text, _ = references.guard(span_text, text, budget, elsewhere=rest_text, files_chars=budget)
        summary_msg = planner.summary_message(text, covered, p.summary_role)
    # Against the forwarded text itself: the summary as stored and everything around it.
    loss = lossreport.report(
        span_text, None if summary_msg is None else str(summary_msg["content"]), rest_text
    )
    anchored = anchors.report(
        span_text, None if summary_msg is None else str(summary_msg["content"]), rest_text
    )
    new = layout.replaced(p.view(), head_len, body, cut, found, summary_msg)
    record = record_for(
        env,
        p,
        new,
        case,
        summary=summary_msg,
        reason=reason,
        started=started,
        confidence=confidence,
        loss=loss,
        llm_tokens=llm_tokens,
        llm_usd=llm_usd,
        llm_cached_tokens=llm_cached_tokens,
        found=found,
        anchored=anchored,
    )
    return Outcome(case, record, reason or case)


def emergency(env: Env, p: Prepared, limit: int, reason: str) -> Outcome:
    """No LLM: prune every old tool result, then drop the oldest whole rounds (pins and the
    recent window stay) down to the trigger, so that this does not fire again soon.

    Where the client edits its own history, within ``Prepared.cut_limit`` when that gets under
    ``limit``: a record reaching past it does not match the next request, which was cut anew,
    its cache lost, on every request (a clearing client whose summaries failed)."""
    if p.cut_limit() is not None:
        held = _emergency(env, p, limit, reason, held=True)
        if held.record is not None and held.record.tokens_after <= limit:
            return held
    return _emergency(env, p, limit, reason, held=False)


def _emergency(env: Env, p: Prepared, limit: int, reason: str, *, held: bool) -> Outcome:
    started = time.monotonic()
    s = env.settings
    pruned = verdict(env, p, pruning(env, p, at_least=1, held=held))
    work = p if pruned.record is None else reviewed(env, p, pruned.record)
    if pruned.record is not None and work.forwarded_tokens <= s.trigger_tokens:
        return pruned
    body, earlier_at = work.body_start()
    counts = work.forwarded_counts
    everything = pins_for(env, work, body, len(work.forwarded))
    # kept[c]: tokens staying before cut c (head, the previous summary's pins, span pins).
    kept = [0] * (len(counts) + 1)
    for i in range(len(counts)):
        stays = i < body and i != earlier_at or i in everything
        kept[i + 1] = kept[i] + (counts[i] if stays else 0)
    # The note's line gets the budget a summary of the longest span it could replace would
    # (never below the key references that span carries: the earlier summary's, the
    # placeholders'): at a fixed 600 characters an emergency after 30 summaries shed 14 of
    # 20 labelled facts. Counted in advance, so the cut leaves room for it.
    upper = lossreport.facts_text(work.forwarded[work.head_len :])
    refs_chars = references.budget(s.key_references_max_chars, upper)
    cut = planner.emergency_cut(
        work.forwarded,
        counts,
        work.head_len,
        limit,
        40 + refs_chars // 2,  # the note's tokens: its text and both budgets of its line
        target_tokens=s.trigger_tokens,
        body_start=body,
        kept_tokens=kept,
        last_cut=work.cut_limit() if held else None,
    )
    if cut is None:
        return pruned if pruned.record is not None else nothing(f"{reason}; nothing can be dropped")
    built = build(
        env, work, cut, EMERGENCY_NOTE, Case.EMERGENCY, reason=reason, confidence=0.0,
        started=started, refs_chars=refs_chars,
    )  # fmt: skip
    outcome = verdict(env, work, built)
    if outcome.record is None:
        return pruned if pruned.record is not None else outcome
    record = outcome.record
    if pruned.record is not None:
        # One record for both steps, measured against what was forwarded before either.
        record = dataclasses.replace(
            record,
            tokens_before=p.forwarded_tokens,
            pruned=pruned.record.pruned,
            facts_dropped=[*pruned.record.facts_dropped, *record.facts_dropped],
        )
    return Outcome(Case.EMERGENCY, record, outcome.reason)


def pin_lines(
    p: Prepared | None, reasons: dict[int, str], where: Sequence[int | None] = ()
) -> list[str]:
    """Loss-report lines naming pins by original message index; the pins an earlier record
    kept in place are still pinned."""
    if p is not None:
        where = p.origins
    lines = [f"message {where[i]}: {why}" for i, why in reasons.items()]
    earlier = p.record.pinned if p is not None and p.record else []
    return list(dict.fromkeys([*earlier, *lines]))
