"""The summarizer's input and the checks its output must pass (DESIGN §5).

The summarizer always covers exactly the span it replaces, plus any earlier summary, so a
rolling series of compactions never loses what the first one kept.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

from proxy.core.messages import Message, render
from proxy.core.summarycheck import SummaryRejected, accept

__all__ = ["SummaryRejected", "accept", "build_request", "strip_summary_header", "summarize"]

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


# One summarizer call as a flow step: the request is yielded, the reply's text and finish
# reason are sent back (the caller makes the call; see proxy.core.commands).
Summarizing = Generator[list[Message], tuple[str | None, str | None], str]
_MAX_REDUCE_ROUNDS = 4


def target_tokens(max_tokens: int) -> int:
    """The length the summarizer is asked for: below its ``max_tokens``, so that it usually
    ends by itself instead of being cut."""
    return max(32, max_tokens * 3 // 4)


def chunk_texts(texts: Sequence[str], max_chars: int) -> list[list[str]]:
    """Consecutive groups of ``texts`` of at most ``max_chars`` each (joined by blank lines);
    a single text longer than that is split into pieces."""
    limit = max(max_chars, 1000)
    chunks: list[list[str]] = []
    current: list[str] = []
    used = 0
    for text in texts:
        pieces = [text[i : i + limit] for i in range(0, len(text), limit)] or [""]
        for piece in pieces:
            if current and used + len(piece) + 2 > limit:
                chunks.append(current)
                current, used = [], 0
            current.append(piece)
            used += len(piece) + 2
    if current:
        chunks.append(current)
    return chunks


def _request(prompt: str, body: str, earlier: str | None, budget_tokens: int) -> list[Message]:
    parts = [f"EARLIER SUMMARY:\n{earlier.strip()}"] if earlier else []
    parts.append(body)
    return [
        {"role": "system", "content": prompt.replace("{budget}", str(budget_tokens))},
        {"role": "user", "content": "\n\n".join(parts) + "\n\nWrite the memory now."},
    ]


def summarize(
    prompt: str,
    span: Sequence[Message],
    earlier: str | None,
    max_tokens: int,
    max_chars: int = DEFAULT_MAX_TRANSCRIPT_CHARS,
) -> Summarizing:
    """The checked summary of ``span`` (folding in ``earlier``), or ``SummaryRejected``: a
    generator that yields each summarizer request and is sent its ``(text, finish_reason)``.

    A span longer than the summary model can read (``max_chars``) is summarized in chunks
    that each fit (map), then the chunk summaries are summarized together with the earlier
    summary (reduce). The result never grows past ``max_tokens`` (~4 characters a token),
    so a rolling summary stays within its budget however many times it is folded in.
    """
    budget = target_tokens(max_tokens)
    limit_chars = max_tokens * 4
    texts = [render(m) for m in span]
    whole = "\n\n".join(texts)
    span_text = f"{earlier or ''}\n\n{whole}"

    def one(body: str, folded: str | None, about: str) -> Summarizing:
        text, finish = yield _request(prompt, body, folded, budget)
        return accept(text, finish, span_text=about, prompt=prompt, max_chars=limit_chars)

    if len(whole) + len(earlier or "") <= max_chars:
        return (yield from one(f"TRANSCRIPT ({len(span)} messages):\n{whole}", earlier, span_text))
    parts = []
    for piece in chunk_texts(texts, max_chars):
        joined = "\n\n".join(piece)
        parts.append(
            (yield from one(f"TRANSCRIPT (one part of the older history):\n{joined}", None, joined))
        )
    for _ in range(_MAX_REDUCE_ROUNDS):
        if len(parts) == 1 and not earlier:
            return parts[0]
        numbered = [f"PART {i + 1}:\n{p}" for i, p in enumerate(parts)]
        if sum(len(p) + 2 for p in numbered) + len(earlier or "") <= max_chars:
            body = "SUMMARIES OF CONSECUTIVE PARTS, OLDEST FIRST:\n\n" + "\n\n".join(numbered)
            return (yield from one(body, earlier, span_text))
        groups = chunk_texts(numbered, max_chars // 2)
        if len(groups) == len(parts):
            parts = parts[-max(1, (max_chars // 2) // max(limit_chars, 1)) :]
            continue  # the parts cannot be grouped: keep the newest that fit
        reduced = []
        for g in groups:
            joined = "SUMMARIES OF CONSECUTIVE PARTS, OLDEST FIRST:\n\n" + "\n\n".join(g)
            reduced.append((yield from one(joined, None, "\n".join(g))))
        parts = reduced
    raise SummaryRejected("summary of the chunk summaries did not converge")
