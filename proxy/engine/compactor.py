"""The compaction engine: identify, substitute, count, decide, compact (DESIGN §2-§5).

This is the shared core that both front doors (the Starlette server and the LiteLLM hook)
call. The pure parts live in ``fingerprint``, ``planner``, ``records``, ``detector`` and
``summarizer``; this module owns the I/O they need (store and LLM calls), the per-conversation
lock, the failure cooldown and background scheduling. Nothing here ever raises into the
request path: every failure leaves the request as the client sent it (or, when it would not
fit, emergency-truncated).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.adapters.llm import LLM, LLMReply
from proxy.adapters.store import Store, get_list
from proxy.adapters.writer import BatchWriter
from proxy.core import (
    costs,
    detector,
    keyfacts,
    layout,
    lossreport,
    pins,
    planner,
    prune,
    stability,
    summarizer,
)
from proxy.core.controls import Controls, sampled
from proxy.core.errors import CompactionFailed, StoreError
from proxy.core.fingerprint import (
    conversation_id,
    earlier_conversation_id,
    fingerprint,
    fingerprints,
    prefix_chain,
)
from proxy.core.messages import Message, head_length
from proxy.core.modelmap import context_window, provider_family
from proxy.core.records import (
    MAX_CHECKPOINTS,
    Checkpoint,
    CompactionRecord,
    body_start,
    conv_key,
    find_checkpoint,
    origins,
    parse_checkpoints,
    substitute,
)
from proxy.core.settings import CompactionSettings
from proxy.core.stability import StabilityState, TierThresholds
from proxy.core.tokens import TOKENS_PER_MESSAGE, TokenCounter
from proxy.operators import ledger

log = logging.getLogger("compaction_proxy.compactor")
# Histories this long (or requests the server finds big, ``prepare(offload=True)``) are
# fingerprinted and counted in a worker thread: counting text seen for the first time costs
# milliseconds per hundred kilobytes, which must not stall every other request on the loop.
# Below it the thread hop would cost more than it saves.
OFFLOAD_MESSAGES = 1000

EMERGENCY_NOTE = (
    "Earlier messages of this conversation were omitted so that it fits the model's context."
)


@dataclass(frozen=True)
class Prompts:
    detector: str
    summarizer: str


@dataclass
class Prepared:
    """One request after identification and substitution: what would be forwarded, and why."""

    tenant: str
    conversation: str
    model: str
    credential: str | None
    original: list[Message]
    original_counts: list[int]
    chain: list[bytes]  # prefix hashes of ``original``: chain[k] names its first k messages
    forwarded: list[Message]
    forwarded_counts: list[int]
    original_tokens: int
    forwarded_tokens: int
    record: CompactionRecord | None
    decision: planner.Decision
    case: str = "none"
    compacted_now: bool = False
    events: list[dict[str, Any]] = field(default_factory=list)
    stability: StabilityState | None = None
    marked: bool = False
    summary_role: str = "system"
    # The name the detector and summarizer are called with (a LiteLLM model group, say),
    # when ``model`` is the underlying model used for token counts and prices.
    llm_model: str = ""
    # Shadow mode: ``forwarded`` is what would have been forwarded; the client's request
    # goes upstream exactly as sent.
    shadow: bool = False
    skipped: bool = False  # bypassed or opted out: never compacted, forwarded as sent

    @property
    def as_sent(self) -> bool:
        """Whether the upstream must receive the client's request byte for byte."""
        return self.shadow or self.skipped

    # The id this session had before its first reply (see fingerprint.conversation_id).
    earlier_conversation: str | None = None
    outside_cache_marks: int = 0  # the client's cache marks outside the messages
    summary_joins: bool = False  # the summary is forwarded inside the next user turn
    # forwarded[i] forwards original[origins[i]], or stored bytes when None.
    origins: list[int | None] = field(default_factory=list)
    # Tokens the request spends besides its messages (tools, max_tokens), for the window guard.
    reserve_tokens: int = 0
    # Over the model's context window and nothing left that could be dropped.
    too_long: bool = False

    @property
    def changed(self) -> bool:
        """Whether the forwarded messages differ from what the client sent."""
        return not self.shadow and (self.record is not None or self.marked)


@dataclass(frozen=True)
class Outcome:
    """The result of one compaction attempt (a new record, or why there is none)."""

    case: str
    record: CompactionRecord | None
    reason: str
    failed: bool = False


class Compactor:
    """The core engine. Owns no sockets itself: the store and LLM client are handed in."""

    def __init__(
        self,
        settings: CompactionSettings,
        store: Store,
        llm: LLM,
        prompts: Prompts,
        *,
        counter: TokenCounter | None = None,
        retention_s: float | None = 30 * 86400,
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """``on_event`` is called with every compaction event (metrics); it must not raise."""
        self.settings = settings
        self.store = store
        self.llm = llm
        self.prompts = prompts
        self.counter = counter or TokenCounter()
        self.retention_s = retention_s
        self.on_event = on_event
        self.tiers = TierThresholds(
            settings.tier_l1_requests, settings.tier_l2_requests, settings.tier_l3_requests
        )
        self._inflight: dict[str, asyncio.Future[Outcome]] = {}
        # Locks this process took but could not release (the store was down): released as
        # soon as the store answers again, so a restarted Redis that kept them (AOF) does not
        # hold those conversations until the locks' TTL.
        self._orphan_locks: dict[str, float] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._recent_stability: dict[tuple[str, str], StabilityState] = {}
        # Ledger entries and the stability tracker are written in batches, off the hot path.
        self.writer = BatchWriter(store, retention_s)

    # ---- store access (sync store, run off the event loop) -------------------------------

    async def _io(self, fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    async def _read(self, fn: Any, *args: Any) -> Any:
        """A hot-path read: inline for a local store, from a thread for a networked one."""
        if getattr(self.store, "reads_block", True):
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    def _lookup_sync(
        self,
        tenant: str,
        conversation: str,
        chain: Sequence[bytes],
        earlier: str | None = None,
    ) -> tuple[CompactionRecord | None, bool]:
        """The record for the longest stored prefix of ``chain``, and whether the
        conversation cools down. Records made under the session's ``earlier`` id (its first
        request, before any reply) count too: they name exact prefixes, so they apply."""
        cooling = self.store.get(conv_key("cool", tenant, conversation)) is not None
        best: tuple[Checkpoint, str] | None = None
        for conv in (conversation, earlier):
            if conv is None:
                continue
            cps = parse_checkpoints(get_list(self.store, conv_key("ck", tenant, conv)))
            cp = find_checkpoint(cps, chain)
            if cp is not None and (best is None or cp.k > best[0].k):
                best = (cp, conv)
        if best is None:
            return None, cooling
        cp, conv = best
        raw = self.store.get(conv_key("rec", tenant, conv) + ":" + cp.prefix_hash)
        record = CompactionRecord.from_json(raw)
        if record is None or record.k != cp.k or record.prefix_hash != cp.prefix_hash:
            return None, cooling
        return record, cooling

    def _prepare_sync(
        self, tenant: str, conversation: str, chain: Sequence[bytes], earlier: str | None = None
    ) -> tuple[CompactionRecord | None, bool, bool, StabilityState | None, Any]:
        """Everything ``prepare`` reads from the store, in one hop off the event loop."""
        record, cooling = self._lookup_sync(tenant, conversation, chain, earlier)
        paused = self.store.get(conv_key("pause", tenant, conversation)) is not None
        return (record, cooling, paused, *self._history_sync(tenant, conversation, earlier))

    def _history_sync(
        self, tenant: str, conversation: str, earlier: str | None = None
    ) -> tuple[StabilityState | None, Any]:
        """The stability tracker (unless this worker holds the newest; else the one of the
        session's first request) and, for the cost policy only, the ledger's view of this
        conversation."""
        state = None
        for conv in (conversation, earlier):
            if conv is None or state is not None:
                continue
            state = self._recent_stability.get((tenant, conv))
            if state is None:
                raw = self.store.get(conv_key("stab", tenant, conv))
                state = StabilityState.from_json(raw)
        meta = None
        if self.settings.policy == "cost":
            meta = self.store.get(conv_key("conv", tenant, conversation))
        return state, meta

    # ---- the request path ----------------------------------------------------------------

    async def prepare(
        self,
        messages: list[Message],
        *,
        model: str,
        tenant: str,
        credential: str | None = None,
        conversation_header: str | None = None,
        bypass: bool = False,
        summary_role: str | None = None,
        llm_model: str | None = None,
        controls: Controls | None = None,
        offload: bool = False,
        outside_cache_marks: int = 0,
        summary_joins: bool = False,
        reserve_tokens: int = 0,
    ) -> Prepared:
        """Identify, substitute, count and decide; compact inline when the decision says so.

        ``reserve_tokens``: what the request needs besides its messages (tool schemas, the
        requested completion): the context-window guard counts them.

        ``controls`` (see ``proxy.controls``) says whether the request may be compacted, only
        measured (shadow) or must pass as sent; ``bypass`` is the short form of the latter.
        ``outside_cache_marks``: cache breakpoints the client placed outside ``messages``
        (Anthropic tool definitions); the proxy's own marks stay within the provider's limit
        together with them. ``summary_joins``: the surface forwards the summary as the first
        block of the next user turn (Anthropic), so it is counted without message framing.
        """
        if controls is None:
            controls = Controls("bypassed by x-compaction: off", "off") if bypass else Controls()
        bypass = controls.skip is not None
        offload = offload or len(messages) >= OFFLOAD_MESSAGES
        if offload:
            # Hashing and counting a huge history takes seconds: off the event loop, so
            # every other request (and /healthz) keeps being answered meanwhile.
            fps, chain, conversation, earlier, counts = await asyncio.to_thread(
                self._identify, messages, model, tenant, conversation_header
            )
        else:
            fps, chain, conversation, earlier, counts = self._identify(
                messages, model, tenant, conversation_header
            )
        original_tokens = sum(counts) + 3
        record, cooling, paused = None, False, False
        tracker: StabilityState | None = None
        meta: Any = None
        if not bypass and self.settings.enabled:
            try:
                record, cooling, paused, tracker, meta = await self._read(
                    self._prepare_sync, tenant, conversation, chain, earlier
                )
            except StoreError as exc:
                log.warning("store lookup failed; forwarding unchanged", extra={"error": str(exc)})
        view_args = (
            messages,
            counts,
            chain,
            model,
            tenant,
            credential,
            conversation,
            record,
            original_tokens,
            summary_joins,
        )
        # Substitution walks the whole history too: off the loop for a huge one.
        prepared = (
            await asyncio.to_thread(self._view, *view_args) if offload else self._view(*view_args)
        )
        prepared.summary_role = summary_role or self.settings.summary_role
        prepared.llm_model = llm_model or model
        prepared.shadow = controls.shadow
        prepared.reserve_tokens = reserve_tokens
        if paused and not bypass:
            controls = Controls("compaction paused for this conversation", "opt-out")
            bypass = True
        prepared.earlier_conversation = earlier
        prepared.outside_cache_marks = outside_cache_marks
        window = context_window(model)
        if window:
            # Room the request needs besides its messages (at most half the window, so that a
            # client asking for the whole window as max_tokens still gets its messages through).
            window = max(1, window - min(reserve_tokens, window // 2))

        def decide() -> planner.Decision:
            return planner.decide(
                prepared.forwarded_tokens,
                self.settings,
                context_window=window,
                bypass=bypass,
                cooling_down=cooling,
                pays=self._pays(prepared, meta),
                shadow=controls.shadow,
                skip_reason=controls.skip,
            )

        prepared.decision = decide()
        if controls.shadow and not sampled(conversation, self.settings.shadow_sample_rate):
            prepared.decision = planner.Decision(
                "forward", "shadow mode: conversation not sampled", use_llm=False
            )
        if bypass:
            prepared.case = controls.case
            prepared.skipped = True
            return prepared
        if controls.shadow:
            return prepared  # measured only: no inline work, no cache marks
        over = prepared.forwarded_tokens > self.settings.trigger_tokens
        if self.settings.enabled and self.settings.prune and over:
            # The cheapest tier first, inline: no LLM call, so no reason to wait for it.
            d = prepared.decision
            llm_next = d.action in ("background", "inline") and d.use_llm
            pruned = await self._prune(prepared, llm_next=llm_next)
            if pruned is not None:
                prepared = pruned
                prepared.decision = decide()
        if prepared.decision.action == "inline":
            prepared = await self._inline(prepared)
        limit = prepared.decision.limit_tokens
        if window and limit is not None and prepared.forwarded_tokens > window:
            prepared.too_long = True
        if self.settings.enabled and offload:
            await asyncio.to_thread(self._stabilise, prepared, tracker, fps)
        elif self.settings.enabled:
            self._stabilise(prepared, tracker, fps)
        return prepared

    def _identify(
        self, messages: list[Message], model: str, tenant: str, conversation_header: str | None
    ) -> tuple[list[bytes], list[bytes], str, str | None, list[int]]:
        """Fingerprints, prefix chain, conversation id (and the session's earlier one, see
        ``fingerprint.conversation_id``) and per-message token counts."""
        fps = fingerprints(messages)
        chain = prefix_chain(tenant, fps)
        conversation = conversation_id(chain, messages, conversation_header)
        earlier = earlier_conversation_id(chain, messages, conversation_header)
        counts = self.counter.count_messages(messages, model, fps)
        return fps, chain, conversation, earlier, counts

    def _pays(self, prepared: Prepared, meta: Any) -> bool:
        """``policy: cost``: whether compacting now is expected to save money overall."""
        if (
            self.settings.policy != "cost"
            or prepared.forwarded_tokens <= self.settings.trigger_tokens
        ):
            return True
        requests = meta.get("requests", 0) if isinstance(meta, dict) else 0
        prompt = meta.get("prompt_tokens", 0) if isinstance(meta, dict) else 0
        cached = meta.get("cached_tokens", 0) if isinstance(meta, dict) else 0
        s = self.settings
        expected_after = min(
            prepared.forwarded_tokens,
            sum(prepared.forwarded_counts[: _head_len(prepared)])
            + s.verbatim_window_tokens
            + s.summary_budget_tokens,
        )
        net = costs.expected_net_saving(
            costs.prices_for(prepared.model),
            forwarded_tokens=prepared.forwarded_tokens,
            expected_after=expected_after,
            cached_share=cached / prompt if prompt else 0.0,
            horizon=max(1, min(int(requests), s.cost_horizon_requests)),
            anthropic=provider_family(prepared.model) == "anthropic",
            summary_tokens=s.summary_budget_tokens,
        )
        return net > 0

    def _stabilise(
        self, prepared: Prepared, previous: StabilityState | None, original_fps: list[bytes]
    ) -> None:
        """Track what stayed in place; on Anthropic-family models place cache breakpoints."""
        head_len = _head_len(prepared)
        summary_at = layout.summary_position(_layout_view(prepared))
        if prepared.record is None:
            fps = original_fps  # nothing substituted: the same messages
        else:
            fps = [
                original_fps[o] if o is not None else fingerprint(m)
                for o, m in zip(prepared.origins, prepared.forwarded, strict=True)
            ]
        items = stability.prompt_items(fps, head_len, summary_at)
        record_hash = prepared.record.prefix_hash if prepared.record else None
        prepared.stability = stability.observe(previous, items, record_hash)
        if provider_family(prepared.model) != "anthropic":
            return
        if stability.has_cache_marks(prepared.original):
            return  # the client manages its own cache breakpoints: never touch them
        budget = stability.MAX_BREAKPOINTS - prepared.outside_cache_marks
        if budget <= 0:
            return
        levels = stability.tiers(prepared.stability, self.tiers)
        # Not on a system message inside the conversation (Claude Code's): left as sent.
        can_mark = [
            stability.markable(m) and (i < head_len or m.get("role") != "system")
            for i, m in enumerate(prepared.forwarded)
        ]
        marks = stability.breakpoints(levels, head_len, summary_at, can_mark, limit=budget)
        if marks:
            prepared.forwarded = stability.with_marks(prepared.forwarded, marks)
            prepared.marked = True

    def _view(
        self,
        messages: list[Message],
        counts: list[int],
        chain: list[bytes],
        model: str,
        tenant: str,
        credential: str | None,
        conversation: str,
        record: CompactionRecord | None,
        original_tokens: int,
        summary_joins: bool = False,
    ) -> Prepared:
        where = origins(record, len(messages))
        if record is None:
            forwarded, fwd_counts = list(messages), list(counts)
        else:
            forwarded = substitute(messages, record)
            fwd_counts = [
                counts[o] if o is not None else self.counter.count_message(m, model, fingerprint(m))
                for o, m in zip(where, forwarded, strict=True)
            ]
            if summary_joins:
                fwd_counts = self._joined_counts(forwarded, fwd_counts, model)
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
            original_tokens=original_tokens,
            forwarded_tokens=sum(fwd_counts) + 3,
            record=record,
            decision=planner.Decision("forward", "not decided"),
            case=record.case if record else "none",
            summary_joins=summary_joins,
            origins=where,
        )

    def _summary_tokens(self, summary: Message, model: str, joins: bool) -> int:
        """What the summary costs as forwarded: a message of its own, or (``joins``) one
        text block of the next user turn, without the framing and role of a message."""
        n = self.counter.count_message(summary, model, fingerprint(summary))
        if joins:
            role = str(summary.get("role", ""))
            n -= TOKENS_PER_MESSAGE + self.counter.count_text(role, model)
        return max(n, 0)

    def _joined_counts(self, forwarded: list[Message], counts: list[int], model: str) -> list[int]:
        """Counts when the summary joins the pins before it and the next user turn into one
        user turn (``layout.joined_run``): one message's framing for all of them."""
        run = layout.joined_run(forwarded)
        if run is None:
            return counts
        out = list(counts)
        for i in run[:-1]:
            role = str(forwarded[i].get("role", ""))
            out[i] = max(0, out[i] - TOKENS_PER_MESSAGE - self.counter.count_text(role, model))
        return out

    async def _inline(self, prepared: Prepared) -> Prepared:
        outcome = await self.compact(prepared, inline=True)
        if outcome.record is None:
            return prepared
        return self._reviewed(prepared, outcome.record)

    def _reviewed(self, prepared: Prepared, record: CompactionRecord) -> Prepared:
        """``prepared`` as forwarded under a new record."""
        updated = self._view(
            prepared.original,
            prepared.original_counts,
            prepared.chain,
            prepared.model,
            prepared.tenant,
            prepared.credential,
            prepared.conversation,
            record,
            prepared.original_tokens,
            prepared.summary_joins,
        )
        updated.decision = prepared.decision
        updated.summary_role = prepared.summary_role
        updated.llm_model = prepared.llm_model
        updated.earlier_conversation = prepared.earlier_conversation
        updated.outside_cache_marks = prepared.outside_cache_marks
        updated.reserve_tokens = prepared.reserve_tokens
        updated.compacted_now = True
        return updated

    async def _prune(self, prepared: Prepared, *, llm_next: bool) -> Prepared | None:
        """The pruning tier, inline: a record when clearing old tool results pays.

        Every pruning breaks the cached prefix, so it must also leave room to grow: when the
        pruned history would still be within ``prune_clear_at_least`` of the trigger (the next
        pruning a round or two away) and the summarizer can run (``llm_next``), the summary
        tier goes instead: one deeper cache break rather than a series of shallow ones."""
        s = self.settings
        outcome = self._pruning(prepared, at_least=s.prune_clear_at_least)
        if outcome.record is None:
            return None
        if llm_next and outcome.record.tokens_after > s.trigger_tokens - s.prune_clear_at_least:
            return None
        outcome = await self._store(prepared, outcome)
        assert outcome.record is not None
        return self._reviewed(prepared, outcome.record)

    def _pruning(self, prepared: Prepared, *, at_least: int) -> Outcome:
        started = time.monotonic()
        model = prepared.model
        found = prune.plan(
            prepared.forwarded,
            self.settings,
            lambda text: self.counter.count_text(text, model),
        )
        if not found.replacements or found.freed_tokens < max(1, at_least):
            return Outcome("none", None, "pruning would not free enough")
        new = layout.pruned(_layout_view(prepared), found.replacements)
        record = self._record(
            prepared,
            new,
            "prune",
            summary=None,
            reason=f"cleared {len(found.cleared)} old tool results",
            started=started,
            loss=lossreport.report(
                found.cleared_text,
                None,
                lossreport.facts_text(
                    [found.replacements.get(i, m) for i, m in enumerate(prepared.forwarded)]
                ),
            ),
        )
        if record is None:
            return Outcome("none", None, "pruning would not reduce tokens")
        record = _with(record, pruned=found.cleared)
        return Outcome("prune", record, record.boundary_reason)

    def _record(
        self,
        prepared: Prepared,
        new: layout.Layout,
        case: str,
        *,
        summary: Message | None,
        reason: str,
        started: float,
        confidence: float = 0.0,
        loss: lossreport.LossReport | None = None,
        llm_tokens: int = 0,
        llm_usd: float = 0.0,
        found: pins.Pins | None = None,
    ) -> CompactionRecord | None:
        """A record for a new layout, or None when it would not reduce tokens."""
        counts = prepared.forwarded_counts
        tokens_after = sum(counts[i] for i in new.kept) + 3
        tokens_after += sum(self.counter.count_message(m, prepared.model) for m in new.added)
        if tokens_after >= prepared.forwarded_tokens:
            return None
        head_len = _head_len(prepared)
        return CompactionRecord(
            k=new.k,
            prefix_hash=prepared.chain[new.k].hex(),
            head_len=head_len,
            summary=summary,
            case=case,
            covered=new.k - head_len,
            created_at=time.time(),
            tokens_before=prepared.forwarded_tokens,
            tokens_after=tokens_after,
            boundary_reason=reason,
            confidence=confidence,
            facts_kept=list(loss.kept) if loss else [],
            facts_dropped=list(loss.dropped) if loss else [],
            facts_appended=list(loss.appended) if loss else [],
            facts_elsewhere=list(loss.elsewhere) if loss else [],
            duration_s=round(time.monotonic() - started, 4),
            model=prepared.model,
            llm_tokens=llm_tokens,
            llm_usd=llm_usd,
            prefix=new.entries,
            pinned=_pin_lines(prepared, found.reasons if found else {}),
            unpinned=_pin_lines(None, found.oversized if found else {}, prepared.origins),
        )

    def schedule(self, prepared: Prepared) -> None:
        """After a successful response: persist the stability tracker and run a background
        compaction if the decision asked for one. Never blocks the caller."""
        loop = asyncio.get_running_loop()
        if prepared.stability is not None:
            # The client's next request can arrive before the store write lands; this
            # worker remembers the newest tracker itself (other workers read the store).
            recent = self._recent_stability
            recent[(prepared.tenant, prepared.conversation)] = prepared.stability
            if len(recent) > 4096:
                recent.pop(next(iter(recent)))
            self._save_stability(prepared)
        if prepared.decision.action == "background":
            self._spawn(loop.create_task(self.compact(prepared, inline=False)))

    def _spawn(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def spawn_io(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run a store write off the request path (drained at shutdown); a store error is
        logged, never raised into a request."""

        async def run() -> None:
            try:
                await asyncio.to_thread(fn, *args)
            except StoreError as exc:
                log.warning("background store write failed", extra={"error": str(exc)})

        self._spawn(asyncio.get_running_loop().create_task(run()))

    def _save_stability(self, prepared: Prepared) -> None:
        assert prepared.stability is not None
        key = conv_key("stab", prepared.tenant, prepared.conversation)
        # Written in the next batch; a lost write only restarts the tracker at N = 0. The
        # state is frozen: it is turned into JSON in the writer's thread (100,000 items take
        # a fifth of a second, which the event loop must not wait for).
        self.writer.put(key, prepared.stability.to_json, self.retention_s)

    async def drain(self, timeout: float | None = None) -> None:
        """Wait for scheduled background compactions and queued writes (shutdown and tests)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        await self.writer.close()

    # ---- compaction ----------------------------------------------------------------------

    async def compact(self, prepared: Prepared, *, inline: bool) -> Outcome:
        """One compaction of ``prepared.forwarded``; at most one per conversation at a time.

        A caller that finds one already running waits for it and reuses its result.
        """
        key = conv_key("lock", prepared.tenant, prepared.conversation)
        running = self._inflight.get(key)
        if running is not None:
            if not inline:
                return Outcome("none", None, "already running")
            await asyncio.shield(running)
            return await self._reuse(prepared)
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        # Resolved in ``finally``: if this task is cancelled (client gone, caller timeout),
        # requests waiting on ``future`` must still wake up rather than hang forever.
        outcome = Outcome("none", None, "compaction cancelled", failed=True)
        try:
            outcome = await self._compact_locked(prepared, key, inline)
        except Exception as exc:  # the last line of failing open
            log.exception("compaction crashed; request goes through unchanged")
            outcome = Outcome("none", None, f"internal error: {type(exc).__name__}", failed=True)
        finally:
            self._inflight.pop(key, None)
            future.set_result(outcome)
        return outcome

    async def _release_orphans(self) -> None:
        for orphan, stamp in list(self._orphan_locks.items()):
            # StoreError: still down, keep it. Only our own lock: once expired, another
            # worker may hold that conversation's lock by now.
            if await self._io(self.store.get, orphan) == stamp:
                await self._io(self.store.delete, orphan)
            self._orphan_locks.pop(orphan, None)

    async def _compact_locked(self, prepared: Prepared, key: str, inline: bool) -> Outcome:
        ttl = self.settings.llm_timeout_s * 2 + 30
        try:
            await self._release_orphans()
            stamp = time.time()
            acquired = await self._io(self.store.add, key, stamp, ttl)
        except StoreError as exc:
            log.warning("store unavailable for the compaction lock", extra={"error": str(exc)})
            return Outcome("none", None, "store unavailable", failed=True)
        if not acquired:
            if not inline:
                return Outcome("none", None, "locked by another worker")
            # Another worker or replica is compacting this conversation: wait, then reuse.
            deadline = time.monotonic() + ttl
            while time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                if await self._io(self.store.get, key) is None:
                    break
            return await self._reuse(prepared)
        try:
            # Another worker may have stored a compaction between our lookup and the lock.
            latest, _ = await self._io(
                self._lookup_sync,
                prepared.tenant,
                prepared.conversation,
                prepared.chain,
                prepared.earlier_conversation,
            )
            if latest is not None and latest != prepared.record:
                return Outcome(latest.case, latest, "reused a compaction stored meanwhile")
            return await self._compact(prepared, inline)
        finally:
            try:
                await self._io(self.store.delete, key)
            except StoreError:
                self._orphan_locks[key] = stamp  # released once the store answers again

    async def _reuse(self, prepared: Prepared) -> Outcome:
        """After waiting for a concurrent compaction: its record, if it matches this history."""
        try:
            record, _ = await self._io(
                self._lookup_sync,
                prepared.tenant,
                prepared.conversation,
                prepared.chain,
                prepared.earlier_conversation,
            )
        except StoreError:
            record = None
        if record is not None and record != prepared.record:
            return Outcome(record.case, record, "reused a concurrent compaction")
        return await self._fallback(prepared, "concurrent compaction gave nothing usable")

    async def _fallback(self, prepared: Prepared, reason: str) -> Outcome:
        limit = prepared.decision.limit_tokens
        if limit is not None and prepared.forwarded_tokens > limit:
            return await self._store(prepared, self._emergency(prepared, limit, reason))
        return Outcome("none", None, reason)

    async def _compact(self, prepared: Prepared, inline: bool) -> Outcome:
        started = time.monotonic()
        if not prepared.decision.use_llm:
            return await self._fallback(prepared, "cooling down")
        if not inline and await self._cooling(prepared):
            # Prepared before an earlier attempt failed: that failure's cooldown holds.
            return Outcome("none", None, "cooling down")
        try:
            outcome = await self._llm_compaction(prepared, started)
        except (CompactionFailed, summarizer.SummaryRejected) as exc:
            # A rejected summary is a soft failure (the next one may pass): a short cooldown.
            # An unreachable or failing model is a hard one: the full cooldown.
            soft = isinstance(exc, summarizer.SummaryRejected)
            log.warning(
                "compaction failed",
                extra={"conversation": prepared.conversation, "error": str(exc), "soft": soft},
            )
            await self._cooldown(prepared, soft=soft)
            error = f"summary check failed: {exc}" if soft else str(exc)
            self._event(prepared, {"case": "failed", "error": error[:300], "soft": soft})
            await self._flush_events(prepared)
            return await self._fallback(prepared, f"compaction failed: {error}")
        if outcome.record is None:
            if outcome.reason != "nothing to cut":
                # The LLMs ran and nothing came of it: do not pay for it again soon.
                await self._cooldown(prepared, soft=True)
            return await self._fallback(prepared, outcome.reason)
        return await self._store(prepared, outcome)

    async def _llm_compaction(self, prepared: Prepared, started: float) -> Outcome:
        s = self.settings
        fwd, counts = prepared.forwarded, prepared.forwarded_counts
        head_len = _head_len(prepared)
        earlier_at = layout.summary_position(_layout_view(prepared))
        body = head_len if earlier_at is None else earlier_at + 1
        plan = planner.plan_cut(fwd, counts, head_len, s, body)
        if plan is None:
            return Outcome("none", None, "nothing to cut")
        offset, window = detector.detector_window(fwd, plan.body_start, s.detector_window_messages)
        detection = detector.SAFE_DEFAULT
        llm_tokens = 0
        llm_usd = 0.0
        try:
            reply = await self.llm.complete(
                s.detection_model or prepared.llm_model or prepared.model,
                detector.build_request(self.prompts.detector, window, s.detector_chars_per_message),
                max_tokens=400,
                purpose="detector",
                credential=prepared.credential,
            )
            llm_tokens += reply.prompt_tokens + reply.completion_tokens
            llm_usd += _reply_usd(reply)
            detection = detector.sane(
                detector.parse_detection(reply.text, len(window)), offset, plan.body_start
            )
        except CompactionFailed as exc:
            # The detector is an optimisation: without it we still summarize.
            self._event(prepared, {"case": "detector_failed", "error": str(exc)[:300]})
        boundary = None if detection.boundary_index is None else offset + detection.boundary_index
        case, cut = planner.choose_case(plan, boundary, detection.confidence, s)
        earlier = None
        if earlier_at is not None:
            earlier = summarizer.strip_summary_header(str(fwd[earlier_at].get("content", "")))
        if case == "truncate":
            if not s.truncate_keeps_note:
                text = None
            else:
                text = (
                    detection.summary
                    or f"An earlier topic was set aside: {detection.boundary_reason}"
                )
                if earlier:
                    text = f"{earlier.strip()}\n\n{text}"
            span_text = lossreport.facts_text(fwd[head_len:cut])
            if not lossreport.note_keeps_all(
                span_text,
                text,
                lossreport.facts_text([*fwd[:head_len], *fwd[cut:]]),
                keyfacts.scaled_budget(s.key_references_max_chars, len(span_text)),
            ):
                # Truncation would lose facts the note cannot carry: summarize instead.
                case, cut = "summarize", plan.verbatim_start
        if case == "summarize":
            spent = [0, 0.0]

            async def complete(request: list[Message]) -> tuple[str | None, str | None]:
                reply = await self.llm.complete(
                    s.summary_model or prepared.llm_model or prepared.model,
                    request,
                    max_tokens=s.summary_budget_tokens,
                    purpose="summarizer",
                    credential=prepared.credential,
                )
                spent[0] += reply.prompt_tokens + reply.completion_tokens
                spent[1] += _reply_usd(reply)
                return reply.text, reply.finish_reason

            try:
                text = await summarizer.summarize(
                    complete,
                    self.prompts.summarizer,
                    _unpinned(fwd, self._pins(prepared, body, cut), body, cut),
                    earlier,
                    s.summary_budget_tokens,
                    _transcript_chars(s.summary_model or prepared.model),
                )
            finally:
                llm_tokens += int(spent[0])
                llm_usd += spent[1]
        return self._build(
            prepared,
            cut,
            text,
            case,
            reason=detection.boundary_reason,
            confidence=detection.confidence,
            started=started,
            llm_tokens=llm_tokens,
            llm_usd=llm_usd,
        )

    def _pins(self, prepared: Prepared, start: int, cut: int) -> pins.Pins:
        """Pins of the span ``[start, cut)`` plus the user turn a round cut falls in."""
        fwd = prepared.forwarded
        found = pins.find(
            fwd[:cut],
            prepared.forwarded_counts,
            prepared.origins,
            pins.first_user_index(prepared.original),
            self.settings,
            start,
        )
        opener = layout.turn_opener(fwd, cut, start)
        limit = self.settings.trigger_tokens * self.settings.pin_max_share
        if opener is not None and prepared.forwarded_counts[opener] <= limit:
            found = pins.with_pin(found, opener, "the instruction of the current turn")
        return found

    def _build(
        self,
        prepared: Prepared,
        cut: int,
        text: str | None,
        case: str,
        *,
        reason: str,
        confidence: float,
        started: float,
        llm_tokens: int = 0,
        llm_usd: float = 0.0,
        refs_scale: bool = True,
    ) -> Outcome:
        """A record for cutting the forwarded list at ``cut``, if it saves tokens. Pins of the
        replaced span stay in place.

        The ``Key references:`` budget grows with the span unless ``refs_scale`` is False (the
        emergency path, whose note size is fixed in advance)."""
        fwd = prepared.forwarded
        view = _layout_view(prepared)
        head_len = _head_len(prepared)
        earlier_at = layout.summary_position(view)
        body = head_len if earlier_at is None else earlier_at + 1
        found = self._pins(prepared, body, cut)
        new = layout.replaced(view, head_len, body, cut, found, None)
        covered = new.k - head_len
        summary_msg = None
        span = _unpinned(fwd, found, head_len, cut)
        span_text = lossreport.facts_text(span)
        replaced = {i for i in range(head_len, cut) if i not in found}
        rest_text = lossreport.facts_text([m for i, m in enumerate(fwd) if i not in replaced])
        if text is not None:
            budget = self.settings.key_references_max_chars
            if refs_scale:
                budget = keyfacts.scaled_budget(budget, len(span_text))
            text, _ = keyfacts.guard(span_text, text, budget, elsewhere=rest_text)
            summary_msg = planner.summary_message(text, covered, prepared.summary_role)
        # Against the forwarded text itself: the summary as stored and everything around it.
        loss = lossreport.report(
            span_text, None if summary_msg is None else str(summary_msg["content"]), rest_text
        )
        new = layout.replaced(view, head_len, body, cut, found, summary_msg)
        record = self._record(
            prepared,
            new,
            case,
            summary=summary_msg,
            reason=reason,
            started=started,
            confidence=confidence,
            loss=loss,
            llm_tokens=llm_tokens,
            llm_usd=llm_usd,
            found=found,
        )
        if record is None:
            return Outcome("none", None, "compaction would not reduce tokens")
        return Outcome(case, record, reason or case)

    def _emergency(self, prepared: Prepared, limit: int, reason: str) -> Outcome:
        """No LLM: prune every old tool result, then drop the oldest whole rounds (pins and the
        recent window stay) down to the trigger, so that this does not fire again soon."""
        started = time.monotonic()
        pruned = self._pruning(prepared, at_least=1)
        work = prepared if pruned.record is None else self._reviewed(prepared, pruned.record)
        work.decision = prepared.decision
        if pruned.record is not None and work.forwarded_tokens <= self.settings.trigger_tokens:
            return pruned
        head_len = _head_len(work)
        view = _layout_view(work)
        earlier_at = layout.summary_position(view)
        body = head_len if earlier_at is None else earlier_at + 1
        note_tokens = 40 + self.settings.key_references_max_chars // 2
        counts = work.forwarded_counts
        everything = self._pins(work, body, len(work.forwarded))
        # kept[c]: tokens staying before cut c (head, the previous summary's pins, span pins).
        kept = [0] * (len(counts) + 1)
        for i in range(len(counts)):
            stays = i < body and i != earlier_at or i in everything
            kept[i + 1] = kept[i] + (counts[i] if stays else 0)
        cut = planner.emergency_cut(
            work.forwarded,
            counts,
            head_len,
            limit,
            note_tokens,
            target_tokens=self.settings.trigger_tokens,
            body_start=body,
            kept_tokens=kept,
        )
        if cut is None:
            return (
                pruned
                if pruned.record is not None
                else Outcome("none", None, f"{reason}; nothing can be dropped")
            )
        outcome = self._build(
            work,
            cut,
            EMERGENCY_NOTE,
            "emergency",
            reason=reason,
            confidence=0.0,
            started=started,
            refs_scale=False,
        )
        if outcome.record is None:
            return pruned if pruned.record is not None else outcome
        record = outcome.record
        if pruned.record is not None:
            # One record for both steps, measured against what was forwarded before either.
            record = _with(
                record,
                tokens_before=prepared.forwarded_tokens,
                pruned=pruned.record.pruned,
                facts_dropped=[*pruned.record.facts_dropped, *record.facts_dropped],
            )
        return Outcome("emergency", record, outcome.reason)

    async def _store(self, prepared: Prepared, outcome: Outcome) -> Outcome:
        record = outcome.record
        if record is None:
            return outcome
        ttl = self.retention_s
        rec_key = conv_key("rec", prepared.tenant, prepared.conversation) + ":" + record.prefix_hash

        def write() -> None:
            self.store.set(rec_key, record.to_json(), ttl)
            self.store.append(
                conv_key("ck", prepared.tenant, prepared.conversation),
                {"k": record.k, "h": record.prefix_hash},
                ttl,
                MAX_CHECKPOINTS,
            )
            ledger.record_compaction(
                self.store,
                prepared.tenant,
                prepared.conversation,
                record=record.prefix_hash,
                case=record.case,
                llm_tokens=record.llm_tokens,
                llm_usd=record.llm_usd,
                retention_s=ttl,
            )

        try:
            await self._io(write)
        except StoreError as exc:
            log.warning("could not store a compaction record", extra={"error": str(exc)})
            # The result still serves this request when it was inline.
        event = {
            "case": record.case,
            "k": record.k,
            "covered": record.covered,
            "tokens_before": record.tokens_before,
            "tokens_after": record.tokens_after,
            "reason": outcome.reason[:300],
            "confidence": record.confidence,
            "duration_s": record.duration_s,
            "llm_tokens": record.llm_tokens,
            "prefix_hash": record.prefix_hash,
            "facts_kept": len(record.facts_kept)
            + len(record.facts_appended)
            + len(record.facts_elsewhere),
            "facts_dropped": len(record.facts_dropped),
        }
        self._event(prepared, event)
        await self._flush_events(prepared)
        log.info(
            "compacted",
            extra={
                "conversation": prepared.conversation,
                "case": record.case,
                "tokens_before": record.tokens_before,
                "tokens_after": record.tokens_after,
            },
        )
        return outcome

    async def _cooling(self, prepared: Prepared) -> bool:
        key = conv_key("cool", prepared.tenant, prepared.conversation)
        try:
            return await self._io(self.store.get, key) is not None
        except StoreError:
            return False

    async def _cooldown(self, prepared: Prepared, *, soft: bool = False) -> None:
        s = self.settings
        seconds = min(s.soft_cooldown_s, s.cooldown_s) if soft else s.cooldown_s
        if seconds <= 0:
            return
        try:
            await self._io(
                self.store.set,
                conv_key("cool", prepared.tenant, prepared.conversation),
                time.time(),
                seconds,
            )
        except StoreError:
            pass

    def _event(self, prepared: Prepared, event: dict[str, Any]) -> None:
        event.setdefault("ts", time.time())
        event.setdefault("model", prepared.model)
        prepared.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    async def _flush_events(self, prepared: Prepared) -> None:
        events, prepared.events = prepared.events, []
        key = conv_key("ev", prepared.tenant, prepared.conversation)

        def write() -> None:
            for event in events:
                self.store.append(key, event, self.retention_s, 500)

        try:
            await self._io(write)
        except StoreError:
            pass


def _transcript_chars(model: str) -> int:
    """What the summary model can read: half its context window (~4 characters a token)."""
    window = context_window(model)
    if not window:
        return summarizer.DEFAULT_MAX_TRANSCRIPT_CHARS
    return max(8_000, window * 2)


def _reply_usd(reply: LLMReply) -> float:
    return costs.llm_cost(
        costs.prices_for(reply.model), reply.prompt_tokens, reply.completion_tokens
    )


def _head_len(prepared: Prepared) -> int:
    return prepared.record.head_len if prepared.record else head_length(prepared.original)


def _pin_lines(
    prepared: Prepared | None, reasons: dict[int, str], where: Sequence[int | None] = ()
) -> list[str]:
    """Loss-report lines naming pins by original message index; the pins an earlier record
    kept in place are still pinned."""
    if prepared is not None:
        where = prepared.origins
    lines = [f"message {where[i]}: {why}" for i, why in reasons.items()]
    earlier = prepared.record.pinned if prepared is not None and prepared.record else []
    return list(dict.fromkeys([*earlier, *lines]))


def _layout_view(prepared: Prepared) -> layout.View:
    return layout.View(
        prepared.forwarded,
        prepared.origins,
        body_start(prepared.record),
        len(prepared.original),
    )


def _unpinned(messages: Sequence[Message], found: pins.Pins, start: int, cut: int) -> list[Message]:
    """The span ``[start, cut)`` without its pins (they are forwarded, not summarized)."""
    return [messages[i] for i in range(start, cut) if i not in found]


def _with(record: CompactionRecord, **changes: Any) -> CompactionRecord:
    return dataclasses.replace(record, **changes)
