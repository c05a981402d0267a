"""The summarizer's input and the checks its output must pass (DESIGN §5).

The summarizer always covers exactly the span it replaces, plus any earlier summary, so a
rolling series of compactions never loses what the first one kept.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .messages import Message, transcript

_REFUSAL_RE = re.compile(
    # ['’]: models often write typographic apostrophes ("I’m sorry").
    r"^\s*(?:I['’]m sorry|I am sorry|Sorry,|I cannot|I can['’]t|I can not|I['’]m unable|"
    r"I am unable|As an AI)",
    re.IGNORECASE,
)


class SummaryRejected(ValueError):
    """The summarizer's reply is empty, truncated or a refusal."""


def build_request(
    prompt: str, span: Sequence[Message], earlier_summary: str | None, budget_tokens: int
) -> list[Message]:
    """Instructions plus the span as one prose transcript in a single user message."""
    parts = []
    if earlier_summary:
        parts.append(f"EARLIER SUMMARY:\n{earlier_summary.strip()}")
    parts.append(f"TRANSCRIPT ({len(span)} messages):\n{transcript(span)}")
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
