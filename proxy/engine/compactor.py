"""The driver: runs the core's compaction flows (``proxy.core.flow_prepare``,
``proxy.core.flow_compact``) against the real store and LLM client.

Everything the flows decide is pure and lives in ``proxy/core``; this module only answers
their commands (``proxy.core.commands``), and owns what needs an event loop: the
per-conversation lock (one compaction at a time, joined by concurrent requests), locks left
behind by a store outage, background scheduling and the batched writes. Nothing here raises
into the request path: every failure leaves the request as the client sent it (or, when it
would not fit, emergency-truncated).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from proxy.adapters.llm import LLM
from proxy.adapters.store import Store
from proxy.adapters.writer import BatchWriter
from proxy.core import flow_compact, flow_prepare
from proxy.core.commands import (
    Command,
    CompactNow,
    Complete,
    CompleteShared,
    Compute,
    Cooldown,
    Emit,
    Flow,
    Persist,
    Read,
    Remember,
)
from proxy.core.controls import Controls
from proxy.core.errors import CallRefused, CompactionFailed, StoreError
from proxy.core.messages import Message
from proxy.core.prepared import Env, Outcome, Prepared, Prompts, nothing
from proxy.core.records import MAX_CHECKPOINTS, conv_key, llm_request_len
from proxy.core.reprint import Reuse
from proxy.core.settings import CompactionSettings
from proxy.core.sharedcall import SharedCall
from proxy.core.tokens import TokenCounter
from proxy.engine.reads import hold, read_store
from proxy.engine.stepping import Done, advance
from proxy.engine.tracing import Tracer
from proxy.operators import ledger

log = logging.getLogger("compaction_proxy.compactor")
T = TypeVar("T")
# Histories this long (or requests the server finds big, ``prepare(offload=True)``) are
# fingerprinted and counted in a worker thread: counting text seen for the first time costs
# milliseconds per hundred kilobytes, which must not stall every other request on the loop.
# Below it the thread hop would cost more than it saves.
OFFLOAD_MESSAGES = 1000
# Histories this long are prepared entirely off the loop (``run(off_loop=True)``): below it
# the substitution, decision and stability steps take under 2 ms on the loop, less than the
# extra thread hops would add (see flow_prepare.SETTLE_OFFLOAD_MESSAGES).
STEP_OFFLOAD_MESSAGES = flow_prepare.SETTLE_OFFLOAD_MESSAGES


class Compactor:
    """The engine. Owns no sockets itself: the store and LLM client are handed in."""

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
        tracer: Tracer | None = None,
    ) -> None:
        """``on_event`` is called with every compaction event (metrics); it must not raise.
        ``tracer``: each compaction attempt gets a span (``proxy.engine.tracing``)."""
        self.settings = settings
        self.store = store
        self.llm = llm
        self.prompts = prompts
        self.env = Env.of(settings, prompts, counter, retention_s)
        self.counter = self.env.counter
        self.retention_s = retention_s
        self.on_event = on_event
        self.tracer = tracer
        self._inflight: dict[str, asyncio.Future[Outcome]] = {}
        # Locks this process took but could not release (the store was down): released as
        # soon as the store answers again, so a restarted Redis that kept them (AOF) does not
        # hold those conversations until the locks' TTL.
        self._orphan_locks: dict[str, float] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        # Stability trackers this worker wrote last, by store key, with when: the client's
        # next request can arrive before the batched write lands (other workers read the
        # store).
        self._recent: dict[str, tuple[Any, float]] = {}
        # Ledger entries and the stability tracker are written in batches, off the hot path.
        self.writer = BatchWriter(store, retention_s, ledger.record_batch)

    # ---- running flows -------------------------------------------------------------------

    async def run(self, flow: Flow[T], *, off_loop: bool = False) -> T:
        """Drive ``flow`` to its end: answer each command, throw each failure back in.
        ``off_loop``: advance the flow itself in a worker thread (``proxy.engine.stepping``),
        for a conversation whose size would make its pure steps stall the event loop."""
        reply: Any = None
        failure: BaseException | None = None
        while True:
            if off_loop:
                step = await asyncio.to_thread(advance, flow, reply, failure, compute=True)
            else:
                step = advance(flow, reply, failure, compute=False)
            if isinstance(step, Done):
                return step.value  # type: ignore[no-any-return]
            command = step
            reply, failure = None, None
            try:
                reply = await self._execute(command)
            except (StoreError, CompactionFailed) as exc:
                failure = exc

    async def _execute(self, command: Command) -> Any:
        match command:
            case Read():
                return await self._read(command)
            case Compute():
                return await asyncio.to_thread(command.run)
            case Complete():
                return await self.llm.complete(
                    command.model,
                    command.messages,
                    max_tokens=command.max_tokens,
                    purpose=command.purpose,
                    credential=command.credential,
                )
            case CompleteShared():
                shared = getattr(self.llm, "shared", None)
                if shared is None:  # (an LLM client of the hook's or a test's)
                    raise CallRefused("this client makes no call in the client's shape")
                return await shared(command.call, command.body, purpose=command.purpose)
            case Persist():
                return await asyncio.to_thread(self._persist, command)
            case Cooldown():
                key = conv_key("cool", command.tenant, command.conversation)
                return await asyncio.to_thread(self.store.set, key, time.time(), command.seconds)
            case Emit():
                if self.on_event is not None:
                    self.on_event(dict(command.event))
                return await asyncio.to_thread(
                    ledger.record_events,
                    self.store,
                    command.tenant,
                    command.conversation,
                    [command.event],
                    self.retention_s,
                )
            case CompactNow():
                return await self.compact(command.prepared, inline=True)
            case Remember():
                # Batched like the tracker, off the request path: it changes with nearly
                # every request of a compacted agent conversation, and a write of its own
                # there cost ~0.25 ms a request (#28).
                hold(self._recent, command.key, command.value)
                self.writer.put(command.key, command.value, self.retention_s)
                return None
        raise TypeError(f"unknown command {command!r}")

    async def _read(self, command: Read) -> dict[str, Any]:
        # A local store answers inline (microseconds); a networked one from a thread.
        if getattr(self.store, "reads_block", True):
            return await asyncio.to_thread(read_store, self.store, command, self._recent)
        return read_store(self.store, command, self._recent)

    def _persist(self, command: Persist) -> None:
        record, ttl = command.record, self.retention_s
        tenant, conversation = command.tenant, command.conversation
        key = conv_key("rec", tenant, conversation) + ":" + record.prefix_hash
        self.store.set(key, record.to_json(), ttl)
        checkpoint = {
            "k": record.k, "h": record.prefix_hash, "t": record.created_at,
            "n": llm_request_len(record),
        }  # fmt: skip
        self.store.append(conv_key("ck", tenant, conversation), checkpoint, ttl, MAX_CHECKPOINTS)
        ledger.record_compaction(
            self.store,
            tenant,
            conversation,
            record=record.prefix_hash,
            case=record.case,
            llm_tokens=record.llm_tokens,
            llm_usd=record.llm_usd,
            retention_s=ttl,
            llm_cached_tokens=record.llm_cached_tokens,
        )

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
        now: float | None = None,
        reuse: Reuse | None = None,
        shared: SharedCall | None = None,
    ) -> Prepared:
        """Identify, substitute, count and decide; compact inline when the decision says so
        (``flow_prepare.Request`` documents the arguments; ``bypass`` is short for
        ``controls`` that forward as sent). ``now``: the request's time (default: the clock;
        a replay passes its own)."""
        if controls is None:
            controls = Controls("bypassed by x-compaction: off", "off") if bypass else Controls()
        request = flow_prepare.Request(
            model=model,
            tenant=tenant,
            credential=credential,
            conversation_header=conversation_header,
            summary_role=summary_role,
            llm_model=llm_model,
            controls=controls,
            offload=offload or len(messages) >= OFFLOAD_MESSAGES,
            outside_cache_marks=outside_cache_marks,
            summary_joins=summary_joins,
            reserve_tokens=reserve_tokens,
            now=time.time() if now is None else now,
            reuse=reuse,
            shared=shared,
        )
        flow = flow_prepare.prepare(self.env, messages, request)
        return await self.run(flow, off_loop=len(messages) >= STEP_OFFLOAD_MESSAGES)

    def schedule(self, prepared: Prepared) -> None:
        """After a successful response: persist the stability tracker and run a background
        compaction if the decision asked for one. Never blocks the caller."""
        if prepared.stability is not None:
            key = conv_key("stab", prepared.tenant, prepared.conversation)
            hold(self._recent, key, prepared.stability)
            # Written in the next batch; a lost write only restarts the tracker at N = 0.
            # The state is frozen: it is turned into JSON in the writer's thread (100,000
            # items take a fifth of a second, which the event loop must not wait for).
            self.writer.put(key, prepared.stability.to_json, self.retention_s)
        if prepared.decision.action == "background":
            loop = asyncio.get_running_loop()
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

    async def drain(self, timeout: float | None = None) -> None:
        """Wait for scheduled background compactions and queued writes (shutdown and tests)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        await self.writer.close()

    # ---- compaction under the conversation's lock ----------------------------------------

    async def compact(self, prepared: Prepared, *, inline: bool) -> Outcome:
        """One compaction of ``prepared.forwarded``; at most one per conversation at a time.

        A caller that finds one already running waits for it and reuses its result.
        """
        key = conv_key("lock", prepared.tenant, prepared.conversation)
        running = self._inflight.get(key)
        if running is not None:
            if not inline:
                return nothing("already running")
            await asyncio.shield(running)
            return await self._guarded(prepared, inline=True, waited=True)
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        # Resolved in ``finally``: if this task is cancelled (client gone, caller timeout),
        # requests waiting on ``future`` must still wake up rather than hang forever.
        outcome = nothing("compaction cancelled", failed=True)
        try:
            outcome = await self._locked(prepared, key, inline)
        finally:
            self._inflight.pop(key, None)
            future.set_result(outcome)
        return outcome

    async def _traced(self, flow: Flow[Outcome], *, inline: bool) -> Outcome:
        """The flow, in a compaction span when tracing is on. Off the loop, always: a
        compaction is rare, waits on LLM calls anyway, and its work (transcripts, key facts,
        loss report) grows with the span."""
        if self.tracer is None:
            return await self.run(flow, off_loop=True)
        with self.tracer.compaction(inline=inline) as span:
            outcome = await self.run(flow, off_loop=True)
            if span is not None:
                span.outcome(outcome)
            return outcome

    async def _guarded(self, prepared: Prepared, *, inline: bool, waited: bool) -> Outcome:
        """The compaction flow within ``compaction_timeout_s``; a crash in it is the last
        line of failing open."""
        budget = self.settings.compaction_timeout_s
        try:
            flow = flow_compact.compact(self.env, prepared, inline=inline, waited=waited)
            try:
                async with asyncio.timeout(budget):
                    return await self._traced(flow, inline=inline)
            except TimeoutError:
                pass  # (not closed: a step may still be running in its thread; it ends alone)
            # Each call had its own bound, but a long span takes many: the request (or the
            # lock, for a background one) must not wait for all of them.
            log.warning("compaction over its time budget", extra={"budget_s": budget})
            reason = f"compaction took longer than {budget:g} s"
            await self.run(flow_compact.cooldown(self.env, prepared, soft=False))
            return await self.run(flow_compact.fallback(self.env, prepared, reason), off_loop=True)
        except Exception as exc:
            log.exception("compaction crashed; request goes through unchanged")
            return nothing(f"internal error: {type(exc).__name__}", failed=True)

    async def _locked(self, prepared: Prepared, key: str, inline: bool) -> Outcome:
        ttl = self.settings.compaction_timeout_s + 30  # outlives the compaction it guards
        try:
            await self._release_orphans()
            stamp = time.time()
            acquired = await asyncio.to_thread(self.store.add, key, stamp, ttl)
        except StoreError as exc:
            log.warning("store unavailable for the compaction lock", extra={"error": str(exc)})
            return nothing("store unavailable", failed=True)
        if not acquired:
            if not inline:
                return nothing("locked by another worker")
            # Another worker or replica is compacting this conversation: wait, then reuse.
            deadline = time.monotonic() + ttl
            while time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                if await asyncio.to_thread(self.store.get, key) is None:
                    break
            return await self._guarded(prepared, inline=True, waited=True)
        try:
            return await self._guarded(prepared, inline=inline, waited=False)
        finally:
            try:
                await asyncio.to_thread(self.store.delete, key)
            except StoreError:
                self._orphan_locks[key] = stamp  # released once the store answers again

    async def _release_orphans(self) -> None:
        for orphan, stamp in list(self._orphan_locks.items()):
            # StoreError: still down, keep it. Only our own lock: once expired, another
            # worker may hold that conversation's lock by now.
            if await asyncio.to_thread(self.store.get, orphan) == stamp:
                await asyncio.to_thread(self.store.delete, orphan)
            self._orphan_locks.pop(orphan, None)
