"""The compaction planner: pure decisions over a forwarded history (DESIGN §5).

Data in, a decision out; no I/O and no clock. The server and the LiteLLM hook call the same
functions, so there is one compress-or-not condition in the codebase (``decide``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from proxy.core.frozen import quick_init
from proxy.core.messages import SUMMARY_PREFIX, Message, tool_results, tool_uses
from proxy.core.settings import CompactionSettings
from proxy.core.types import Case, CaseName

Action = Literal["forward", "background", "inline"]
HOLD = "cost policy: "  # a decision held back because compacting now would not pay
TREADMILL = "no treadmill: "  # held back because the last LLM compaction is too recent


@quick_init
@dataclass(frozen=True)
class Decision:
    """What to do with one request, and why (the reason goes to logs and events)."""

    action: Action
    reason: str
    use_llm: bool = True
    limit_tokens: int | None = None


def hard_limit(settings: CompactionSettings, context_window: int | None) -> int:
    """The size above which a request is compacted before forwarding, whatever the mode:
    ``emergency_factor`` x the trigger or the context window, whichever is lower; with
    ``policy: cost`` and no factor set, the window alone (``settings.bound_is_window``)."""
    if context_window and settings.bound_is_window:
        return context_window
    limit = settings.emergency_tokens
    if context_window:
        limit = min(limit, context_window)
    return limit


def decide(
    forwarded_tokens: int,
    settings: CompactionSettings,
    *,
    context_window: int | None = None,
    bypass: bool = False,
    cooling_down: bool = False,
    pays: bool = True,
    shadow: bool = False,
    skip_reason: str | None = None,
    cold: bool = False,
    hold_reason: str | None = None,
    too_soon: str | None = None,
) -> Decision:
    """The one compaction decision, used by every route and by the hook. ``too_soon``: why
    the last LLM compaction is too recent for another (``timing.too_soon``), any policy.

    In shadow mode nothing is forwarded changed, so nothing is worth making the client wait
    for: what would be inline work runs in the background.
    """
    if bypass:
        return Decision("forward", skip_reason or "bypassed by x-compaction: off", use_llm=False)
    decision = _decide(
        forwarded_tokens,
        settings,
        context_window=context_window,
        cooling_down=cooling_down,
        pays=pays,
        cold=cold,
        hold_reason=hold_reason,
        too_soon=too_soon,
    )
    if shadow and decision.action == "inline":
        return Decision(
            "background",
            f"{decision.reason} (shadow mode)",
            decision.use_llm,
            decision.limit_tokens,
        )
    return decision


def _decide(
    forwarded_tokens: int,
    settings: CompactionSettings,
    *,
    context_window: int | None,
    cooling_down: bool,
    pays: bool,
    cold: bool = False,
    hold_reason: str | None = None,
    too_soon: str | None = None,
) -> Decision:
    if not settings.enabled:
        return Decision("forward", "compaction disabled", use_llm=False)
    limit = hard_limit(settings, context_window)
    # The limit comes first: a small model's context window can be below the trigger.
    if forwarded_tokens <= settings.trigger_tokens and forwarded_tokens <= limit:
        return Decision("forward", "below trigger", use_llm=False)
    if forwarded_tokens > limit:
        why = (
            "over context window"
            if context_window and limit == context_window
            else ("over emergency limit")
        )
        # Cooling down after a failure: do not call the LLMs again, but still make it fit.
        return Decision("inline", why, use_llm=not cooling_down, limit_tokens=limit)
    if cooling_down:
        return Decision("forward", "cooling down after a failed compaction", use_llm=False)
    if too_soon:
        return Decision("forward", f"{TREADMILL}{too_soon}", use_llm=False)
    if not pays:
        why = hold_reason or "compacting would not pay yet"
        return Decision("forward", f"{HOLD}{why}", use_llm=False)
    if cold:
        # The cached prefix is gone anyway: compacting this request breaks nothing, and
        # in the background the compaction would land on the next one, warm again.
        why = hold_reason or "cache cold"
        return Decision("inline", f"over trigger, {why}", limit_tokens=limit)
    if settings.mode == "inline":
        return Decision("inline", "over trigger (inline mode)", limit_tokens=limit)
    return Decision("background", "over trigger (background mode)", limit_tokens=limit)


def summary_index(messages: Sequence[Message], head_len: int) -> int | None:
    """Index of a summary written by us right after the head, if there is one."""
    if head_len < len(messages):
        content = messages[head_len].get("content")
        if isinstance(content, str) and content.startswith(SUMMARY_PREFIX):
            return head_len
    return None


def cut_points(messages: Sequence[Message], start: int = 0, rounds: bool = True) -> list[int]:
    """Legal cut indices >= ``start``: a user turn start, or (``rounds``) an assistant message
    right after a completed tool round, with no tool call left unanswered before it.

    A cut at i keeps ``messages[i:]``. It is illegal when a tool result at or after i answers a
    call issued before i, so a tool call is never separated from its results; a user message
    that carries tool results (Anthropic ``tool_result`` blocks) is never a turn start, and a
    system message is never a cut. A call that is never answered separates nothing. A cut
    between rounds lets a single-instruction agent loop of any length be compacted.
    """
    issued_at: dict[str, int] = {}
    # blocked[i] > 0 while some call issued before i is answered at or after i.
    delta = [0] * (len(messages) + 1)
    answers = [False] * len(messages)
    for j, m in enumerate(messages):
        for call_id in tool_uses(m):
            issued_at[call_id] = j
        results = tool_results(m)
        answers[j] = bool(results)
        for call_id in results:
            a = issued_at.get(call_id)
            if a is not None and a + 1 <= j:
                delta[a + 1] += 1
                delta[j + 1] -= 1
    cuts: list[int] = []
    blocked = 0
    for i, m in enumerate(messages):
        blocked += delta[i]
        if i < start or blocked or answers[i]:
            continue
        role = m.get("role")
        if role == "user" or (rounds and role == "assistant" and i > 0 and answers[i - 1]):
            cuts.append(i)
    return cuts


def verbatim_start(
    messages: Sequence[Message],
    counts: Sequence[int],
    body_start: int,
    settings: CompactionSettings,
    cuts: Sequence[int],
) -> int | None:
    """Where the verbatim window begins: a legal cut > ``body_start``, or None.

    Scans back from the end while the window budget lasts, extends the window until it holds
    at least ``min_verbatim_exchanges`` exchanges (an exchange starts at every legal cut: a user
    turn, or a tool round), then moves back to a legal cut.
    """
    budget = settings.verbatim_window_tokens
    starts = set(cuts)
    tokens = 0
    exchanges = 0
    point = len(messages)
    for i in range(len(messages) - 1, body_start - 1, -1):
        fits = tokens + counts[i] <= budget
        if not fits and exchanges >= settings.min_verbatim_exchanges:
            break
        tokens += counts[i]
        if i in starts:
            exchanges += 1
        point = i
    if exchanges < settings.min_verbatim_exchanges:
        return None
    legal = [c for c in cuts if body_start < c <= point]
    return legal[-1] if legal else None


def latest_cut_keeping(
    messages: Sequence[Message], cuts: Sequence[int], min_exchanges: int
) -> int | None:
    """The latest legal cut that still keeps ``min_exchanges`` exchanges verbatim."""
    need = max(1, min_exchanges)
    return cuts[-need] if len(cuts) >= need else None


def nearest_cut(index: int, cuts: Sequence[int], lower: int, upper: int | None) -> int | None:
    """The legal cut closest to ``index`` within (lower, upper]; ties go to the later cut."""
    candidates = [c for c in cuts if c > lower and (upper is None or c <= upper)]
    if not candidates:
        return None
    return min(candidates, key=lambda c: (abs(c - index), -c))


@dataclass(frozen=True)
class CutPlan:
    """Where a compaction of a forwarded history may cut."""

    head_len: int
    body_start: int
    verbatim_start: int
    latest_cut: int
    cuts: tuple[int, ...]


def plan_cut(
    messages: Sequence[Message],
    counts: Sequence[int],
    head_len: int,
    settings: CompactionSettings,
    body_start: int | None = None,
    last_cut: int | None = None,
) -> CutPlan | None:
    """The cut plan for ``messages`` (head, optional pins and earlier summary, body), or None.

    ``body_start``: where the body begins (after an earlier summary); by default right after
    the head, or after a summary found right after it. ``last_cut``: no cut after it (the
    client edits its own history from there on: a record reaching past it would stop
    matching its next request); the verbatim window then starts there at the latest."""
    if body_start is None:
        s_idx = summary_index(messages, head_len)
        body_start = head_len + (1 if s_idx is not None else 0)
    cuts = cut_points(messages, body_start)
    start = verbatim_start(messages, counts, body_start, settings, cuts)
    if start is None:
        return None
    latest = latest_cut_keeping(messages, cuts, settings.min_verbatim_exchanges)
    if latest is None or latest < start:
        latest = start
    if last_cut is not None and latest > last_cut:
        allowed = [c for c in cuts if body_start < c <= last_cut]
        if not allowed:
            return None
        latest = allowed[-1]
        start = min(start, latest)
    return CutPlan(head_len, body_start, start, latest, tuple(cuts))


def widen(
    plan: CutPlan,
    counts: Sequence[int],
    kept_before: Sequence[int],
    note_tokens: int,
    target_tokens: int,
) -> CutPlan | None:
    """No treadmill: ``plan`` with its verbatim start moved to the earliest legal cut whose
    result fits ``target_tokens``, or None when even the latest cut does not fit.

    A compaction that lands just under the trigger fires again a request or two later, each
    time paying the detector and summarizer and breaking the cached prefix. ``kept_before[c]``:
    tokens staying before cut c (head, pins); ``note_tokens``: the summary's.
    """
    suffix = [0] * (len(counts) + 1)
    for i in range(len(counts) - 1, -1, -1):
        suffix[i] = suffix[i + 1] + counts[i]
    for c in plan.cuts:
        if plan.verbatim_start <= c <= plan.latest_cut:
            if kept_before[c] + note_tokens + suffix[c] <= target_tokens:
                if c == plan.verbatim_start:
                    return plan
                return CutPlan(plan.head_len, plan.body_start, c, plan.latest_cut, plan.cuts)
    return None


def at_latest_cut(plan: CutPlan) -> CutPlan:
    """``plan`` keeping as little verbatim as it may: its latest legal cut."""
    return CutPlan(plan.head_len, plan.body_start, plan.latest_cut, plan.latest_cut, plan.cuts)


def target_tokens(settings: CompactionSettings) -> int:
    """What an optional compaction must leave at most (``compact_to_share`` of the trigger)."""
    return max(1, int(settings.trigger_tokens * settings.compact_to_share))


def relaxed_target(settings: CompactionSettings, forwarded_tokens: int) -> int:
    """What an optional compaction of ``forwarded_tokens`` may leave when no cut reaches
    ``target_tokens``: pins can keep more than the share (the loop breaker's rounds, a long
    system prompt), and refusing every such compaction let the history grow to the
    emergency bound each time. Still no treadmill: it must free at least the distance from
    the trigger to the share (so each LLM compaction pays for that much growth) and land
    under the trigger."""
    share = target_tokens(settings)
    trigger = settings.trigger_tokens
    return max(share, min(trigger, forwarded_tokens - (trigger - share)))


def over_limit(forwarded_tokens: int, decision: Decision) -> bool:
    """Whether the request is over its hard limit: the compaction is forced, not optional."""
    limit = decision.limit_tokens
    return limit is not None and forwarded_tokens > limit


def choose_case(
    plan: CutPlan,
    boundary: int | None,
    confidence: float,
    settings: CompactionSettings,
) -> tuple[CaseName, int]:
    """Truncate at a confident topic boundary inside the verbatim window, else summarize.

    The boundary itself is compared with the verbatim start, before it is moved to a legal
    cut, and it only ever moves back (to the latest legal cut at or before it): a message the
    detector placed in the new topic is never dropped.
    """
    if (
        boundary is not None
        and confidence >= settings.min_confidence
        and boundary >= plan.verbatim_start
    ):
        legal = [c for c in plan.cuts if plan.body_start < c <= min(boundary, plan.latest_cut)]
        if legal and legal[-1] >= plan.verbatim_start:
            return Case.TRUNCATE, legal[-1]
    return Case.SUMMARIZE, plan.verbatim_start


def emergency_cut(
    messages: Sequence[Message],
    counts: Sequence[int],
    head_len: int,
    limit_tokens: int,
    note_tokens: int,
    *,
    target_tokens: int | None = None,
    body_start: int | None = None,
    kept_tokens: Sequence[int] | None = None,
    last_cut: int | None = None,
) -> int | None:
    """Where emergency truncation cuts: the earliest legal cut whose result fits
    ``target_tokens`` (the trigger: so that it does not fire again a few requests later), else
    the earliest that fits ``limit_tokens``, else the last legal cut.

    The oldest whole rounds are dropped when no LLM path could help. ``kept_tokens[c]``: tokens
    of what stays in place before cut c (head, pins); by default the head alone. ``last_cut``:
    no cut after it (where the client edits its own history, ``Prepared.cut_limit``), and the
    last one when none fits the target: the earliest fitting the limit left the history just
    under it, and the next request was cut again.
    """
    if body_start is None:
        s_idx = summary_index(messages, head_len)
        body_start = head_len + (1 if s_idx is not None else 0)
    cuts = [
        c
        for c in cut_points(messages, body_start)
        if c > body_start and (last_cut is None or c <= last_cut)
    ]
    if not cuts:
        return None
    suffix = [0] * (len(messages) + 1)
    for i in range(len(messages) - 1, -1, -1):
        suffix[i] = suffix[i + 1] + counts[i]
    head_tokens = sum(counts[:head_len])

    def size(c: int) -> int:
        kept = kept_tokens[c] if kept_tokens is not None else head_tokens
        return kept + note_tokens + suffix[c]

    for bound in (target_tokens, None if last_cut is not None else limit_tokens):
        if bound is None:
            continue
        for c in cuts:
            if size(c) <= bound:
                return c
    return cuts[-1]


def summary_message(text: str, covered_messages: int, role: str) -> Message:
    """The summary message exactly as it is forwarded (its bytes must never change)."""
    return {
        "role": role,
        "content": f"{SUMMARY_PREFIX}{covered_messages} earlier messages]\n\n{text.strip()}",
    }
