"""Message fingerprints and the prefix hash chain (DESIGN §3).

A fingerprint names the *meaning* of one message: role, content, name, tool calls and
tool-call id. Benign client variations (a string vs a list of one text part, absent vs null
fields, key order, prompt-cache marks) hash the same; anything else hashes differently.
The chain ``h[0] = H(tenant)``, ``h[k] = H(h[k-1] || fp(m[k-1]))`` names the exact first k
messages of a tenant, so a stored compaction can only ever match the history it was made for;
the head (the leading system/developer messages) enters it by role alone (``chain_of``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import orjson
import xxhash

from proxy.core.messages import HEAD_ROLES, head_length

Message = dict[str, Any]

# The fields that carry a message's meaning; everything else (provider extras, cache marks,
# client-side ids) is ignored so that a resent history still matches.
_MEANING_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id", "function_call")
# Part keys that never change what the model reads.
_IGNORED_PART_KEYS = frozenset({"cache_control"})


def _clean(value: Any) -> Any:
    """Drop null fields and cache marks recursively, so absent and null compare equal."""
    if isinstance(value, dict):
        return {
            k: _clean(v) for k, v in value.items() if v is not None and k not in _IGNORED_PART_KEYS
        }
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def canonical_content(content: Any, clean: Callable[[Any], Any] = _clean) -> Any:
    """The content with a list of exactly one text part collapsed to its string."""
    if isinstance(content, list):
        if (
            len(content) == 1
            and isinstance(content[0], dict)
            and content[0].get("type") == "text"
            and isinstance(content[0].get("text"), str)
        ):
            return content[0]["text"]
        return clean(content)
    return content


def canonical_form(message: Message) -> bytes:
    """Serialise the meaning of ``message`` deterministically (sorted keys, no nulls)."""
    return orjson.dumps(_meaning(message), option=orjson.OPT_SORT_KEYS)


def _meaning(message: Message) -> dict[str, Any]:
    """The canonical form, every nested value walked (the definition)."""
    return _form(message, _clean)


def _form(message: Message, clean: Callable[[Any], Any]) -> dict[str, Any]:
    form: dict[str, Any] = {}
    for key in _MEANING_FIELDS:
        value = message.get(key)
        if value is None:
            continue
        if key == "content":
            value = canonical_content(value, clean)
            if value == "" and message.get("tool_calls"):
                # Clients disagree on "" vs null for the content of a tool-calling turn.
                continue
        elif isinstance(value, dict | list):
            value = clean(value)
        form[key] = value
    return form


def _plain(role: str, content: str) -> bytes:
    # A separate, cheaper encoding for the commonest meaning (a role and a string): no JSON
    # serialisation. Every message of that meaning takes this path, whatever its shape.
    return xxhash.xxh3_128_digest(f"plain\x00{role}\x00{content}".encode())


def _cleaned(value: Any) -> Any:
    """``_clean(value)`` without its walk when it would leave ``value`` as it is: no null
    and no cache mark, which its JSON shows in one C call (a "null" or "cache_control"
    inside a string only sends the value the longer way)."""
    if type(value) is dict or type(value) is list:
        try:
            encoded = orjson.dumps(value)
        except orjson.JSONEncodeError:
            return _clean(value)
        if b"null" not in encoded and b'"cache_control"' not in encoded:
            return value
    return _clean(value)


def fingerprint(message: Message) -> bytes:
    """A 128-bit fingerprint of the message's canonical form."""
    role, content = message.get("role"), message.get("content")
    if len(message) == 2 and type(role) is str and type(content) is str:
        return _plain(role, content)
    form = _form(message, _cleaned)
    if len(form) == 2 and type(form.get("role")) is str and type(form.get("content")) is str:
        return _plain(form["role"], form["content"])
    return xxhash.xxh3_128_digest(orjson.dumps(form, option=orjson.OPT_SORT_KEYS))


class Remembered:
    """Fingerprints of the messages seen lately, by a hash of their exact JSON (#28).

    Agents resend their whole history with every request, so nearly every message was seen
    before; most are not a role and a string (tool calls, tool results, Anthropic's content
    blocks), and their canonical form is built in Python (2-4 us each). Equal JSON bytes are
    an equal value (orjson writes each JSON value one way), so a message whose JSON hashes
    to a remembered one has its fingerprint (0.3-0.5 us): checked by its bytes, never
    trusted by position. Bounded: two generations of at most ``size`` each (~180 bytes an
    entry: 7 MB at most by default); a lookup that hits the older one moves the entry to the
    newer. Safe from threads (dict operations).
    """

    def __init__(self, size: int = 20_000) -> None:
        self.size = size
        self._new: dict[bytes, bytes] = {}
        self._old: dict[bytes, bytes] = {}

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    def fingerprint(self, message: Message) -> bytes:
        return self.with_exact(message)[0]

    def with_exact(self, message: Message) -> tuple[bytes, bytes | None]:
        """The fingerprint and ``exact_digest`` of ``message`` (the key it is remembered by)."""
        key = exact_digest(message)
        if key is None:  # not JSON (the LiteLLM hook's objects)
            return fingerprint(message), None
        found = self._new.get(key)
        if found is None:
            found = self._old.get(key)
            if found is None:
                found = fingerprint(message)
            if len(self._new) >= self.size:
                self._old, self._new = self._new, {}
            self._new[key] = found
        return found, key


def exact_digest(message: Message) -> bytes | None:
    """A 128-bit digest of ``message``'s exact JSON (None when it is not JSON): equal only for
    equal values written alike (``fingerprint`` names the meaning; this, what was sent)."""
    try:
        return xxhash.xxh3_128_digest(orjson.dumps(message))
    except (orjson.JSONEncodeError, TypeError):
        return None


def _with_exact_afresh(message: Message) -> tuple[bytes, bytes | None]:
    return fingerprint(message), exact_digest(message)


REMEMBERED = Remembered()


def fingerprints(
    messages: Sequence[Message],
    remembered: Remembered | None = REMEMBERED,
    exact: list[bytes | None] | None = None,
) -> list[bytes]:
    """Each message's ``fingerprint``; those that are not a role and a string through
    ``remembered`` (None: computed afresh). ``exact``: each one's exact digest is appended
    to it too (``exact_digest``; for a role and a string, that pair alone is its value, so
    its fingerprint is). Why: the ledger names the stored history's segments by them, so
    writing a conversation's history costs what changed in it, not its length (#28)."""
    # ``fingerprint``'s commonest case inline: a call less for each plain message.
    digest = xxhash.xxh3_128_digest
    out: list[bytes] = []
    if exact is None:
        other = fingerprint if remembered is None else remembered.fingerprint
        for m in messages:
            role, content = m.get("role"), m.get("content")
            if len(m) == 2 and type(role) is str and type(content) is str:
                out.append(digest(f"plain\x00{role}\x00{content}".encode()))
            else:
                out.append(other(m))
        return out
    both = _with_exact_afresh if remembered is None else remembered.with_exact
    for m in messages:
        role, content = m.get("role"), m.get("content")
        if len(m) == 2 and type(role) is str and type(content) is str:
            plain = digest(f"plain\x00{role}\x00{content}".encode())
            out.append(plain)
            exact.append(plain)
        else:
            found, key = both(m)
            out.append(found)
            exact.append(key)
    return out


def chain_root(tenant: str) -> bytes:
    """``h[0]``: the tenant namespace. Two tenants never share a chain."""
    return xxhash.xxh3_128_digest(b"tenant\x00" + tenant.encode())


def _head_print(role: str) -> bytes:
    return xxhash.xxh3_128_digest(b"head\x00" + role.encode())


_HEAD_PRINTS = {role: _head_print(role) for role in HEAD_ROLES}


def chain_prints(messages: Sequence[Message], fps: Sequence[bytes]) -> list[bytes]:
    """What the prefix chain hashes: each message's fingerprint, but the head's (the leading
    system/developer messages) by role alone.

    The head is never compacted: every request forwards the client's own head, whatever a
    record stored. So a client whose system prompt changes from request to request (a clock
    in it, the date, a rotating tool list) still matches its records and keeps its
    conversation id, instead of starting a new conversation on each request (and, over the
    trigger, compacting anew on each). What the head says still counts everywhere else (its
    token count, the cache stability items, what is forwarded)."""
    out = list(fps)
    for i in range(min(head_length(messages), len(out))):
        out[i] = _HEAD_PRINTS[messages[i]["role"]]
    return out


def chain_of(
    tenant: str, messages: Sequence[Message], fps: Sequence[bytes] | None = None
) -> list[bytes]:
    """The prefix chain of ``messages`` (their ``fps`` when already computed)."""
    fps = fingerprints(messages) if fps is None else fps
    return prefix_chain(tenant, chain_prints(messages, fps))


def prefix_chain(tenant: str, fps: Sequence[bytes]) -> list[bytes]:
    """All prefix hashes ``h[0..n]`` in one pass over what they hash (``chain_prints``);
    ``h[k]`` names the first k messages."""
    return extend_chain([chain_root(tenant)], fps)


def extend_chain(chain: list[bytes], fps: Sequence[bytes]) -> list[bytes]:
    """``chain`` (a prefix chain) continued over the next messages' ``fps``, in place."""
    digest = xxhash.xxh3_128_digest
    for fp in fps:
        chain.append(digest(chain[-1] + fp))
    return chain


def tenant_id(credential: str | None, tenant_header: str | None = None) -> str:
    """A stable tenant name from the client's credential; the key itself is never kept.

    A keyed, slow-to-reverse hash (blake2b) rather than the fast fingerprint hash, because
    this value is stored and shown on dashboards.
    """
    material = (credential or "").encode() + b"\x00" + (tenant_header or "").encode()
    return hashlib.blake2b(material, digest_size=16, person=b"cproxy-tenant").hexdigest()


def first_reply_index(messages: Sequence[Message]) -> int | None:
    """Index of the first assistant message after the first user message, if any."""
    seen_user = False
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "user":
            seen_user = True
        elif role == "assistant" and seen_user:
            return i
    return None


def conversation_id(
    chain: Sequence[bytes], messages: Sequence[Message], header: str | None = None
) -> str:
    """The client's ``X-Conversation-Id`` (as ``c:<id>``), else ``h[through the first reply]``.

    The hash runs through the first assistant message after the first user message, so two
    sessions of an agent that always opens with the same user message (a fixed task, an
    environment context) separate as soon as their first replies differ, while a session
    keeps its id for as long as it resends its history. A history with no reply yet (the
    first request of a session) is named by all of it: that is the id the session's next
    request knows as ``earlier_conversation_id``.
    It only groups records and stats; lookup itself relies on the chain.
    """
    if header and header.strip():
        return "c:" + header.strip()[:200]
    reply = first_reply_index(messages)
    k = len(messages) if reply is None else reply + 1
    return chain[k].hex()


def conversation_label(conversation: str) -> str:
    """A conversation id as the client knows it: its ``x-conversation-id`` as sent (without
    the ``c:`` that keeps header ids apart from hash ids in the store), or the hash id."""
    return conversation.removeprefix("c:")


def earlier_conversation_id(
    chain: Sequence[bytes], messages: Sequence[Message], header: str | None = None
) -> str | None:
    """The id this session had on its first request, before its first reply: where records
    made then (a stability tracker, a compaction) are found. None when there is none."""
    if header and header.strip():
        return None
    reply = first_reply_index(messages)
    return None if reply is None else chain[reply].hex()
