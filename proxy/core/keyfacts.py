"""The key-facts guard: identifiers a summary must not lose (DESIGN §5).

Summaries paraphrase; operators and models need the exact strings back (ticket ids, paths,
URLs, amounts, decisions). Facts are extracted by kind, noise is dropped (progress
percentages, tool-call ids, reasoning hashes, log timestamps), and the rest is ranked by how
identifying it is. ``proxy.core.references`` labels and ranks them for the
bounded ``Key references:`` line of a summary.
"""

from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass

from proxy.core import textscan

# (kind, weight, pattern). A higher weight names a thing more uniquely. When two matches
# overlap, the one found by the earlier pattern at the same place wins, and a match inside
# another one (a ticket id inside a URL) is not counted twice.
_UNITS_STOP = (
    "a an and are as at be by for from in into is it of on or so than that the then this to "
    "was were will with more less times time"
)
_STOP_UNITS = frozenset(_UNITS_STOP.split())
_SPEC: list[tuple[str, float, str]] = [
    (
        "decision",
        10,
        r"\b(?:[Ww]e|I|[Tt]hey|[Tt]he team|[Yy]ou)\s+(?:(?:have|had|'ve|finally)\s+)?"
        r"(?:chose|chosen|choose|decided|picked|selected|settled on|went with|agreed|"
        r"will use|'ll use|are going with|opted)\b[^.!?\n]{3,150}",
    ),
    ("decision", 10, r"\b(?:[Dd]ecision|[Dd]ecided):\s*[^.!?\n]{3,150}"),
    ("url", 9, r"https?://[^\s<>\"'`)\]]+"),
    (
        "command",
        8,
        r"\b(?:pip3?|uv pip|uv|npm|yarn|pnpm|poetry|brew|apt-get|apt|cargo|gem|go)\s+"
        r"(?:install|add|remove|uninstall|get)\s+[^\n`;|]{1,100}",
    ),
    (
        "command",
        8,
        r"\bgit\s+(?:commit|checkout|rebase|push|pull|clone|merge|reset|revert|cherry-pick|"
        r"stash|tag|bisect|switch|branch|fetch|apply|am)\b[^\n`;|]{0,100}",
    ),
    (
        "command",
        8,
        r"(?m)(?:^\s*\$\s+|`)(?:docker|kubectl|helm|make|pytest|python3?|curl|terraform|"
        r"npm|npx|pip3?|git|cargo|go|uv|psql|redis-cli|systemctl|ssh|scp)\s[^\n`]{1,100}",
    ),
    (
        "ticket",
        10,
        r"(?<![\w/.-])[A-Z][A-Z0-9]{1,9}(?:-[A-Z0-9]+)+(?![\w-])",
    ),
    ("ticket", 7, r"(?<![\w&#])#\d{2,7}\b"),
    ("channel", 7, r"(?<![\w&#])#[a-z][\w-]{2,}"),
    ("header", 7, r"\b[A-Z][A-Za-z]*(?:-[A-Z][A-Za-z]*)+:[ \t]?[\w./-]+"),
    # Tracking numbers, serials, license keys: upper-case letters and digits mixed.
    ("id", 8, r"\b(?=[A-Z0-9]*\d)(?=[A-Z0-9]*[A-Z])[A-Z0-9]{8,}\b"),
    (
        "amount",
        9,
        r"[$€£¥]\s?\d[\d,]*(?:\.\d+)?(?:\s?(?:k|m|bn|million|billion)\b)?|"
        r"\b\d[\d,]*(?:\.\d+)?\s?(?:USD|EUR|GBP|JPY|CHF|CAD|AUD|dollars|euros|pounds)\b|"
        r"\b(?:USD|EUR|GBP|CHF|CAD|AUD)\s?\d[\d,]*(?:\.\d+)?",
    ),
    # Absolute, home and relative paths with two components, Windows paths, file names.
    ("path", 8, r"(?<![\w/])(?:(?:~|\.{1,2})(?:/[\w.\-]+)+|(?:/[\w.\-]+){2,})/?"),
    ("path", 8, r"\b[A-Za-z]:\\[\w.\\\-]+"),
    (
        "path",
        8,
        r"\b[\w\-]+(?:/[\w\-.]+)*\.(?:py|js|ts|tsx|jsx|go|rs|java|kt|rb|php|c|h|cpp|hpp|cs|"
        r"md|rst|json|ya?ml|toml|sql|sh|txt|csv|ini|cfg|conf|env|lock|html|css|xml|proto|tf)\b"
        r"(?:::[\w\[\]-]+)*",  # a pytest node id: tests/test_x.py::test_y
    ),
    # Relative paths and branch names without a leading ./ (release/2024.11-hotfix3).
    ("path", 7, r"(?<![\w/.:@-])[A-Za-z_][\w.-]*(?:/[\w.-]+)+/?"),
    (
        "host",
        8,
        r"\b[a-z0-9](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)*"
        r"\.(?:internal|local|lan|corp|com|net|org|io|dev|cloud|ai|app|svc|example|test)"
        r"(?::\d{2,5})?\b",
    ),
    ("host", 8, r"\b[a-z][a-z0-9]*(?:-[a-z0-9]+)*-\d+[a-z0-9]*(?:\.[a-z][\w-]*)*\b"),
    ("error", 8, r"\b[A-Z]\w*(?:Error|Exception|Warning|Fault)\b"),
    ("error", 8, r"\bE[A-Z]{4,}\b|\b(?:HTTP|[Ss]tatus|[Ee]rror|[Ee]xit code)\s?\d{3}\b"),
    ("error", 7, r"\b[A-Z]{1,5}\d{3,5}\b"),
    ("sha", 8, r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"),
    (
        "date",
        7,
        r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?"
        r"|\b\d{1,2} (?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* \d{4}\b"
        r"|\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* \d{1,2}(?:st|nd|rd|th)?"
        r"(?:,? \d{4})?\b|\b\d{1,2}/\d{1,2}/\d{2,4}\b",
    ),
    ("time", 3, r"(?<![\d:])\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?\b"),
    (
        "version",
        7,
        r"\bv\d+(?:\.\d+)+(?:[-+][\w.]+)?\b|\b\d+\.\d+\.\d+(?:[-+][\w.]+)?\b|"
        r"\b(?:version|Python|Node|Go|Java|PostgreSQL|Postgres|Django|Ubuntu|Redis|v)\s?"
        r"\d+(?:\.\d+)*\b",
    ),
    ("constant", 7, r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b"),
    ("quantity", 6, r"\b(?:port|line|PR|pid)\s\d+\b"),
    (
        "quantity",
        6,
        r"(?<![\w.,\-/:$€£¥])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?:\s?[A-Za-z]+(?:/[A-Za-z]+)?)?",
    ),
    ("quantity", 6, r"(?<![\w.,\-/:$€£¥])\d+(?:\.\d+)?\s?%"),
    ("quantity", 6, r"(?<![\w.,\-/:$€£¥])\d+(?:\.\d+)?\s?[A-Za-zµ°]+(?:/[A-Za-z]+)?\b"),
    ("name", 6, r"\b(?:name is|named|called|I'm|I am|this is|ask|contact)\s+([A-Z][a-z]+)\b"),
    ("name", 6, r"\b[A-Z][a-z]+(?:[ ][A-Z][a-zA-Z0-9]+)+\b"),
    ("symbol", 5, r"\b[A-Za-z_]\w*\(\)"),
    ("symbol", 5, r"\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+\b(?!\.\w)"),
    ("symbol", 4, r"\b[a-z]+(?:_[a-z0-9]+)+\b"),
    ("symbol", 4, r"\b[a-z]+(?:[A-Z][a-z0-9]+){1,}\b"),
    ("symbol", 4, r"\b[a-z][a-z0-9]*(?:-[a-z0-9]+)+\b"),  # kebab-case names: acme-eu
    ("number", 3, r"(?<![\w.,\-/#])\d{4,}\b"),
]
_COMPILED = [(kind, weight, re.compile(p)) for kind, weight, p in _SPEC]
_MAX_FACT_LEN = 160

# ``payload.get`` or ``log.debug`` name no fact worth keeping: generic method calls on
# whatever variable happened to be at hand.
_GENERIC_METHODS = frozenset(
    "get set pop append extend update items keys values copy format join split strip lower "
    "upper replace debug info warning warn error exception critical log print read write "
    "close open load loads dump dumps".split()
)
# Capitalised words that start sentences, not names ("Thanks Dana" names Dana).
_NOT_NAMES = frozenset(
    "The A An This That These Those We I You He She It They Our My Your Their In On At For If "
    "When Then And But So Also Please Thanks Thank Hi Hello Hey Yes No Ok OK Let Now Here "
    "There What Why How Which Who Where Sure Great Good Done Next First Second Finally After "
    "Before Note Use Run See Check Added Fixed Updated Key Summary User Assistant Tool Result "
    "Earlier History Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
)
_LOG_PREFIX_RE = re.compile(r"\s*(?:[A-Z][A-Z ]*(?: \([^)]*\))?:\s*)?[\[(]?\s*")
_COMMAND_END_RE = re.compile(r"\s(?:then|and|to|so|because|which|but|if)\s")
_TOOL_ID_RE = re.compile(r"^(?:call|toolu|fc|rs|msg|resp|item|chatcmpl)_[A-Za-z0-9_-]+$")
_BLOB_RE = re.compile(r"[A-Za-z0-9+/=_-]{40,}")
_HEX_RE = re.compile(r"[0-9a-f]{41,}")
# Opaque reasoning items (Responses ``reasoning``, Anthropic ``thinking`` signatures): never
# mined, whatever form the renderer gives them.
_REASONING_RE = re.compile(
    r"^\s*(?:[A-Z]+(?: \([^)]*\))?:\s*)?\[(?:reasoning|thinking|redacted_thinking)\][^\n]*$",
    re.MULTILINE,
)
_TOOL_ID_IN_TEXT_RE = re.compile(r"\b(?:call|toolu|fc|rs|msg|resp|item|chatcmpl)_[A-Za-z0-9_-]{6,}")


@dataclass(frozen=True)
class Fact:
    """One identifying string of a span, with its kind and how identifying it is."""

    text: str
    kind: str
    score: float
    first: int  # offset of its first appearance


def _line_prefix(text: str, start: int) -> str:
    return text[text.rfind("\n", 0, start) + 1 : start]


def _is_progress(text: str, start: int, end: int) -> bool:
    """``[ 45%]`` (pytest), ``45%|####`` (tqdm), ``progress: 45%``, ``45% complete``."""
    before = text[max(0, start - 12) : start].lower()
    after = text[end : end + 12].lower()
    return (
        before.rstrip().endswith("[")
        or after.lstrip().startswith("|")
        or after.lstrip().startswith("]")
        or "progress" in before
        or "download" in before
        or after.lstrip().startswith(("complete", "done"))
    )


def _is_log_timestamp(text: str, start: int, fact: str) -> bool:
    """A date-time with seconds, or a bare time, that opens a log line (perhaps right after
    the transcript's ``TOOL RESULT (call_1):`` label)."""
    if not re.search(r"\d:\d{2}:\d{2}|^\d{1,2}:\d{2}:\d{2}", fact):
        return False
    return _LOG_PREFIX_RE.fullmatch(_line_prefix(text, start)) is not None


def _clean(kind: str, fact: str) -> str:
    fact = fact.strip().rstrip(".,;:!?'\"")
    if kind == "name":
        words = fact.split()
        while words and words[0] in _NOT_NAMES:
            words.pop(0)
        fact = " ".join(words)
    if kind in ("decision", "command"):
        fact = fact.split(". ")[0].rstrip(".,;:")
    if kind == "command":
        fact = _COMMAND_END_RE.split(fact.lstrip("$` \t"))[0]
    while fact.endswith("]") and fact.count("]") > fact.count("["):
        fact = fact[:-1]  # a bracket closing the text around it (a placeholder), not the fact
    return fact.replace("; ", ", ")


def _is_noise(kind: str, fact: str, text: str, start: int, end: int) -> bool:
    if _TOOL_ID_RE.match(fact) or _HEX_RE.search(fact):
        return True
    if kind not in ("url", "path", "decision", "command") and _BLOB_RE.fullmatch(fact):
        # A long unbroken token mixing cases and digits: a signature or hash, not a name.
        mixed = any(c.isupper() for c in fact) and any(c.islower() for c in fact)
        if mixed and any(c.isdigit() for c in fact):
            return True
    if kind == "quantity" and fact.endswith("%") and _is_progress(text, start, end):
        return True
    if kind in ("date", "time") and _is_log_timestamp(text, start, fact):
        return True
    if kind == "quantity":
        unit = fact.split()[-1] if " " in fact else ""
        if unit.lower() in _STOP_UNITS:
            return True
    if kind == "symbol" and "/" not in fact and "(" not in fact:
        head, dot, tail = fact.rpartition(".")
        if dot and head.isidentifier() and tail in _GENERIC_METHODS:
            return True
        if dot and min(len(p) for p in fact.split(".")) < 2:
            return True  # e.g., i.e.
    return False


def strip_opaque(text: str) -> str:
    """The text without reasoning lines and tool-call ids (they identify nothing a user said)."""
    text = textscan.sub(_REASONING_RE, "", text)
    return textscan.sub(_TOOL_ID_IN_TEXT_RE, " ", text)


def facts_in(text: str, limit: int = 500) -> list[Fact]:
    """The distinct facts of ``text`` with their kind and score, in order of first appearance."""
    text = strip_opaque(text)
    per_pattern: list[list[tuple[int, int, int, str, float, str, bool]]] = []
    for order, (kind, weight, pattern) in enumerate(_COMPILED):
        found_here = []
        for m in textscan.finditer(pattern, text):  # a slice at a time: see textscan
            group = 1 if m.re.groups and m.group(1) is not None else 0
            captured = group == 1
            found_here.append(
                (m.start(group), -m.end(group), order, kind, weight, m.group(group), captured)
            )
        found_here.sort()  # already in order of position: linear
        per_pattern.append(found_here)
    # Merged, not sorted as one list: one sort of 100,000 matches holds the GIL for long.
    matches = heapq.merge(*per_pattern)
    # Spans already taken, by start; ``reach``: the furthest end of those starting at or
    # before the current match. A match ending within it lies inside a taken span. (Checking
    # every taken span per match was quadratic: 20 s for a 10,000-message span.)
    pending: list[tuple[int, int]] = []
    reach = -1
    found: dict[str, Fact] = {}
    for start, neg_end, _, kind, weight, raw, captured in matches:
        end = -neg_end
        while pending and pending[0][0] <= start:
            reach = max(reach, heapq.heappop(pending)[1])
        if end <= reach:
            continue  # inside a larger fact already counted
        fact = _clean(kind, raw)
        if not 2 < len(fact) <= _MAX_FACT_LEN:
            continue
        if _is_noise(kind, fact, text, start, end):
            heapq.heappush(pending, (start, end))  # its parts are noise too (a log line's "2024")
            continue
        if kind == "name" and not captured and len(fact.split()) < 2:
            continue  # "Thanks Dana": one word left is no multi-word name
        at = raw.find(fact)
        if at >= 0:  # what is left after cleaning: the rest may hold other facts
            start, end = start + at, start + at + len(fact)
        heapq.heappush(pending, (start, end))
        if fact not in found:
            if len(found) >= limit:
                continue
            digits = 0.5 if any(c.isdigit() for c in fact) else 0.0
            found[fact] = Fact(fact, kind, weight + digits, start)
    # A fact whose form many other facts share (src/queue_1.py, src/queue_2.py, ...) is a
    # routine artifact of tools and logs; a one-off form identifies something. No bonus for
    # repetition either: what a tool keeps touching is not what a user said once.
    shapes: dict[str, int] = {}
    for known in found.values():
        shape = _shape(known.text, known.kind)
        shapes[shape] = shapes.get(shape, 0) + 1
    return [
        Fact(f.text, f.kind, f.score - 0.75 * math.log2(shapes[_shape(f.text, f.kind)]), f.first)
        if f.kind not in _SHAPELESS
        else f
        for f in found.values()
    ]


# Every name or decision has the same coarse form: their form says nothing about them.
_SHAPELESS = frozenset({"name", "decision", "command"})


def _shape(fact: str, kind: str) -> str:
    """``src/queue_1.py`` -> ``a/a_#.a``: what facts of one routine form have in common. A
    quantity keeps its unit: ``1834 tokens`` and ``900 s`` are not the same kind of thing."""
    if kind in ("quantity", "amount", "number"):
        return re.sub(r"\d[\d,.]*", "#", fact)
    return re.sub(r"[A-Z]+", "A", re.sub(r"[a-z]+", "a", re.sub(r"\d+", "#", fact)))


def extract_key_facts(text: str, limit: int = 500) -> list[str]:
    """Distinct identifiers in ``text``, in order of first appearance, at most ``limit``."""
    return [f.text for f in sorted(facts_in(text, limit), key=lambda f: f.first)]


def ranked(facts: list[Fact]) -> list[Fact]:
    """Most identifying first; ties keep their order of appearance."""
    return sorted(facts, key=lambda f: (-f.score, f.first))


def scaled_budget(base_chars: int, span_chars: int, factor: int = 4) -> int:
    """The ``Key references:`` budget for a span: ``base_chars`` for up to ~24k characters,
    growing with the span's size up to ``factor`` times the base."""
    if base_chars <= 0:
        return 0
    return min(base_chars * factor, max(base_chars, span_chars // 40))
