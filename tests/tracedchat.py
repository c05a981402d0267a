"""A traced chat for the tests of #27: a proxy exporting to a real Phoenix (``tests.phoenix``),
a 10-turn chat past the inline trigger through it, and its spans read back."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import openai

from tests.checks import INLINE
from tests.conversations import user_turns
from tests.litellmproc import MODEL
from tests.phoenix import Phoenix
from tests.proxyproc import ProxyProcess
from tests.upstream import ScriptedUpstream

SYSTEM = "You are a careful coding assistant for the billing service."
TURNS = 10
# A short summary and a tight key-references line: the compaction drops facts, whose ids and
# categories (never their text) the compaction event carries.
COMPACTION = {**INLINE, "key_references_max_chars": 40}
CLIENT_SPAN = "00f067aa0ba902b7"


def short_summary(request: dict[str, Any]) -> str:
    return "The user and the assistant worked through the billing service refactor together."


def otel_env(phoenix: Phoenix, project: str, **more: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": phoenix.url,
        "OTEL_RESOURCE_ATTRIBUTES": f"openinference.project.name={project}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: export soon after each request
        **more,
    }


def converse(
    client: openai.OpenAI, messages: list[dict[str, Any]] | None = None
) -> list[dict[str, str]]:
    """A plain chat past the inline trigger, every other turn streamed; each turn's
    ``x-compaction-*`` response headers. ``messages``: an empty list the chat is kept in."""
    texts = [t for t in user_turns(2 * TURNS) if "[[tool:" not in t][:TURNS]
    messages = [] if messages is None else messages
    messages.append({"role": "system", "content": SYSTEM})
    seen = []
    for i, text in enumerate(texts):
        messages.append({"role": "user", "content": text})
        if i % 2:
            with client.chat.completions.with_streaming_response.create(
                model=MODEL, messages=messages, stream=True
            ) as raw:
                headers = raw.headers
                chunks = list(raw.parse())
            reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            raw_whole = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages
            )
            headers = raw_whole.headers
            reply = raw_whole.parse().choices[0].message.content or ""
        seen.append({k: v for k, v in headers.items() if k.startswith("x-compaction")})
        messages.append({"role": "assistant", "content": reply})
    return seen


def spans_when(
    phoenix: Phoenix, project: str, ready: Callable[[list[dict[str, Any]]], bool]
) -> list[dict[str, Any]]:
    """Phoenix's spans of ``project`` once ``ready`` holds (export is batched, then stored)."""
    deadline = time.monotonic() + 60
    spans = phoenix.spans(project)
    while not ready(spans) and time.monotonic() < deadline:
        time.sleep(0.5)
        spans = phoenix.spans(project)
    return spans


def ours(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request spans (LiteLLM may export its own spans too), in order."""
    found = [s for s in spans if "compaction_proxy.route" in s["attributes"]]
    return sorted(found, key=lambda s: s["start_time"])


def children(spans: list[dict[str, Any]], parent: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in spans if s["parent_id"] == parent["context"]["span_id"]]


def all_arrived(spans: list[dict[str, Any]]) -> bool:
    requests = ours(spans)
    llm = [s for s in spans if "compaction_proxy.purpose" in s["attributes"]]
    ups = [s for s in spans if s["name"] == "upstream"]
    return len(requests) == TURNS and len(ups) == TURNS and len(llm) >= 2


@contextlib.contextmanager
def traced_proxy(
    work: Path,
    up: ScriptedUpstream,
    phoenix: Phoenix,
    project: str,
    trace: str | None,
    env: Mapping[str, str] | None = None,
    **sections: Any,
) -> Iterator[tuple[ProxyProcess, openai.OpenAI]]:
    """A proxy exporting to ``phoenix`` under ``project`` (``env``: more variables), and an
    OpenAI client of it whose requests carry a ``traceparent`` in the client's ``trace``
    (its span ``CLIENT_SPAN``; None: no traceparent)."""
    px = ProxyProcess(work, up.base_url, **sections)
    px.start(env=otel_env(phoenix, project, **(env or {})))
    try:
        headers = {"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"} if trace else None
        yield (
            px,
            openai.OpenAI(
                base_url=px.base_url, api_key="sk-client", max_retries=0, default_headers=headers
            ),
        )
    finally:
        px.stop()
