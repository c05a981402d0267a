"""The topic-boundary detector: its prompt input and a lenient parser (DESIGN §5).

Model output is messy (code fences, prose around the JSON, strings for numbers). Parsing
never raises: anything unusable becomes the safe default, which means "no boundary".
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy.core.messages import Message, render

_FENCE_RE = re.compile(r"```(?:json|JSON)?\s*(.*?)```", re.DOTALL)
# "The topic is not a new one", "no topic change", "same task", "still on the same bug".
_NO_NEW_TOPIC_RE = re.compile(
    r"\b(?:no|not|isn't|n't|never|without)\s+(?:[\w-]+\s+){0,3}?"
    r"(?:new|different|change[sd]?|switch(?:es|ed)?|shift(?:s|ed)?|boundary|break)\b"
    r"|\bsame\s+(?:[\w-]+\s+)?(?:topic|task|subject|thread|work|problem|issue|bug|feature)\b"
    r"|\b(?:still|continues|continuing|continuation of)\s+(?:on|with|the|to|working)\b",
    re.IGNORECASE,
)
_WORDS_RE = re.compile(r"[A-Za-z]{3,}")
# A reason that hedges cannot carry a high confidence.
_HEDGE_RE = re.compile(
    r"\b(?:maybe|perhaps|possibly|might|may be|unclear|not sure|uncertain|hard to say|"
    r"could be|probably not|slightly)\b",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Detection:
    """The detector's verdict. ``boundary_index`` is local to the window it was shown."""

    boundary_index: int | None = None
    boundary_reason: str = ""
    confidence: float = 0.0
    summary: str = ""


SAFE_DEFAULT = Detection()


def indexed_lines(messages: Sequence[Message], max_chars: int) -> str:
    """``[i] ROLE: text`` per message, each cut at ``max_chars`` characters."""
    lines = []
    for i, m in enumerate(messages):
        text = render(m).replace("\n", " ")
        if len(text) > max_chars:
            text = text[:max_chars] + " ..."
        lines.append(f"[{i}] {text}")
    return "\n".join(lines)


def detector_window(
    messages: Sequence[Message], body_start: int, window: int
) -> tuple[int, Sequence[Message]]:
    """The last ``window`` body messages, with the offset of the first one."""
    offset = max(body_start, len(messages) - window)
    return offset, messages[offset:]


def build_request(prompt: str, window_messages: Sequence[Message], max_chars: int) -> list[Message]:
    """The detector's chat messages: instructions plus one user message of indexed prose."""
    excerpt = indexed_lines(window_messages, max_chars)
    return [
        {"role": "system", "content": prompt},
        {"role": "user", "content": f"Conversation excerpt:\n\n{excerpt}\n\nAnswer with the JSON."},
    ]


def _candidates(text: str) -> list[str]:
    found = [m.group(1) for m in _FENCE_RE.finditer(text)]
    found.append(text)
    return found


def _find_object(text: str) -> dict[str, Any] | None:
    decoder = json.JSONDecoder()
    for candidate in _candidates(text):
        candidate = candidate.strip()
        for start in [i for i, ch in enumerate(candidate) if ch == "{"][:20]:
            try:
                value, _ = decoder.raw_decode(candidate, start)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None


def _as_index(value: Any) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("[").rstrip("]").isdigit():
        return int(value.strip().lstrip("[").rstrip("]"))
    return None


def _as_confidence(value: Any) -> float:
    if isinstance(value, bool):
        return 0.0
    percent = isinstance(value, str) and value.strip().endswith("%")
    try:
        number = float(value.strip().rstrip("%")) if percent else float(value)
    except (TypeError, ValueError):
        return 0.0
    if not math.isfinite(number):
        return 0.0
    if percent or (number > 1.0 and number <= 100.0):
        number /= 100.0  # "85" or "85%" meaning 85%
    return min(max(number, 0.0), 1.0)


def parse_detection(text: str | None, window_len: int) -> Detection:
    """Parse the detector's reply; out-of-range or non-integer indices become None."""
    if not text:
        return SAFE_DEFAULT
    obj = _find_object(text)
    if obj is None:
        return SAFE_DEFAULT
    index = _as_index(obj.get("boundary_index"))
    if index is not None and not 0 <= index < window_len:
        index = None
    reason = obj.get("boundary_reason")
    summary = obj.get("summary")
    return Detection(
        boundary_index=index,
        boundary_reason=reason.strip()[:500] if isinstance(reason, str) else "",
        confidence=_as_confidence(obj.get("confidence")) if index is not None else 0.0,
        summary=summary.strip() if isinstance(summary, str) else "",
    )


def sane(detection: Detection, offset: int, body_start: int) -> Detection:
    """The detection, or "no boundary" when it contradicts itself.

    A boundary at (or before) the first message of the body leaves nothing to set aside; a
    reason saying there is no new topic, a hedging reason with a high confidence, or a reason
    without words is no evidence of a topic change whatever the index says.
    """
    if detection.boundary_index is None:
        return detection
    reason = detection.boundary_reason
    if (
        offset + detection.boundary_index <= body_start
        or _NO_NEW_TOPIC_RE.search(reason)
        or (detection.confidence >= 0.8 and _HEDGE_RE.search(reason))
        # A reason without words ("2025-01-04 10:03:07,120 INFO") explains nothing.
        or len(_WORDS_RE.findall(reason)) < 2
    ):
        return Detection(None, reason, 0.0, detection.summary)
    return detection
