"""#26: the agent's behaviour after a compaction and the loop breaker's decision (pure)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from proxy.core import behaviour, prune
from proxy.core.records import CompactionRecord
from proxy.core.settings import CompactionSettings


def read(n: int, path: str, text: str = "x " * 300) -> list[dict[str, Any]]:
    call = {
        "id": f"call_{n}",
        "type": "function",
        "function": {"name": "read_file", "arguments": json.dumps({"path": path})},
    }
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{n}", "content": text},
    ]  # fmt: skip


HISTORY = [
    {"role": "system", "content": "agent"},
    {"role": "user", "content": "fix it"},
    *read(1, "src/a.py"),
    *read(2, "src/b.py"),
]
# A pruning that replaced both results (positions 3 and 5) by placeholders, made for this
# six-message request.
PRUNED = CompactionRecord(
    k=6, prefix_hash="ab" * 16, head_len=1, summary=None, case="prune", covered=5,
    created_at=0.0, prefix=[0, 1, 2, {"role": "tool", "content": "[cleared]"}, 4,
    {"role": "tool", "content": "[cleared]"}], request_len=6,
)  # fmt: skip


def test_calls_repeating_a_cleared_result_are_counted_once_each() -> None:
    later = [*HISTORY, *read(3, "src/a.py"), *read(4, "src/c.py"), *read(5, "src/a.py")]
    seen = behaviour.observe(later, PRUNED)
    assert seen.repeated_calls == 2 and seen.rereads == 2
    assert seen.repeated == ["read_file(path=src/a.py)"]
    assert seen.turns_before == 2.0 and seen.turns_after == 3.0
    # The calls made before the record took effect are not "after" it.
    assert behaviour.observe(HISTORY, PRUNED).repeated_calls == 0


def test_a_result_answers_the_last_call_issued_before_it_with_its_id() -> None:
    """Agents that number calls per turn reuse ids ("call_1" every turn): a result is read
    as the answer to the call just before it, not to a later call with the same id."""
    later = [*HISTORY, *read(3, "src/a.py"), *read(3, "src/q.py")]  # id 3 twice
    seen = behaviour.observe(later, PRUNED)
    assert seen.repeated == ["read_file(path=src/a.py)"] and seen.repeated_calls == 1
    # Read the other way (each id's last call), both results would be q.py's: no repeat.


def test_a_result_forwarded_in_place_is_not_cleared() -> None:
    kept_b = CompactionRecord(**{**PRUNED.to_json(), "prefix": [0, 1, 2, {"role": "tool",
                                 "content": "[cleared]"}, 4, 5]})  # fmt: skip
    later = [*HISTORY, *read(3, "src/b.py")]
    assert behaviour.observe(later, kept_b).repeated_calls == 0


def test_the_breaker_fires_at_the_threshold_once_per_compaction() -> None:
    later = [*HISTORY, *read(3, "src/a.py"), *read(4, "src/a.py")]
    seen = behaviour.observe(later, PRUNED)
    assert behaviour.breaker(seen, None, 3, 1.0) is None  # two repeats: not yet
    third = behaviour.observe([*later, *read(5, "src/a.py")], PRUNED)
    fired = behaviour.breaker(third, None, 3, 2.0)
    assert fired is not None and fired.action == behaviour.KEEP and fired.fired == 1
    assert fired.keep == [behaviour.identity("read_file", {"path": "src/a.py"})]
    assert behaviour.breaker(third, fired, 3, 3.0) is None  # the same compaction
    assert behaviour.breaker(third, None, 0, 3.0) is None  # off
    assert behaviour.LoopBreak.from_json(fired.to_json()) == fired


def test_repeats_split_by_a_compaction_add_up_since_the_breaker_last_fired() -> None:
    # A pruning fell between the re-reads: two after the earlier compaction, one after this.
    later = [*HISTORY, *read(3, "src/a.py"), *read(4, "src/a.py")]
    earlier = dataclasses.replace(behaviour.observe(later, PRUNED), record="e" * 32)
    one = dataclasses.replace(earlier, record=PRUNED.prefix_hash, repeated_calls=1)
    assert behaviour.breaker(one, None, 3, 1.0) is None  # alone: not yet
    fired = behaviour.breaker(one, None, 3, 1.0, [earlier.to_json(), one.to_json()])
    assert fired is not None and fired.record == PRUNED.prefix_hash
    assert "and 1 before it the agent repeated 3 tool calls" in fired.reason, fired.reason
    assert fired.keep == [behaviour.identity("read_file", {"path": "src/a.py"})]
    # No repeat after this compaction: earlier ones alone do not fire it.
    none = dataclasses.replace(one, repeated_calls=0)
    assert behaviour.breaker(none, None, 3, 1.0, [earlier.to_json(), earlier.to_json()]) is None


def test_pruning_keeps_what_the_breaker_keeps_within_its_own_window() -> None:
    settings = CompactionSettings(
        prune_keep_tool_results=0, prune_protect_tokens=0, prune_clear_at_least=1
    )
    history = [*HISTORY, *read(3, "src/c.py")]
    count = len  # a character a token: enough to rank and bound
    keep = frozenset({behaviour.identity("read_file", {"path": "src/a.py"})})
    cleared = prune.plan(history, settings, count).cleared
    assert any("src/a.py" in c for c in cleared)
    roomy = CompactionSettings(
        prune_keep_tool_results=0, prune_protect_tokens=700, prune_clear_at_least=1
    )
    assert any("src/a.py" in c for c in prune.plan(history, roomy, count).cleared)
    kept = prune.plan(history, roomy, count, keep=keep).cleared
    assert not any("src/a.py" in c for c in kept) and any("src/b.py" in c for c in kept)
    # A window too small for the result: pruning clears it anyway.
    assert any("src/a.py" in c for c in prune.plan(history, settings, count, keep=keep).cleared)


def test_the_figures_are_written_as_the_store_gives_them_back() -> None:
    seen = behaviour.Behaviour(
        "abc", "summarize", 2, 1, ["Read(a.py)"], ["Read:a.py"], 1.5, 3.0, (3, 2), (6, 2)
    )
    written = seen.to_json()
    expected = dataclasses.asdict(seen)
    expected["counts_before"], expected["counts_after"] = [3, 2], [6, 2]
    assert written == expected and list(written) == [f.name for f in dataclasses.fields(seen)]
    assert json.loads(json.dumps(written)) == written
    assert written["repeated"] is not seen.repeated  # a copy: the figures stay as observed
