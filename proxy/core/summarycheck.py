"""Checks a summary must pass before it replaces anything (DESIGN §5). Pure.

Small models echo their instructions, invent a transcript of turns that never happened, loop
on one sentence or drift to another subject altogether. A summary that is cut at the token
limit is usually fine up to its last complete sentence: it is trimmed and kept, not failed.
"""

from __future__ import annotations

import re

from proxy.core import textscan

_REFUSAL_RE = re.compile(
    # ['’]: models often write typographic apostrophes ("I’m sorry").
    r"^\s*(?:I['’]m sorry|I am sorry|Sorry,|I cannot|I can['’]t|I can not|I['’]m unable|"
    r"I am unable|As an AI)",
    re.IGNORECASE,
)
# "TRANSCRIPT (12 messages):" and "[3] USER: ..." are the shapes of our own requests.
_TRANSCRIPT_RE = re.compile(
    r"\bTRANSCRIPT\b|^\s*\[\d+\]\s*(?:USER|ASSISTANT|SYSTEM|TOOL)\b", re.MULTILINE
)
_ROLE_LINE_RE = re.compile(r"^\s*(?:USER|ASSISTANT|TOOL RESULT)\b[^:\n]{0,40}:", re.MULTILINE)
# Our own request's framing lines, when a model (or an extractive summarizer) repeats them.
_FRAMING_RE = re.compile(
    r"^\s*(?:TRANSCRIPT \([^)\n]*\):|EARLIER SUMMARY:|SUMMARIES OF CONSECUTIVE PARTS[^\n]*:|"
    r"PART \d+:|Write the memory now\.?)\s*$",
    re.MULTILINE,
)
_SENTENCE_END_RE = re.compile(r"[.!?)\]](?=\s|$)|\n")
_WORD_RE = re.compile(r"[A-Za-z][A-Za-z'-]+")
# Words any summary uses whatever it is about; they say nothing about the subject.
_GENERIC = frozenset(
    """about above after again against also although among another anything around because
    been before being below between both could does doing done during each either else even
    every from further have having here however into itself just last later least less like
    made make many more most much must need next once only other over perhaps please rather
    really same several should since some still such than that their them then there these
    they thing things this those though through under until upon very want wanted wants were
    what when where whether which while whom whose will with within without would your yours
    user users assistant conversation summary memory discussed discussion asked asks told
    mentioned talked earlier previous currently current first second third next step steps
    part parts point points working work wants going able help helped helping question
    questions answer answered answers provided provide information details detail message
    messages topic topics following follow regarding related overall include includes
    including included general specific""".split()
)


class SummaryRejected(ValueError):
    """The summarizer's reply is unusable (the reason says why). A soft failure: the next
    attempt may well succeed."""


def trim_to_sentence(text: str) -> str:
    """``text`` up to its last complete sentence (or line), for a reply cut at ``max_tokens``."""
    ends = [m.end() for m in _SENTENCE_END_RE.finditer(text)]
    return text[: ends[-1]].rstrip() if ends else ""


def dedupe_sentences(text: str) -> str:
    """Drop sentences and lines repeated verbatim (a small model looping on one sentence)."""
    parts = re.split(r"((?<=[.!?])[ \t]+|\n)", text)
    seen: set[str] = set()
    out: list[str] = []
    dropped = False
    for i in range(0, len(parts), 2):
        piece, sep = parts[i], parts[i + 1] if i + 1 < len(parts) else ""
        key = " ".join(piece.lower().split())
        if key and key in seen:
            dropped = True
            continue
        seen.add(key)
        out.append(piece + sep)
    if not dropped:
        return text
    return re.sub(r"\n{3,}", "\n\n", "".join(out)).strip()


def _stem(word: str) -> str:
    return word.lower()[:5]


def content_words(text: str) -> set[str]:
    """The stems of the words that say what ``text`` is about."""
    return {
        _stem(w)
        for w in _WORD_RE.findall(text)
        if len(w) >= 4 and w.lower() not in _GENERIC and not w.isupper()
    }


def overlap(summary: str, span_text: str) -> float:
    """The share of the summary's subject words that occur in the span."""
    words = content_words(summary)
    if len(words) < 3:
        return 1.0  # too few words to judge
    span = {_stem(w) for w in textscan.findall(_WORD_RE, span_text)}  # a slice at a time
    return len(words & span) / len(words)


def echoes_prompt(summary: str, prompt: str) -> bool:
    """Whether the summary repeats a line of its instructions or of our request's framing."""
    if "Write the memory now" in summary or "EARLIER SUMMARY:" in summary:
        return True
    lowered = " ".join(summary.lower().split())
    for line in prompt.splitlines():
        line = " ".join(line.strip(" -*").lower().split())
        if len(line) >= 30 and "{budget}" not in line and line in lowered:
            return True
    return False


def gibberish(summary: str) -> str | None:
    """Why the text is not prose (too few letters, no words, looping), or None."""
    visible = [c for c in summary if not c.isspace()]
    letters = sum(c.isalpha() for c in visible)
    if not visible or letters / len(visible) < 0.4:
        return "too few letters"
    words = _WORD_RE.findall(summary)
    if len(words) < 3:
        return "too few words"
    long_words = [w for w in words if len(w) >= 4]
    if long_words:
        vowelless = sum(1 for w in long_words if not re.search(r"[aeiouyAEIOUY]", w))
        if vowelless / len(long_words) > 0.3:
            return "not words"
    if sum(len(w) for w in words) / len(words) > 14:
        return "not words"
    if len(words) >= 30 and len({w.lower() for w in words}) / len(words) < 0.2:
        return "repetitive"
    return None


def invented_lines(summary: str, span_text: str) -> list[str]:
    """Lines shaped like our transcripts (``TRANSCRIPT``, ``[3] USER:``, ``USER:``) that are not
    copied from the span: turns the model made up."""
    out = []
    for line in summary.splitlines():
        stripped = line.strip()
        if not (_TRANSCRIPT_RE.search(stripped) or _ROLE_LINE_RE.match(stripped)):
            continue
        if stripped not in span_text:
            out.append(stripped)
    return out


def strip_framing(text: str) -> tuple[str, bool]:
    """The text without lines that repeat our request's framing (``TRANSCRIPT (12
    messages):``), and whether there were any."""
    stripped = _FRAMING_RE.sub("", text)
    if stripped == text:
        return text, False
    return re.sub(r"\n{3,}", "\n\n", stripped).strip(), True


def check(
    summary: str,
    span_text: str,
    prompt: str = "",
    min_overlap: float = 0.3,
    *,
    echoed_framing: bool = False,
) -> str | None:
    """Why ``summary`` must not replace ``span_text``, or None when it may.

    ``echoed_framing``: the reply repeated our transcript's framing (already stripped); then a
    single made-up turn is enough to call it an invented transcript.
    """
    if _REFUSAL_RE.match(summary):
        return "summarizer refused"
    invented = invented_lines(summary, span_text)
    if (
        any(_TRANSCRIPT_RE.search(line) for line in invented)
        or len(invented) >= 2
        or (echoed_framing and invented)
    ):
        return "summary invents a transcript"
    if prompt and echoes_prompt(summary, prompt):
        return "summary echoes the prompt"
    # Lines copied verbatim from the span are the user's own text, never gibberish.
    novel = "\n".join(
        line for line in summary.splitlines() if line.strip() and line.strip() not in span_text
    )
    why = gibberish(novel) if novel == summary.strip() or len(novel.split()) >= 3 else None
    if why:
        return f"summary is gibberish ({why})"
    share = overlap(summary, span_text)
    if span_text and share < min_overlap:
        return f"summary is off-topic ({share:.0%} of its subject words occur in the span)"
    return None


def accept(
    text: str | None,
    finish_reason: str | None,
    *,
    span_text: str = "",
    prompt: str = "",
    max_chars: int | None = None,
) -> str:
    """The usable summary text, or ``SummaryRejected`` saying why not.

    A reply cut at the token limit (or longer than ``max_chars``) keeps its complete
    sentences.
    """
    if finish_reason in ("tool_calls", "function_call"):
        raise SummaryRejected("summarizer answered with a tool call")
    cleaned = (text or "").strip()
    if cleaned.startswith("```") and cleaned.endswith("```") and len(cleaned) > 6:
        cleaned = cleaned.strip("`").strip()
    # Lines copied from the transcript are fine (an extractive summary); its framing is not.
    cleaned, echoed = strip_framing(dedupe_sentences(cleaned))
    if finish_reason == "length":
        cleaned = trim_to_sentence(cleaned)
    if max_chars is not None and len(cleaned) > max_chars:
        cleaned = trim_to_sentence(cleaned[:max_chars])
    if len(cleaned) < 8:
        raise SummaryRejected(
            "summary empty" if finish_reason != "length" else "summary cut before one sentence"
        )
    why = check(cleaned, span_text, prompt, echoed_framing=echoed)
    if why:
        raise SummaryRejected(why)
    return cleaned
