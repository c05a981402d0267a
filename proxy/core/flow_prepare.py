"""One request, from the client's messages to what is forwarded, as a sans-I/O flow
(DESIGN §2-§4): identify, read the conversation's state, substitute its record, count,
decide; prune inline when over the trigger; compact inline (a ``CompactNow`` command) when the
request would not fit otherwise; track stability and place cache marks.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from proxy.core import candidates, planner, stability, timing
from proxy.core.behaviour import LoopBreak, observe
from proxy.core.commands import CompactNow, Compute, Flow, Read
from proxy.core.controls import Controls, sampled
from proxy.core.errors import StoreError
from proxy.core.fingerprint import conversation_id, earlier_conversation_id, fingerprint
from proxy.core.flow_compact import may_share, persist
from proxy.core.flow_watch import watch
from proxy.core.frozen import quick_init
from proxy.core.lookup import checked_record, checkpoint_keys, checkpoints_found, record_key
from proxy.core.messages import Message
from proxy.core.modelmap import context_window, provider_family
from proxy.core.prepared import Env, Outcome, Prepared
from proxy.core.records import CompactionRecord, conv_key, llm_since
from proxy.core.reprint import Reuse, counted, fingerprinted
from proxy.core.sharedcall import SharedCall
from proxy.core.stability import StabilityState
from proxy.core.view import reviewed, view

log = logging.getLogger("compaction_proxy.compactor")
T = TypeVar("T")

# Substitution and stability tracking cost a fraction of identification per message
# (~0.3 us): below this many messages a thread hop (~0.2 ms, measured) costs more than
# running them on the loop, which they then hold for under 2 ms.
SETTLE_OFFLOAD_MESSAGES = 5000


@quick_init
@dataclass(frozen=True)
class Request:
    """What a front door knows about one request besides its messages."""

    model: str
    tenant: str
    credential: str | None = None
    conversation_header: str | None = None
    summary_role: str | None = None
    llm_model: str | None = None
    controls: Controls = field(default_factory=Controls)
    # Hash, count and substitute off the event loop (a huge history: ``Compute`` commands);
    # identify on it all the same when ``reuse`` is light (the new part is small).
    offload: bool = False
    outside_cache_marks: int = 0  # the client's cache marks outside ``messages``
    summary_joins: bool = False  # the summary is forwarded inside the next user turn
    reserve_tokens: int = 0  # what the request needs besides its messages
    # When the request arrived (the driver's clock, as data): the cost policy compares it
    # with the conversation's last request and the provider's cache TTL.
    now: float | None = None
    # What the body it resends left: the shared messages' fingerprints (``reprint``).
    reuse: Reuse | None = None
    # The summarizer call that reads this conversation's cache, if the front door can make it.
    shared: SharedCall | None = None


@quick_init
@dataclass(frozen=True)
class Identity:
    fps: list[bytes]
    chain: list[bytes]
    conversation: str
    earlier: str | None
    counts: list[int]
    exact: list[bytes | None]  # each message's exact digest (``fingerprint.exact_digest``)


@quick_init
@dataclass(frozen=True)
class State:
    """What the store holds about the conversation, as the request path needs it."""

    record: CompactionRecord | None = None
    cooling: bool = False
    paused: bool = False
    refused: bool = False  # the upstream refused a compacted body of this conversation
    tracker: StabilityState | None = None
    meta: Any = None  # the ledger's view of the conversation (``policy: cost`` only)
    behave: Any = None  # the agent's behaviour after each compaction (flow_watch)
    loop: LoopBreak | None = None  # the loop breaker's decision in force
    # The newest checkpoint's last LLM compaction (``lookup.checkpoints_found``), matching
    # or not.
    last_llm: int = 0


def identify(env: Env, messages: list[Message], req: Request) -> Identity:
    """Fingerprints, prefix chain, conversation id (and the session's earlier one, see
    ``fingerprint.conversation_id``) and per-message token counts."""
    fps, chain, exact = fingerprinted(req.tenant, messages, req.reuse)
    conversation = conversation_id(chain, messages, req.conversation_header)
    earlier = earlier_conversation_id(chain, messages, req.conversation_header)
    counts = counted(env.counter, messages, req.model, fps, req.reuse)
    return Identity(fps, chain, conversation, earlier, counts, exact)


def read_state(env: Env, req: Request, ident: Identity) -> Flow[State]:
    """The record, cooldown, pause, stability tracker (the session's earlier one when this id
    has none yet) and, for the cost policy, the ledger's view: two reads at most, the second
    only for what the first found missing or pointed to."""
    t, conv, earlier = req.tenant, ident.conversation, ident.earlier
    cool, pause, stab = (conv_key(kind, t, conv) for kind in ("cool", "pause", "stab"))
    refused = conv_key("refused", t, conv)
    behave, loop = conv_key("behave", t, conv), conv_key("loop", t, conv)
    meta = (conv_key("conv", t, conv),) if env.settings.policy == "cost" else ()
    keys = (cool, pause, stab, refused, behave, loop, *meta)
    got = yield Read(values=keys, lists=checkpoint_keys(t, conv, earlier))
    tracker = _tracker(got.get(stab))
    best, last_llm = checkpoints_found(got, t, conv, earlier, ident.chain)
    rec = record_key(t, best[1], best[0]) if best is not None else None
    known = env.records.get(rec, best[0], req.now) if best is not None and rec else None
    earlier_stab = conv_key("stab", t, earlier) if tracker is None and earlier else None
    more = tuple(k for k in (None if known else rec, earlier_stab) if k is not None)
    found = (yield Read(values=more)) if more else {}
    if earlier_stab is not None:
        tracker = _tracker(found.get(earlier_stab))
    record = known
    if record is None and best is not None and rec:
        record = checked_record(found.get(rec), best[0])
        if record is not None:
            env.records.put(rec, record)
    return State(
        record,
        cooling=got.get(cool) is not None,
        paused=got.get(pause) is not None,
        refused=got.get(refused) is not None,
        tracker=tracker,
        meta=got.get(meta[0]) if meta else None,
        behave=got.get(behave),
        loop=LoopBreak.from_json(got.get(loop)),
        last_llm=last_llm,
    )


def _tracker(raw: Any) -> StabilityState | None:
    # The driver answers with the tracker it holds itself when its write is still queued.
    return raw if isinstance(raw, StabilityState) else StabilityState.from_json(raw)


def prepare(env: Env, messages: list[Message], req: Request) -> Flow[Prepared]:
    """Identify, substitute, count and decide; compact inline when the decision says so."""
    s = env.settings
    controls = req.controls
    bypass = controls.skip is not None
    if req.offload and not (req.reuse is not None and req.reuse.light):
        ident = yield Compute(identify, (env, messages, req))
    else:
        ident = identify(env, messages, req)
    state = State()
    if not bypass and s.enabled:
        try:
            state = yield from read_state(env, req, ident)
        except StoreError as exc:
            log.warning("store lookup failed; forwarding unchanged", extra={"error": str(exc)})
    if state.refused:
        state = dataclasses.replace(state, record=None)  # never forwarded again

    def substituted() -> Prepared:
        return view(
            env, messages, ident.counts, ident.chain, model=req.model, tenant=req.tenant,
            credential=req.credential, conversation=ident.conversation, record=state.record,
            summary_joins=req.summary_joins,
        )  # fmt: skip

    # Substitution walks the whole history too: off the loop for a huge one.
    settle_off = req.offload and len(messages) >= SETTLE_OFFLOAD_MESSAGES
    p = (yield Compute(substituted, ())) if settle_off else substituted()
    p = p.but(
        summary_role=req.summary_role or s.summary_role,
        llm_model=req.llm_model or req.model,
        shadow=controls.shadow,
        reserve_tokens=req.reserve_tokens,
        earlier_conversation=ident.earlier,
        outside_cache_marks=req.outside_cache_marks,
        shared=req.shared,
        llm_since=llm_since(state.record, state.last_llm, len(messages)),
        edit_limit=state.tracker.edit_limit() if state.tracker else None,
        original_exact=ident.exact,
    )
    if state.paused and not bypass:
        controls = Controls("compaction paused for this conversation", "opt-out")
        bypass = True
    elif state.refused and not bypass:
        # A defect of ours costs one retry, never the session: its records are not used
        # again and no new one is made (the operator sees why on the conversation page).
        controls = Controls("the upstream refused a compacted request", "opt-out")
        bypass = True
    window = context_window(req.model)
    if window:
        # Room the request needs besides its messages (at most half the window, so that a
        # client asking for the whole window as max_tokens still gets its messages through).
        window = max(1, window - min(req.reserve_tokens, window // 2))

    def decide(p: Prepared) -> Prepared:
        t = judge(env, p, state.meta, req.now)
        soon = timing.too_soon(s, p.original, p.original_counts, p.llm_since)
        decision = planner.decide(
            p.forwarded_tokens, s, context_window=window, bypass=bypass,
            cooling_down=state.cooling, pays=t.pays, cold=t.cold, hold_reason=t.reason,
            shadow=controls.shadow, skip_reason=controls.skip, too_soon=soon,
        )  # fmt: skip
        if t.cold and p.shared is not None and s.summary_reads_cache == "auto":
            # Nothing of it is cached: the standalone call reads less.
            return p.but(decision=decision, shared=None)
        return p.but(decision=decision)

    p = decide(p)
    if controls.shadow and not sampled(ident.conversation, s.shadow_sample_rate):
        unsampled = planner.Decision("forward", "shadow mode: conversation not sampled", False)
        p = p.but(decision=unsampled)
    if bypass:
        return p.but(case=controls.case, skipped=True)
    if controls.shadow:
        return p  # measured only: no inline work, no cache marks
    if s.enabled and p.record is not None:
        # One pass over what the history added since the last request (the whole of it
        # the first time), like substitution: off the loop for a huge one.
        observing = functools.partial(
            observe, p.original, p.record, resume=(ident.conversation, ident.chain)
        )
        seen = (yield Compute(observing, ())) if settle_off else observing()
        loop = yield from watch(env, p, seen, state.behave, state.loop)
        if loop is not None and loop.holds(seen.counts_before[0] + seen.counts_after[0]):
            p = p.but(keep_results=frozenset(loop.keep))
    if s.enabled and s.prune and p.forwarded_tokens > s.trigger_tokens:
        # The cheapest tier first, inline: no LLM call, so no reason to wait for it.
        d = p.decision
        llm_next = d.action in ("background", "inline") and d.use_llm
        pruned = yield from _work(req, _pruned, env, p, s.prune_clear_at_least, llm_next)
        if pruned.record is not None and d.reason.startswith((planner.HOLD, planner.TREADMILL)):
            # The summary tier would not pay now; a pruning (no LLM call) may on its own.
            after = pruned.record.tokens_after
            if not judge(env, p, state.meta, req.now, after=after, llm=False).pays:
                pruned = Outcome(pruned.case, None, "pruning would not pay yet")
        if pruned.record is not None:
            yield from persist(p, pruned)
            p = decide((yield from _work(req, reviewed, env, p, pruned.record)))
    if p.decision.action == "inline":
        outcome = yield CompactNow(p)
        if outcome.record is not None:
            p = yield from _work(req, reviewed, env, p, outcome.record)
    limit = p.decision.limit_tokens
    if window and limit is not None and p.forwarded_tokens > window:
        p = p.but(too_long=True)
    if s.enabled:
        if settle_off:
            p = yield Compute(stabilise, (env, p, state.tracker, ident.fps))
        else:
            p = stabilise(env, p, state.tracker, ident.fps)
    return p


def _work(req: Request, fn: Callable[..., T], *args: Any) -> Flow[T]:
    """``fn(*args)``: a ``Compute`` command (off the loop) for a big request, else here."""
    if req.offload:
        return (yield Compute(fn, args))  # type: ignore[no-any-return]
    return fn(*args)


def _pruned(env: Env, p: Prepared, at_least: int, llm_next: bool) -> Outcome:
    """The pruning tier's verdict (its loss report reads the whole pruned span)."""
    pruning = candidates.pruning(env, p, at_least=at_least)
    # Pruning short of room defers to the summary tier only when that tier can go: else
    # (no cut meets its no-treadmill target) both declined, and the history grew to the
    # emergency bound.
    llm_next = llm_next and pruning.record is not None and candidates.llm_can_go(env, p)
    return candidates.verdict(env, p, pruning, llm_next=llm_next)


def judge(
    env: Env,
    p: Prepared,
    meta: Any,
    now: float | None,
    *,
    after: int | None = None,
    llm: bool = True,
) -> timing.Timing:
    """``policy: cost``: whether compacting ``p`` now pays, given the conversation's ledger
    row (``meta``) and the time (``timing.judge``)."""
    s = env.settings
    # (What the cost policy never reads, a request under the trigger does not scan for.)
    judged = llm and s.policy == "cost" and p.forwarded_tokens > s.trigger_tokens
    head = sum(p.forwarded_counts[: p.head_len])
    last = p.cut_limit() if judged and after is None else None
    if last is not None:
        # The client edits its history from there on: the summary ends there, what follows
        # stays (the head and the summary besides), whatever the verbatim window would take.
        kept = head + s.summary_budget_tokens + sum(p.forwarded_counts[max(last, p.head_len) :])
        after = max(kept, timing.expected_after(s, head, p.forwarded_tokens))
        after = min(after, p.forwarded_tokens)
    return timing.judge(
        s, p.model, forwarded_tokens=p.forwarded_tokens,
        head_tokens=head, meta=meta, now=now,
        after=after, llm=llm, llm_model=s.summary_model, shared=judged and may_share(p),
    )  # fmt: skip


def stabilise(
    env: Env, p: Prepared, previous: StabilityState | None, original_fps: list[bytes]
) -> Prepared:
    """Track what stayed in place; on Anthropic-family models place cache breakpoints."""
    head_len = p.head_len
    _, summary_at = p.body_start()
    if p.record is None:
        fps = original_fps  # nothing substituted: the same messages
    else:
        fps = [
            original_fps[o] if o is not None else fingerprint(m)
            for o, m in zip(p.origins, p.forwarded, strict=True)
        ]
    items = stability.prompt_items(fps, head_len, summary_at)
    record_hash = p.record.prefix_hash if p.record else None
    state = stability.observe(
        previous, items, record_hash, p.origins if p.record is not None else None
    )
    p = p.but(stability=state)
    if provider_family(p.model) != "anthropic" or stability.has_cache_marks(p.original):
        return p  # (the client manages its own cache breakpoints: never touch them)
    budget = stability.MAX_BREAKPOINTS - p.outside_cache_marks
    if budget <= 0:
        return p
    levels = stability.tiers(state, env.tiers)
    # Not on a system message inside the conversation (Claude Code's): left as sent.
    can_mark = [
        stability.markable(m) and (i < head_len or m.get("role") != "system")
        for i, m in enumerate(p.forwarded)
    ]
    marks = stability.breakpoints(levels, head_len, summary_at, can_mark, limit=budget)
    if not marks:
        return p
    return p.but(forwarded=stability.with_marks(p.forwarded, marks), marked=True)
