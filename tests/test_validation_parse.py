"""Big bodies parsed in slices give orjson's value and verdict; the depth check is exact.

``parse_in_slices`` cuts a big array where orjson accepts the cut; these check that every
cut it keeps is a real element boundary (strings and nested values full of ``}, {``), that it
refuses what orjson refuses (trailing commas, lone surrogates, garbage after the body), and
that ``within_depth`` (orjson's own depth limit, else a walk) says what the walk says.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core import validation
from proxy.core.errors import BadRequest
from proxy.core.validation import (
    _check_message,
    _walk_within,
    parse_in_slices,
    validate_chat,
    within_depth,
)

TRICKY = ['}, {"role": "user"}', '\\"}, {\\"', "}]", "},", "\\", '"', "é ☃ 𝄞", "\\u0000", ""]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(TRICKY), st.text(max_size=12),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["role", "content", "type", "text", "x"]), inner, max_size=4
        )
    ),
    max_leaves=12,
)
messages = st.lists(
    st.one_of(
        st.fixed_dictionaries({"role": st.just("user"), "content": st.sampled_from(TRICKY)}),
        st.fixed_dictionaries({"role": st.just("assistant"), "content": values}),
        values,
    ),
    max_size=30,
)


@pytest.fixture
def small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices of a few characters, so that every path runs on small bodies."""
    monkeypatch.setattr(validation, "_SLICE", 40)
    monkeypatch.setattr(validation, "_WINDOW", 30)
    monkeypatch.setattr(validation, "_FAILURES", 10**6)


def dumps(body: Any, spaced: bool) -> bytes:
    if spaced:
        return json.dumps(body, ensure_ascii=False, indent=1).encode()
    return orjson.dumps(body)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    msgs=messages,
    before=st.dictionaries(st.sampled_from(["model", "tools", "system"]), values, max_size=2),
    after=st.dictionaries(st.sampled_from(["stream", "tools", "n", "model"]), values, max_size=2),
    spaced=st.booleans(),
)
def test_slices_parse_as_orjson(
    small_slices: None, msgs: list[Any], before: dict[str, Any], after: dict[str, Any], spaced: bool
) -> None:
    body = {**before, "messages": msgs, **after}
    raw = dumps(body, spaced)
    assert parse_in_slices(raw) == orjson.loads(raw)
    assert parse_in_slices(dumps(msgs, spaced)) == msgs  # a top-level array


@pytest.mark.parametrize("failures", [0, 3, 10**6])
def test_a_long_history_and_a_refused_budget(
    monkeypatch: pytest.MonkeyPatch, failures: int
) -> None:
    monkeypatch.setattr(validation, "_SLICE", 200)
    monkeypatch.setattr(validation, "_WINDOW", 100)
    monkeypatch.setattr(validation, "_FAILURES", failures)
    history = []
    for i in range(300):
        history.append({"role": "user", "content": f"turn {i} " + TRICKY[i % len(TRICKY)] * 7})
        parts = [{"type": "text", "text": "}, {"}, {"type": "text", "text": str(i)}]
        history.append({"role": "assistant", "content": parts, "tool_calls": [{"id": i}, {}]})
    for raw in (
        orjson.dumps({"model": "m", "messages": history, "tools": [{"a": 1}, {"b": [{}]}]}),
        json.dumps({"messages": history, "x": {"y": [1, {}]}}, indent=2).encode(),
    ):
        assert parse_in_slices(raw) == orjson.loads(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": [{"a": 1}, {"b": 2},]}',
        b'{"messages": [{"a": 1}, {"b": 2}, ], "n": 1}',
        b'{"messages": [{"a": 1}, {"b": 2}]',
        b'{"messages": [{"a": 1}, {"b": 2}]} x',
        b'{"messages": [{"a": 1}\x0b, {"b": 2}]}',
        b'{"messages": [{"a": NaN}, {"b": 2}]}',
        b'{"messages": [{"a": "\\ud800"}, {"b": 2}], "n": 1}',
        b'{"m": "\\udfff", "messages": [{"a": 1}]}',
        b'{"messages": [{"a": 1}, {"b": 2}], "\\u0000": 1,}',
    ],
)
def test_what_orjson_refuses_is_refused(small_slices: None, raw: bytes) -> None:
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(raw)
    with pytest.raises(ValueError):
        parse_in_slices(raw)


def test_surrogate_pairs_and_the_tail_key(small_slices: None) -> None:
    for raw in (
        b'{"m": "\\ud83d\\ude00", "messages": [{"a": "\\ud83d\\ude00"}, {"b": 2}]}',
        b'{"messages": [{"a": 1}, {"b": 2}], "\\u0000": [1], "\\u0000": 2}',
        b'{"messages": [{"a": 1}], "messages": [{"b": 2}, {"c": 3}]}',
    ):
        assert parse_in_slices(raw) == orjson.loads(raw)


def nested(levels: int) -> Any:
    value: Any = {"type": "text", "text": "x"}
    for i in range(levels - 1):
        value = [value] if i % 2 else {"parts": value}
    return value


@pytest.mark.parametrize("levels", [1, 2, 199, 200, 201, 300, 260])
def test_depth_matches_the_walk(levels: int) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}, nested(levels)]}  # +2 levels
    assert within_depth(body, 200) == _walk_within(body, 200) == (levels + 2 <= 200)


def test_depth_of_values_orjson_cannot_write() -> None:
    big = 2**70  # the standard library parses it; orjson does not write it: the walk decides
    assert within_depth({"a": [big, nested(150)]}, 200)
    assert not within_depth({"a": [big, nested(250)]}, 200)
    assert within_depth({}, 1) and within_depth([], 1) and not within_depth([[]], 1)
    assert within_depth(5, 0) and not within_depth([], 0)


@settings(max_examples=200, deadline=None)
@given(value=values, limit=st.integers(0, 6))
def test_depth_properties(value: Any, limit: int) -> None:
    assert within_depth(value, limit) == _walk_within(value, limit)


@pytest.mark.parametrize("role", [[], {}, 3, None, "robot"])
def test_a_role_that_is_not_a_known_string_is_a_400(role: Any) -> None:
    with pytest.raises(BadRequest, match=r"messages\[1\].role"):
        validate_chat(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "a"}, {"role": role, "content": "x"}],
            }
        )


@settings(max_examples=400, deadline=None)
@given(
    message=st.dictionaries(
        st.sampled_from(["role", "content", "name", "tool_call_id", "tool_calls", "x"]),
        st.one_of(
            st.none(),
            st.sampled_from(["user", "tool", "robot", ""]),
            st.integers(0, 1),
            st.lists(st.one_of(st.just({"type": "text"}), st.just({}), st.just(1)), max_size=2),
        ),  # fmt: skip
        max_size=4,
    )
)
def test_the_shortcuts_accept_what_the_full_check_accepts(message: dict[str, Any]) -> None:
    def verdict(check: Any) -> str | None:
        try:
            check()
        except BadRequest as exc:
            return str(exc)
        return None

    body = {"model": "m", "messages": [message]}
    assert verdict(lambda: validate_chat(body)) == verdict(lambda: _check_message(0, message))


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(alphabet=st.sampled_from(['a', ' ', '"', "\\", "\n", "é", "𝄞", "\x00", "}"]),
                 min_size=0, max_size=400),
    ascii_only=st.booleans(),
    where=st.sampled_from(["content", "parts", "system"]),
)  # fmt: skip
def test_a_long_string_is_decoded_in_slices_as_orjson_decodes_it(
    small_slices: None, text: str, ascii_only: bool, where: str
) -> None:
    """One huge message (#29): its string is decoded a slice at a time, cut before escapes,
    surrogate pairs (ensure_ascii) included."""
    if where == "content":
        body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": text}]}
    elif where == "parts":
        part = {"type": "text", "text": text}
        body = {"model": "m", "messages": [{"role": "user", "content": [part, part]}]}
    else:
        body = {"system": text, "model": "m", "messages": [{"role": "user", "content": "hi"}]}
    raw = json.dumps(body, ensure_ascii=ascii_only).encode()
    assert parse_in_slices(raw) == orjson.loads(raw)
