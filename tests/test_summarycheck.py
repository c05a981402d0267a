"""proxy.summarycheck and the map-reduce summarizer: what a summary must pass (#12)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from proxy.core.summarizer import summarize, target_tokens
from proxy.core.summarycheck import (
    SummaryRejected,
    accept,
    check,
    dedupe_sentences,
    trim_to_sentence,
)

PROMPT = (
    "You write the running memory of a long conversation between a user and an AI assistant.\n"
    "Write the memory in at most {budget} tokens, as plain prose and short bullet points:\n"
    "- decisions made and why; what was tried and what failed;"
)
SPAN = (
    "USER: The refund for order PAY-48213 failed on the payment gateway.\n\n"
    "ASSISTANT: The gateway returned HTTP 503; we will retry the refund with backoff and "
    "log the invoice id without customer data."
)
GOOD = "The refund for order PAY-48213 failed with HTTP 503 at the gateway; retry with backoff."


def test_a_good_summary_passes() -> None:
    assert check(GOOD, SPAN, PROMPT) is None
    assert accept(GOOD, "stop", span_text=SPAN, prompt=PROMPT) == GOOD


# ---- trimming --------------------------------------------------------------------------------


def test_trim_to_the_last_complete_sentence() -> None:
    assert trim_to_sentence("One thing. Two things! Three thi") == "One thing. Two things!"
    assert trim_to_sentence("- bullet one\n- bullet tw") == "- bullet one"
    assert trim_to_sentence("no sentence end at all") == ""


def test_a_summary_cut_at_max_tokens_is_trimmed_and_kept() -> None:
    cut = GOOD + " Next the user wants to add a dead-letter qu"
    assert accept(cut, "length", span_text=SPAN, prompt=PROMPT) == GOOD


def test_a_summary_longer_than_its_budget_is_trimmed() -> None:
    long = " ".join([GOOD] * 3) + " The refund is retried later."
    out = accept(long, "stop", span_text=SPAN, max_chars=120)
    assert len(out) <= 120 and out.endswith(".")


def test_a_looping_summary_keeps_one_copy_of_each_sentence() -> None:
    looping = "The refund failed. " * 20 + "Retry with backoff."
    assert dedupe_sentences(looping) == "The refund failed. Retry with backoff."
    assert dedupe_sentences(GOOD) == GOOD


# ---- the checks ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "echo",
    [
        "You write the running memory of a long conversation between a user and an AI assistant.",
        "decisions made and why; what was tried and what failed; the refund PAY-48213 failed.",
        "EARLIER SUMMARY:\nThe refund failed.",
        "The refund failed. Write the memory now.",
    ],
)
def test_an_echoed_prompt_is_rejected(echo: str) -> None:
    assert check(echo, SPAN, PROMPT) == "summary echoes the prompt"


@pytest.mark.parametrize(
    "invented",
    [
        "TRANSCRIPT (4 messages):\nUSER: hello",
        "[0] USER: I want a refund.\n[1] ASSISTANT: Sure.",
        "USER: Can you refund order 77?\nASSISTANT: Yes, refunded.",
    ],
)
def test_an_invented_transcript_is_rejected(invented: str) -> None:
    assert check(invented, SPAN, PROMPT) == "summary invents a transcript"


def test_transcript_lines_copied_from_the_span_are_not_invented() -> None:
    copied = "\n".join(line for line in SPAN.splitlines() if "PAY-48213" in line or "503" in line)
    assert check(copied, SPAN, PROMPT) is None


@pytest.mark.parametrize(
    "junk",
    [
        "1234 5678 9012 3456 7890 #### $$$$ 0000 1111",
        "xkcd qwrtp zxcvb mnbvc lkjhg pprst fghjk",
        "refund " * 40,
        "Supercalifragilisticexpialidociousantidisestablishmentarianism refundgatewayretry x",
    ],
)
def test_gibberish_is_rejected(junk: str) -> None:
    assert (check(junk, SPAN, PROMPT) or "").startswith("summary is gibberish")


def test_an_off_topic_summary_is_rejected() -> None:
    off = "Paris is the capital of France, famous for museums, bakeries and long boulevards."
    why = check(off, SPAN, PROMPT)
    assert why is not None and why.startswith("summary is off-topic")
    with pytest.raises(SummaryRejected, match="off-topic"):
        accept(off, "stop", span_text=SPAN, prompt=PROMPT)


# ---- map-reduce over a span longer than the summary model's window ----------------------------


def test_a_long_span_is_summarized_in_chunks_then_reduced() -> None:
    span = [
        {"role": "user", "content": f"Part {i}: the refund ledger entry {i} is REF-{1000 + i}."}
        for i in range(60)
    ]
    requests: list[list[dict[str, Any]]] = []

    # The summarizer is a flow: it yields each request and is sent the reply, by hand here.
    flow = summarize("p {budget}", span, "The ledger is REF-0999.", 200, 1500)
    request = next(flow)
    while True:
        requests.append(request)
        refs = sorted(set(re.findall(r"REF-\d+", request[1]["content"])))
        try:
            request = flow.send(
                (f"The refund ledger entries {refs[0]} to {refs[-1]} were reviewed.", "stop")
            )
        except StopIteration as done:
            out = done.value
            break
    assert len(requests) > 2  # several map calls and a reduce
    assert all(len(r[1]["content"]) <= 1500 + 200 for r in requests)
    assert "EARLIER SUMMARY:\nThe ledger is REF-0999." in requests[-1][1]["content"]
    assert "REF-1000" in requests[0][1]["content"] and "REF-1059" not in requests[0][1]["content"]
    assert out.startswith("The refund ledger entries")
    assert len(out) <= 200 * 4


def test_the_summarizer_is_asked_for_less_than_its_max_tokens() -> None:
    assert target_tokens(400) == 300 and target_tokens(40) == 32


def test_an_extractive_summary_repeating_our_framing_keeps_only_the_copied_lines() -> None:
    copied = "TRANSCRIPT (2 messages):\n" + SPAN.splitlines()[0]
    assert accept(copied, "stop", span_text=SPAN, prompt=PROMPT) == SPAN.splitlines()[0]
    invented = "TRANSCRIPT (2 messages):\nUSER: please refund order 77 now"
    with pytest.raises(SummaryRejected, match="invents a transcript"):
        accept(invented, "stop", span_text=SPAN, prompt=PROMPT)
