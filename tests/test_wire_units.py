"""Pure pieces behind the agent fixes: summary joining, terminal events, opaque reasoning,
the breakpoint budget and the ledger row of a session's first request."""

from __future__ import annotations

from pathlib import Path

import orjson

from proxy.adapters.store import DiskStore
from proxy.core.messages import render, transcript
from proxy.core.records import conv_key
from proxy.core.stability import breakpoints
from proxy.core.surfaces import ANTHROPIC_MESSAGES, OPENAI_RESPONSES, alternating_turns
from proxy.core.tokens import TokenCounter
from proxy.operators import ledger, reqlog
from proxy.server.sse import is_terminal

SUMMARY = "[History Summary - 4 earlier messages]\n\nWe fixed the parser."
MARK = {"type": "ephemeral"}


def test_the_summary_joins_the_first_kept_user_turn() -> None:
    kept = {"role": "user", "content": "next step"}
    reply = {"role": "assistant", "content": "ok"}
    joined = alternating_turns([{"role": "user", "content": SUMMARY}, kept, reply])
    assert joined == [
        {
            "role": "user",
            "content": [{"type": "text", "text": SUMMARY}, {"type": "text", "text": "next step"}],
        },
        reply,
    ]
    # A marked summary keeps its mark; list content keeps its blocks; the same input gives
    # the same bytes.
    marked = {"role": "user", "content": [{"type": "text", "text": SUMMARY, "cache_control": MARK}]}
    image = {"role": "user", "content": [{"type": "image", "source": {}}]}
    once = alternating_turns([{"role": "system", "content": "s"}, marked, image])
    # A system message never leads (the Messages API wants a user turn first): it follows.
    assert once[0]["content"] == [marked["content"][0], image["content"][0]]
    assert once[1] == {"role": "system", "content": "s"}
    again = alternating_turns([{"role": "system", "content": "s"}, marked, image])
    assert orjson.dumps(once) == orjson.dumps(again)
    # Nothing to join: no summary, or the client's own text.
    plain = [kept, reply]
    assert alternating_turns(plain) == plain


def test_messages_surface_round_trip_with_a_summary() -> None:
    body = {"model": "claude", "max_tokens": 5, "system": "sys", "messages": []}
    view = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": SUMMARY},
        {"role": "user", "content": "go on"},
        {"role": "system", "content": "reminder"},
    ]
    out = ANTHROPIC_MESSAGES.from_view(body, view)
    assert out["system"] == "sys"
    assert [m["role"] for m in out["messages"]] == ["user", "system"]
    ANTHROPIC_MESSAGES.validate({**body, "messages": out["messages"]})  # system role accepted
    tools = [{"name": "a"}, {"name": "b", "cache_control": MARK}]
    assert ANTHROPIC_MESSAGES.outside_cache_marks({"tools": tools}) == 1


def test_terminal_events() -> None:
    assert is_terminal(b"data: [DONE]\n\n")
    assert is_terminal(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    assert is_terminal(b'data: {"type":"message_stop"}\n\n')
    assert is_terminal(b'event: response.completed\ndata: {"type":"response.completed"}\n\n')
    assert is_terminal(b"event: response.incomplete\ndata: {}\n\n")
    assert is_terminal(b"event: response.failed\ndata: {}\n\n")
    assert not is_terminal(b'data: {"choices":[{"delta":{"content":"[DONE] soon"}}]}\n\n')
    assert not is_terminal(b'event: message_delta\ndata: {"type":"message_delta"}\n\n')
    assert not is_terminal(b'data: {"type":"response.output_text.delta","delta":"x"}\n\n')


def test_reasoning_is_never_rendered() -> None:
    secret = "gAAAAABsecretsecretsecret"
    body = {
        "model": "gpt-5",
        "input": [
            {"role": "user", "content": "hi"},
            {"type": "reasoning", "id": "rs_abc123", "summary": [], "encrypted_content": secret},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text",
                                                                  "text": "hello"}]},
        ],
    }  # fmt: skip
    view = OPENAI_RESPONSES.to_view(body)
    text = transcript(view)
    assert secret not in text and "rs_abc123" not in text and "hello" in text
    thinking = {
        "role": "assistant",
        "content": [{"type": "thinking", "thinking": "private plan", "signature": secret}],
    }
    assert "private plan" not in render(thinking) and secret not in render(thinking)
    # The view forwards the item itself, byte for byte.
    assert OPENAI_RESPONSES.from_view(body, view)["input"] == body["input"]
    # Counted as one token per 4 bytes of its JSON.
    part = view[1]["content"][0]
    n = TokenCounter().count_message(view[1], "gpt-5")
    assert n >= len(orjson.dumps(part)) // 4


def test_breakpoints_leave_room_for_the_clients_marks() -> None:
    levels = [3, 3, 3, 2, 2, 1, 1, 0]
    assert len(breakpoints(levels, 1, None)) <= 4
    assert len(breakpoints(levels, 1, 2, limit=3)) == 3
    assert breakpoints(levels, 1, 2, limit=0) == []


def _entry(conv: str, earlier: str | None = None, ts: float = 1.0) -> ledger.RequestEntry:
    return ledger.RequestEntry(
        ts=ts, tenant="t", conversation=conv, model="gpt-4o", route="chat.completions",
        case="none", status=200, original_messages=2, forwarded_messages=2,
        original_tokens=100, forwarded_tokens=100, prompt_tokens=100, cached_tokens=0,
        cache_write_tokens=0, completion_tokens=5, latency_s=0.1, overhead_s=0.001,
        earlier_conversation=earlier,
    )  # fmt: skip


def test_the_first_requests_ledger_row_joins_the_session(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    ledger.record_batch(store, [(_entry("first"), None)], None)
    # A compaction charged to the session's id before its second request landed.
    ledger.record_compaction(
        store, "t", "session", record="h", case="summarize", llm_tokens=50, llm_usd=0.1,
        retention_s=None,
    )  # fmt: skip
    ledger.record_batch(store, [(_entry("session", "first", 2.0), None)], None)
    meta = store.get(conv_key("conv", "t", "session"))
    assert meta["requests"] == 2 and meta["compactions"] == 1 and meta["llm_tokens"] == 50
    assert len(reqlog.read(store, "t", "session", meta["requests"])) == 2
    assert store.get(conv_key("conv", "t", "first")) is None
    # A later request of the session changes nothing more.
    ledger.record_batch(store, [(_entry("session", "first", 3.0), None)], None)
    assert store.get(conv_key("conv", "t", "session"))["requests"] == 3
    store.close()


def test_the_ledger_returns_each_requests_net_in_batch_order(tmp_path: Path) -> None:
    """The net dollars a request span carries (#27): one per entry, where the entry was in
    the batch, the same as its ``req`` row and adding up to its conversation's; none for an
    error or a model without a price."""
    store = DiskStore(tmp_path)
    compacted = ledger.RequestEntry(**{**_entry("a", ts=2.0).__dict__, "forwarded_tokens": 40})
    failed = ledger.RequestEntry(**{**_entry("b", ts=2.0).__dict__, "status": 500})
    unpriced = ledger.RequestEntry(**{**_entry("c").__dict__, "model": "my-local-model"})
    batch = [_entry("a"), _entry("b"), compacted, failed, unpriced]
    nets = ledger.record_batch(store, [(e, None) for e in batch], None)
    assert nets[1] is not None and nets[3] is None and nets[4] is None
    assert nets[0] == 0.0 and nets[2] is not None and nets[2] > 0  # 60 tokens fewer
    rows = reqlog.read(store, "t", "a", store.get(conv_key("conv", "t", "a"))["requests"])
    assert [r["net_usd"] for r in rows] == [nets[0], nets[2]]
    meta = store.get(conv_key("conv", "t", "a"))
    assert meta["counterfactual_usd"] - meta["actual_usd"] == nets[0] + nets[2]
    store.close()
