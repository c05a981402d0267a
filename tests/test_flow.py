"""The compaction flow stepped by hand (#14): no server, no store, no LLM client, no fakes of
I/O classes. Each test sends plain values (a store read, an LLM reply, a failure) and asserts
the next command the flow asks for, for each case: none, prune, truncate, summarize,
emergency and failure.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import pytest

from proxy.core import candidates, flow_compact, flow_prepare, planner
from proxy.core.candidates import EMERGENCY_NOTE
from proxy.core.commands import CompactNow, Complete, Cooldown, Emit, Persist, Read
from proxy.core.errors import CompactionFailed, StoreError
from proxy.core.prepared import Env, Outcome, Prepared
from proxy.core.settings import CompactionSettings
from proxy.core.tokens import TokenCounter
from tests.test_compactor import (
    GOOD_SUMMARY,
    MODEL,
    NULL_DETECTION,
    PROMPTS,
    SETTINGS,
    conversation,
)

COUNTER = TokenCounter()


@dataclass
class Reply:
    """An LLM reply as the flow reads it (``Complete``'s result)."""

    text: str
    finish_reason: str = "stop"
    prompt_tokens: int = 100
    completion_tokens: int = 20
    model: str = MODEL


class Stepper:
    """Holds a flow and its pending command; ``send``/``throw`` answer it."""

    def __init__(self, flow: Generator[Any, Any, Any]) -> None:
        self.flow = flow
        self.done = False
        self.result: Any = None
        self.command: Any = None
        self._resume(lambda: next(flow))

    def _resume(self, step: Any) -> None:
        try:
            self.command = step()
        except StopIteration as stop:
            self.done, self.result, self.command = True, stop.value, None

    def send(self, value: Any = None) -> Any:
        assert not self.done
        self._resume(lambda: self.flow.send(value))
        return self.command

    def throw(self, exc: BaseException) -> Any:
        assert not self.done
        self._resume(lambda: self.flow.throw(exc))
        return self.command


def env(**overrides: Any) -> Env:
    return Env.of(CompactionSettings(**{**SETTINGS.__dict__, **overrides}), PROMPTS, COUNTER)


def nothing_stored(read: Read) -> dict[str, Any]:
    """What an empty store answers to ``read``."""
    return {**{k: None for k in read.values}, **{k: [] for k in read.lists}}


def request(**kw: Any) -> flow_prepare.Request:
    return flow_prepare.Request(model=MODEL, tenant="tenant-a", credential="sk-test", **kw)


def start(e: Env, msgs: list[dict[str, Any]]) -> Stepper:
    """A prepare flow, past its state reads (an empty store)."""
    step = Stepper(flow_prepare.prepare(e, msgs, request()))
    assert isinstance(step.command, Read)
    assert any(k.startswith("pause:tenant-a:") for k in step.command.values)
    assert any(k.startswith("ck:tenant-a:") for k in step.command.lists)
    step.send(nothing_stored(step.command))
    if isinstance(step.command, Read):
        # No tracker under this id: the one of the session's first request, before its
        # first reply (no record to read: no checkpoint was found).
        assert [k.split(":")[0] for k in step.command.values] == ["stab"]
        step.send(nothing_stored(step.command))
    return step


def compacting(e: Env, step: Stepper, *, inline: bool = True) -> tuple[Prepared, Stepper]:
    """The prepare flow asks for an inline compaction: step that compaction's own flow."""
    assert isinstance(step.command, CompactNow)
    p = step.command.prepared
    inner = Stepper(flow_compact.compact(e, p, inline=inline))
    # First it looks for a record another worker stored meanwhile: none.
    assert isinstance(inner.command, Read) and inner.command.lists
    inner.send(nothing_stored(inner.command))
    return p, inner


def finish_persist(step: Stepper, case: str) -> Any:
    """A ``Persist`` of a ``case`` record, then its event; returns the record."""
    assert isinstance(step.command, Persist), step.command
    record = step.command.record
    assert record.case == case
    step.send(None)
    assert isinstance(step.command, Emit) and step.command.event["case"] == case
    assert step.command.event["tokens_after"] == record.tokens_after
    step.send(None)
    return record


def summarized(e: Env) -> tuple[Stepper, Prepared, Any]:
    """A 14-turn conversation summarized inline: the prepare flow, its request, the record."""
    step = start(e, conversation(14))
    p, inner = compacting(e, step)
    inner.send(Reply(NULL_DETECTION))
    inner.send(Reply(GOOD_SUMMARY))
    return step, p, finish_persist(inner, "summarize")


# ---- none ------------------------------------------------------------------------------------


def test_none_below_the_trigger_one_read_then_forwarded_as_sent() -> None:
    msgs = conversation(4)
    step = start(env(mode="inline"), msgs)
    assert step.done, step.command  # no further I/O: nothing to compact
    p: Prepared = step.result
    assert p.case == "none" and p.record is None and not p.compacted_now
    assert p.decision.action == "forward" and p.decision.reason == "below trigger"
    assert p.forwarded == msgs


def test_a_store_failure_on_the_read_forwards_unchanged() -> None:
    msgs = conversation(30)
    step = Stepper(flow_prepare.prepare(env(), msgs, request()))
    assert isinstance(step.command, Read)
    step.throw(StoreError("store down"))
    # Over the emergency limit, so it compacts inline even without the store's state.
    assert isinstance(step.command, CompactNow)


def test_skipped_requests_read_nothing() -> None:
    from proxy.core.controls import Controls

    skip = Controls("bypassed by x-compaction: off", "off")
    step = Stepper(flow_prepare.prepare(env(), conversation(30), request(controls=skip)))
    assert step.done and step.result.case == "off" and step.result.skipped


# ---- prune -----------------------------------------------------------------------------------


def tool_heavy(rounds: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the failing build of the parser module."},
    ]
    for i in range(rounds):
        args = json.dumps({"path": f"f{i}.py"})
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "read_file", "arguments": args}}  # fmt: skip
        msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        body = " ".join(f"line{i}_{j} = compute({j})" for j in range(400))
        msgs.append({"role": "tool", "tool_call_id": f"call_{i}", "content": body})
    msgs.append({"role": "assistant", "content": "The build is fixed."})
    return msgs


def test_prune_inline_without_any_llm_call() -> None:
    e = env(prune=True, trigger_tokens=20_000, emergency_factor=10.0, prune_clear_at_least=2_000,
            prune_protect_tokens=1_000, prune_keep_tool_results=2)  # fmt: skip
    msgs = tool_heavy(12)
    step = start(e, msgs)
    record = finish_persist(step, "prune")
    assert step.done
    p: Prepared = step.result
    assert p.case == "prune" and p.compacted_now and p.record == record
    assert p.forwarded_tokens < p.original_tokens
    assert record.pruned  # which tool results were cleared, by index
    assert len(p.forwarded) == len(msgs)  # pruning replaces contents, never messages


# ---- summarize -------------------------------------------------------------------------------


def test_summarize_inline_detector_then_summarizer_then_persist() -> None:
    e = env(mode="inline")
    step = start(e, conversation(14))
    p, inner = compacting(e, step)
    assert isinstance(inner.command, Complete) and inner.command.purpose == "detector"
    assert inner.command.credential == "sk-test"
    inner.send(Reply(NULL_DETECTION))
    assert isinstance(inner.command, Complete) and inner.command.purpose == "summarizer"
    assert inner.command.max_tokens == SETTINGS.summary_budget_tokens
    inner.send(Reply(GOOD_SUMMARY))
    record = finish_persist(inner, "summarize")
    assert inner.done
    outcome: Outcome = inner.result
    assert outcome.case == "summarize" and outcome.record == record
    assert record.llm_tokens == 240  # both calls' prompt and completion tokens
    # The prepare flow forwards the new record.
    step.send(outcome)
    assert step.done
    done: Prepared = step.result
    assert done.compacted_now and done.case == "summarize" and done.record == record
    assert done.forwarded_tokens < p.forwarded_tokens
    assert any(GOOD_SUMMARY in str(m.get("content")) for m in done.forwarded)


def test_a_summary_longer_than_counted_by_its_references_alone_is_not_refused() -> None:
    # The cut is chosen before the LLM calls, counting the summary at its budget and the
    # Key references line at its base budget; the line's budget grows with the span (up to
    # 4x). A summary over the no-treadmill target by no more than that was refused after its
    # two calls (three replayed runs on OpenAI's prices: calls paid for nothing, 1.01x).
    e = env(mode="inline")
    _, p, record = summarized(e)
    target = planner.relaxed_target(e.settings, p.forwarded_tokens)
    refs = " ".join(f"src/pkg/module_{n}.py" for n in range(60))
    long_note = {
        **record.summary,
        "content": f"{record.summary['content']}\n\nKey references: {refs}",
    }
    longer = candidates.overrun(e, p, dataclasses.replace(record, summary=long_note))
    assert 0 < longer and target + longer < p.forwarded_tokens
    assert candidates.overrun(e, p, record) == 0  # the ordinary summary fits the count

    def judged(summary: Any, after: int) -> bool:
        made = dataclasses.replace(record, summary=summary, tokens_after=after)
        return candidates.verdict(e, p, Outcome("summarize", made, "r")).record is not None

    assert judged(record.summary, target) and not judged(record.summary, target + 1)
    assert judged(long_note, target + longer) and not judged(long_note, target + longer + 1)


# ---- truncate --------------------------------------------------------------------------------


def test_truncate_on_a_confident_boundary_needs_no_summarizer() -> None:
    e = env(mode="inline")
    step = start(e, conversation(14))
    _, inner = compacting(e, step)
    assert isinstance(inner.command, Complete) and inner.command.purpose == "detector"
    lines = str(inner.command.messages[1]["content"]).splitlines()
    users = [int(x.split("]")[0][1:]) for x in lines if re.match(r"\[\d+\] USER:", x)]
    detection = {"boundary_index": users[-2], "boundary_reason": "new task",
                 "confidence": "90%", "summary": "Old topic: the ledger NOTE-42."}  # fmt: skip
    inner.send(Reply(json.dumps(detection)))
    record = finish_persist(inner, "truncate")  # no summarizer call in between
    assert "Old topic: the ledger NOTE-42." in str(record.summary["content"])
    step.send(inner.result)
    assert step.done and step.result.case == "truncate"


# ---- emergency and failure -------------------------------------------------------------------


def test_emergency_when_both_llm_calls_fail_over_the_limit() -> None:
    e = env(mode="background")
    step = start(e, conversation(30))
    p, inner = compacting(e, step)
    assert p.decision.action == "inline" and p.decision.limit_tokens == SETTINGS.emergency_tokens
    assert isinstance(inner.command, Complete) and inner.command.purpose == "detector"
    inner.throw(CompactionFailed("detector down"))
    assert isinstance(inner.command, Emit) and inner.command.event["case"] == "detector_failed"
    inner.send(None)
    assert isinstance(inner.command, Complete) and inner.command.purpose == "summarizer"
    inner.throw(CompactionFailed("summarizer down"))
    assert isinstance(inner.command, Cooldown) and inner.command.seconds == SETTINGS.cooldown_s
    inner.send(None)
    assert isinstance(inner.command, Emit) and inner.command.event["case"] == "failed"
    assert inner.command.event["soft"] is False
    inner.send(None)
    record = finish_persist(inner, "emergency")
    assert EMERGENCY_NOTE in str(record.summary["content"])
    assert record.tokens_after <= SETTINGS.emergency_tokens
    step.send(inner.result)
    assert step.done and step.result.case == "emergency"
    assert step.result.forwarded_tokens <= SETTINGS.emergency_tokens


@pytest.mark.parametrize("junk", ["", "USER: hi\nASSISTANT: hello\nUSER: refund now please"])
def test_a_refused_summary_is_a_soft_failure_with_nothing_forwarded(junk: str) -> None:
    e = env(mode="background")
    step = start(e, conversation(14))
    assert step.done and step.result.decision.action == "background"
    p: Prepared = step.result
    inner = Stepper(flow_compact.compact(e, p, inline=False))
    inner.send(nothing_stored(inner.command))  # no record stored meanwhile
    # In the background it first checks the cooldown an earlier failure may have set.
    assert isinstance(inner.command, Read) and inner.command.values[0].startswith("cool:")
    inner.send({inner.command.values[0]: None})
    inner.send(Reply(NULL_DETECTION))
    assert isinstance(inner.command, Complete) and inner.command.purpose == "summarizer"
    inner.send(Reply(junk))
    assert isinstance(inner.command, Cooldown)
    assert inner.command.seconds == min(SETTINGS.soft_cooldown_s, SETTINGS.cooldown_s)
    inner.send(None)
    assert isinstance(inner.command, Emit) and inner.command.event["soft"] is True
    inner.send(None)
    assert inner.done  # nothing persisted: below the emergency limit, no fallback
    assert inner.result.record is None and "summary check failed" in inner.result.reason


def test_a_record_stored_meanwhile_is_reused_without_llm_calls() -> None:
    e = env(mode="inline")
    step, _, record = summarized(e)
    # A second request of the same history finds the record's checkpoint and reads it.
    again = Stepper(flow_compact.compact(e, step.command.prepared, inline=True))
    ck = {"k": record.k, "h": record.prefix_hash}
    assert isinstance(again.command, Read)
    again.send({k: [ck] for k in again.command.lists})
    assert isinstance(again.command, Read) and again.command.values[0].startswith("rec:")
    again.send({again.command.values[0]: record.to_json()})
    assert again.done and again.result.reused and again.result.record == record


def test_one_read_when_the_conversation_has_its_own_tracker() -> None:
    """The session's earlier tracker is read only when this id has none: one store round
    trip for a request of a known conversation with nothing to substitute."""
    msgs = conversation(4)
    step = Stepper(flow_prepare.prepare(env(mode="inline"), msgs, request()))
    assert isinstance(step.command, Read)
    answer = nothing_stored(step.command)
    stab = next(k for k in step.command.values if k.startswith("stab:"))
    answer[stab] = {"record": None, "items": [["h0", 3]]}
    step.send(answer)
    assert step.done and step.result.stability is not None
