"""Property-based tests over random conversations (hypothesis).

Random shapes: 0-2 head system/developer messages, 1-12 user turns, each with 0-2 tool-call
rounds of 1-3 calls, content from one word to a few hundred, occasionally as a list of one
text part. The pure planner properties run on their own; the engine properties drive
``proxy.compactor.Compactor`` with the in-process fake LLM and a fresh DiskStore per example.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
import re
import tempfile
from typing import Any

import orjson
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from proxy.adapters.store import DiskStore
from proxy.core.errors import CompactionFailed
from proxy.core.fingerprint import chain_of, conversation_id
from proxy.core.lookup import lookup
from proxy.core.messages import head_length, text_of
from proxy.core.pins import first_user_index
from proxy.core.planner import cut_points, emergency_cut, plan_cut
from proxy.core.prepared import Prepared
from proxy.core.records import body_start
from proxy.core.settings import CompactionSettings
from proxy.core.tokens import TokenCounter
from proxy.engine.compactor import Compactor
from proxy.engine.reads import run_reads
from tests.test_compactor import MODEL, PROMPTS, FakeLLM

Message = dict[str, Any]
COUNTER = TokenCounter()
WORDS = (
    "the parser invoice ledger retry worker cache settings deploy branch staging error "
    "path config port host ticket function value result test build run fix add remove"
).split()

PROPERTY = settings(
    max_examples=int(os.environ.get("PROPERTY_EXAMPLES", "40")),
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ---- strategies ------------------------------------------------------------------------------


def _text(draw: st.DrawFn, label: str, max_words: int = 120) -> str:
    n = draw(st.integers(1, max_words))
    rng = random.Random(draw(st.integers(0, 2**32)))
    return f"{label} " + " ".join(rng.choice(WORDS) for _ in range(n))


def _content(draw: st.DrawFn, label: str) -> Any:
    text = _text(draw, label)
    if draw(st.integers(0, 5)) == 0:
        return [{"type": "text", "text": text}]
    return text


@st.composite
def conversations(draw: st.DrawFn) -> list[Message]:
    msgs: list[Message] = []
    for h in range(draw(st.integers(0, 2))):
        role = draw(st.sampled_from(["system", "developer"]))
        msgs.append({"role": role, "content": _text(draw, f"head{h}", 40)})
    for t in range(draw(st.integers(1, 12))):
        msgs.append({"role": "user", "content": _content(draw, f"user{t}")})
        rounds = draw(st.integers(0, 2))
        for r in range(rounds):
            ids = [f"call_{t}_{r}_{j}" for j in range(draw(st.integers(1, 3)))]
            msgs.append(
                {
                    "role": "assistant",
                    "content": draw(st.sampled_from([None, "", "Let me check."])),
                    "tool_calls": [
                        {
                            "id": i,
                            "type": "function",
                            "function": {"name": "lookup", "arguments": f'{{"q": "{i}"}}'},
                        }
                        for i in ids
                    ],
                }
            )
            for i in ids:
                msgs.append({"role": "tool", "tool_call_id": i, "content": _text(draw, i)})
        if rounds == 0 or draw(st.booleans()):
            msgs.append({"role": "assistant", "content": _content(draw, f"answer{t}")})
    return msgs


@st.composite
def compaction_settings(draw: st.DrawFn) -> CompactionSettings:
    return CompactionSettings(
        policy="tokens",  # the mechanics of compaction; the money rules: test_economics
        trigger_tokens=draw(st.integers(150, 1500)),
        verbatim_window_tokens=draw(st.integers(30, 600)),
        summary_budget_tokens=100,
        min_verbatim_exchanges=draw(st.integers(1, 3)),
        min_confidence=0.5,
        emergency_factor=2.0,
        mode="inline",
        key_references_max_chars=draw(st.sampled_from([0, 200, 600])),
    )


class BoundaryAt:
    """A detector that points at the ``from_end``-th last USER line of its excerpt."""

    def __init__(self, from_end: int, confidence: float) -> None:
        self.from_end, self.confidence = from_end, confidence

    def __repr__(self) -> str:
        return f"BoundaryAt({self.from_end}, {self.confidence})"

    def __call__(self, messages: list[Message]) -> str:
        lines = messages[-1]["content"].splitlines()
        users = [int(x[1 : x.index("]")]) for x in lines if re.match(r"\[\d+\] USER\b", x)]
        index = users[max(0, len(users) - self.from_end)] if users else None
        return json.dumps(
            {
                "boundary_index": index,
                "boundary_reason": "new task",
                "confidence": self.confidence,
                "summary": "Earlier topic note.",
            }
        )


detections = st.one_of(
    st.just('{"boundary_index": null, "confidence": 0}'),
    st.just("garbage, not JSON"),
    st.builds(
        lambda i, c: (
            f'{{"boundary_index": {i}, "boundary_reason": "new task", '
            f'"confidence": {c}, "summary": "Earlier topic note."}}'
        ),
        st.integers(-2, 60),
        st.sampled_from([0.2, 0.9, 1.0]),
    ),
    st.builds(BoundaryAt, st.integers(1, 4), st.sampled_from([0.3, 0.9])),
    st.builds(BoundaryAt, st.integers(1, 3), st.just(0.9)),  # weights towards truncation
)
SUMMARY = "Summary of the earlier part: the user asked questions and got answers."
# Mostly a good summary; sometimes a failure (then cooldown, and emergency truncation when
# the history is over the hard limit).
summaries = st.sampled_from([SUMMARY, SUMMARY, SUMMARY, "", CompactionFailed])


# ---- helpers ---------------------------------------------------------------------------------


def dumps(value: Any) -> bytes:
    return orjson.dumps(value)


def separated(messages: list[Message], cut: int) -> bool:
    issued = {c["id"]: i for i, m in enumerate(messages) for c in (m.get("tool_calls") or [])}
    return any(
        m.get("role") == "tool" and issued.get(m["tool_call_id"], cut) < cut for m in messages[cut:]
    )


def tokens(messages: list[Message]) -> int:
    return sum(COUNTER.count_messages(messages, MODEL)) + 3


def check_forwarded(p: Prepared, s: CompactionSettings) -> None:
    """Every invariant of what would be forwarded, for any prepared request."""
    orig, fwd = p.original, p.forwarded
    head = head_length(orig)
    # Head system/developer messages: first and byte-identical.
    assert dumps(fwd[:head]) == dumps(orig[:head])
    # Never more tokens than the client sent (and the counts are honest).
    assert p.forwarded_tokens <= p.original_tokens
    assert p.forwarded_tokens == tokens(fwd)
    if p.record is None:
        assert dumps(fwd) == dumps(orig)
        return
    r = p.record
    assert r.head_len == head
    assert r.tokens_after < r.tokens_before
    body = body_start(r)
    if r.summary is not None:
        assert dumps(r.summary) in [dumps(m) for m in fwd[head:body]]
        assert r.summary["content"].startswith(f"[History Summary - {r.k - head} earlier")
    # After the record's prefix, the original tail byte for byte.
    assert dumps(fwd[body:]) == dumps(orig[r.k :])
    if r.case != "prune":
        # A summary or a drop ends at a legal cut: a user turn or the start of a round.
        assert r.k == len(orig) or r.k in cut_points(orig)
        assert not separated(orig, r.k)
    # No tool result in the forwarded list lost its call; no call lost a result it had.
    issued = {c["id"] for m in fwd for c in (m.get("tool_calls") or [])}
    answered_orig = {m["tool_call_id"] for m in orig if m.get("role") == "tool"}
    answered_fwd = {m["tool_call_id"] for m in fwd if m.get("role") == "tool"}
    assert answered_fwd <= issued
    assert (issued & answered_orig) <= answered_fwd
    # Pinned: system messages anywhere and the task stay, byte for byte, in order.
    pinned = [m for m in orig if m["role"] in ("system", "developer")]
    task = first_user_index(orig)
    limit = int(s.trigger_tokens * s.pin_max_share)
    system_tokens = tokens(pinned) - 3
    if task is not None and s.pin_first_user and COUNTER.count_message(orig[task], MODEL) <= limit:
        if system_tokens + COUNTER.count_message(orig[task], MODEL) <= 2 * limit:
            before = [m for m in orig[:task] if m["role"] in ("system", "developer")]
            pinned.insert(len(before), orig[task])
    forwarded_bytes = [dumps(m) for m in fwd]
    positions = [forwarded_bytes.index(dumps(m)) for m in pinned]
    assert positions == sorted(positions)
    # The minimum exchange guarantee (emergency truncation only keeps what fits).
    if r.case in ("summarize", "truncate"):
        exchanges = [c for c in cut_points(orig) if c >= r.k]
        assert len(exchanges) >= s.min_verbatim_exchanges


def run(coro: Any) -> Any:
    return asyncio.run(coro)


class Engine:
    """A compactor over a fresh DiskStore in a temporary folder."""

    def __init__(self, s: CompactionSettings, detection: Any, summary: Any) -> None:
        self.tmp = tempfile.TemporaryDirectory()
        self.store = DiskStore(self.tmp.name)
        self.llm = FakeLLM(summarizer=summary, detector=detection)
        self.compactor = Compactor(s, self.store, self.llm, PROMPTS, counter=COUNTER)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.store.close()
        self.tmp.cleanup()

    async def prepare(self, msgs: list[Message], tenant: str = "tenant-a") -> Prepared:
        return await self.compactor.prepare(msgs, model=MODEL, tenant=tenant, credential="k")

    def lookup(self, msgs: list[Message], tenant: str, conversation: str) -> Any:
        chain = chain_of(tenant, msgs)
        return run_reads(lookup(tenant, conversation, None, chain), self.store)


# ---- pure planner properties -----------------------------------------------------------------


@PROPERTY
@given(conversations(), compaction_settings(), st.integers(0, 2**32))
def test_planner_cuts_are_legal(msgs: list[Message], s: CompactionSettings, seed: int) -> None:
    head = head_length(msgs)
    cuts = cut_points(msgs)
    for c in cuts:
        assert msgs[c]["role"] in ("user", "assistant") and not separated(msgs, c)
        if msgs[c]["role"] == "assistant":  # a cut between rounds: right after a result
            assert msgs[c - 1]["role"] == "tool"
    # Every user message not listed really would separate a tool round.
    for i, m in enumerate(msgs):
        if m["role"] == "user" and i not in cuts:
            assert separated(msgs, i)
    rng = random.Random(seed)
    counts = [rng.randint(1, 300) for _ in msgs]
    plan = plan_cut(msgs, counts, head, s)
    if plan is not None:
        assert head < plan.verbatim_start <= plan.latest_cut < len(msgs)
        for c in (plan.verbatim_start, plan.latest_cut):
            assert c in cuts
            exchanges = [x for x in cuts if x >= c]
            assert len(exchanges) >= s.min_verbatim_exchanges
    limit = rng.randint(1, sum(counts) + 10)
    cut = emergency_cut(msgs, counts, head, limit, 10)
    if cut is not None:
        assert cut > head and cut in cuts
        fits = sum(counts[:head]) + 10 + sum(counts[cut:]) <= limit
        later = [c for c in cuts if c > head]
        assert fits or cut == later[-1]
        # No earlier whole-turn cut would have fitted.
        for c in later:
            if c < cut:
                assert sum(counts[:head]) + 10 + sum(counts[c:]) > limit


# ---- engine properties -----------------------------------------------------------------------


@PROPERTY
@given(conversations(), compaction_settings(), detections, summaries, st.data())
def test_engine_invariants_and_exact_prefix_substitution(
    msgs: list[Message], s: CompactionSettings, detection: Any, summary: Any, data: st.DataObject
) -> None:
    async def scenario() -> None:
        with Engine(s, detection, summary) as engine:
            p = await engine.prepare(copy.deepcopy(msgs))
            check_forwarded(p, s)
            event(f"case: {p.case}")
            if p.record is None:
                return
            k = p.record.k
            tenant, conv = p.tenant, p.conversation

            # The same history, resent with a new turn, matches the same record.
            more = [*copy.deepcopy(msgs), {"role": "user", "content": "and then?"}]
            assert engine.lookup(more, tenant, conv) == p.record
            # A benign variation (a string sent as one text part) still matches.
            i = data.draw(st.integers(0, k - 1), label="benign index")
            variant = copy.deepcopy(msgs)
            text = text_of(variant[i])
            if variant[i].get("role") != "assistant" or text:
                variant[i]["content"] = [{"type": "text", "text": text}]
                assert engine.lookup(variant, tenant, conv) == p.record

            # Any edit of a message before k: no match, whatever conversation key is used.
            j = data.draw(st.integers(0, k - 1), label="edited index")
            edit = data.draw(st.sampled_from(["content", "role", "name", "drop", "insert"]))
            edited = copy.deepcopy(msgs)
            if edit == "content":
                edited[j]["content"] = text_of(edited[j]) + " (edited)"
            elif edit == "role":
                edited[j]["role"] = "assistant" if edited[j]["role"] != "assistant" else "user"
            elif edit == "name":
                edited[j]["name"] = "someone"
            elif edit == "drop":
                del edited[j]
            else:
                edited.insert(j, {"role": "user", "content": "an inserted message"})
            if j < head_length(msgs) and edit in ("content", "name"):
                # The head is never compacted and goes on as sent: the chain takes it by
                # role alone, so a changed system prompt keeps the record.
                assert engine.lookup(edited, tenant, conv) == p.record, (edit, j, k)
            else:
                for key in {conv, conversation_id(chain_of(tenant, edited), edited)}:
                    assert engine.lookup(edited, tenant, key) is None, (edit, j, k)

            # Another tenant never matches, under its own or the first tenant's key.
            other = await engine.prepare(copy.deepcopy(msgs), tenant="tenant-b")
            assert other.record is None or other.record.prefix_hash != p.record.prefix_hash
            assert engine.lookup(msgs, "tenant-b", conv) is None
            check_forwarded(other, s)

    run(scenario())


@PROPERTY
@given(conversations(), conversations(), compaction_settings(), detections, summaries)
def test_engine_successive_compactions(
    first: list[Message],
    later: list[Message],
    s: CompactionSettings,
    detection: Any,
    summary: Any,
) -> None:
    """A history that grows after a compaction: the second compaction works on what is
    forwarded (summary + tail) and its record still names an exact original prefix."""
    tail = [m for m in later if m["role"] not in ("system", "developer")]
    # Keep the ids unique across the two parts.
    tail = orjson.loads(dumps(tail).replace(b'"call_', b'"later_'))
    grown = [*copy.deepcopy(first), *tail]

    async def scenario() -> None:
        with Engine(s, detection, summary) as engine:
            p1 = await engine.prepare(copy.deepcopy(first))
            check_forwarded(p1, s)
            p2 = await engine.prepare(copy.deepcopy(grown))
            check_forwarded(p2, s)
            event(f"first: {p1.case}, grown: {p2.case}, compacted again: {p2.compacted_now}")
            if p1.record is not None and p2.record is not None:
                assert p2.record.k >= p1.record.k
            if p2.record is not None:
                # The record names exactly the first k messages of this tenant.
                chain = chain_of(p2.tenant, grown)
                assert p2.record.prefix_hash == chain[p2.record.k].hex()
                # And it is what the next request (same history) is served from.
                p3 = await engine.prepare(copy.deepcopy(grown))
                check_forwarded(p3, s)
                assert p3.record is not None and p3.record.k >= p2.record.k
                if not p3.compacted_now:
                    assert dumps(p3.forwarded) == dumps(p2.forwarded)

    run(scenario())
