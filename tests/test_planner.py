"""proxy.planner: legal cuts, the verbatim window, the one decision, cases, emergency cuts."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.core import planner
from proxy.core.messages import SUMMARY_PREFIX, head_length
from proxy.core.planner import (
    choose_case,
    cut_points,
    decide,
    emergency_cut,
    hard_limit,
    latest_cut_keeping,
    nearest_cut,
    plan_cut,
    summary_index,
    summary_message,
    verbatim_start,
)
from proxy.core.settings import CompactionSettings

Message = dict[str, Any]


def sys_(text: str = "You are helpful.") -> Message:
    return {"role": "system", "content": text}


def user(text: str = "question") -> Message:
    return {"role": "user", "content": text}


def asst(text: str = "answer") -> Message:
    return {"role": "assistant", "content": text}


def calls(*ids: str) -> Message:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids
        ],
    }


def result(call_id: str) -> Message:
    return {"role": "tool", "tool_call_id": call_id, "content": "ok"}


def separated(messages: list[Message], cut: int) -> bool:
    """True when a tool result at or after ``cut`` answers a call issued before ``cut``."""
    issued = {c["id"]: i for i, m in enumerate(messages) for c in (m.get("tool_calls") or [])}
    return any(
        m.get("role") == "tool" and issued.get(m["tool_call_id"], cut) < cut for m in messages[cut:]
    )


# ---- cut points ------------------------------------------------------------------------------


def test_cut_points_are_user_messages() -> None:
    msgs = [sys_(), user(), asst(), user(), asst(), user()]
    assert cut_points(msgs) == [1, 3, 5]
    assert cut_points(msgs, start=2) == [3, 5]


def test_cut_points_never_separate_tool_calls_from_their_results() -> None:
    msgs = [
        sys_(),  # 0
        user(),  # 1
        calls("a", "b"),  # 2
        result("a"),  # 3
        user("interjection while a tool runs"),  # 4: b is still unanswered here
        result("b"),  # 5
        asst(),  # 6
        user(),  # 7
        calls("c"),  # 8
        user("another interjection"),  # 9: c answered later
        result("c"),  # 10
        user(),  # 11
    ]
    assert cut_points(msgs, rounds=False) == [1, 7, 11]
    # 6: an assistant message after a completed round (a and b both answered) is a cut too.
    cuts = cut_points(msgs)
    assert cuts == [1, 6, 7, 11]
    for c in cuts:
        assert not separated(msgs, c)
    # Every user message that is not a legal cut really would separate a call from its result.
    for i, m in enumerate(msgs):
        if m["role"] == "user" and i not in cuts:
            assert separated(msgs, i)


def test_unanswered_call_separates_nothing() -> None:
    msgs = [user(), calls("lost"), user(), asst(), user()]
    assert cut_points(msgs) == [0, 2, 4]


def test_head_system_and_developer_messages_are_never_cuts() -> None:
    msgs = [sys_(), {"role": "developer", "content": "d"}, user(), asst(), user()]
    assert head_length(msgs) == 2
    assert all(c >= 2 for c in cut_points(msgs))
    plan = plan_cut(
        msgs,
        [10] * len(msgs),
        2,
        CompactionSettings(verbatim_window_tokens=5, min_verbatim_exchanges=1),
    )
    assert plan is not None and plan.body_start == 2
    assert all(c > plan.body_start for c in [plan.verbatim_start, plan.latest_cut])
    cut = emergency_cut(msgs, [10] * len(msgs), 2, limit_tokens=1, note_tokens=0)
    assert cut is not None and cut > 2


# ---- the verbatim window ---------------------------------------------------------------------


def alternating(turns: int, head: int = 1) -> list[Message]:
    msgs = [sys_() for _ in range(head)]
    for t in range(turns):
        msgs += [user(f"q{t}"), asst(f"a{t}")]
    return msgs


def test_verbatim_window_stops_at_its_budget() -> None:
    msgs = alternating(6)  # 13 messages: 0 system, users at 1,3,...,11
    counts = [100] * len(msgs)
    s = CompactionSettings(verbatim_window_tokens=450, min_verbatim_exchanges=1)
    start = verbatim_start(msgs, counts, 1, s, cut_points(msgs, 1))
    # 400 tokens fit: messages 9..12; the window starts at the user message 9.
    assert start == 9


def test_verbatim_window_keeps_min_exchanges_beyond_its_budget() -> None:
    msgs = alternating(6)
    counts = [100] * len(msgs)
    for min_ex in (1, 2, 3, 4):
        s = CompactionSettings(verbatim_window_tokens=50, min_verbatim_exchanges=min_ex)
        start = verbatim_start(msgs, counts, 1, s, cut_points(msgs, 1))
        assert start is not None
        kept = sum(1 for m in msgs[start:] if m["role"] == "user")
        assert kept >= min_ex
        assert kept == min_ex  # and no more than needed when the budget is tiny


def test_verbatim_window_moves_back_to_a_turn_start() -> None:
    msgs = [sys_(), user(), asst(), user(), calls("a"), result("a"), asst(), user(), asst()]
    counts = [10] * len(msgs)
    s = CompactionSettings(verbatim_window_tokens=25, min_verbatim_exchanges=1)
    # The budget covers 8 and 7 exactly: the window starts at the user turn 7.
    assert verbatim_start(msgs, counts, 1, s, cut_points(msgs, 1)) == 7
    for budget in (35, 45):
        # The budget ends inside the turn that starts at 3 (3: user, 4-5: tool round,
        # 6: answer): the window moves back to that turn's start, never into the round...
        s2 = CompactionSettings(verbatim_window_tokens=budget, min_verbatim_exchanges=1)
        start = verbatim_start(msgs, counts, 1, s2, cut_points(msgs, 1, rounds=False))
        assert start == 3
        assert msgs[start]["role"] == "user" and not separated(msgs, start)
        # ...or to the answer after the completed round, when cuts between rounds are legal.
        start = verbatim_start(msgs, counts, 1, s2, cut_points(msgs, 1))
        assert start == 6 if budget == 35 else start == 3
        assert not separated(msgs, start)


def test_verbatim_window_none_when_too_few_exchanges_or_everything_fits() -> None:
    msgs = alternating(2)
    counts = [10] * len(msgs)
    s = CompactionSettings(verbatim_window_tokens=1, min_verbatim_exchanges=3)
    assert verbatim_start(msgs, counts, 1, s, cut_points(msgs, 1)) is None
    s_all = CompactionSettings(verbatim_window_tokens=10_000, min_verbatim_exchanges=1)
    assert verbatim_start(msgs, counts, 1, s_all, cut_points(msgs, 1)) is None
    assert plan_cut(msgs, counts, 1, s_all) is None


def test_latest_cut_keeping_min_exchanges() -> None:
    msgs = alternating(5)
    cuts = cut_points(msgs)
    assert latest_cut_keeping(msgs, cuts, 2) == 7
    assert latest_cut_keeping(msgs, cuts, 1) == 9
    assert latest_cut_keeping(msgs, cuts, 0) == 9  # at least one user turn is always kept
    assert latest_cut_keeping(msgs, cuts, 6) is None


def test_plan_cut_skips_an_earlier_summary() -> None:
    msgs = [sys_(), planner.summary_message("old facts", 10, "system"), *alternating(4, head=0)]
    assert summary_index(msgs, 1) == 1
    assert summary_index(alternating(3), 1) is None
    counts = [10] * len(msgs)
    plan = plan_cut(
        msgs, counts, 1, CompactionSettings(verbatim_window_tokens=25, min_verbatim_exchanges=1)
    )
    assert plan is not None
    assert plan.head_len == 1 and plan.body_start == 2
    assert all(c >= 2 for c in plan.cuts)
    assert plan.verbatim_start > plan.body_start


def test_plan_cut_ends_where_the_client_edits_its_own_history() -> None:
    # A client that clears its older results in place from index e on: a record reaching past
    # e would not match its next request, so no cut lies after it (the verbatim window then
    # starts there at the latest); none at all when no legal cut is that early.
    msgs = [sys_(), *alternating(8, head=0)]
    counts = [10] * len(msgs)
    s = CompactionSettings(verbatim_window_tokens=25, min_verbatim_exchanges=1)
    free = plan_cut(msgs, counts, 1, s)
    assert free is not None and free.verbatim_start > 6
    held = plan_cut(msgs, counts, 1, s, last_cut=6)
    assert held is not None
    assert held.verbatim_start <= held.latest_cut <= 6
    assert held.latest_cut in held.cuts and held.cuts == free.cuts
    assert plan_cut(msgs, counts, 1, s, last_cut=free.latest_cut) == free  # (no change)
    assert plan_cut(msgs, counts, 1, s, last_cut=1) is None


# ---- decide() --------------------------------------------------------------------------------

S = CompactionSettings(trigger_tokens=1000, emergency_factor=2.0)


def test_decide_below_trigger() -> None:
    d = decide(1000, S)
    assert d.action == "forward" and d.reason == "below trigger" and not d.use_llm


def test_decide_bypass_wins_even_over_the_limit() -> None:
    d = decide(10**6, S, bypass=True, context_window=1000)
    assert d.action == "forward" and "bypass" in d.reason and not d.use_llm


def test_decide_disabled() -> None:
    d = decide(10**6, CompactionSettings(enabled=False, trigger_tokens=1000))
    assert d.action == "forward" and "disabled" in d.reason


def test_decide_background_mode_over_trigger() -> None:
    d = decide(1500, S)
    assert d.action == "background" and d.use_llm and d.limit_tokens == 2000


def test_decide_inline_mode_over_trigger() -> None:
    d = decide(1500, CompactionSettings(trigger_tokens=1000, mode="inline"))
    assert d.action == "inline" and d.use_llm and d.limit_tokens == 2000


def test_decide_over_emergency_factor_is_inline_even_in_background_mode() -> None:
    assert decide(2000, S).action == "background"  # exactly at the limit: not over it
    d = decide(2001, S)
    assert d.action == "inline" and d.use_llm and d.limit_tokens == 2000
    assert "emergency" in d.reason


def test_decide_over_context_window() -> None:
    d = decide(1600, S, context_window=1500)
    assert d.action == "inline" and d.limit_tokens == 1500 and "context window" in d.reason
    assert hard_limit(S, 1500) == 1500
    assert hard_limit(S, 10**6) == 2000
    assert hard_limit(S, None) == 2000
    # A context window larger than the emergency limit does not change anything.
    assert decide(1600, S, context_window=10**6).action == "background"


def test_the_cost_policy_is_bounded_by_the_window_unless_a_factor_is_set() -> None:
    # policy cost holds a compaction past the trigger until it pays; a bound at twice the
    # trigger forced the ones it declined near a session's end (django-11910: 1.094x what
    # forwarding unchanged costs on Anthropic's prices; 1.000x with the window as the bound).
    cost = CompactionSettings(trigger_tokens=1000, verbatim_window_tokens=200, policy="cost")
    assert cost.emergency_factor is None
    assert hard_limit(cost, 200_000) == 200_000
    assert hard_limit(cost, None) == 2000  # the window unknown: twice the trigger
    d = decide(150_000, cost, context_window=200_000)
    assert d.action != "inline" or "emergency" not in d.reason
    tokens = CompactionSettings(trigger_tokens=1000, verbatim_window_tokens=200, policy="tokens")
    assert hard_limit(tokens, 200_000) == 2000
    set_ = CompactionSettings(trigger_tokens=1000, verbatim_window_tokens=200, policy="cost",
                              emergency_factor=3.0)  # fmt: skip
    assert hard_limit(set_, 200_000) == 3000 and hard_limit(set_, 2500) == 2500


def test_decide_cooling_down() -> None:
    d = decide(1500, S, cooling_down=True)
    assert d.action == "forward" and "cooling" in d.reason and not d.use_llm
    # Over the hard limit it still has to fit, but without calling the LLMs.
    d2 = decide(2500, S, cooling_down=True)
    assert d2.action == "inline" and not d2.use_llm and d2.limit_tokens == 2000
    d3 = decide(2500, S, cooling_down=False)
    assert d3.use_llm


# ---- choose_case -----------------------------------------------------------------------------


@pytest.fixture
def plan() -> planner.CutPlan:
    msgs = alternating(8)  # users at 1,3,...,15
    counts = [100] * len(msgs)
    s = CompactionSettings(verbatim_window_tokens=450, min_verbatim_exchanges=2)
    p = plan_cut(msgs, counts, 1, s)
    assert p is not None
    assert p.verbatim_start == 13 and p.latest_cut == 13  # keeps users 13 and 15
    return p


def test_choose_case_truncate_at_a_confident_boundary_in_the_window(plan: planner.CutPlan) -> None:
    s = CompactionSettings(min_confidence=0.5)
    assert choose_case(plan, 13, 0.9, s) == ("truncate", 13)
    assert choose_case(plan, 14, 0.5, s) == ("truncate", 13)  # moved to the nearest legal cut


def test_choose_case_summarize_below_min_confidence(plan: planner.CutPlan) -> None:
    s = CompactionSettings(min_confidence=0.5)
    assert choose_case(plan, 13, 0.49, s) == ("summarize", 13)
    assert choose_case(plan, 13, 0.9, CompactionSettings(min_confidence=0.95)) == ("summarize", 13)


def test_choose_case_summarize_without_boundary_or_before_the_window(
    plan: planner.CutPlan,
) -> None:
    s = CompactionSettings()
    assert choose_case(plan, None, 1.0, s) == ("summarize", 13)
    assert choose_case(plan, 5, 1.0, s) == ("summarize", 13)
    assert choose_case(plan, 0, 1.0, s) == ("summarize", 13)


def test_choose_case_never_cuts_past_the_latest_cut() -> None:
    msgs = alternating(8)
    counts = [100] * len(msgs)
    s = CompactionSettings(verbatim_window_tokens=850, min_verbatim_exchanges=1)
    p = plan_cut(msgs, counts, 1, s)
    assert p is not None and p.verbatim_start == 9 and p.latest_cut == 15
    assert choose_case(p, 11, 0.9, s) == ("truncate", 11)
    assert choose_case(p, 16, 0.9, s) == ("truncate", 15)
    case, cut = choose_case(p, 100, 0.9, s)
    assert case == "truncate" and cut <= p.latest_cut


def test_nearest_cut_prefers_later_on_ties() -> None:
    assert nearest_cut(4, [1, 3, 5, 7], 0, None) == 5
    assert nearest_cut(4, [1, 3, 5, 7], 0, 4) == 3
    assert nearest_cut(4, [1, 3], 3, None) is None


# ---- emergency cuts --------------------------------------------------------------------------


def _suffix_tokens(counts: list[int], cut: int) -> int:
    return sum(counts[cut:])


def test_emergency_cut_drops_the_oldest_whole_turns_and_fits() -> None:
    msgs = [sys_(), user(), calls("a"), result("a"), asst(), user(), asst(), user(), asst()]
    counts = [50, 100, 100, 300, 100, 100, 100, 100, 100]
    limit, note = 500, 20
    cut = emergency_cut(msgs, counts, 1, limit, note)
    assert cut == 5  # the first turn (with its tool round) goes as a whole
    assert msgs[cut]["role"] == "user" and not separated(msgs, cut)
    assert counts[0] + note + _suffix_tokens(counts, cut) <= limit
    # It is the earliest cut that fits: keeping one more turn would not.
    assert counts[0] + note + _suffix_tokens(counts, 1) > limit


def test_emergency_cut_without_a_fitting_cut_keeps_the_last_turn() -> None:
    msgs = alternating(3)
    counts = [10, 1000, 1000, 1000, 1000, 1000, 1000]
    assert emergency_cut(msgs, counts, 1, limit_tokens=100, note_tokens=0) == 5


def test_emergency_cut_within_a_last_cut_takes_the_latest_when_none_fits_the_target() -> None:
    # Cuts 3, 5, 7 leave 610, 410, 210 tokens. Where the client edits its history (cut 5 at
    # the latest) and no allowed cut fits the target: the earliest fitting the limit (3) left
    # it just under the limit and the next request was cut anew; the latest allowed cut (5)
    # leaves the most room. Without a fit even there, the last allowed cut all the same.
    msgs = alternating(4)
    counts = [10, 100, 100, 100, 100, 100, 100, 100, 100]
    assert emergency_cut(msgs, counts, 1, 700, 0, target_tokens=300) == 7
    assert emergency_cut(msgs, counts, 1, 700, 0, target_tokens=100) == 3
    assert emergency_cut(msgs, counts, 1, 700, 0, target_tokens=100, last_cut=5) == 5
    assert emergency_cut(msgs, counts, 1, 700, 0, target_tokens=450, last_cut=5) == 5
    assert emergency_cut(msgs, counts, 1, 700, 0, target_tokens=650, last_cut=5) == 3
    assert emergency_cut(msgs, counts, 1, 100, 0, target_tokens=50, last_cut=3) == 3


def test_emergency_cut_never_splits_a_tool_round() -> None:
    msgs = [sys_(), user(), calls("a"), user("x"), result("a"), asst(), user(), asst()]
    counts = [10, 10, 10, 10, 10, 10, 10, 10]
    cut = emergency_cut(msgs, counts, 1, limit_tokens=50, note_tokens=0)
    # 5: the answer after the completed round (a answered at 4), a legal cut between rounds.
    assert cut == 5 and not separated(msgs, cut)


def test_emergency_cut_none_when_nothing_can_be_dropped() -> None:
    msgs = [sys_(), user(), asst()]
    assert emergency_cut(msgs, [10, 10000, 10], 1, 100, 0) is None


def test_emergency_cut_skips_an_earlier_summary() -> None:
    msgs = [sys_(), summary_message("s", 4, "system"), user(), asst(), user(), asst()]
    counts = [10, 10, 100, 100, 10, 10]
    cut = emergency_cut(msgs, counts, 1, limit_tokens=60, note_tokens=10)
    assert cut == 4


def test_summary_message_format() -> None:
    m = summary_message("  the text \n", 12, "user")
    assert m == {"role": "user", "content": f"{SUMMARY_PREFIX}12 earlier messages]\n\nthe text"}


def test_decide_context_window_below_the_trigger_still_compacts() -> None:
    # A small local model (say 800 tokens) behind a proxy whose trigger is higher.
    assert S.trigger_tokens > 800
    d = decide(900, S, context_window=800)
    assert d.action == "inline" and d.limit_tokens == 800 and "context window" in d.reason
    assert decide(700, S, context_window=800).action == "forward"


def test_a_boundary_just_before_the_window_summarizes_rather_than_drop_new_topic(
    plan: planner.CutPlan,
) -> None:
    # 12 is the assistant message before the window's first user turn (13): the detector
    # placed it in the new topic, so truncating at 13 would drop part of the new topic.
    s = CompactionSettings(min_confidence=0.5)
    assert choose_case(plan, 12, 0.95, s) == ("summarize", 13)
