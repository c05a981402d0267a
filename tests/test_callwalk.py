"""``behaviour.observe`` resumed from its pass over the previous request (``callwalk``, #28)
gives what a pass over the whole history gives: for agents whose requests extend the last
one, for a request that goes back to an earlier history or changes a message in it, for
another record (a new compaction) and another tenant, and in both APIs' shapes (OpenAI
``tool`` messages, Anthropic ``tool_result`` blocks). The memory of walks is bounded."""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core import behaviour, callwalk
from proxy.core.fingerprint import fingerprints, prefix_chain
from proxy.core.records import CompactionRecord, entries

Message = dict[str, Any]


def rounds(n: int, path: str, anthropic: bool, call_id: str) -> list[Message]:
    arguments = {"path": path}
    if anthropic:
        use = {"type": "tool_use", "id": call_id, "name": "read_file", "input": arguments}
        result = {"type": "tool_result", "tool_use_id": call_id, "content": f"text {n}"}
        return [{"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
    call = {"id": call_id, "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps(arguments)}}  # fmt: skip
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": f"text {n}"},
    ]


STEP = st.tuples(
    st.sampled_from(["a", "b", "c", "d"]),  # the file read: repeats are likely
    st.booleans(),  # a user instruction after it
    st.sampled_from(["fresh", "reused"]),  # call ids: unique, or "call_0" every turn
)


def history(steps: list[tuple[str, bool, str]], anthropic: bool) -> list[Message]:
    out: list[Message] = [{"role": "system", "content": "agent"}, {"role": "user", "content": "go"}]
    for n, (path, instruct, ids) in enumerate(steps):
        out += rounds(n, f"src/{path}.py", anthropic, f"call_{n}" if ids == "fresh" else "call_0")
        if instruct:
            out.append({"role": "user", "content": f"instruction {n}"})
    return out


def record(messages: list[Message], k: int, kept: set[int]) -> CompactionRecord:
    prefix: list[Any] = [
        i if i in kept or m["role"] != "tool" else {"role": "tool", "content": "[cleared]"}
        for i, m in enumerate(messages[:k])
    ]
    return CompactionRecord(
        k=k, prefix_hash=f"{k:032x}", head_len=1, summary=None, case="prune",
        covered=k - 1, created_at=0.0, prefix=prefix, request_len=k + 1,
    )  # fmt: skip


def chain(tenant: str, messages: list[Message]) -> list[bytes]:
    return prefix_chain(tenant, fingerprints(messages))


@settings(max_examples=120, deadline=None)
@given(
    steps=st.lists(STEP, min_size=4, max_size=30),
    anthropic=st.booleans(),
    cut=st.floats(min_value=0.1, max_value=0.6),
    grow=st.lists(st.integers(min_value=0, max_value=5), min_size=3, max_size=8),
    kept=st.sets(st.integers(min_value=0, max_value=20), max_size=3),
)
def test_resumed_walks_observe_what_whole_walks_observe(
    steps: list[tuple[str, bool, str]], anthropic: bool, cut: float, grow: list[int],
    kept: set[int],
) -> None:  # fmt: skip
    full = history(steps, anthropic)
    k = max(2, int(len(full) * cut))
    rec = record(full, k, kept)
    walks = callwalk.Walks()
    length = k + 1
    in_place = frozenset(e for e in entries(rec) if isinstance(e, int))
    cut_of = (rec.k, rec.request_len, in_place)  # as observe cuts it
    for n, extra in enumerate(grow):  # each request extends the last one by a few messages
        length = min(len(full), length + extra)
        messages = full[:length]
        if n:  # the pass over the last request is there to go on from
            assert walks.resume(("conv", rec.prefix_hash), cut_of, chain("t", messages))
        resumed = behaviour.observe(
            messages, rec, resume=("conv", chain("t", messages)), walks=walks
        )
        assert resumed == behaviour.observe(messages, rec)
    # Back to an earlier history, a changed message, another record, another tenant.
    earlier = full[: max(k + 1, length - 3)]
    changed = [*full[:length]]
    changed[k] = {"role": "user", "content": "something else"}
    other = record(full, max(2, k - 1), set())
    for messages, rec_now, tenant in (
        (earlier, rec, "t"), (changed, rec, "t"), (full, other, "t"), (full, rec, "u"),
    ):  # fmt: skip
        resumed = behaviour.observe(
            messages, rec_now, resume=("conv", chain(tenant, messages)), walks=walks
        )
        assert resumed == behaviour.observe(messages, rec_now)


def test_a_walk_is_resumed_only_over_the_same_messages_and_cut() -> None:
    full = history([("a", False, "fresh"), ("b", True, "fresh"), ("a", False, "fresh")] * 3, False)
    rec = record(full, 6, set())
    walks = callwalk.Walks()
    cut = (rec.k, rec.request_len, frozenset[int]())
    first = full[:10]
    w = callwalk.walk(first, cut)
    walks.keep(("conv", rec.prefix_hash), cut, chain("t", first), w)
    longer = full[:14]
    assert walks.resume(("conv", rec.prefix_hash), cut, chain("t", longer)) is w
    assert walks.resume(("conv", rec.prefix_hash), cut, chain("u", longer)) is None  # tenant
    assert walks.resume(("conv", rec.prefix_hash), (5, 7, frozenset()), chain("t", longer)) is None
    assert walks.resume(("conv", rec.prefix_hash), cut, chain("t", full[:8])) is None  # shorter
    resumed = callwalk.walk(longer, cut, w)
    assert w.length == 10 and resumed.length == 14  # the kept walk itself is not changed
    assert resumed == callwalk.walk(longer, cut)


def test_the_memory_of_walks_is_bounded() -> None:
    walks = callwalk.Walks(size=4)
    messages = history([("a", False, "fresh")], False)
    links = chain("t", messages)
    cut = (2, 3, frozenset[int]())
    for i in range(10):
        walks.keep((f"conv{i}", "r"), cut, links, callwalk.walk(messages, cut))
    assert len(walks._kept) == 4
    assert walks.resume(("conv9", "r"), cut, links) is not None
    assert walks.resume(("conv0", "r"), cut, links) is None


def test_a_call_whose_arguments_nest_too_deep_to_write_is_still_named() -> None:
    deep = "[" * 300 + "]" * 300  # valid JSON, deeper than orjson writes
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
    again = {"id": "c2", "type": "function", "function": {"name": "f", "arguments": deep}}
    messages: list[Message] = [
        {"role": "system", "content": "agent"},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "out"},
        {"role": "assistant", "content": None, "tool_calls": [again]},
        {"role": "tool", "tool_call_id": "c2", "content": "out"},
    ]
    rec = record(messages, 4, set())
    seen = behaviour.observe(messages, rec)
    assert seen.repeated_calls == 1  # the same call again, named alike
    assert seen.identities == [behaviour.identity("f", orjson.loads(deep))]
