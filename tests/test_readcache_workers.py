"""Two proxy processes on one diskcache folder, a conversation's requests alternating between
them: each worker answers unchanged store keys from memory (``proxy.adapters.readcache``,
#28), and still follows what the other wrote. Once one worker compacted, every request
either forwards carries the compaction (the other read its checkpoint, which it had read as
absent before), and between compactions the forwarded prefix stays byte-stable across the
two."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import orjson

from proxy.core.tokens import TokenCounter
from tests.checks import assert_forwarded_faithful, summary_text
from tests.conversations import drive_conversation
from tests.proxyproc import ProxyProcess
from tests.upstream import ScriptedUpstream

MODEL = "gpt-4o-mini"
SYSTEM = "You are a careful coding assistant for the billing service."
COMPACTION = {
    "trigger_tokens": 12000,
    "verbatim_window_tokens": 6000,
    "summary_budget_tokens": 300,
    "mode": "inline",
}
_counter = TokenCounter()


def test_two_workers_follow_each_others_compactions(tmp_path: Path) -> None:
    store = {"url": f"diskcache://{tmp_path / 'store'}"}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with ScriptedUpstream(count_tokens=lambda m: _counter.count_total(m, MODEL)) as up:
        with (
            ProxyProcess(tmp_path / "a", up.base_url, store=store, compaction=COMPACTION) as a,
            ProxyProcess(tmp_path / "b", up.base_url, store=store, compaction=COMPACTION) as b,
        ):
            clients = [
                openai.OpenAI(base_url=px.base_url, api_key="sk-two-workers", max_retries=0)
                for px in (a, b)
            ]
            sent: list[list[dict[str, Any]]] = []

            def send(messages: list[dict[str, Any]]) -> Any:
                client = clients[len(sent) % 2]  # a, b, a, b...
                sent.append(messages)
                reply = client.chat.completions.create(model=MODEL, messages=messages)
                return reply.choices[0].message.model_dump(exclude_none=True)

            drive_conversation(send, 44, SYSTEM)
        requests = up.chat_requests()
    assert len(requests) == len(sent)
    forwarded = [r.json["messages"] for r in requests]
    summaries = [summary_text(f) for f in forwarded]
    first = next((i for i, s in enumerate(summaries) if s is not None), None)
    assert first is not None, "no compaction happened"
    # The worker that did not compact had read the conversation's checkpoints (none) and
    # kept that read: it must read the other's checkpoint all the same.
    uncompacted = [i for i in range(first, len(summaries)) if summaries[i] is None]
    assert uncompacted == [], f"forwarded without the compaction: {uncompacted}"
    compactions = [i for i in range(first + 1, len(summaries)) if summaries[i] != summaries[i - 1]]
    # Each compaction is forwarded by the other worker next, never made again there (a worker
    # that missed the other's record compacts on its own: a new summary every request).
    for i in [first, *compactions]:
        if i + 1 < len(summaries):
            assert summaries[i + 1] == summaries[i], f"compacted again at request {i + 1}"
    checked = 0
    for i in range(first + 1, len(requests)):
        if i in compactions:
            continue
        before, after = orjson.dumps(forwarded[i - 1]), orjson.dumps(forwarded[i])
        assert after.startswith(before[:-1]), f"prefix bytes changed at request {i}"
        checked += 1
    assert checked >= 10
    for client_messages, went in zip(sent, forwarded, strict=True):
        assert_forwarded_faithful(client_messages, went)
