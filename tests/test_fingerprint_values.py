"""Fingerprints keep their values: stored records and chains name prefixes by them.

``fingerprint`` takes shortcuts (a plain message hashed without JSON; nested values not
cleaned when their JSON shows nothing to clean); these pin its values and check it against
the canonical form's hash, the definition, on generated messages.
"""

from __future__ import annotations

from typing import Any

import orjson
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.fingerprint import Remembered, _meaning, fingerprint, fingerprints

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": null}'}}
F = {"name": "f", "arguments": "{}"}
PINNED = [
    ({"role": "user", "content": "hello ☃"}, "55855b48967d3287b08d4ca8d3e5249d"),
    (
        {"role": "tool", "tool_call_id": "call_1", "content": "result"},
        "2c429e0bd1688a1fc3b443927b1cc339",
    ),
    (
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        "e8481eef6e19e9d57fb57904c5bb9a1d",
    ),
    (
        {"role": "assistant", "content": "", "tool_calls": [{**CALL, "function": F, "x": None}]},
        "94deab4b89db2c8ea18805ca6606db09",
    ),
    (
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"a": 1}}]},
        "becf6b8874b30c2f15dff3f4117536c2",
    ),
    (
        {"role": "user", "name": "bob", "content": "x", "extra": 1},
        "59de2c324c1a951aa6cb06f9805b8969",
    ),
]


def definition(message: dict[str, Any]) -> bytes:
    """The fingerprint as DESIGN §3 defines it (the plain encoding for a role and a text)."""
    form = _meaning(message)
    if len(form) == 2 and type(form.get("role")) is str and type(form.get("content")) is str:
        return xxhash.xxh3_128_digest(f"plain\x00{form['role']}\x00{form['content']}".encode())
    return xxhash.xxh3_128_digest(orjson.dumps(form, option=orjson.OPT_SORT_KEYS))


def test_pinned_values() -> None:
    for message, value in PINNED:
        assert fingerprint(message).hex() == value
    assert [f.hex() for f in fingerprints([m for m, _ in PINNED])] == [v for _, v in PINNED]


text = st.sampled_from(["", "x", "null", '"cache_control"', "é"])
# Booleans and floats beside integers: 1, 1.0 and true are equal in Python, not in JSON.
leaf = st.one_of(st.none(), text, st.integers(-5, 5), st.booleans(), st.sampled_from([0.0, 1.0]))
nested = st.recursive(
    leaf,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["type", "text", "cache_control", "id"]), inner, max_size=3
        )
    ),
    max_leaves=8,
)
messages = st.dictionaries(
    st.sampled_from(
        ["role", "content", "name", "tool_calls", "tool_call_id", "function_call", "extra"]
    ),
    nested,
    max_size=5,
)


@settings(max_examples=500, deadline=None)
@given(message=messages)
def test_shortcuts_give_the_definition(message: dict[str, Any]) -> None:
    assert fingerprint(message) == definition(message)
    assert fingerprints([message, message]) == [definition(message)] * 2


# One memory across the examples, as in the proxy: what an earlier example left there must
# never answer for a message that is not the same JSON.
SHARED = Remembered(size=64)


@settings(max_examples=500, deadline=None)
@given(batch=st.lists(messages, max_size=6))
def test_remembered_fingerprints_are_the_definition(batch: list[dict[str, Any]]) -> None:
    """Through the memory (#28), first sight or not, a message gets the definition's value."""
    expected = [definition(m) for m in batch]
    assert fingerprints(batch, SHARED) == expected
    assert fingerprints(batch, SHARED) == expected  # now from memory
    assert fingerprints(batch, None) == expected
    assert len(SHARED) <= 2 * SHARED.size


def test_remembered_tells_apart_what_python_calls_equal() -> None:
    """1 == 1.0 == True in Python: a memory keyed by value would give them one fingerprint."""
    memory = Remembered()
    shapes = [1, 1.0, True]
    part = {"type": "tool_result", "tool_use_id": "t1", "content": "x"}
    batch = [{"role": "user", "content": [{**part, "is_error": v}, part]} for v in shapes]
    got = fingerprints(batch, memory)
    assert len(set(got)) == 3
    assert fingerprints(list(reversed(batch)), memory) == list(reversed(got))
    assert got == [definition(m) for m in batch]


def test_remembered_is_bounded_and_forgets_the_oldest() -> None:
    memory = Remembered(size=3)
    batch = [{"role": "tool", "tool_call_id": f"c{i}", "content": "x"} for i in range(10)]
    assert fingerprints(batch, memory) == [definition(m) for m in batch]
    assert len(memory) <= 6
    # Forgotten or not, the value is the same.
    assert fingerprints(batch, memory) == [definition(m) for m in batch]


def test_a_value_json_cannot_write_is_fingerprinted_directly() -> None:
    """The LiteLLM hook may hand over objects orjson cannot write: no memory, same value."""

    class Opaque:
        pass

    memory = Remembered()
    message = {"role": "user", "content": [{"type": "text", "text": "x"}], "extra": Opaque()}
    assert fingerprints([message], memory) == [fingerprint(message)]
    assert len(memory) == 0
