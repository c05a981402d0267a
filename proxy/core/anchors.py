"""Anchors in four categories, and each one's fate in a compaction (#26). Pure.

Published evaluations of compaction probe four things an agent needs after one: the
*artifact trail* (which files it read, wrote, edited, created, deleted), *recall* (error names
and codes, ids, versions, hosts, numbers with units), *decisions* (the user's directives and
the choices made) and *continuation* (the current plan or TODO list, the step in progress,
the last failing test). Each anchor of a replaced or pruned span ends in one place:
``verbatim`` (still forwarded as the client sent it), ``summary`` (in the summary's own
words), ``references`` (on its ``Key references:`` line) or ``dropped``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.core import artifacts, keyfacts, references

ARTIFACT, RECALL, DECISION, CONTINUATION = "artifact", "recall", "decision", "continuation"
CATEGORIES = (ARTIFACT, RECALL, DECISION, CONTINUATION)
VERBATIM, SUMMARY, REFERENCES, DROPPED = "verbatim", "summary", "references", "dropped"
FATES = (VERBATIM, SUMMARY, REFERENCES, DROPPED)
LISTED = 12  # dropped anchors named per category in a record (the counts are complete)

_RECALL_KINDS = frozenset(
    {"error", "ticket", "id", "version", "host", "amount", "quantity", "sha", "url", "header",
     "constant", "date"}
)  # fmt: skip
_PLAN_TOOLS = frozenset({"todowrite", "todo_write", "update_plan", "write_todos", "plan"})
_CALL_RE = re.compile(r"called tool ([^\s(]+)\((.*)\) \[id [^\]\n]*\]$", re.MULTILINE)
_CHECKBOX_RE = re.compile(r"(?m)^\s*[-*] \[ \] (.{3,120})$")
_FAILED_RE = re.compile(r"FAILED\s+(\S+::\S+)|(\S+::\S+)\s+FAILED|^FAIL:?\s+(\S+)", re.M)


@dataclass(frozen=True)
class Anchor:
    category: str
    key: str  # the string whose presence says the anchor survived


def _plan_items(args: Any) -> list[str]:
    """The open items of a TODO/plan tool call (Claude Code TodoWrite, Codex update_plan)."""
    if not isinstance(args, dict):
        return []
    items = args.get("todos") or args.get("plan") or args.get("items") or []
    out = []
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict) or item.get("status") == "completed":
            continue
        text = item.get("content") or item.get("step") or item.get("title")
        if isinstance(text, str) and text.strip():
            out.append(" ".join(text.split())[:120])
    return out


def _continuation(text: str) -> list[str]:
    plan: list[str] = []
    for m in _CALL_RE.finditer(text):
        if m.group(1).lower() in _PLAN_TOOLS:
            try:
                plan = _plan_items(orjson.loads(m.group(2)))  # the latest plan replaces earlier
            except orjson.JSONDecodeError:
                continue
    boxes = [m.group(1).strip() for m in _CHECKBOX_RE.finditer(text)]
    failing = [next(g for g in m.groups() if g) for m in _FAILED_RE.finditer(text)]
    return list(dict.fromkeys([*plan, *boxes[-8:], *failing[-1:]]))


def anchors(span_text: str) -> list[Anchor]:
    """The anchors of a replaced or pruned span, once each, by category."""
    text = references.unframed(keyfacts.strip_opaque(span_text))
    out: dict[tuple[str, str], Anchor] = {}

    def add(category: str, key: str) -> None:
        key = key.strip()
        if len(key) > 2:
            out.setdefault((category, key), Anchor(category, key))

    for art in artifacts.trail(text):
        add(ARTIFACT, art.path)
    for fact in keyfacts.facts_in(text):
        if fact.kind in _RECALL_KINDS:
            add(RECALL, fact.text.rstrip("]"))
        elif fact.kind == "decision":
            add(DECISION, fact.text)
    for ref in references.references(span_text):
        if ref.tier == 0 and ref.item == references.USER_MARK + ref.fact:
            add(DECISION, ref.fact)  # a directive clause of the user's
    for item in _continuation(text):
        add(CONTINUATION, item)
    return list(out.values())


def fate(anchor: Anchor, own: str, refs: str, rest: str) -> str:
    if anchor.key in rest:
        return VERBATIM
    if anchor.key in own:
        return SUMMARY
    if anchor.key in refs:
        return REFERENCES
    return DROPPED


@dataclass(frozen=True)
class AnchorReport:
    """Per category, how many anchors met each fate, and the dropped ones by name."""

    counts: dict[str, dict[str, int]]
    dropped: dict[str, list[str]]

    def to_json(self) -> dict[str, Any]:
        return {"counts": self.counts, "dropped": self.dropped}


def report(span_text: str, summary: str | None, rest_text: str) -> AnchorReport:
    """Where each anchor of ``span_text`` is once it is replaced by ``summary`` (None: by
    nothing, or by pruning placeholders that are part of ``rest_text``)."""
    own, refs = _split(summary or "")
    counts = {c: dict.fromkeys(FATES, 0) for c in CATEGORIES}
    dropped: dict[str, list[str]] = {c: [] for c in CATEGORIES}
    for anchor in anchors(span_text):
        where = fate(anchor, own, refs, rest_text)
        counts[anchor.category][where] += 1
        if where == DROPPED and len(dropped[anchor.category]) < LISTED:
            dropped[anchor.category].append(anchor.key)
    return AnchorReport(counts, {c: d for c, d in dropped.items() if d})


def _split(summary: str) -> tuple[str, str]:
    at = summary.rfind(references.KEY_REFERENCES)
    if at < 0:
        return summary, ""
    return summary[:at], summary[at + len(references.KEY_REFERENCES) :]
