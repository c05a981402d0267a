"""Labelled key references (#26): the facts a summary lost, each with the few words that say
what it is, ranked by what an agent needs most. Pure.

A bare "99310027" means nothing to a model; "customer acct 99310027" does. Each fact keeps
the words around its first occurrence (the clause it sits in: the words before it, and the
words after it when those before say too little); a file keeps what was done to it ("edited
src/app.py"). Our own framing is never a fact: the summary header, the pruning placeholders'
wording and token counts, the key-references line's own words are removed before extraction.
An earlier summary's references are carried with their labels, and their ``user:`` mark.

Rank: the user's own statements and decisions, errors, files changed, files read, hosts and
ids and the rest, test ids last; within a rank, the most identifying first (``keyfacts``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from proxy.core import artifacts, keyfacts

KEY_REFERENCES = "\n\nKey references: "  # how ``guard`` appends lost facts
USER_MARK = "user: "  # a reference taken from the user's own words
TIERS = ("user", "error", "file changed", "file read", "id", "test")
_FRAMING = [
    re.compile(r"\[History Summary - \d+ earlier messages?\]"),
    re.compile(r"\[tool result cleared by compaction-proxy: "),
    re.compile(r" returned \d+ tokens; call the tool again if you need them\.?"),
    re.compile(r" was called again later with the same arguments; see the latest;?"),
    re.compile(r"Earlier messages of this conversation were omitted so that it fits the model's "
               r"context\."),
    re.compile(r"\(private reasoning, not shown\)"),
]  # fmt: skip
# A line's items; a pruning placeholder's line ends with the placeholder's own "]".
_REFS_RE = re.compile(r"(?m)[Kk]ey references: ([^\n]*?)\]?$")
# How a transcript names a message's author (``messages.render``): our framing, never a label.
_RENDERED = re.compile(
    r"^(?:(?:USER: )?TOOL RESULT \([^)]*\):"
    r"|(?:USER|ASSISTANT|SYSTEM|DEVELOPER)(?: called tool)?:?)\s*"
)
_ROLE_RE = re.compile(r"(?m)^(USER|ASSISTANT|SYSTEM|DEVELOPER)\b|^(?:USER: )?(TOOL) RESULT \(")
_GROUP_RE = re.compile(r"^(read|written|edited|created|deleted): ")
_STOP = frozenset(
    "the a an and or so then also that which this these is are was were be been to of in on "
    "at for by with as it its note please now just".split()
)
_DIRECTIVE_RE = re.compile(
    r"\b(?:[Uu]se|[Dd]on't|[Dd]o not|[Nn]ever|[Aa]lways|[Mm]ust|[Aa]void|[Pp]refer|"
    r"[Ii]nstead of|[Dd]ecided|[Cc]hose|[Gg]o with|[Ss]hould not)\b"
)
_SENTENCE_END = re.compile(r"[.!?\n]")
_CALL_TAIL = re.compile(r"[\"'}\])\s]*\[id\b.*$")  # a command cut out of a rendered tool call
_TEST_RE = re.compile(r"::|(?:^|/)tests?/|(?:^|/)test_\w+\.\w+|_test\.\w+$")
LABEL_WORDS_BEFORE, LABEL_WORDS_AFTER, MAX_ITEM = 6, 5, 110
# Where the clause that names a fact begins: a line, a sentence, a list item.
_OPENERS = ("\n", ". ", "; ", ": ", "! ", "? ", "(", "[", "{", '"', " and ", ", ")
_CLOSERS = ("\n", ". ", ";", ": ", "! ", "? ", "(", ")", "]", '"', ", ")


@dataclass(frozen=True)
class Reference:
    """One fact of a span, as the ``Key references:`` line would show it."""

    fact: str  # the identifier itself (what the loss report tracks)
    item: str  # what is shown: the fact with its label, or ``action: path``
    tier: int  # index in ``TIERS``: lower is needed more
    score: float
    first: int
    action: str = ""  # a file's action (artifacts.READ...), grouped on the line
    carried: bool = False  # an item of an earlier summary's line: carried whole, label and all

    @property
    def words(self) -> tuple[str, ...]:
        """The label's content words: what must stand next to the fact for it to mean
        anything."""
        rest = self.item.removeprefix(USER_MARK).replace(self.fact, " ")
        return tuple(w for w in _words(rest) if w.lower() not in _STOP)


def _words(text: str) -> list[str]:
    return [w.strip(".,;:!?()[]{}\"'`") for w in text.split() if w.strip(".,;:!?()[]{}\"'`")]


def unframed(text: str) -> str:
    """``text`` without what compaction-proxy itself wrote around the facts."""
    for pattern in _FRAMING:
        text = pattern.sub(" ", text)
    return text


def _segments(text: str) -> list[tuple[int, str]]:
    """Where each message's text begins, and whose it is (a bare text is the user's)."""
    marks = [
        (m.start(), "tool" if m.group(2) else m.group(1).lower()) for m in _ROLE_RE.finditer(text)
    ]
    return sorted([(0, "user"), *marks]) if not marks or marks[0][0] > 0 else sorted(marks)


def _role(marks: list[tuple[int, str]], at: int) -> str:
    role = "user"  # a bare text (a test's span) is the user's
    for start, name in marks:
        if start > at:
            break
        role = name
    return role


def _clause(text: str, start: int, end: int) -> tuple[list[str], list[str]]:
    before = text[max(0, start - 160) : start]
    found = [(before.rfind(b), len(b)) for b in _OPENERS]
    cut = max((at + size for at, size in found if at >= 0), default=0)
    words = before[cut:].split()
    after = text[end : end + 120]
    stops = [i for i in (after.find(b) for b in _CLOSERS) if i >= 0]
    tail = after[: min(stops)] if stops else after
    tail = tail[:-1] if tail.endswith(".") else tail
    return words[-LABEL_WORDS_BEFORE:], tail.split()[:LABEL_WORDS_AFTER]


def label(text: str, fact: str, start: int) -> str:
    """The fact with the words of its clause that say what it is (``fact`` when none do)."""
    before, after = _clause(text, start, start + len(fact))
    before = _RENDERED.sub("", " ".join(before)).split()
    if before and before[-1].endswith("="):
        before.pop()  # a placeholder's "read_file(path=a.py)": an argument name, not a label
    while before and before[0].lower().strip(",") in _STOP:
        before.pop(0)
    content = [w for w in before if w.lower() not in _STOP and not w.startswith(("{", "["))]
    if len(content) >= 2:
        after = []
    while after and after[-1].lower() in _STOP:
        after.pop()
    item = " ".join([*before, fact, *after]).strip(" ,")
    while len(item) > MAX_ITEM and before:
        before.pop(0)
        item = " ".join([*before, fact, *after])
    return item if len(item) <= MAX_ITEM else fact


def _in_refs(regions: list[tuple[int, int, str]], at: int) -> str | None:
    """The key-references item (of an earlier summary) that holds offset ``at``."""
    for start, end, line in regions:
        if start <= at < end:
            offset = at - start
            used = 0
            for part in line.split("; "):
                if used <= offset < used + len(part) + 2:
                    return part
                used += len(part) + 2
    return None


def references(span_text: str, limit: int = 500) -> list[Reference]:
    """The facts of ``span_text`` with labels and ranks, most needed first."""
    return list(_references(span_text, limit))


@functools.lru_cache(maxsize=4)  # one compaction asks for the same span's references 3 times
def _references(span_text: str, limit: int) -> tuple[Reference, ...]:
    text = unframed(keyfacts.strip_opaque(span_text))
    marks = _segments(text)
    regions = [(m.start(1), m.end(1), m.group(1)) for m in _REFS_RE.finditer(text)]
    files: dict[str, str] = {}
    for art in artifacts.trail(text):
        if files.get(art.path) in artifacts.CHANGED:
            continue  # a changed file stays listed as changed
        files[art.path] = art.action
    out: list[Reference] = []
    for f in keyfacts.facts_in(text, limit):
        fact = _CALL_TAIL.sub("", f.text).rstrip("]")
        if len(fact) < 3:
            continue
        role = _role(marks, f.first)
        carried = _in_refs(regions, f.first)
        action = files.get(fact, "")
        user = role == "user" or f.kind == "decision"
        if carried is not None:
            group = _GROUP_RE.match(carried)
            action = group.group(1) if group else action
            user = carried.startswith(USER_MARK)
            item = carried if not group else fact
        else:
            item = fact if action else label(text, fact, f.first)
        if user and not action and not item.startswith(USER_MARK):
            item = USER_MARK + item
        tier = _tier(f.kind, fact, action, user)
        out.append(Reference(fact, item, tier, f.score, f.first, action, carried is not None))
    out += _directives(text, marks, regions, {r.fact for r in out})
    # "req/min" inside "312 req/min": the longer fact carries it (and says what it is).
    facts = [r.fact for r in out]
    # A file the agent touched stays itself, though: "test_x.py" it wrote inside a longer
    # "/testbed/test_x.py" of a traceback would fall to the test-id rank and be shed.
    out = [r for r in out if r.action or not any(r.fact != f and r.fact in f for f in facts)]
    return tuple(sorted(out, key=lambda r: (r.tier, -r.score, r.first)))


def _tier(kind: str, fact: str, action: str, user: bool) -> int:
    if user:
        return 0
    if kind == "error":
        return 1
    if _TEST_RE.search(fact) and action != artifacts.WRITTEN:
        return 5
    if action in artifacts.CHANGED:
        return 2
    if action:
        return 3
    return 4  # a path merely named (a test runner's argument, a log line) is an id


def _directives(
    text: str, marks: list[tuple[int, str]], regions: list[tuple[int, int, str]], known: set[str]
) -> list[Reference]:
    """The user's directives (use / don't / always / never / must...), as whole clauses, and
    the ``user:`` items an earlier summary carried."""
    out = []
    ends = [*marks[1:], (len(text), "")]
    for (start, role), (end, _) in zip(marks, ends, strict=True):
        if role != "user":
            continue  # only the user's own turns: a cheap scan of a long agent span
        for m in _DIRECTIVE_RE.finditer(text, start, end):
            if _in_refs(regions, m.start()) is not None:
                continue
            before = [
                x.end()
                for x in _SENTENCE_END.finditer(text, max(start, m.start() - 160), m.start())
            ]
            after = _SENTENCE_END.search(text, m.end(), min(end, m.end() + 160))
            raw = text[
                before[-1] if before else max(start, m.start() - 160) : after.start()
                if after
                else min(end, m.end() + 160)
            ]
            clause = re.sub(r"^(?:USER|TOOL RESULT)\b[^:]*:\s*", "", " ".join(raw.split()))
            clause = clause.strip(" ,-*")
            if 12 <= len(clause) <= MAX_ITEM and clause not in known:
                known.add(clause)
                out.append(Reference(clause, USER_MARK + clause, 0, 9.0, m.start()))
    for start, _, line in regions:
        for part in line.split("; "):
            said = part[len(USER_MARK) :]
            if part.startswith(USER_MARK) and said not in known:
                known.add(said)
                out.append(Reference(said, part, 0, 9.0, start, carried=True))
    return out


def _lines(text: str) -> list[str]:
    return [part for line in text.splitlines() for part in line.split("; ")]


def carried(text: str, ref: Reference) -> bool:
    """Whether ``text`` holds ``ref.fact`` with its label: on one line (or one item of a
    references line) with at least half the label's content words (a summary words things
    its own way). A file counts when its path is there: a path names itself."""
    if ref.fact not in text:
        return False
    if ref.action or not ref.words:
        return True
    need = {w.lower() for w in ref.words}
    for line in _lines(text):
        if ref.fact in line and 2 * len(need & {w.lower() for w in _words(line)}) >= len(need):
            return True
    return False


@dataclass(frozen=True)
class FactReport:
    """Where the replaced span's key facts are after a compaction."""

    kept: tuple[str, ...]  # in the summary text itself
    dropped: tuple[str, ...]  # nowhere in the forwarded context
    appended: tuple[str, ...]  # added on the ``Key references:`` line
    elsewhere: tuple[str, ...] = ()  # still in the forwarded head, pins or verbatim part


def render(chosen: list[Reference]) -> str:
    """The line's items in rank order; files grouped by action (``edited: a.py, b.py``) where
    the action's first file ranks."""
    parts: list[str | list[str]] = []
    groups: dict[str, list[str]] = {}
    for ref in chosen:
        if ref.action:
            if ref.action not in groups:
                groups[ref.action] = []
                parts.append(groups[ref.action])
            groups[ref.action].append(ref.fact)
            continue
        parts.append(ref.item)
    shown = []
    for part in parts:
        if isinstance(part, list):
            action = next(a for a, g in groups.items() if g is part)
            shown.append(f"{action}: {', '.join(part)}")
        else:
            shown.append(part)
    return "; ".join(shown)


def budget(base_chars: int, span_text: str, factor: int = 4) -> int:
    """The line's budget for a span: ``keyfacts.scaled_budget``, but never less than the
    references an earlier summary in the span carried (a later compaction of a shorter span
    must not shed them), and never more than ``factor`` times the base."""
    carried = sum(len(m.group(1)) for m in _REFS_RE.finditer(span_text))
    scaled = keyfacts.scaled_budget(base_chars, len(span_text), factor)
    return min(base_chars * factor, max(scaled, carried)) if base_chars > 0 else 0


def guard(
    span_text: str, summary: str, max_chars: int, *, elsewhere: str = "", files_chars: int = 0
) -> tuple[str, FactReport]:
    """Append the facts that the summary and ``elsewhere`` (the rest of the forwarded
    context) both lack with their labels, most needed first, within ``max_chars``; report
    where each fact is. ``dropped`` lists what is missing even after the appended line.

    ``files_chars``: a budget of its own for the files the span's tool calls touched (the
    artifact trail agents lose first; changed files rank first), spent before ``max_chars``:
    the line is at most ``max_chars + files_chars`` long."""
    refs = references(span_text)
    kept = [r.fact for r in refs if carried(summary, r)]
    # The client's own messages forwarded as sent carry a fact in their own words.
    there = [r.fact for r in refs if r.fact not in kept and r.fact in elsewhere]
    lost = [r for r in refs if r.fact not in kept and r.fact not in there]
    # First as many facts as fit bare, most needed first (never fewer than an unlabelled
    # line would carry); then their labels while the budget lasts: first the labels an
    # earlier line carried (shedding those for newer ones is how labels faded over
    # successive summaries), then the rest, each in rank order.
    chosen: list[Reference] = []
    used = files_used = 0
    groups: set[str] = set()
    for ref in lost:
        if any(ref.fact in c.fact for c in chosen):
            continue  # already carried by a longer fact: costs nothing
        cost = len(ref.fact) + 2
        if ref.action and ref.action not in groups:
            cost += len(ref.action) + 2
        if ref.action and files_used + cost <= files_chars:
            files_used += cost
        elif used + cost <= max_chars:
            used += cost
        else:
            continue
        chosen.append(ref)
        groups.add(ref.action)
    order = sorted(range(len(chosen)), key=lambda n: not chosen[n].carried)
    bare = set()
    for n in order:
        ref = chosen[n]
        extra = 0 if ref.action else len(ref.item) - len(ref.fact)
        if extra > 0 and used + extra <= max_chars:
            used += extra
        elif not ref.action:
            bare.add(n)
    items: set[str] = set()
    shown: list[Reference] = []
    for n, ref in enumerate(chosen):
        if n in bare:
            ref = Reference(ref.fact, ref.fact, ref.tier, ref.score, ref.first)
        if not ref.action and ref.item in items:
            continue  # two facts of one carried item: shown once
        items.add(ref.item)
        shown.append(ref)
    chosen = shown
    line = render(chosen)
    appended = [r.fact for r in lost if r.fact in line]
    if line:
        summary = f"{summary.rstrip()}{KEY_REFERENCES}{line}"
    dropped = [r.fact for r in lost if r.fact not in appended]
    return summary, FactReport(tuple(kept), tuple(dropped), tuple(appended), tuple(there))
