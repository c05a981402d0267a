"""What the proxy may do with one request: compact it, only measure it, or leave it alone.

Pure: headers, settings and messages in, one frozen ``Controls`` out. Every front door asks
this module, so a bypass, an opt-out or a client's own compaction is honoured the same way
on every route (a compress-or-not condition written at several sites drifts apart).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from proxy.core.messages import Message, text_of
from proxy.core.settings import CompactionSettings
from proxy.core.types import Case, CaseName

# Phrases of the prompts with which clients compact their own history. A request carrying
# one is the client summarizing its conversation: compacting it too would summarize twice.
_COMPACT_REQUEST_MARKERS = (
    ("claude-code", "your task is to create a detailed summary of the conversation so far"),
    ("codex", "you are performing a context checkpoint compaction"),
    ("opencode", "provide a detailed prompt for continuing our conversation above"),
    ("opencode", "you are a helpful ai assistant tasked with summarizing conversations"),
)
# Phrases that open the summary a client starts its new history from.
CLIENT_SUMMARY_MARKERS = (
    ("claude-code", "this session is being continued from a previous conversation"),
    ("codex", "another language model started to solve this problem and produced a summary"),
)
_TAIL_SCANNED = 2  # the compaction prompt is the last user turn (or the instructions)
_SCANNED_CHARS = 20_000  # of each message read for a marker
# Texts at least this long have their answer remembered (``_compaction_marker``): at most
# ``_SEEN_TEXTS`` of them, 2.5 MB at most in ASCII.
_REMEMBERED_FROM = 1_000
_SEEN_TEXTS = 32


@dataclass(frozen=True)
class Controls:
    """What this request allows. ``skip`` names why it is forwarded exactly as sent."""

    skip: str | None = None
    case: CaseName = Case.NONE  # a skipped request's: off | opt-out | client-compaction
    shadow: bool = False


def client_compaction(messages: Sequence[Message]) -> str | None:
    """The client whose own compaction request this is (``claude-code``, ...), or None.

    Only the head (system prompt / instructions) and the last turns are read: a compaction
    prompt is what the client asks now, not something quoted earlier in the history.
    """
    head = [m for m in messages[:2] if m.get("role") in ("system", "developer")]
    tail = [m for m in messages[-_TAIL_SCANNED:] if m.get("role") in ("user", "system")]
    for message in (*head, *tail):
        client = _compaction_marker(text_of(message)[:_SCANNED_CHARS])
        if client is not None:
            return client
    return None


def _compaction_marker(text: str) -> str | None:
    """The client whose compaction marker ``text`` holds (any case), or None.

    An agent resends the same long instructions with every request (Claude Code's are
    ~20,000 characters), and lowering them and searching four phrases took ~40 us a request
    (#28). The answer for a long text is remembered by the text itself: a hit costs its hash
    and one comparison (~5 us). Bounded: ``_SEEN_TEXTS`` texts, least recently used first."""
    return _marker_of(text) if len(text) < _REMEMBERED_FROM else _remembered_marker(text)


def _marker_of(text: str) -> str | None:
    lowered = text.lower()
    for client, marker in _COMPACT_REQUEST_MARKERS:
        if marker in lowered:
            return client
    return None


_remembered_marker = functools.lru_cache(maxsize=_SEEN_TEXTS)(_marker_of)


def is_client_summary(message: Message) -> bool:
    """Whether this message is the summary a client started its new history from."""
    if message.get("role") not in ("user", "system", "developer"):
        return False
    text = text_of(message)[:2_000].lower()
    return any(marker in text for _, marker in CLIENT_SUMMARY_MARKERS)


def opted_out(
    settings: CompactionSettings, *, tenant: str, tenant_name: str | None, model: str
) -> str | None:
    """Why this tenant or model is opted out by configuration, or None."""
    names = {tenant} | ({tenant_name} if tenant_name else set())
    if names & set(settings.opt_out_tenants):
        return "tenant opted out"
    for pattern in settings.opt_out_models:
        if fnmatchcase(model, pattern):
            return f"model opted out ({pattern})"
    return None


def sampled(conversation: str, rate: float) -> bool:
    """Deterministically whether a conversation is in the shadow sample (same answer on
    every request, worker and replica)."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    digest = hashlib.blake2b(conversation.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < rate


def request_controls(
    settings: CompactionSettings,
    *,
    header: str | None,
    tenant: str,
    tenant_name: str | None,
    model: str,
    messages: Sequence[Message],
    stateful: bool = False,
) -> Controls:
    """The one place that decides whether a request may be compacted, measured or neither.

    ``header`` is the client's ``x-compaction`` value (``off`` or ``shadow``).
    """
    value = (header or "").strip().lower()
    if value == "off":
        return Controls("bypassed by x-compaction: off", Case.OFF)
    if stateful:
        return Controls("server-side conversation state", Case.OFF)
    client = client_compaction(messages)
    if client is not None:
        return Controls(f"the client compacts its own history ({client})", Case.CLIENT_COMPACTION)
    reason = opted_out(settings, tenant=tenant, tenant_name=tenant_name, model=model)
    if reason is not None:
        return Controls(reason, Case.OPT_OUT)
    return Controls(shadow=value == "shadow" or settings.mode == "shadow")
