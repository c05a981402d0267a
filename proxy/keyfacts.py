"""The key-facts guard: identifiers a summary must not lose (DESIGN §5).

Summaries paraphrase; operators and models need the exact strings back (paths, URLs, ticket
ids, error names). Whatever the replaced span contained and the summary lost is appended as
one bounded ``Key references:`` line, and reported as kept/dropped for the loss report.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PATTERNS = [
    # URLs first so their path parts are not matched again as file paths.
    r"https?://[^\s<>\"'`)\]]+",
    # Unix and Windows paths with at least two components, or a file name with an extension.
    r"(?<![\w/])(?:~|\.{1,2})?(?:/[\w.\-]+){2,}/?",
    r"\b[A-Za-z]:\\[\w.\\\-]+",
    r"\b[\w\-]+(?:/[\w\-]+)*\.(?:py|js|ts|tsx|go|rs|java|rb|c|h|cpp|md|json|ya?ml|toml|sql|sh|"
    r"txt|csv|ini|cfg|conf|env|lock|html|css)\b",
    # Ticket-like ids: ABC-1234.
    r"\b[A-Z][A-Z0-9]{1,9}-\d{1,7}\b",
    # Error and exception names.
    r"\b[A-Z]\w*(?:Error|Exception|Warning|Fault)\b",
    # Code symbols: calls, dotted names and snake/camel identifiers.
    r"\b[A-Za-z_]\w*\(\)",
    r"\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+\b(?!\.\w)",
    r"\b[a-z]+(?:_[a-z0-9]+)+\b",
    r"\b[a-z]+(?:[A-Z][a-z0-9]+){1,}\b",
    # Numbers with units, and labelled numbers (port 8443, v2.3.1).
    r"\$\s?\d[\d,]*(?:\.\d+)?",
    # "%" is outside the trailing \b: a word boundary never follows "%" before a space.
    r"\b\d+(?:\.\d+)?\s?(?:(?:ms|s|sec|min|h|KB|MB|GB|TB|KiB|MiB|GiB|px|tokens|USD|EUR)\b|%)",
    r"\b(?:port|version|v)\s?\d+(?:\.\d+)*\b",
    # Host-like names with digits (pg-billing-02).
    r"\b[a-z][a-z0-9]*(?:-[a-z0-9]+)*-\d+[a-z0-9]*\b",
]
_FACT_RE = re.compile("|".join(f"(?:{p})" for p in _PATTERNS))
_MAX_FACT_LEN = 160
# ``payload.get`` or ``log.debug`` name no fact worth keeping: generic method calls on
# whatever variable happened to be at hand.
_GENERIC_METHODS = frozenset(
    "get set pop append extend update items keys values copy format join split strip lower "
    "upper replace debug info warning warn error exception critical log print read write "
    "close open load loads dump dumps".split()
)


def _is_noise(fact: str) -> bool:
    if "/" in fact or "(" in fact:
        return False
    head, dot, tail = fact.rpartition(".")
    return bool(dot) and head.isidentifier() and tail in _GENERIC_METHODS


def extract_key_facts(text: str, limit: int = 500) -> list[str]:
    """Distinct identifiers in ``text``, in order of first appearance, at most ``limit``."""
    seen: dict[str, None] = {}
    for match in _FACT_RE.finditer(text):
        fact = match.group(0).rstrip(".,;:")
        if 2 < len(fact) <= _MAX_FACT_LEN and fact not in seen and not _is_noise(fact):
            seen[fact] = None
            if len(seen) >= limit:
                break
    return list(seen)


@dataclass(frozen=True)
class FactReport:
    """What the summary kept and dropped of the replaced span's key facts."""

    kept: tuple[str, ...]
    dropped: tuple[str, ...]
    appended: tuple[str, ...]


def guard(span_text: str, summary: str, max_chars: int) -> tuple[str, FactReport]:
    """Append the facts the summary lost, within ``max_chars``; report kept and dropped.

    ``dropped`` lists what is missing even after the appended line (it did not fit).
    """
    facts = extract_key_facts(span_text)
    kept = [f for f in facts if f in summary]
    lost = [f for f in facts if f not in summary]
    appended: list[str] = []
    used = 0
    for fact in lost:
        cost = len(fact) + 2
        if used + cost > max_chars:
            continue
        appended.append(fact)
        used += cost
    if appended:
        summary = f"{summary.rstrip()}\n\nKey references: {'; '.join(appended)}"
    dropped = [f for f in lost if f not in appended]
    return summary, FactReport(tuple(kept), tuple(dropped), tuple(appended))
