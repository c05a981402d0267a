"""Cache stability (DESIGN §6): byte-stable prefixes, breakpoints, re-registration, net cost."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from proxy.adapters.llm import LLMReply
from proxy.adapters.store import DiskStore
from proxy.core import costs, stability
from proxy.core.errors import CompactionFailed
from proxy.core.prepared import Prompts
from proxy.core.records import conv_key
from proxy.core.settings import CompactionSettings
from proxy.core.stability import StabilityState, TierThresholds
from proxy.core.tokens import TokenCounter
from proxy.engine.compactor import Compactor
from proxy.operators import ledger
from tests.checks import INLINE, assert_forwarded_faithful, summary_index, summary_text
from tests.conversations import drive_conversation
from tests.proxyproc import ProxyProcess
from tests.upstream import ScriptedUpstream

MODEL = "gpt-4o-mini"
CLAUDE = "claude-sonnet-4-5-20250929"
SYSTEM = "You are a careful coding assistant for the billing service."
_counter = TokenCounter()


# ---- the tracker (pure) -------------------------------------------------------------------


def test_items_count_consecutive_requests_unchanged_in_place() -> None:
    state = stability.observe(None, ["system:a", "history:b"], None)
    assert [n for _, n in state.items] == [0, 0]
    state = stability.observe(state, ["system:a", "history:b", "history:c"], None)
    assert [n for _, n in state.items] == [1, 1, 0]
    state = stability.observe(state, ["system:a", "history:x", "history:c"], None)
    assert [n for _, n in state.items] == [2, 0, 0], "a changed item restarts at 0"


def test_a_compaction_purges_history_items_which_register_afresh() -> None:
    state = StabilityState(None, (("system:a", 5), ("history:b", 5), ("history:c", 5)))
    after = stability.observe(state, ["system:a", "history:b", "history:c"], "rec1")
    assert [n for _, n in after.items] == [6, 0, 0]
    again = stability.observe(after, ["system:a", "history:b", "history:c"], "rec1")
    assert [n for _, n in again.items] == [7, 1, 1]


def test_an_edit_in_place_is_found_and_remembered_a_few_requests() -> None:
    a, b, c, d = "system:a", "history:b", "history:c", "history:d"
    first = stability.observe(None, [a, b, c], None)
    # Appended to, shrunk (a regenerated reply), compacted in between: no edit in place.
    assert first.edit_at == -1
    assert stability.observe(first, [a, b, c, d], None).edit_at == -1
    assert stability.observe(first, [a, b], None).edit_at == -1
    assert stability.observe(first, [a, "history:x", c], "rec1").edit_at == -1
    # A message it had sent changed (an old result cleared): its index; under a record, the
    # index in the client's history the item forwards.
    changed = stability.observe(first, [a, "history:x", c, d], None)
    assert (changed.edit_at, changed.edit_age) == (1, 0)
    assert stability.observe(first, [a, "history:x", c], None, [0, 9, 10]).edit_at == 9
    assert stability.observe(first, [a, "history:x", c], None, [0, None, 10]).edit_at == -1
    # A head that changed (a clock in the system prompt) is no edit of the history: it is
    # forwarded as sent, never compacted. Its cache is lost all the same (counts restart).
    clocked = stability.observe(first, ["system:a2", b, c, d], None)
    assert clocked.edit_at == -1 and [n for _, n in clocked.items] == [0, 0, 0, 0]
    assert stability.observe(first, ["system:a2", "history:x", c], None).edit_at == 1
    assert stability.observe(first, ["system:a2", "system:z", "history:x", c], None).edit_at == 2
    assert stability.observe(first, [a, "system:z", b, c], None).edit_at == -1
    # Remembered, a request older each time, until another edit.
    later = stability.observe(changed, [a, "history:x", c, d, "history:e"], None)
    assert (later.edit_at, later.edit_age) == (1, 1)
    assert later.edit_limit() == 1
    edited = StabilityState(None, first.items, edit_at=7, edit_age=0)
    assert edited.edit_limit() == 7
    old = StabilityState(None, first.items, edit_at=7, edit_age=stability.EDIT_MEMORY)
    assert old.edit_limit() is None and first.edit_limit() is None
    # Stored and read back; a tracker stored before these fields reads as "never seen".
    assert StabilityState.from_json(orjson.loads(orjson.dumps(edited.to_json()))) == edited
    assert StabilityState.from_json(first.to_json()) == first
    assert "edit_at" not in first.to_json()
    bad = {**edited.to_json(), "edit_at": True}
    assert StabilityState.from_json(bad) == first


def test_tiers_follow_the_thresholds() -> None:
    t = TierThresholds(1, 3, 10)
    assert [t.tier(n) for n in (0, 1, 2, 3, 9, 10, 50)] == [0, 1, 1, 2, 2, 3, 3]


def test_breakpoints_at_tier_ends_never_more_than_four() -> None:
    levels = [3, 3, 3, 3, 2, 2, 1, 1, 0, 0]
    marks = stability.breakpoints(levels, head_len=1, summary_index=1)
    assert marks == [0, 1, 5, 7]
    assert len(stability.breakpoints([3] * 10, head_len=3, summary_index=3)) <= 4
    assert stability.breakpoints([0, 0, 0], head_len=0, summary_index=None) == []


def test_marks_go_on_the_last_part_and_clients_marks_are_detected() -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    marked = stability.with_marks(messages, [0])
    assert marked[0]["content"] == [
        {"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}
    ]
    assert messages[0]["content"] == "s", "the client's message must not be mutated"
    assert stability.has_cache_marks(marked)
    assert not stability.has_cache_marks(messages)


def test_no_mark_on_a_thinking_block() -> None:
    # A reply cut while thinking ends its message with the thinking block: the API's
    # thinking blocks take no cache_control (a 400), so that message carries no mark.
    for block in ({"type": "thinking", "thinking": "t", "signature": "s"},
                  {"type": "redacted_thinking", "data": "d"}):  # fmt: skip
        cut = {"role": "assistant", "content": [block]}
        after = {"role": "assistant", "content": [block, {"type": "text", "text": "done"}]}
        assert not stability.markable(cut)
        assert stability.markable(after)
        history = [{"role": "user", "content": "u"}, cut, {"role": "user", "content": "go on"}]
        assert stability.with_marks(history, [1])[1] == cut
        can_mark = [stability.markable(m) for m in history]
        # A stable run ending on the cut reply marks the message before it instead.
        assert stability.breakpoints([2, 2, 0], 0, None, can_mark) == [0]


# ---- a 60-turn session against a prefix-caching upstream ----------------------------------


def _drive(px: ProxyProcess, model: str, turns: int, key: str = "sk-cache") -> list[list[dict]]:
    client = openai.OpenAI(base_url=px.base_url, api_key=key, max_retries=0)
    sent: list[list[dict[str, Any]]] = []

    def send(messages: list[dict[str, Any]]) -> Any:
        sent.append(messages)
        reply = client.chat.completions.create(model=model, messages=messages)
        return reply.choices[0].message.model_dump(exclude_none=True)

    drive_conversation(send, turns, SYSTEM)
    return sent


def test_sixty_turns_keep_the_prefix_cached_between_compactions(tmp_path: Path) -> None:
    with ScriptedUpstream(count_tokens=lambda m: _counter.count_total(m, MODEL)) as up:
        with ProxyProcess(
            tmp_path,
            up.base_url,
            compaction={
                "trigger_tokens": 12000,
                "verbatim_window_tokens": 6000,
                "summary_budget_tokens": 300,
                "mode": "inline",
            },
        ) as px:
            sent = _drive(px, MODEL, 60)
        requests = up.chat_requests()
        assert len(requests) == len(sent) == len(up.cached_log)
        forwarded = [r.json["messages"] for r in requests]
        summaries = [summary_text(f) for f in forwarded]
        compactions = [i for i in range(1, len(summaries)) if summaries[i] != summaries[i - 1]]
        # Each compaction leaves at most half the trigger (compact_to_share, #25: no
        # treadmill), so 60 turns make two; before, with a 6,000-token window, they made 4.
        assert len(compactions) >= 2, f"only {len(compactions)} compactions"

        prompt = cached = 0
        for i, (p, c) in enumerate(up.cached_log):
            # The first request has nothing to reuse; a request right after a compaction
            # is the one planned cache miss; below 1,024 tokens nothing is cacheable.
            if i == 0 or i in compactions or up.cached_log[i - 1][0] < 1024:
                continue
            prompt += p
            cached += c
        assert cached / prompt >= 0.90, f"cached share {cached / prompt:.3f}"

        # Byte equality, directly: between compactions the serialised messages of each
        # request are a byte prefix of the next, and that is what went over the wire.
        checked = 0
        for i in range(1, len(requests)):
            if i in compactions or summaries[i] is None:
                continue
            before = orjson.dumps(forwarded[i - 1])
            after = orjson.dumps(forwarded[i])
            assert before in requests[i - 1].body and after in requests[i].body
            assert after.startswith(before[:-1]), f"prefix bytes changed at request {i}"
            checked += 1
        assert checked >= 20
        for client_msgs, fwd in zip(sent, forwarded, strict=True):
            assert_forwarded_faithful(client_msgs, fwd)


# ---- breakpoints through the proxy --------------------------------------------------------


def _mark_positions(messages: list[dict[str, Any]]) -> list[int]:
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list) and any("cache_control" in p for p in content):
            out.append(i)
    return out


def _unmarked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and len(content) == 1 and "cache_control" in content[0]:
            m = {**m, "content": content[0]["text"]}
        out.append(m)
    return out


def test_anthropic_breakpoints_at_tier_ends_and_replaced_after_compaction(tmp_path: Path) -> None:
    with ScriptedUpstream() as up:
        with ProxyProcess(
            tmp_path,
            up.base_url,
            compaction=INLINE,
        ) as px:
            sent = _drive(px, CLAUDE, 30)
            forwarded = [r.json["messages"] for r in up.chat_requests()]
            summaries = [summary_text(_unmarked(f)) for f in forwarded]
            re_placed = 0
            for i, fwd in enumerate(forwarded):
                marks = _mark_positions(fwd)
                assert 1 <= len(marks) <= 4
                assert marks[0] == 0, "the system prompt's end is a tier end"
                s = summary_index(_unmarked(fwd))
                if s is not None:
                    assert s in marks, "the summary is a tier end"
                if i == 0:
                    continue
                compacted_now = summaries[i] != summaries[i - 1]
                history_marks = [m for m in marks if m > (s if s is not None else 0)]
                if compacted_now:
                    assert history_marks == [], "history items must re-register after compaction"
                    re_placed += 1
                else:
                    # Unchanged in place since the last request: the mark goes on the last
                    # message of the previous request that can carry one.
                    previous = forwarded[i - 1]
                    last = max(j for j, m in enumerate(previous) if stability.markable(m))
                    assert history_marks and history_marks[-1] == last
                assert_forwarded_faithful(sent[i], _unmarked(fwd))
            assert re_placed >= 2

            client = openai.OpenAI(base_url=px.base_url, api_key="sk-own", max_retries=0)
            own = [
                {
                    "role": "system",
                    "content": [
                        {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}
                    ],
                },
                {"role": "user", "content": "hello"},
            ]
            client.chat.completions.create(model=CLAUDE, messages=own)
            client.chat.completions.create(model=CLAUDE, messages=own)
            assert up.chat_requests()[-1].json["messages"] == own, "client's own marks touched"

            _drive(px, MODEL, 6, key="sk-openai")
            for r in up.chat_requests()[-6:]:
                assert _mark_positions(r.json["messages"]) == [], (
                    "marks sent to a non-Anthropic model"
                )


# ---- net cost ---------------------------------------------------------------------------


def _entry(**kw: Any) -> ledger.RequestEntry:
    base = dict(
        ts=1_800_000_000.0,
        tenant="t",
        conversation="c",
        model=MODEL,
        route="chat.completions",
        case="none",
        status=200,
        original_messages=10,
        forwarded_messages=10,
        original_tokens=0,
        forwarded_tokens=0,
        prompt_tokens=0,
        cached_tokens=0,
        cache_write_tokens=0,
        completion_tokens=0,
        latency_s=0.1,
        overhead_s=0.001,
    )
    base.update(kw)
    return ledger.RequestEntry(**base)  # type: ignore[arg-type]


def test_net_cost_matches_hand_computed_figures(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "s")
    p = costs.prices_for(MODEL)
    assert (p.input, p.cache_read) == (1.5e-07, 7.5e-08)
    # Request 1: 4,000 tokens, uncompacted, nothing cached yet.
    ledger.record_request(
        store, _entry(original_tokens=4000, forwarded_tokens=4000, prompt_tokens=4000), None, None
    )
    # A compaction that spent 3,000 prompt + 200 completion tokens on the summarizer.
    ledger.record_compaction(
        store,
        "t",
        "c",
        record="r1",
        case="summarize",
        llm_tokens=3200,
        llm_usd=3000 * 1.5e-07 + 200 * 6e-07,
        retention_s=None,
    )
    # Request 2: client sends 5,000; 2,000 forwarded; the new prefix misses the cache.
    ledger.record_request(
        store,
        _entry(
            original_tokens=5000,
            forwarded_tokens=2000,
            prompt_tokens=2000,
            case="summarize",
            record="r1",
        ),
        None,
        None,
    )
    # Request 3: client sends 5,600; 2,600 forwarded; 1,920 cached.
    ledger.record_request(
        store,
        _entry(
            original_tokens=5600,
            forwarded_tokens=2600,
            prompt_tokens=2600,
            cached_tokens=1920,
            case="summarize",
            record="r1",
        ),
        None,
        None,
    )
    meta = store.get(conv_key("conv", "t", "c"))
    # By hand. Counterfactual: the previous original history cached (floor to 128s).
    cf1 = 4000 * 1.5e-07
    cf2 = (5000 - 3968) * 1.5e-07 + 3968 * 7.5e-08
    cf3 = (5600 - 4992) * 1.5e-07 + 4992 * 7.5e-08
    act1 = 4000 * 1.5e-07
    act2 = 2000 * 1.5e-07
    act3 = (2600 - 1920) * 1.5e-07 + 1920 * 7.5e-08
    llm = 3000 * 1.5e-07 + 200 * 6e-07
    assert meta["saved_tokens"] == 3000 + 3000
    assert meta["cache_tokens_lost"] == 3968 + (4992 - 1920)
    assert meta["llm_tokens"] == 3200
    assert ledger.net_usd(meta) == pytest.approx(cf1 + cf2 + cf3 - act1 - act2 - act3 - llm)
    per = meta["by_compaction"]["r1"]
    assert per["gross_tokens"] == 6000 and per["requests"] == 2
    assert per["cache_tokens_lost"] == 3968 + 3072
    totals = store.get(ledger.TOTALS_KEY)
    assert ledger.net_usd(totals) == pytest.approx(ledger.net_usd(meta))
    store.close()


class _ScriptedLLM:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def complete(
        self, model: str, messages: Any, *, max_tokens: int, purpose: str, credential: str | None
    ) -> LLMReply:
        self.calls.append(purpose)
        if purpose == "detector":
            return LLMReply('{"boundary_index": null}', "stop", 10, 5, model)
        text = "\n".join(line for line in messages[-1]["content"].splitlines() if "FACT" in line)
        if not text:
            raise CompactionFailed("nothing to say")
        return LLMReply(text, "stop", 100, 20, model)


def _history(n_turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for i in range(n_turns):
        messages.append({"role": "user", "content": f"FACT {i}: " + "word " * 300})
        messages.append({"role": "assistant", "content": "ok " * 100})
    return messages


async def test_cost_policy_waits_until_compaction_pays(tmp_path: Path) -> None:
    settings = CompactionSettings(
        trigger_tokens=4000,
        verbatim_window_tokens=1000,
        mode="inline",
        policy="cost",
        cost_horizon_requests=20,
    )
    store = DiskStore(tmp_path / "s")
    llm = _ScriptedLLM()
    engine = Compactor(settings, store, llm, Prompts("d", "s"))
    messages = _history(14)
    first = await engine.prepare(messages, model=MODEL, tenant="t")
    key = conv_key("conv", first.tenant, first.conversation)
    # A mostly cached, young conversation: re-reading its prefix is cheap; a compaction
    # (a cache miss plus the summarizer reading it all) does not pay back in one request.
    store.set(key, {"requests": 1, "prompt_tokens": 10000, "cached_tokens": 9500})
    young = await engine.prepare(messages, model=MODEL, tenant="t")
    assert young.decision.action == "forward" and "cost" in young.decision.reason
    assert llm.calls == [] and young.record is None
    # The same conversation after many requests: the saving over the horizon pays (180: a
    # ninth of them, the conservative horizon of #25, is the configured 20).
    store.set(key, {"requests": 180, "prompt_tokens": 1800000, "cached_tokens": 1710000})
    old = await engine.prepare(messages, model=MODEL, tenant="t")
    assert old.decision.action == "inline" and old.record is not None
    assert "summarizer" in llm.calls
    # The tokens policy would have compacted the young conversation at once.
    eager = Compactor(
        CompactionSettings(
            trigger_tokens=4000, verbatim_window_tokens=1000, mode="inline", policy="tokens"
        ),
        DiskStore(tmp_path / "s2"),
        _ScriptedLLM(),
        Prompts("d", "s"),
    )
    assert (await eager.prepare(messages, model=MODEL, tenant="t")).record is not None
    store.close()
