"""The loss report of one compaction: where the replaced span's key facts are now. Pure.

It is computed against the text that is actually forwarded (the summary as stored, the head,
pinned messages and the verbatim part), never against the guard's own bookkeeping, so a fact
listed as dropped is really absent from what the model sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxy.core import references
from proxy.core.messages import Message, render

KEY_REFERENCES = references.KEY_REFERENCES
_ITEM_KEY = "_responses_item"  # surfaces.ITEM_KEY: the Responses item behind a view message
_OPAQUE_ITEMS = frozenset({"reasoning"})


def _opaque(message: Message) -> bool:
    item = message.get(_ITEM_KEY)
    return isinstance(item, dict) and item.get("type") in _OPAQUE_ITEMS


def facts_text(messages: Sequence[Message]) -> str:
    """The messages as the key-facts guard reads them: prose, without opaque reasoning."""
    return "\n\n".join(render(m) for m in messages if not _opaque(m))


def split_summary(summary: str) -> tuple[str, str]:
    """The summary's own text and its ``Key references:`` line (empty when it has none)."""
    at = summary.rfind(KEY_REFERENCES)
    if at < 0:
        return summary, ""
    return summary[:at], summary[at + len(KEY_REFERENCES) :]


@dataclass(frozen=True)
class LossReport:
    """The replaced span's facts, most identifying first, by where they are forwarded."""

    kept: tuple[str, ...]  # in the summary's own words
    appended: tuple[str, ...]  # on the summary's ``Key references:`` line
    elsewhere: tuple[str, ...]  # in the forwarded head, pins or verbatim part
    dropped: tuple[str, ...]  # nowhere in the forwarded context

    @property
    def found(self) -> int:
        return len(self.kept) + len(self.appended) + len(self.elsewhere) + len(self.dropped)


def report(span_text: str, summary: str | None, rest_text: str) -> LossReport:
    """Where each fact of ``span_text`` is after replacing it by ``summary`` (None: nothing),
    given ``rest_text``, the text of everything else that is forwarded."""
    own, refs = split_summary(summary or "")
    kept: list[str] = []
    appended: list[str] = []
    elsewhere: list[str] = []
    dropped: list[str] = []
    for ref in references.references(span_text):
        text = ref.fact
        if text in own:
            kept.append(text)
        elif text in refs:
            appended.append(text)
        elif text in rest_text:
            elsewhere.append(text)
        else:
            dropped.append(text)
    return LossReport(tuple(kept), tuple(appended), tuple(elsewhere), tuple(dropped))


def note_keeps_all(span_text: str, note: str | None, rest_text: str, max_chars: int) -> bool:
    """Whether truncating ``span_text`` behind ``note`` (plus its key references within
    ``max_chars``) loses no fact the rest of the forwarded context does not hold."""
    if note is None:
        return not report(span_text, None, rest_text).dropped
    _, guarded = references.guard(span_text, note, max_chars, elsewhere=rest_text)
    return not guarded.dropped
