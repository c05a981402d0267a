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

from proxy.core.fingerprint import _meaning, fingerprint, fingerprints

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
leaf = st.one_of(st.none(), text, st.integers(-5, 5))
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
