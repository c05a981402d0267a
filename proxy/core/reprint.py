"""The fingerprints a request takes from the body it resends (#28, ``proxy.core.reparse``).

A body parsed from a remembered one shares its first history elements with it, value for
value (compared byte for byte). The view a surface makes of a body is the messages before the
history (a system prompt, instructions) and then one message per element, made from that
element alone; so the shared elements' fingerprints are the earlier request's, and so is the
prefix chain up to them when the tenant and the messages before are the same. ``Prints``
holds what the engine computed for one body, ``Reuse`` what one request may take and where
it leaves its own. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from proxy.core.fingerprint import chain_of, chain_prints, extend_chain, fingerprints
from proxy.core.messages import Message, head_length
from proxy.core.tokens import TokenCounter

T = TypeVar("T")


@dataclass
class Prints:
    """What the engine computed from a remembered body's view, for the next body to take
    (filled once, by ``fingerprinted``): how many view messages come before the history's
    first element (a system prompt, instructions), each view message's fingerprint and the
    prefix chain (which starts with the tenant's root). Empty (``offset`` -1) until then."""

    offset: int = -1
    fps: list[bytes] = field(default_factory=list)
    chain: list[bytes] = field(default_factory=list)
    # Each view message's exact digest (``fingerprint.exact_digest``; never changed).
    exact: list[bytes | None] = field(default_factory=list)
    # Each view message's token count for ``counted_as`` (``counted``): looked up per
    # message, they were ~6 % of a 2,000-message request's CPU.
    counts: list[int] = field(default_factory=list)
    counted_as: str = ""


@dataclass(frozen=True)
class Reuse:
    """What a request may take from the body it resends: ``earlier``'s prints of its first
    ``shared`` history elements (the same values: compared byte for byte); ``elements``: this
    body's history length; ``mine``: where this body's prints go for the next one;
    ``fresh_bytes``: how much of the body was parsed afresh (all of it when it extends none)."""

    earlier: Prints
    shared: int
    elements: int
    mine: Prints
    fresh_bytes: int

    @property
    def light(self) -> bool:
        """Whether identifying the body is work for its new part only, and that part is
        small (``FRESH_ON_LOOP_BYTES``): the earlier body's prints are there to take, so it
        is done on the event loop even for a big body (a worker thread's round trip costs
        ~0.1 ms, more than that work)."""
        fresh = self.fresh_bytes
        return self.shared > 0 and self.earlier.offset >= 0 and fresh < FRESH_ON_LOOP_BYTES


# Bytes of new JSON a request may bring for its parse and per-message work (fingerprints,
# counts) to run on the event loop; a body with more is parsed and identified in a worker
# thread (parsing and checking megabytes would stall every other request on the loop).
FRESH_ON_LOOP_BYTES = 256 * 1024
NOTHING_YET = Prints()  # (never filled: ``fingerprinted`` fills ``Reuse.mine`` only)


def fingerprinted(
    tenant: str, messages: list[Message], reuse: Reuse | None
) -> tuple[list[bytes], list[bytes], list[bytes | None]]:
    """The view's fingerprints, prefix chain and exact digests (``fingerprint.fingerprints``,
    ``prefix_chain``), taking the earlier body's for the history elements the two share.

    A surface's view is the messages before the history (``offset`` of them, computed afresh)
    and then one message per history element, made from that element alone: the shared
    elements, equal values, have the earlier view's fingerprints. The chain up to them is the
    earlier one when the tenant and the messages before are the same. What it computes is
    left in ``reuse.mine`` (copies of the fingerprints and chain: the caller's lists are its
    own; the digests' list is shared, never changed by anyone)."""
    # (offset < 0: a view not made one message per element: nothing taken, nothing left)
    offset = len(messages) - reuse.elements if reuse is not None else -1
    exact: list[bytes | None] = []
    if reuse is None or offset < 0:
        fps = fingerprints(messages, exact=exact)
        return fps, chain_of(tenant, messages, fps), exact
    earlier, shared = reuse.earlier, reuse.shared
    fps = fingerprints(messages[:offset], exact=exact)
    # (The chain hashes the messages before the history by role alone, after the tenant's
    # root: equal chains up to the history mean the same tenant and the same roles before.)
    before = chain_of(tenant, messages[:offset], fps)
    same_before = earlier.offset == offset and earlier.chain[: offset + 1] == before
    taken = _taken(earlier.fps, earlier, shared)
    taken_exact = _taken(earlier.exact, earlier, shared)
    if taken is not None and taken_exact is not None:
        fps += taken
        exact += taken_exact
        fps += fingerprints(messages[offset + shared :], exact=exact)
    else:
        fps += fingerprints(messages[offset:], exact=exact)
        shared = 0
    if same_before and len(earlier.chain) > offset + shared:
        # The history's first elements are the earlier body's, and so is the chain through them.
        start = offset + shared
        rest = chain_prints(messages, fps)[start:] if start < head_length(messages) else fps[start:]
        chain = extend_chain(earlier.chain[: start + 1], rest)
    else:
        chain = chain_of(tenant, messages, fps)
    mine = reuse.mine
    mine.offset, mine.fps, mine.chain, mine.exact = offset, list(fps), list(chain), exact
    return fps, chain, exact


def counted(
    counter: TokenCounter,
    messages: list[Message],
    model: str,
    fps: list[bytes],
    reuse: Reuse | None,
) -> list[int]:
    """Each view message's token count for ``model`` (``TokenCounter.count_messages``),
    taking the earlier body's counts for the history elements the two share (the same
    values, counted for the same model). Leaves them in ``reuse.mine`` for the next."""
    offset = len(messages) - reuse.elements if reuse is not None else -1
    if reuse is None or offset < 0:
        return counter.count_messages(messages, model, fps)
    earlier, shared = reuse.earlier, reuse.shared
    taken = _taken(earlier.counts, earlier, shared) if earlier.counted_as == model else None
    if taken is not None:
        counts = counter.count_messages(messages[:offset], model, fps[:offset])
        counts += taken
        at = offset + shared
        counts += counter.count_messages(messages[at:], model, fps[at:])
    else:
        counts = counter.count_messages(messages, model, fps)
    mine = reuse.mine
    mine.counts, mine.counted_as = list(counts), model
    return counts


def _taken(values: list[T], earlier: Prints, shared: int) -> list[T] | None:
    """``earlier``'s ``values`` (one per view message) of the ``shared`` history elements,
    when it has them all (not yet left, or left for fewer: None)."""
    taken = values[earlier.offset : earlier.offset + shared] if earlier.offset >= 0 else []
    return taken if len(taken) == shared else None
