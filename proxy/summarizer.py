"""The summarizer's input and the checks its output must pass (DESIGN §5).

The summarizer always covers exactly the span it replaces, plus any earlier summary, so a
rolling series of compactions never loses what the first one kept.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .messages import Message, render

_REFUSAL_RE = re.compile(
    # ['’]: models often write typographic apostrophes ("I’m sorry").
    r"^\s*(?:I['’]m sorry|I am sorry|Sorry,|I cannot|I can['’]t|I can not|I['’]m unable|"
    r"I am unable|As an AI)",
    re.IGNORECASE,
)


class SummaryRejected(ValueError):
    """The summarizer's reply is empty, truncated or a refusal."""


# Transcripts are capped so the summary model can read them (~4 characters a token).
DEFAULT_MAX_TRANSCRIPT_CHARS = 400_000


def build_request(
    prompt: str,
    span: Sequence[Message],
    earlier_summary: str | None,
    budget_tokens: int,
    max_chars: int = DEFAULT_MAX_TRANSCRIPT_CHARS,
) -> list[Message]:
    """Instructions plus the span as one prose transcript in a single user message.

    A transcript longer than ``max_chars`` keeps its most recent messages and says how many
    older ones it leaves out: a first compaction of a history larger than the summary model's
    context would otherwise always fail. (The key-facts guard still reads the whole span.)
    """
    parts = []
    if earlier_summary:
        parts.append(f"EARLIER SUMMARY:\n{earlier_summary.strip()}")
    rendered = [render(m) for m in span]
    kept, used = 0, 0
    for text in reversed(rendered):
        if kept and used + len(text) + 2 > max_chars:
            break
        kept += 1
        used += len(text) + 2
    left_out = len(rendered) - kept
    body_text = "\n\n".join(rendered[left_out:])
    if left_out:
        body_text = f"[{left_out} older messages left out: too long to read at once]\n\n{body_text}"
    parts.append(f"TRANSCRIPT ({len(span)} messages):\n{body_text}")
    body = "\n\n".join(parts)
    return [
        {"role": "system", "content": prompt.replace("{budget}", str(budget_tokens))},
        {"role": "user", "content": f"{body}\n\nWrite the memory now."},
    ]


def strip_summary_header(content: str) -> str:
    """The text of an earlier summary without its ``[History Summary - N ...]`` line."""
    if content.startswith("[History Summary - "):
        _, _, rest = content.partition("\n\n")
        return rest
    return content


def accept(text: str | None, finish_reason: str | None) -> str:
    """The usable summary text, or ``SummaryRejected`` saying why not."""
    if finish_reason == "length":
        raise SummaryRejected("summary truncated at the token limit")
    if finish_reason in ("tool_calls", "function_call"):
        raise SummaryRejected("summarizer answered with a tool call")
    cleaned = (text or "").strip()
    if cleaned.startswith("```") and cleaned.endswith("```"):
        cleaned = cleaned.strip("`").strip()
    if len(cleaned) < 8:
        raise SummaryRejected("summary empty")
    if _REFUSAL_RE.match(cleaned):
        raise SummaryRejected("summarizer refused")
    return cleaned
