"""The history a conversation's client last sent (its page's left side), kept in segments.

Kept whole under ``orig:<tenant>:<conversation>``, it was encoded and written again by every
ledger flush that held a request of the conversation. An agent sends a request every few
seconds, each in a flush of its own, so each of its requests paid for its whole history:
~0.08 / 0.18 / 0.84 ms of the writer's CPU at 50 / 300 / 2,000 messages, and as many bytes
written to the database (#28, docs/benchmarks.md).

A history of more than ``SEGMENT`` messages now goes in segments of ``SEGMENT`` messages,
``orig:<t>:<c>:<id>``, which a head under the old key lists, with the messages after the
last full segment (``{"n": messages, "segments": [id, ...], "tail": [...]}``); a shorter
one is written whole, as before (and an old whole list is read as it is). Each worker
remembers, for its recent long conversations, which messages it last wrote in which segment
(``Written``) and writes again only the segments whose messages changed, then the head: an
agent's next turn writes the head alone, and a segment each ``SEGMENT`` messages. A
segment's id is the hash of its JSON (xxh3, 64 bits), so workers serving one conversation in
turn write and name the same segments, and a key's content is the one its id says. So a
worker that does not remember the conversation (another worker wrote it last, or it was
forgotten past the bounds below) reads the head it replaces: the segments it names are
stored, since the head's ``since`` (when the oldest of them was written), and only the
others are written. A worker deletes the segments the head it replaces named (as it
remembers it, else as stored) and its new one does not (the head it has just written is the
conversation's newest). Only a conversation whose content goes back to what
one worker deleted meanwhile (two clients alternating on one history) can leave another
worker's next head naming a deleted segment: that reads as no history until the worker's
memory is refreshed (below).

Messages are compared by value (``==``; the very objects when the body was parsed from the
previous one, ``proxy.core.reparse``), so a segment whose values are equal but were written
differently (keys in another order, ``1`` for ``1.0``) keeps the earlier writing. What a
worker remembers is trusted for ``REFRESH_S`` at most, and half the retention when that is
shorter (its segments are then written again: none expires while a head names it, and one
lost meanwhile comes back), and forgotten beyond ``MAX_CONVERSATIONS`` or ``MAX_BYTES``
(the segments' size as written; the least recently written first: nothing is lost, the next
flush reads the stored head). A stored head is trusted as a memory is, from its ``since``
(one without, from an earlier version, not at all). Held objects are mostly the parser's
own (``Reparser`` keeps 8 MB of recent bodies); a history parsed afresh each time is held
here alone, hence the bound.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import orjson
import xxhash

from proxy.adapters.store import Store, read_many
from proxy.core.prepared import Sent
from proxy.core.records import conv_key
from proxy.operators.perstore import PerStore, trusted_for

SEGMENT = 16  # messages a segment holds
REFRESH_S = 600.0  # a worker's memory of what it wrote is trusted this long at most
MAX_CONVERSATIONS = 256
MAX_BYTES = 16 * 1024 * 1024  # the remembered segments' size as written, all conversations
NAMED_BYTES = 128  # what a segment named by digest counts there (its id and place; no messages)


@dataclass(frozen=True)
class Written:
    """What this worker last wrote for one conversation: each segment's id, and its
    messages (named by JSON) or the digest of their digests (named by digest)."""

    segments: tuple[list[Any], ...]  # (none when named by digest)
    ids: tuple[str, ...]
    sizes: tuple[int, ...]  # each segment's bytes as written
    since: float  # when the oldest of them was written
    prefix: bytes | None = None  # named by digest: ``_digest_of`` their messages' digests

    @property
    def size(self) -> int:
        return sum(self.sizes)


class _Memory:
    """One worker's ``Written`` per conversation, bounded; thread-safe (the ledger writes in
    a worker thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_conv: OrderedDict[tuple[str, str], Written] = OrderedDict()
        self.held = 0

    def pop(self, key: tuple[str, str]) -> Written | None:
        with self.lock:
            found = self.by_conv.pop(key, None)
            self.held -= found.size if found else 0
            return found

    def put(self, key: tuple[str, str], written: Written) -> None:
        with self.lock:
            self.by_conv[key] = written
            self.held += written.size
            while self.by_conv and (len(self.by_conv) > MAX_CONVERSATIONS or self.held > MAX_BYTES):
                _, gone = self.by_conv.popitem(last=False)
                self.held -= gone.size


_memories: PerStore[_Memory] = PerStore(_Memory)


def _memory(store: Store) -> _Memory:
    return _memories.of(store)


def write(
    store: Store,
    tenant: str,
    conversation: str,
    messages: list[Any] | Sent,
    retention_s: float | None,
    now: float | None = None,
) -> None:
    """Store ``messages`` as the conversation's newest history (the ledger's writer thread).
    Raises what the store or the encoder raises; the segments written before stay until
    their retention, unnamed (``read`` never sees them). ``Sent``: the messages with their
    exact digests, which name the segments (``_named``)."""
    exact: Sequence[bytes | None] | None = None
    if isinstance(messages, Sent):
        messages, exact = messages
    base = conv_key("orig", tenant, conversation)
    memory = _memory(store)
    key = (tenant, conversation)
    before = memory.pop(key)
    if len(messages) <= SEGMENT:
        store.set(base, messages, retention_s)
        _drop(store, base, before.ids if before else ())
        return
    now = time.time() if now is None else now
    trusted = trusted_for(REFRESH_S, retention_s)
    fresh = before is not None and now - before.since < trusted
    # Not remembered (another worker's conversation, or forgotten past the bounds): the head
    # it replaces says which segments are stored, and since when.
    stored = _stored_head(store, base, now, trusted) if before is None else None
    full = len(messages) // SEGMENT * SEGMENT
    ids: list[str] = []
    sizes: list[int] = []
    start, named, prefix = 0, None, None
    if exact is not None and len(exact) == len(messages):
        if fresh and before is not None and before.prefix is not None:
            # The segments this worker wrote from these very digests are as they were.
            end = len(before.ids) * SEGMENT
            check = _digest_of(exact, end) if end <= full else None
            if check == before.prefix:
                start = len(before.ids)
                prefix = check if end == full else None  # (until the next segment fills)
        named = _named(exact, start * SEGMENT, full)
        if named is not None:
            ids, sizes = list(before.ids[:start]) if before else [], [NAMED_BYTES] * start
            prefix = prefix or _digest_of(exact, full)
        else:  # (a message with no digest: all of them named by their JSON, as before)
            start, prefix = 0, None
    kept_stored = False
    for i in range(start, full // SEGMENT):
        segment = messages[i * SEGMENT : (i + 1) * SEGMENT]
        if named is not None:  # (named by digest: its JSON is written only if it is not stored)
            ids.append(named[i - start])
            sizes.append(NAMED_BYTES)
            if fresh and before and i < len(before.ids) and before.ids[i] == ids[-1]:
                continue
        elif fresh and before and i < len(before.segments) and before.segments[i] == segment:
            ids.append(before.ids[i])
            sizes.append(before.sizes[i])
            continue
        else:
            encoded = orjson.dumps(segment)  # (raises what the store's encoder would)
            ids.append(xxhash.xxh3_64_hexdigest(encoded))
            sizes.append(len(encoded))
        if stored is not None and stored.fresh and ids[-1] in stored.ids:
            kept_stored = True  # (its content is its id's: stored, within the trusted time)
            continue
        store.set(f"{base}:{ids[-1]}", segment, retention_s)
    if fresh and before:
        since = before.since
    else:
        since = stored.since if stored is not None and kept_stored else now
    # The messages after the last full segment go in the head: a conversation growing by a
    # turn writes its head alone until the next segment fills. ``since``: when the oldest
    # segment it names was written (a worker that does not remember them trusts them so long).
    head = {"n": len(messages), "segments": ids, "tail": messages[full:], "since": since}
    store.set(base, head, retention_s)
    # (Named by digest, the ids and the digests' digest tell what is unchanged: no message
    # is held.)
    held = (
        ()
        if named is not None
        else tuple(messages[at : at + SEGMENT] for at in range(0, full, SEGMENT))
    )
    memory.put(key, Written(held, tuple(ids), tuple(sizes), since, prefix))
    kept = set(ids)
    replaced = before.ids if before else stored.ids if stored is not None else ()
    _drop(store, base, [i for i in replaced if i not in kept])


def _named(exact: Sequence[bytes | None], start: int, full: int) -> list[str] | None:
    """The ids of the segments from message ``start`` to ``full``, from their messages'
    exact digests (a prefix marks them apart from ids that hash a segment's JSON); None when
    one of those messages has none.

    Why: naming a segment by its JSON meant writing the JSON of every segment of the history
    whenever this worker did not remember it (another worker wrote it last, or more long
    conversations than its memory holds): with 200 conversations, ~0.12 / 0.41 ms of the
    writer's CPU a request at 300 / 2,000 messages (docs/benchmarks.md, #28). The digests
    come with the request (``fingerprint.fingerprints``, the shared messages' taken from
    the body it resends), so naming costs a hash of 16 digests a segment. Equal digests are
    equal values written alike, so an id still names one content."""
    digest, digests = xxhash.xxh3_64_hexdigest, cast("Sequence[bytes]", exact)
    try:  # (``join`` refuses a None: a message with no digest)
        return [
            "d" + digest(b"".join(digests[at : at + SEGMENT])) for at in range(start, full, SEGMENT)
        ]
    except TypeError:
        return None


def _digest_of(exact: Sequence[bytes | None], end: int) -> bytes | None:
    """One digest of the first ``end`` messages' digests (None when one has none): a worker
    that remembers its last write tells its segments unchanged by it, without naming each."""
    try:
        return xxhash.xxh3_128_digest(b"".join(cast("Sequence[bytes]", exact[:end])))
    except TypeError:
        return None


@dataclass(frozen=True)
class _Stored:
    """The segments the stored head names, since when, and whether that is recent enough
    to trust them (``fresh``)."""

    ids: frozenset[str]
    since: float
    fresh: bool


def _stored_head(store: Store, base: str, now: float, trusted: float) -> _Stored | None:
    """What the conversation's stored head names (None: no head in segments).

    Why: an agent's next request often comes to a worker that does not remember what was
    written (several workers, or more long conversations than ``MAX_BYTES`` holds): writing
    every segment again cost ~20 us each (a 300-message history: ~0.35 ms, 2,000: ~1.7 ms
    of the writer's CPU a request, docs/benchmarks.md). A segment's id is its content's
    hash, so one the head names is stored as it is (unless lost since: as for a worker's
    memory, trusted only within ``trusted`` of its writing)."""
    head = store.get(base)
    if not isinstance(head, dict) or not isinstance(head.get("segments"), list):
        return None
    ids = frozenset(i for i in head["segments"] if isinstance(i, str))
    since = head.get("since")
    if not isinstance(since, int | float) or isinstance(since, bool):
        return _Stored(ids, 0.0, False)  # (an earlier version's head: its segments written again)
    return _Stored(ids, float(since), 0 <= now - since < trusted)


def _drop(store: Store, base: str, ids: Any) -> None:
    """Segments the newest head does not name (a reader that read the head before finds one
    gone and reads again: ``read``)."""
    for old in ids:
        store.delete(f"{base}:{old}")


def read(store: Store, tenant: str, conversation: str) -> list[dict[str, Any]]:
    """The conversation's newest history (empty when none is stored, or when part of it is
    gone: a segment lost to the store's size limit until its writer writes it again)."""
    base = conv_key("orig", tenant, conversation)
    for _ in range(3):  # a writer may replace the head and drop a segment between two reads
        head = store.get(base)
        if isinstance(head, list):  # short, or written whole by an earlier version
            return [m for m in head if isinstance(m, dict)]
        if not isinstance(head, dict) or not isinstance(head.get("segments"), list):
            return []
        names = [f"{base}:{i}" for i in head["segments"] if isinstance(i, str)]
        got = read_many(store, names, ())
        tail = head.get("tail")
        if all(isinstance(got[n], list) for n in names) and isinstance(tail, list):
            messages = [m for n in names for m in got[n] if isinstance(m, dict)]
            messages += [m for m in tail if isinstance(m, dict)]
            return messages if len(messages) == head.get("n") else []
    return []


def delete(store: Store, tenant: str, conversation: str) -> None:
    """The history and its segments (a conversation merged into another, ``adopt``)."""
    base = conv_key("orig", tenant, conversation)
    head = store.get(base)
    if isinstance(head, dict) and isinstance(head.get("segments"), list):
        _drop(store, base, [i for i in head["segments"] if isinstance(i, str)])
    store.delete(base)
    _memory(store).pop((tenant, conversation))
