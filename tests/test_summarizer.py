"""proxy.summarizer: the request it sends and the checks its reply must pass."""

from __future__ import annotations

import pytest

from proxy.core.summarizer import SummaryRejected, accept, build_request, strip_summary_header

GOOD = "The user is fixing parse_invoice() in src/billing/invoice.py; tests pass."


# ---- accept ----------------------------------------------------------------------------------


def test_good_text_is_accepted_and_stripped() -> None:
    assert accept(GOOD, "stop") == GOOD
    assert accept(f"\n\n  {GOOD}  \n", "stop") == GOOD
    assert accept(GOOD, None) == GOOD
    assert accept(f"```\n{GOOD}\n```", "stop") == GOOD


@pytest.mark.parametrize("text", [None, "", " ", "\n\t \n", "ok", "```\n```", "``` ```"])
def test_empty_or_whitespace_is_rejected(text: str | None) -> None:
    with pytest.raises(SummaryRejected, match="empty"):
        accept(text, "stop")


def test_a_summary_cut_at_the_token_limit_keeps_its_complete_sentences() -> None:
    cut = GOOD + " The next step is to deploy the fix to stag"
    assert accept(cut, "length") == GOOD
    assert accept(GOOD, "length") == GOOD
    with pytest.raises(SummaryRejected, match="cut before one sentence"):
        accept("The user is fixing parse_inv", "length")


@pytest.mark.parametrize("reason", ["tool_calls", "function_call"])
def test_tool_call_finish_is_rejected(reason: str) -> None:
    with pytest.raises(SummaryRejected, match="tool call"):
        accept(GOOD, reason)


@pytest.mark.parametrize(
    "text",
    [
        "I'm sorry, but I can't help with summarizing this conversation.",
        "I am sorry, I cannot do that.",
        "Sorry, I can't assist with that request.",
        "I cannot provide a summary of this content.",
        "I can't summarize this.",
        "I can not comply.",
        "I'm unable to summarize private conversations.",
        "I am unable to help with that.",
        "As an AI language model, I do not keep memories.",
        "  i'm SORRY, but no.",
        # Typographic apostrophes, as models often write them.
        "I\u2019m sorry, but I can\u2019t help with that.",
        "I can\u2019t summarize this conversation.",
        "I\u2019m unable to do that.",
    ],
)
def test_refusals_are_rejected(text: str) -> None:
    with pytest.raises(SummaryRejected, match="refused"):
        accept(text, "stop")


def test_text_mentioning_sorry_later_is_not_a_refusal() -> None:
    text = "The user said: I'm sorry for the delay. Then they fixed the bug."
    assert accept(text, "stop") == text


# ---- the request -----------------------------------------------------------------------------

SPAN = [
    {"role": "user", "content": "Please read src/app.py"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_7",
                "type": "function",
                "function": {"name": "read_file", "arguments": '{"path": "src/app.py"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_7", "content": "def main(): pass"},
    {"role": "assistant", "content": "It defines main()."},
]


def test_build_request_is_one_user_message_of_prose_and_no_tools() -> None:
    req = build_request("Write at most {budget} tokens.", SPAN, None, 321)
    assert [m["role"] for m in req] == ["system", "user"]
    assert sum(1 for m in req if m["role"] == "user") == 1
    assert req[0]["content"] == "Write at most 321 tokens."
    # Plain messages: no tool shapes anywhere (no tools, tool_calls, tool roles or ids).
    for m in req:
        assert set(m) == {"role", "content"}
        assert isinstance(m["content"], str)
    body = req[1]["content"]
    assert "TRANSCRIPT (4 messages):" in body
    assert "USER: Please read src/app.py" in body
    assert 'ASSISTANT called tool read_file({"path": "src/app.py"}) [id call_7]' in body
    assert "TOOL RESULT (call_7): def main(): pass" in body
    assert "ASSISTANT: It defines main()." in body
    assert "EARLIER SUMMARY" not in body


def test_build_request_folds_in_the_earlier_summary_first() -> None:
    req = build_request("p", SPAN, "  Earlier: the deploy ticket is OPS-4821.  ", 500)
    body = req[1]["content"]
    assert body.startswith("EARLIER SUMMARY:\nEarlier: the deploy ticket is OPS-4821.")
    assert body.index("EARLIER SUMMARY") < body.index("TRANSCRIPT")


def test_build_request_renders_dict_arguments_and_names() -> None:
    span = [
        {
            "role": "user",
            "name": "ann",
            "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {}}],
        },
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"a": 1}}}],
        },
    ]
    body = build_request("p", span, None, 1)[1]["content"]
    assert "USER (ann): hi\n[image]" in body
    assert 'ASSISTANT called tool f({"a":1}) [id c]' in body


def test_strip_summary_header() -> None:
    content = "[History Summary - 12 earlier messages]\n\nThe text.\n\nMore."
    assert strip_summary_header(content) == "The text.\n\nMore."
    assert strip_summary_header("no header here") == "no header here"


def test_an_overlong_transcript_keeps_the_newest_messages_and_says_what_it_left_out() -> None:
    span = [{"role": "user", "content": f"message {i} " + "x" * 1000} for i in range(50)]
    messages = build_request("p {budget}", span, "EARLIER", 300, max_chars=10_500)
    text = messages[-1]["content"]
    assert "EARLIER" in text, "the earlier summary is always kept"
    assert "message 49 " in text and "message 40 " in text
    assert "message 39 " not in text and "message 0 " not in text
    assert "[40 older messages left out" in text
    # Within the limit nothing is left out.
    short = build_request("p {budget}", span[:3], None, 300, max_chars=10_500)
    assert "left out" not in short[-1]["content"] and "message 0 " in short[-1]["content"]
