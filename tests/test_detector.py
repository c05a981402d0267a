"""proxy.detector: the indexed prose it is shown and the lenient parsing of its reply."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from proxy.core.detector import (
    SAFE_DEFAULT,
    Detection,
    build_request,
    detector_window,
    indexed_lines,
    parse_detection,
    sane,
)


def reply(**fields: Any) -> str:
    base: dict[str, Any] = {
        "boundary_index": 3,
        "boundary_reason": "the user moved to the billing bug",
        "confidence": 0.9,
        "summary": "Set up the repo; tests pass.",
    }
    base.update(fields)
    return json.dumps(base)


# ---- well-formed and wrapped JSON ----------------------------------------------------------


def test_clean_json() -> None:
    d = parse_detection(reply(), 10)
    assert d == Detection(
        3, "the user moved to the billing bug", 0.9, "Set up the repo; tests pass."
    )


@pytest.mark.parametrize(
    "text",
    [
        f"```json\n{reply()}\n```",
        f"```JSON\n{reply()}\n```",
        f"```\n{reply()}\n```",
        f"Here is my analysis:\n```json\n{reply()}\n```\nLet me know if you need more.",
    ],
    ids=["json-fence", "upper-fence", "bare-fence", "fence-in-prose"],
)
def test_fenced_json(text: str) -> None:
    d = parse_detection(text, 10)
    assert d.boundary_index == 3 and d.confidence == 0.9
    assert d.summary == "Set up the repo; tests pass."


def test_json_inside_prose() -> None:
    text = f"Sure! The topic changes at message three. {reply()} I hope {{this}} helps."
    d = parse_detection(text, 10)
    assert d.boundary_index == 3 and d.confidence == 0.9
    assert d.boundary_reason == "the user moved to the billing bug"


def test_braces_in_prose_before_the_json() -> None:
    text = f"Ignoring {{not json}} and {{'also': not}}: {reply(boundary_index=2)}"
    assert parse_detection(text, 10).boundary_index == 2


def test_null_boundary() -> None:
    d = parse_detection(reply(boundary_index=None, confidence=0.95), 10)
    assert d.boundary_index is None
    assert d.confidence == 0.0  # no boundary, nothing to be confident about
    assert d.summary == "Set up the repo; tests pass."


# ---- indices -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (9, 9),
        (10, None),  # out of range for a window of 10
        (1000, None),
        (-1, None),
        (-3, None),
        (3.5, None),
        (3.0, 3),
        ("4", 4),
        (" 4 ", 4),
        ("[4]", 4),
        ("-1", None),
        ("abc", None),
        ("3.5", None),
        ("", None),
        (True, None),
        (False, None),
        ([3], None),
        ({"i": 3}, None),
    ],
)
def test_boundary_index_validation(value: Any, expected: int | None) -> None:
    d = parse_detection(reply(boundary_index=value), 10)
    assert d.boundary_index == expected
    if expected is None:
        assert d.confidence == 0.0


def test_nan_and_infinite_indices() -> None:
    # Python's json accepts NaN/Infinity literals; they are not indices.
    for literal in ("NaN", "Infinity", "-Infinity"):
        text = '{"boundary_index": ' + literal + ', "confidence": 0.9}'
        assert parse_detection(text, 10).boundary_index is None


# ---- confidence ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0.7, 0.7),
        (1, 1.0),
        (0, 0.0),
        ("0.8", 0.8),
        (" 0.65 ", 0.65),
        ("85", 0.85),
        (85, 0.85),
        ("85%", 0.85),
        ("40 %", 0.4),
        (150, 1.0),
        (-0.3, 0.0),
        ("high", 0.0),
        ("", 0.0),
        (None, 0.0),
        (True, 0.0),
        ([0.9], 0.0),
        ("nan", 0.0),
        ("inf", 0.0),
    ],
)
def test_confidence_parsing(value: Any, expected: float) -> None:
    d = parse_detection(reply(confidence=value), 10)
    assert d.boundary_index == 3
    assert d.confidence == pytest.approx(expected)
    assert 0.0 <= d.confidence <= 1.0


def test_missing_confidence_is_zero() -> None:
    assert parse_detection('{"boundary_index": 2}', 5) == Detection(2, "", 0.0, "")


def test_reason_and_summary_types() -> None:
    d = parse_detection(reply(boundary_reason=42, summary=["x"]), 10)
    assert d.boundary_reason == "" and d.summary == ""
    long = parse_detection(reply(boundary_reason="r" * 2000, summary="  s  "), 10)
    assert len(long.boundary_reason) == 500 and long.summary == "s"


# ---- garbage -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        None,
        "",
        "   ",
        "I could not find a boundary.",
        "{not json at all",
        "```json\n{broken: }\n```",
        "[1, 2, 3]",
        '"just a string"',
        "null",
        "\x00\xff garbage {{{{ }}}}",
        "{" * 5000,
    ],
)
def test_garbage_gives_the_safe_default(text: str | None) -> None:
    assert parse_detection(text, 10) == SAFE_DEFAULT
    assert SAFE_DEFAULT == Detection(None, "", 0.0, "")


def test_parse_never_raises_on_a_window_of_zero() -> None:
    assert parse_detection(reply(boundary_index=0), 0).boundary_index is None


# ---- what the detector is shown ------------------------------------------------------------


def test_indexed_lines_and_request() -> None:
    msgs = [
        {"role": "user", "content": "first line\nsecond line"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "grep", "arguments": '{"pattern": "x"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "y" * 50},
    ]
    lines = indexed_lines(msgs, 20).split("\n")
    assert len(lines) == 3  # one line per message: newlines inside are flattened
    assert lines[0] == "[0] USER: first line sec ..."  # "USER: ..." cut at 20 characters
    lines = indexed_lines(msgs, 40).split("\n")
    assert lines[0] == "[0] USER: first line second line"
    assert lines[1].startswith("[1] ASSISTANT called tool grep(")
    assert lines[2].startswith("[2] TOOL RESULT (c1): yyy")
    assert len(lines[2]) == len("[2] ") + 40 + len(" ...")

    req = build_request("PROMPT", msgs, 1000)
    assert [m["role"] for m in req] == ["system", "user"]
    assert req[0]["content"] == "PROMPT"
    assert "[1] ASSISTANT called tool grep" in req[1]["content"]
    assert all(set(m) == {"role", "content"} for m in req)


def test_detector_window_takes_the_last_messages_after_the_body_start() -> None:
    msgs = [{"role": "user", "content": str(i)} for i in range(100)]
    offset, window = detector_window(msgs, 2, 50)
    assert offset == 50 and list(window) == msgs[50:]
    offset, window = detector_window(msgs[:30], 2, 50)
    assert offset == 2 and list(window) == msgs[2:30]


# ---- sanity (#12) ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "reason",
    [
        "The topic is not a new one",
        "There is no topic change here",
        "Same task as before",
        "The user is still working on the same bug",
    ],
)
def test_a_reason_saying_there_is_no_new_topic_means_no_boundary(reason: str) -> None:
    d = sane(Detection(5, reason, 0.8, "s"), offset=10, body_start=1)
    assert d.boundary_index is None and d.confidence == 0.0


def test_the_issue_reply_truncates_nothing() -> None:
    reply = (
        '{"boundary_index": 1, "boundary_reason": "The topic is not a new one", "confidence": 0.8}'
    )
    d = sane(parse_detection(reply, 20), offset=1, body_start=1)
    assert d.boundary_index is None


def test_a_boundary_at_the_first_message_of_the_body_is_no_boundary() -> None:
    d = Detection(0, "The user moved to writing docs", 0.9)
    assert sane(d, offset=1, body_start=1).boundary_index is None
    assert sane(d, offset=8, body_start=1).boundary_index == 0


def test_a_hedging_reason_cannot_carry_a_high_confidence() -> None:
    hedged = Detection(6, "Maybe the user changed topic", 0.9)
    assert sane(hedged, offset=10, body_start=1).boundary_index is None
    modest = Detection(6, "Maybe the user changed topic", 0.6)
    assert sane(modest, offset=10, body_start=1).boundary_index == 6


def test_a_clear_switch_is_kept() -> None:
    for reason in [
        "The user switched to a new task: writing the runbook",
        "Not a continuation: a new task begins",
    ]:
        d = Detection(6, reason, 0.9)
        assert sane(d, offset=10, body_start=1) == d


def test_the_prompt_names_the_cues() -> None:
    prompt = (Path(__file__).parents[1] / "proxy" / "prompts" / "detector.md").read_text()
    for cue in ("switches task", "another file", "kind of work changes", "context reset", "middle"):
        assert cue in prompt


def test_a_reason_without_words_is_no_boundary() -> None:
    d = Detection(6, "2025-01-04 10:03:07,120 INFO", 0.8)
    assert sane(d, offset=10, body_start=1).boundary_index is None
