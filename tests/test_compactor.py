"""proxy.compactor: the engine end to end, with an in-process fake LLM and a real DiskStore."""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.adapters.llm import LLMReply
from proxy.adapters.store import DiskStore
from proxy.core.candidates import EMERGENCY_NOTE
from proxy.core.commands import Read
from proxy.core.errors import CompactionFailed
from proxy.core.fingerprint import chain_of
from proxy.core.lookup import lookup
from proxy.core.messages import SUMMARY_PREFIX
from proxy.core.prepared import Prepared, Prompts
from proxy.core.records import body_start, conv_key
from proxy.core.settings import CompactionSettings
from proxy.core.tokens import TokenCounter
from proxy.engine.compactor import Compactor
from proxy.operators.ledger import TOTALS_KEY

Message = dict[str, Any]
MODEL = "gpt-4o-mini"
PROMPTS = Prompts(detector="Find the topic boundary.", summarizer="Summarize in {budget} tokens.")
SETTINGS = CompactionSettings(
    policy="tokens",  # the mechanics of compaction; the money rules: test_economics
    trigger_tokens=2000,
    verbatim_window_tokens=500,
    summary_budget_tokens=200,
    min_verbatim_exchanges=2,
    cooldown_s=300,
    # These tests are about the summary tier; pins and pruning have their own (test_agents).
    pin_first_user=False,
    prune=False,
)
NULL_DETECTION = '{"boundary_index": null, "boundary_reason": "", "confidence": 0, "summary": ""}'
# On topic: the summary checks reject a summary whose words do not occur in the span.
GOOD_SUMMARY = (
    "Earlier the user and the assistant reviewed the parser, the invoice ledger and the retry "
    "worker; the staging deploy branch is settled and nothing is open."
)

_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu parser "
    "invoice ledger retry worker cache settings deploy branch staging"
).split()


# ---- conversations ---------------------------------------------------------------------------


def prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def conversation(
    turns: int, *, seed: int = 0, words: int = 60, tool_every: int = 3, system: bool = True
) -> list[Message]:
    """A deterministic chat: ~80 tokens a message, a tool round every ``tool_every`` turns."""
    rng = random.Random(seed)
    msgs: list[Message] = []
    if system:
        msgs.append({"role": "system", "content": "You are a careful coding assistant."})
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Turn {t}. {prose(rng, words)}"})
        if tool_every and t % tool_every == tool_every - 1:
            call_id = f"call_{seed}_{t}"
            msgs.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {
                                "name": "read_file",
                                "arguments": json.dumps({"path": f"src/mod{t}.py"}),
                            },
                        }
                    ],
                }
            )
            msgs.append({"role": "tool", "tool_call_id": call_id, "content": prose(rng, words)})
        msgs.append({"role": "assistant", "content": f"Answer {t}. {prose(rng, words)}"})
    return msgs


def dumps(messages: Any) -> bytes:
    return orjson.dumps(messages)


def forwarded_text(prepared: Prepared) -> str:
    return "\n".join(str(m.get("content") or "") for m in prepared.forwarded)


def summary_text(prepared: Prepared) -> str:
    """The forwarded summary (or emergency note): pins of the replaced span may precede it."""
    for m in prepared.forwarded:
        content = m.get("content")
        if isinstance(content, str) and content.startswith(SUMMARY_PREFIX):
            return content
    raise AssertionError("no summary forwarded")


def assert_well_formed(prepared: Prepared) -> None:
    """What would be forwarded: head first and intact, the tail byte-identical, tools paired."""
    fwd, orig = prepared.forwarded, prepared.original
    record = prepared.record
    if record is None:
        assert dumps(fwd) == dumps(orig)
        return
    head = record.head_len
    assert dumps(fwd[:head]) == dumps(orig[:head])
    body = body_start(record)
    if record.summary is not None:
        assert dumps(record.summary) in [dumps(m) for m in fwd[head:body]]
    assert dumps(fwd[body:]) == dumps(orig[record.k :])
    assert body == len(fwd) or fwd[body]["role"] in ("user", "assistant")
    issued: set[str] = set()
    for m in fwd:
        for call in m.get("tool_calls") or []:
            issued.add(call["id"])
        if m.get("role") == "tool":
            assert m["tool_call_id"] in issued, "a tool result lost its call"


# ---- the fake LLM ----------------------------------------------------------------------------


@dataclass
class Call:
    purpose: str
    model: str
    messages: list[Message]
    max_tokens: int
    credential: str | None

    @property
    def user_text(self) -> str:
        return "\n".join(str(m["content"]) for m in self.messages if m["role"] == "user")


Behaviour = Any  # str | LLMReply | BaseException | callable(messages) -> any of those


class FakeLLM:
    """Implements ``proxy.llm.LLM`` in process; records every call."""

    def __init__(
        self,
        summarizer: Behaviour = GOOD_SUMMARY,
        detector: Behaviour = NULL_DETECTION,
        delay: float = 0.0,
    ) -> None:
        self.summarizer = summarizer
        self.detector = detector
        self.delay = delay
        self.calls: list[Call] = []

    async def complete(
        self,
        model: str,
        messages: Any,
        *,
        max_tokens: int,
        purpose: str,
        credential: str | None,
    ) -> LLMReply:
        self.calls.append(
            Call(purpose, model, copy.deepcopy(list(messages)), max_tokens, credential)
        )
        if self.delay:
            await asyncio.sleep(self.delay)
        behaviour = self.detector if purpose == "detector" else self.summarizer
        if callable(behaviour) and not isinstance(behaviour, BaseException | type):
            behaviour = behaviour(messages)
            if inspect.isawaitable(behaviour):
                behaviour = await behaviour
        if isinstance(behaviour, type) and issubclass(behaviour, BaseException):
            raise behaviour(f"{purpose} failed")
        if isinstance(behaviour, BaseException):
            raise behaviour
        if isinstance(behaviour, LLMReply):
            return behaviour
        return LLMReply(str(behaviour), "stop", 100, 20, model)

    def of(self, purpose: str) -> list[Call]:
        return [c for c in self.calls if c.purpose == purpose]


def extractive(messages: list[Message]) -> str:
    """A scripted summarizer that returns only the lines containing FACT that it was given."""
    text = "\n".join(str(m["content"]) for m in messages if m["role"] == "user")
    lines = [line.strip() for line in text.splitlines() if "FACT" in line]
    return "\n".join(dict.fromkeys(lines)) or "Nothing to keep from this part."


# ---- fixtures --------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[DiskStore]:
    s = DiskStore(tmp_path / "store")
    yield s
    s.close()


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter()


MakeCompactor = Callable[..., Compactor]


@pytest.fixture
def make(store: DiskStore, counter: TokenCounter) -> MakeCompactor:
    def build(llm: FakeLLM, **overrides: Any) -> Compactor:
        settings = CompactionSettings(**{**SETTINGS.__dict__, **overrides})
        return Compactor(settings, store, llm, PROMPTS, counter=counter)

    return build


async def prepare(
    c: Compactor, messages: list[Message], tenant: str = "tenant-a", **kw: Any
) -> Prepared:
    return await c.prepare(messages, model=MODEL, tenant=tenant, credential="sk-test", **kw)


# ---- below trigger ---------------------------------------------------------------------------


async def test_below_trigger_nothing_happens(make: MakeCompactor, store: DiskStore) -> None:
    llm = FakeLLM()
    c = make(llm, mode="inline")
    msgs = conversation(4)
    p = await prepare(c, msgs)
    assert p.original_tokens <= SETTINGS.trigger_tokens
    assert p.decision.action == "forward" and p.decision.reason == "below trigger"
    assert p.record is None and not p.compacted_now and p.case == "none"
    assert dumps(p.forwarded) == dumps(msgs)
    assert p.forwarded_tokens == p.original_tokens
    c.schedule(p)
    await c.drain()
    assert llm.calls == []
    for kind in ("rec", "ck", "cool", "lock", "ev"):
        assert list(store.keys(f"{kind}:")) == []


# ---- inline and background compaction --------------------------------------------------------


async def test_inline_compaction_substitutes_on_the_next_prepare(make: MakeCompactor) -> None:
    llm = FakeLLM()
    c = make(llm, mode="inline")
    msgs = conversation(14)
    first = await prepare(c, msgs)
    assert SETTINGS.trigger_tokens < first.original_tokens <= SETTINGS.emergency_tokens
    assert first.decision.action == "inline"
    assert first.compacted_now and first.case == "summarize"
    assert first.record is not None
    assert first.forwarded_tokens < first.original_tokens
    assert summary_text(first).startswith(f"{SUMMARY_PREFIX}{first.record.k - 1} earlier")
    assert GOOD_SUMMARY in summary_text(first)
    assert_well_formed(first)
    assert [c.purpose for c in llm.calls] == ["detector", "summarizer"]

    # The client resends its full history plus a new turn: the stored record applies.
    longer = msgs + [{"role": "user", "content": "One more question."}]
    second = await prepare(c, longer)
    assert second.record == first.record
    assert not second.compacted_now
    assert second.decision.action == "forward"
    assert dumps(second.forwarded[: len(first.forwarded)]) == dumps(first.forwarded)
    assert second.forwarded[-1] == longer[-1]
    assert second.forwarded_tokens < second.original_tokens
    assert_well_formed(second)
    assert len(llm.calls) == 2  # no new LLM calls


async def test_a_record_read_once_comes_from_memory_while_the_store_names_it(
    make: MakeCompactor, store: DiskStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#28: a compacted conversation's record is read and decoded once, not on every request;
    the checkpoint read with each request says whether it is still the stored one."""
    c = make(FakeLLM(), mode="inline")
    msgs = conversation(14)
    first = await prepare(c, msgs)
    assert first.record is not None
    read: list[str] = []
    get_many = store.get_many

    def recording(keys: Any) -> dict[str, Any]:
        read.extend(keys)
        return get_many(keys)

    monkeypatch.setattr(store, "get_many", recording)

    def record_reads() -> int:
        return sum(1 for key in read if key.startswith("rec:"))

    longer = msgs + [{"role": "user", "content": "One more question."}]
    for _ in range(3):
        p = await prepare(c, longer)
        assert p.record == first.record and p.forwarded_tokens < p.original_tokens
    assert record_reads() == 1

    # Its retention over: read from the store again, which decides.
    late = first.record.created_at + 31 * 86400
    assert (await prepare(c, longer, now=late)).record == first.record
    assert record_reads() == 2

    # Another worker stores another record for the same prefix: its checkpoint names it.
    (key,) = store.keys("rec:")
    (ck,) = store.keys("ck:")
    theirs = dict(store.get(key))
    theirs["created_at"] = first.record.created_at + 1
    theirs["summary"] = {**theirs["summary"], "content": "Another worker's summary."}
    store.set(key, theirs)
    store.append(ck, {"k": theirs["k"], "h": theirs["prefix_hash"], "t": theirs["created_at"]})
    p = await prepare(c, longer)
    assert p.record is not None and p.record.summary == theirs["summary"]
    assert record_reads() == 3

    # The conversation deleted from the store: no record, whatever was read before (so
    # this request, over the trigger, is compacted afresh).
    store.delete(key)
    store.delete(ck)
    p = await prepare(c, longer)
    assert p.compacted_now and p.record is not None
    assert p.record.created_at not in (first.record.created_at, theirs["created_at"])


async def test_the_agents_figures_go_in_the_batch_and_are_held_meanwhile(
    make: MakeCompactor, store: DiskStore
) -> None:
    """#28: what the agent did since the compaction changes with nearly every request; it is
    written in the writer's next batch (not by a write of its own on the request path), and
    this worker answers the next request with what it queued until then."""
    c = make(FakeLLM(), mode="inline")
    msgs = conversation(14)
    first = await prepare(c, msgs)
    assert first.record is not None
    longer = msgs + [
        {"role": "assistant", "content": "Done with that."},
        {"role": "user", "content": "One more question."},
    ]
    p = await prepare(c, longer)
    key = conv_key("behave", p.tenant, p.conversation)
    figures = c._recent[key][0]
    assert figures[first.record.prefix_hash]["counts_after"] == [1, 1]
    assert c.writer._latest[key][0] is figures  # queued for the next batch
    # The next request, before the batch lands: this worker's figures, unchanged, so
    # nothing new is queued or reported.
    c.writer._latest.clear()
    again = await prepare(c, longer)
    assert again.record == first.record and key not in c.writer._latest
    c.writer.put(key, figures, None)  # (taken out above) written by the batch:
    await c.drain()
    assert store.get(key) == figures


async def test_background_compaction_via_schedule_and_drain(make: MakeCompactor) -> None:
    llm = FakeLLM()
    c = make(llm, mode="background")
    msgs = conversation(14)
    p = await prepare(c, msgs)
    assert p.decision.action == "background"
    assert not p.compacted_now and p.record is None
    assert dumps(p.forwarded) == dumps(msgs)  # this request goes out as sent
    assert llm.calls == []
    c.schedule(p)
    await c.drain()
    assert len(llm.of("summarizer")) == 1
    nxt = await prepare(c, msgs + [{"role": "user", "content": "next"}])
    assert nxt.record is not None and nxt.case == "summarize"
    assert nxt.forwarded_tokens < nxt.original_tokens
    assert_well_formed(nxt)
    events = store_events(c, nxt)
    assert [e["case"] for e in events] == ["summarize"]


def store_events(c: Compactor, p: Prepared) -> list[dict[str, Any]]:
    from proxy.adapters.store import get_list

    return get_list(c.store, conv_key("ev", p.tenant, p.conversation))


async def test_later_compaction_folds_in_the_earlier_summary(make: MakeCompactor) -> None:
    summaries = iter(
        ["FIRST-SUMMARY: the parser work is done.", "SECOND-SUMMARY: the ledger retry is done."]
    )
    llm = FakeLLM(summarizer=lambda _m: next(summaries))
    c = make(llm, mode="inline")
    msgs = conversation(14)
    first = await prepare(c, msgs)
    assert first.compacted_now and first.record is not None
    grown = conversation(26)
    assert dumps(grown[: len(msgs)]) == dumps(msgs)  # same history, grown
    second = await prepare(c, grown)
    assert second.compacted_now and second.record is not None
    calls = llm.of("summarizer")
    assert len(calls) == 2
    assert "EARLIER SUMMARY:\nFIRST-SUMMARY: the parser work is done." in calls[1].user_text
    assert "FIRST-SUMMARY" not in calls[0].user_text
    # The new record points at a longer original prefix; one summary is forwarded.
    assert second.record.k > first.record.k
    assert (
        sum(1 for m in second.forwarded if str(m.get("content", "")).startswith(SUMMARY_PREFIX))
        == 1
    )
    assert "SECOND-SUMMARY" in summary_text(second)
    assert summary_text(second).startswith(f"{SUMMARY_PREFIX}{second.record.k - 1} ")
    assert_well_formed(second)
    # The summarizer's span is exactly what the new record replaces (after the old summary).
    # Pins of the span (the user turn a cut between rounds falls in) are forwarded, not
    # summarized: every turn is in the span or forwarded, none in both.
    span_turns = [int(t) for t in re.findall(r"USER: Turn (\d+)\.", calls[1].user_text)]
    forwarded_turns = [
        int(m["content"].split(".")[0].split()[1])
        for m in second.forwarded
        if m["role"] == "user" and m["content"].startswith("Turn ")
    ]
    assert not set(span_turns) & set(forwarded_turns)
    everything = sorted([*span_turns, *forwarded_turns])
    assert everything == list(range(everything[0], everything[-1] + 1))
    after_first = [m for m in first.forwarded[body_start(first.record) :] if m["role"] == "user"]
    first_kept = int(re.findall(r"Turn (\d+)\.", after_first[0]["content"])[0])
    assert span_turns[0] <= first_kept


async def test_llm_requests_are_prose_without_tool_shapes(make: MakeCompactor) -> None:
    llm = FakeLLM()
    c = make(llm, mode="inline")
    p = await prepare(c, conversation(14))
    assert p.compacted_now
    assert {call.purpose for call in llm.calls} == {"detector", "summarizer"}
    for call in llm.calls:
        assert [m["role"] for m in call.messages] == ["system", "user"]
        for m in call.messages:
            assert set(m) == {"role", "content"} and isinstance(m["content"], str)
        assert call.model == MODEL and call.credential == "sk-test"
    summarizer = llm.of("summarizer")[0]
    assert summarizer.max_tokens == SETTINGS.summary_budget_tokens
    assert "called tool read_file(" in summarizer.user_text
    assert "TOOL RESULT (call_0_2):" in summarizer.user_text
    # Asked for less than its max_tokens, so that it usually ends by itself.
    assert "Summarize in 150 tokens." == summarizer.messages[0]["content"]


async def test_configured_models_are_used(make: MakeCompactor) -> None:
    llm = FakeLLM()
    c = make(llm, mode="inline", detection_model="det-model", summary_model="sum-model")
    await prepare(c, conversation(14))
    assert [(x.purpose, x.model) for x in llm.calls] == [
        ("detector", "det-model"),
        ("summarizer", "sum-model"),
    ]


# ---- failures and cooldown -------------------------------------------------------------------

FAILURES = [
    pytest.param(CompactionFailed, id="raises-CompactionFailed"),
    pytest.param("", id="empty"),
    pytest.param("   \n  ", id="whitespace"),
    pytest.param("I'm sorry, but I can't help with that request.", id="refusal"),
    pytest.param(LLMReply("Earlier the user and", "length", 100, 200, MODEL), id="cut-early"),
    pytest.param("The capital of France is Paris, famous for its museums.", id="off-topic"),
    pytest.param(LLMReply("", "tool_calls", 100, 20, MODEL), id="tool-call"),
]


@pytest.mark.parametrize("failure", FAILURES)
async def test_failing_summarizer_leaves_the_request_and_cools_down(
    make: MakeCompactor, store: DiskStore, failure: Behaviour
) -> None:
    llm = FakeLLM(summarizer=failure)
    c = make(llm, mode="inline")
    msgs = conversation(14)
    p = await prepare(c, msgs)
    assert p.decision.action == "inline"
    assert len(llm.of("summarizer")) == 1
    assert p.record is None and not p.compacted_now and p.case == "none"
    assert dumps(p.forwarded) == dumps(msgs)
    assert p.forwarded_tokens == p.original_tokens
    assert store.get(conv_key("cool", p.tenant, p.conversation)) is not None
    assert [e["case"] for e in store_events(c, p)] == ["failed"]

    calls = len(llm.calls)
    again = await prepare(c, msgs + [{"role": "user", "content": "still there?"}])
    assert len(llm.calls) == calls  # cooling down: the LLM is not called again
    assert again.decision.action == "forward" and "cooling" in again.decision.reason
    assert again.record is None
    c.schedule(again)
    await c.drain()
    assert len(llm.calls) == calls


async def test_failing_background_compaction_cools_down(make: MakeCompactor) -> None:
    llm = FakeLLM(summarizer="")
    c = make(llm, mode="background")
    msgs = conversation(14)
    p = await prepare(c, msgs)
    c.schedule(p)
    await c.drain()
    assert len(llm.of("summarizer")) == 1
    nxt = await prepare(c, msgs)
    assert nxt.decision.action == "forward" and not nxt.decision.use_llm
    c.schedule(nxt)
    await c.drain()
    assert len(llm.of("summarizer")) == 1
    # The failure reached the operators' counters (the overview and the conversation row).
    assert c.store.get(TOTALS_KEY)["compaction_failures"] == 1
    row = c.store.get(conv_key("conv", "tenant-a", p.conversation))
    assert row["compaction_failures"] == 1


async def test_cooldown_expires(make: MakeCompactor) -> None:
    llm = FakeLLM(summarizer="")
    c = make(llm, mode="inline", cooldown_s=0.2)
    msgs = conversation(14)
    await prepare(c, msgs)
    await asyncio.sleep(0.4)
    await prepare(c, msgs)
    assert len(llm.of("summarizer")) == 2


@pytest.mark.parametrize("failure", [CompactionFailed, "", "Sorry, I can't do that."])
async def test_over_emergency_with_a_failing_llm_truncates_whole_turns(
    make: MakeCompactor, failure: Behaviour
) -> None:
    llm = FakeLLM(summarizer=failure, detector=CompactionFailed)
    c = make(llm, mode="background")
    msgs = conversation(30)
    p = await prepare(c, msgs)
    limit = SETTINGS.emergency_tokens
    assert p.original_tokens > limit
    assert p.decision.action == "inline" and p.decision.limit_tokens == limit
    assert p.compacted_now and p.case == "emergency"
    assert p.record is not None and p.record.case == "emergency"
    assert p.forwarded_tokens <= limit
    assert EMERGENCY_NOTE in summary_text(p)
    assert_well_formed(p)
    # Only whole turns were dropped, the oldest ones, and as few as needed.
    assert p.original[p.record.k]["role"] == "user"
    kept = len(p.forwarded) - 2
    assert dumps(p.forwarded[2:]) == dumps(msgs[-kept:])
    assert len(llm.of("summarizer")) == 1

    # Cooling down: the next, longer request is truncated again without any LLM call.
    calls = len(llm.calls)
    more = msgs + conversation(3, seed=9, system=False)
    nxt = await prepare(c, more)
    assert len(llm.calls) == calls
    assert nxt.forwarded_tokens <= limit
    assert_well_formed(nxt)


async def test_over_the_context_window_compacts_inline(make: MakeCompactor) -> None:
    llm = FakeLLM()
    # The emergency limit (1M) is far above gpt-4o-mini's 128k window: the window binds.
    c = make(
        llm,
        mode="background",
        trigger_tokens=100_000,
        emergency_factor=10.0,
        verbatim_window_tokens=20_000,
    )
    msgs = conversation(500, words=150, tool_every=0)
    p = await prepare(c, msgs)
    assert p.original_tokens > 128_000 >= p.decision.limit_tokens
    assert p.decision.reason == "over context window"
    assert p.compacted_now and p.forwarded_tokens <= p.decision.limit_tokens
    assert_well_formed(p)


async def test_detector_garbage_still_summarizes(make: MakeCompactor) -> None:
    for detector in ("not json at all {", "", CompactionFailed, '{"boundary_index": "abc"}'):
        llm = FakeLLM(detector=detector)
        c = make(llm, mode="inline")
        p = await prepare(c, conversation(14), tenant=f"t-{detector!r}")
        assert p.compacted_now and p.case == "summarize", detector
        assert len(llm.of("summarizer")) == 1


async def test_confident_boundary_truncates_with_a_note(make: MakeCompactor) -> None:
    msgs = conversation(14)

    def detect(messages: list[Message]) -> str:
        # Point at the last-but-one user turn of the excerpt.
        lines = messages[1]["content"].splitlines()
        users = [int(x.split("]")[0][1:]) for x in lines if re.match(r"\[\d+\] USER:", x)]
        return json.dumps(
            {
                "boundary_index": users[-2],
                "boundary_reason": "new task",
                "confidence": "90%",
                "summary": "Old topic: the ledger NOTE-42.",
            }
        )

    llm = FakeLLM(detector=detect)
    c = make(llm, mode="inline")
    p = await prepare(c, msgs)
    assert p.compacted_now and p.case == "truncate"
    assert llm.of("summarizer") == []
    assert "Old topic: the ledger NOTE-42." in summary_text(p)
    assert sum(1 for m in p.forwarded[2:] if m["role"] == "user") == 2
    assert_well_formed(p)

    # Without a note, only a span without key facts may be dropped ...
    plain = conversation(14, tool_every=0)
    llm2 = FakeLLM(detector=detect)
    c2 = make(llm2, mode="inline", truncate_keeps_note=False)
    p2 = await prepare(c2, plain, tenant="other")
    assert p2.case == "truncate" and p2.record is not None and p2.record.summary is None
    assert p2.forwarded[0] == plain[0] and p2.forwarded[1]["role"] == "user"
    assert_well_formed(p2)
    # ... one with paths (src/modN.py) is summarized instead: truncation would lose them.
    p3 = await prepare(c2, msgs, tenant="third")
    assert p3.case == "summarize" and p3.record is not None
    assert "src/mod2.py" in summary_text(p3)
    assert not p3.record.facts_dropped


# ---- concurrency, tenants, edits -------------------------------------------------------------


def is_state_read(command: Any) -> bool:
    """The read of a request's conversation state (the lookup of ``prepare``)."""
    return isinstance(command, Read) and any(k.startswith("pause:") for k in command.values)


async def test_concurrent_inline_prepares_share_one_compaction(make: MakeCompactor) -> None:
    both_looked_up = asyncio.Event()

    async def detect(_messages: list[Message]) -> str:
        # Truly concurrent: the compaction cannot finish before the second request has
        # looked the conversation up (and so found no record yet).
        await both_looked_up.wait()
        await asyncio.sleep(0.05)
        return NULL_DETECTION

    llm = FakeLLM(detector=detect)
    c = make(llm, mode="inline")
    lookups = 0
    execute = c._execute

    async def counting(command: Any) -> Any:
        nonlocal lookups
        result = await execute(command)
        if is_state_read(command):
            lookups += 1
            if lookups == 2:
                both_looked_up.set()
        return result

    c._execute = counting  # type: ignore[method-assign]
    msgs = conversation(14)
    a, b = await asyncio.gather(prepare(c, msgs), prepare(c, copy.deepcopy(msgs)))
    assert len(llm.of("summarizer")) == 1
    assert len(llm.of("detector")) == 1
    assert a.record is not None and a.record == b.record
    assert dumps(a.forwarded) == dumps(b.forwarded)
    assert a.forwarded_tokens < a.original_tokens
    assert {a.compacted_now, b.compacted_now} == {True}


async def test_cancelled_compaction_does_not_strand_a_waiting_request(
    make: MakeCompactor,
) -> None:
    gate = asyncio.Event()

    async def blocked(_messages: list[Message]) -> str:
        await gate.wait()
        return GOOD_SUMMARY

    llm = FakeLLM(summarizer=blocked)
    c = make(llm, mode="inline")
    lookups = 0
    execute = c._execute

    async def counting(command: Any) -> Any:
        nonlocal lookups
        lookups += is_state_read(command)
        return await execute(command)

    c._execute = counting  # type: ignore[method-assign]
    msgs = conversation(14)
    first = asyncio.create_task(prepare(c, msgs))
    while not llm.of("summarizer"):
        await asyncio.sleep(0.01)
    second = asyncio.create_task(prepare(c, msgs))
    while lookups < 2:
        await asyncio.sleep(0.01)
    for _ in range(5):
        await asyncio.sleep(0.01)  # let the second request reach the running compaction
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    gate.set()
    # A hang guard, not a timing assertion: the waiter must finish at all.
    p = await asyncio.wait_for(second, timeout=20)
    assert dumps(p.original) == dumps(msgs)
    assert_well_formed(p)
    # The lock was released: a later request can compact.
    third = await prepare(c, msgs)
    assert third.record is not None


async def test_a_second_tenant_never_gets_the_first_tenants_record(make: MakeCompactor) -> None:
    llm = FakeLLM()
    msgs = conversation(14)
    inline = make(llm, mode="inline")
    a = await prepare(inline, msgs, tenant="tenant-a", conversation_header="shared-id")
    assert a.compacted_now and a.record is not None
    background = make(llm, mode="background")
    for header in ("shared-id", None):
        b = await prepare(background, msgs, tenant="tenant-b", conversation_header=header)
        assert b.record is None and dumps(b.forwarded) == dumps(msgs)
        # Even looking under tenant B's keys with tenant A's conversation finds nothing.
        chain_b = chain_of("tenant-b", msgs)
        found = await background.run(lookup("tenant-b", a.conversation, None, chain_b))
        assert found is None
    again = await prepare(background, msgs, tenant="tenant-a", conversation_header="shared-id")
    assert again.record == a.record


@pytest.mark.parametrize("header", [None, "pinned"])
async def test_an_edited_early_message_gets_no_stale_summary(
    make: MakeCompactor, header: str | None
) -> None:
    llm = FakeLLM()
    msgs = conversation(14)
    a = await prepare(make(llm, mode="inline"), msgs, conversation_header=header)
    assert a.record is not None
    background = make(llm, mode="background")
    for index in (1, 2, a.record.k - 1):
        edited = copy.deepcopy(msgs)
        edited[index]["content"] = str(edited[index].get("content")) + " (edited)"
        p = await prepare(background, edited, conversation_header=header)
        assert p.record is None, index
        assert dumps(p.forwarded) == dumps(edited)
    # The head (the system prompt: a clock in it) is never compacted: the summary stays, and
    # the head forwarded is the one sent now.
    edited = copy.deepcopy(msgs)
    edited[0]["content"] = "You are terse. It is now 10:41:07."
    p = await prepare(background, edited, conversation_header=header)
    assert p.record == a.record
    assert p.forwarded[0] == edited[0] and dumps(p.forwarded[1:]) == dumps(a.forwarded[1:])
    # An edit after k keeps the summary (the prefix it names is unchanged).
    edited = copy.deepcopy(msgs)
    edited[-1]["content"] = "changed answer"
    assert (await prepare(background, edited, conversation_header=header)).record == a.record


async def test_bypass_and_disabled_forward_unchanged(make: MakeCompactor) -> None:
    llm = FakeLLM()
    msgs = conversation(30)
    c = make(llm, mode="inline")
    p = await prepare(c, msgs, bypass=True)
    assert p.case == "off" and p.record is None and dumps(p.forwarded) == dumps(msgs)
    d = await prepare(make(llm, enabled=False), msgs)
    assert d.record is None and dumps(d.forwarded) == dumps(msgs)
    assert llm.calls == []


# ---- five successive compactions keep every planted fact -------------------------------------

FACTS = [
    "FACT-1: the deploy ticket is OPS-4821.",
    "FACT-2: the config lives at /srv/billing/config.yaml.",
    "FACT-3: the staging port is 8443.",
    "FACT-4: the database host is pg-billing-02.",
    "FACT-5: the runbook is https://wiki.example.internal/runbooks/rollback.",
    "FACT-6: the crash is a KeyError in parse_invoice().",
    "FACT-7: the release branch is release-2024.11-hotfix3.",
    "FACT-8: the on-call engineer is Priya Raman.",
]


def long_conversation(n_messages: int) -> tuple[list[Message], list[int]]:
    """The first 8 user messages each start with one FACT line; returns their indices too."""
    msgs = conversation(200, seed=7, words=55)
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"][: len(FACTS)]
    for i, fact in zip(users, FACTS, strict=True):
        msgs[i] = {**msgs[i], "content": f"{fact}\n{msgs[i]['content']}"}
    return msgs[:n_messages], users


async def test_five_successive_compactions_keep_every_planted_fact(
    make: MakeCompactor,
) -> None:
    llm = FakeLLM(summarizer=extractive)
    c = make(llm, mode="inline", trigger_tokens=3000, verbatim_window_tokens=800)
    full, fact_indices = long_conversation(300)
    assert len(full) == 300
    compactions = 0
    cases: list[str] = []
    last: Prepared | None = None
    for n in range(20, 301, 10):
        msgs = full[:n]
        if msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls"):
            msgs = full[: n + 1]  # never end on an unanswered call
        last = await prepare(c, msgs)
        assert last.forwarded_tokens <= SETTINGS.emergency_tokens * 1.5
        if last.compacted_now:
            compactions += 1
            cases.append(last.case)
            assert_well_formed(last)
            text = forwarded_text(last)
            assert all(f in text for f in FACTS), "a compaction lost a fact"
    assert last is not None and last.record is not None
    assert compactions >= 5, compactions
    assert set(cases) == {"summarize"}
    assert len(llm.of("summarizer")) == compactions
    text = forwarded_text(last)
    for fact in FACTS:
        assert fact in text, fact
    assert last.forwarded_tokens < last.original_tokens / 4
    # The facts survive only through the summaries: their messages were replaced long ago.
    assert last.record.k > fact_indices[-1]
    assert_well_formed(last)


async def test_a_compaction_that_saves_nothing_cools_down(
    make: MakeCompactor, store: DiskStore
) -> None:
    # A summary longer than what it replaces: no record, and no new LLM calls next time.
    llm = FakeLLM(summarizer="FACT padding. " * 2000)
    c = make(llm, mode="inline")
    msgs = conversation(14)
    p = await prepare(c, msgs)
    assert p.record is None and p.case == "none"
    assert len(llm.of("summarizer")) == 1
    assert store.get(conv_key("cool", p.tenant, p.conversation)) is not None
    calls = len(llm.calls)
    await prepare(c, msgs + [{"role": "user", "content": "and now?"}])
    assert len(llm.calls) == calls


# ---- #12: soft and hard failures, the loss report ------------------------------------------


async def test_a_rejected_summary_cools_down_briefly_a_failing_model_fully(
    make: MakeCompactor,
) -> None:
    soft = FakeLLM(summarizer="USER: hello\nASSISTANT: invented turn")
    c = make(soft, mode="inline", cooldown_s=300, soft_cooldown_s=0.2)
    msgs = conversation(14)
    p = await prepare(c, msgs)
    [event] = store_events(c, p)
    assert event["case"] == "failed" and event["soft"] is True
    assert event["error"] == "summary check failed: summary invents a transcript"
    await asyncio.sleep(0.4)  # the short cooldown is over: the next request tries again
    await prepare(c, msgs)
    assert len(soft.of("summarizer")) == 2

    hard = FakeLLM(summarizer=CompactionFailed)
    c2 = make(hard, mode="inline", cooldown_s=300, soft_cooldown_s=0.2)
    p2 = await prepare(c2, msgs, tenant="hard")
    assert store_events(c2, p2)[-1]["soft"] is False
    await asyncio.sleep(0.4)
    await prepare(c2, msgs, tenant="hard")
    assert len(hard.of("summarizer")) == 1  # still cooling down


async def test_the_loss_report_matches_the_forwarded_text(make: MakeCompactor) -> None:
    llm = FakeLLM(summarizer="The parser and the invoice ledger were reviewed for the deploy.")
    c = make(llm, mode="inline", key_references_max_chars=12)
    msgs = conversation(14)
    msgs[1] = {
        **msgs[1],
        "content": msgs[1]["content"] + " Ticket KB-7734-BLK, host db-eu-west-7.internal.",
    }
    p = await prepare(c, msgs)
    assert p.compacted_now and p.record is not None
    text = "\n".join(str(m.get("content")) for m in p.forwarded) + json.dumps(p.forwarded)
    r = p.record
    assert r.facts_dropped, "12 characters of key references cannot hold every fact"
    for fact in r.facts_dropped:
        assert fact not in text
    for fact in [*r.facts_kept, *r.facts_appended, *r.facts_elsewhere]:
        assert fact in text
    [event] = store_events(c, p)
    assert event["facts_dropped"] == len(r.facts_dropped)
    assert event["facts_kept"] == len(r.facts_kept) + len(r.facts_appended) + len(r.facts_elsewhere)


async def test_a_compaction_over_its_time_budget_gives_way_to_the_emergency_cut(
    make: MakeCompactor,
) -> None:
    """Each call is within ``llm_timeout_s``, but the compaction as a whole is not within
    ``compaction_timeout_s``: the request goes on with the emergency cut, and the
    conversation cools down instead of paying for the same slow attempt again."""
    llm = FakeLLM(delay=3600)  # the backstop is the budget under test, not this
    c = make(llm, mode="background", llm_timeout_s=7200, compaction_timeout_s=0.2)
    msgs = conversation(30)
    p = await asyncio.wait_for(prepare(c, msgs), timeout=120)
    assert p.compacted_now and p.case == "emergency"
    assert p.forwarded_tokens <= SETTINGS.emergency_tokens
    calls = len(llm.calls)
    nxt = await prepare(c, msgs + conversation(3, seed=9, system=False))
    assert len(llm.calls) == calls  # cooling down: no new LLM call
    assert nxt.forwarded_tokens <= SETTINGS.emergency_tokens
