"""The ``x-compaction-*`` response headers: the same from every front door."""

from __future__ import annotations

from typing import TYPE_CHECKING

from proxy.core.fingerprint import conversation_label

if TYPE_CHECKING:  # the compactor is not needed to read a prepared request
    from proxy.core.prepared import Prepared


def compaction_headers(prepared: Prepared | None) -> dict[str, str]:
    """What the proxy did with a request, for the client and the operator's curl.

    In shadow mode the forwarded tokens are what really went upstream (the original), and
    what would have been forwarded is reported in ``x-compaction-shadow-*``.
    """
    if prepared is None:
        return {"x-compaction-case": "error"}
    headers = {
        "x-compaction-case": prepared.case,
        "x-compaction-original-tokens": str(prepared.original_tokens),
        "x-compaction-forwarded-tokens": str(prepared.forwarded_tokens),
        "x-compaction-conversation": conversation_label(prepared.conversation),
    }
    if prepared.shadow:
        headers.update(
            {
                "x-compaction-case": "shadow",
                "x-compaction-forwarded-tokens": str(prepared.original_tokens),
                "x-compaction-shadow-case": prepared.case,
                "x-compaction-shadow-forwarded-tokens": str(prepared.forwarded_tokens),
            }
        )
    return headers
