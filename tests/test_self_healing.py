"""A compacted body the upstream refuses costs one retry, never the session (issue #24).

A real proxy process, the official clients, and the strict upstream with one more rule: it
refuses any body that carries the proxy's summary (as a provider would refuse a shape we got
wrong). The client still gets its answer (the client's own body sent once more), the
conversation's records are never forwarded again, and the refusal shows in ``/metrics``, the
ledger totals and the admin API.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest

from proxy.adapters.store import DiskStore
from proxy.operators.details import conversation_detail
from proxy.operators.queries import list_conversations, resolve
from tests.agentclients import wait_for
from tests.checks import INLINE, SUMMARY_PREFIX
from tests.litellmproc import running
from tests.proxyproc import ProxyProcess
from tests.upstream import ScriptedUpstream, filler_sentence

TOKEN = "self-healing-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def refuse_summaries(body: dict[str, Any]) -> str | None:
    """The provider's rule for this test: no message may carry the proxy's summary."""
    for m in body.get("messages") or []:
        if SUMMARY_PREFIX in orjson.dumps(m.get("content")).decode():
            return "messages: this provider refuses the proxy's summary (test rule)"
    return None


def _conversation(px: ProxyProcess) -> dict[str, Any]:
    rows = httpx.get(f"{px.root}/admin/api/conversations", headers=AUTH, timeout=30).json()
    (row,) = rows["items"]
    return httpx.get(
        f"{px.root}/admin/api/conversations/{row['id']}", headers=AUTH, timeout=30
    ).json()


def _metric(px: ProxyProcess, name: str, **labels: str) -> float:
    text = httpx.get(f"{px.root}/metrics", headers=AUTH, timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _bodies(up: ScriptedUpstream, path: str) -> list[bytes]:
    return [r.body for r in up.requests if r.path == path and r.purpose is None]


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_compaction_is_sent_as_sent_and_never_used_again(
    tmp_path: Path, stream: bool
) -> None:
    with (
        ScriptedUpstream(refuse=refuse_summaries, expect_rejections=True) as up,
        ProxyProcess(tmp_path, up.base_url, compaction=INLINE, admin={"token": TOKEN}) as px,
    ):
        client = openai.OpenAI(base_url=px.base_url, api_key="sk-heal", max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
        cases = []
        for turn in range(24):
            messages.append({"role": "user", "content": f"Q{turn}: {filler_sentence(turn, 120)}"})
            raw = client.chat.completions.with_raw_response.create(
                model="gpt-4o-mini",
                messages=messages,
                stream=stream,  # type: ignore[arg-type]
            )
            cases.append(raw.headers["x-compaction-case"])
            if stream:
                text = "".join(
                    c.choices[0].delta.content or ""
                    for c in raw.parse()
                    if c.choices  # type: ignore[union-attr]
                )
            else:
                text = raw.parse().choices[0].message.content  # type: ignore[union-attr]
            assert text, f"turn {turn}: no answer"
            messages.append({"role": "assistant", "content": text})
        bodies = _bodies(up, "/v1/chat/completions")
        # Exactly one refusal: the first compacted body. The client's own body went next,
        # and every later request of the conversation went as the client sent it.
        assert len(up.rejections) == 1, up.rejections
        refused = [i for i, b in enumerate(bodies) if SUMMARY_PREFIX.encode() in b]
        assert len(refused) == 1, "a refused record was forwarded again"
        assert SUMMARY_PREFIX.encode() not in bodies[refused[0] + 1]
        assert len(bodies) == 24 + 1  # one retry for 24 client calls
        assert cases.count("healed") == 1
        after = cases[cases.index("healed") + 1 :]
        assert after and set(after) == {"opt-out"}, after
        wait_for(lambda: _conversation(px)["meta"]["requests"] >= 24, what="ledger entries")
        detail = _conversation(px)
        assert detail["meta"]["refused"]["case"] in ("summarize", "truncate", "emergency")
        assert detail["meta"]["refused"]["record"]
        route = "chat.completions"
        assert _metric(px, "compaction_proxy_upstream_refused_compactions_total",
                       route=route, outcome="healed") == 1  # fmt: skip
        stats = httpx.get(f"{px.root}/admin/api/stats", headers=AUTH, timeout=30).json()
        assert stats["totals"]["healed"] == 1
        page = httpx.get(f"{px.root}/dashboard/conversations/{detail['id']}", headers=AUTH)
        assert "the upstream refused a compacted request" in page.text


def test_a_body_refused_as_sent_too_is_the_requests_own_fault(tmp_path: Path) -> None:
    """The upstream refuses the client's own body as well: the client gets that 400, and the
    conversation is not marked (the compaction was not at fault)."""

    def refuse_late_turns(body: dict[str, Any]) -> str | None:
        last = body["messages"][-1]
        return "messages: refused (test rule)" if "Q18:" in str(last.get("content")) else None

    with (
        ScriptedUpstream(refuse=refuse_late_turns, expect_rejections=True) as up,
        ProxyProcess(tmp_path, up.base_url, compaction=INLINE, admin={"token": TOKEN}) as px,
    ):
        client = anthropic.Anthropic(base_url=px.root, api_key="sk-heal", max_retries=0)
        messages: list[dict[str, Any]] = []
        refused_at = None
        for turn in range(20):
            messages.append({"role": "user", "content": f"Q{turn}: {filler_sentence(turn, 240)}"})
            try:
                reply = client.messages.create(
                    model="claude-sonnet-4-5-20250929",
                    max_tokens=64,
                    messages=messages,  # type: ignore[arg-type]
                )
            except anthropic.BadRequestError:
                refused_at = turn
                messages.pop()
                continue
            text = "".join(b.text for b in reply.content if b.type == "text")
            messages.append({"role": "assistant", "content": text})
        assert refused_at == 18
        bodies = _bodies(up, "/v1/messages")
        assert any(SUMMARY_PREFIX.encode() in b for b in bodies), "no compaction happened"
        assert len(up.rejections) in (1, 2)  # the compacted body (if it was), then as sent
        wait_for(lambda: _conversation(px)["meta"]["requests"] >= 19, what="ledger entries")
        assert _conversation(px)["meta"]["refused"] is None
        # Later requests still go compacted: nothing was marked.
        assert SUMMARY_PREFIX.encode() in bodies[-1]


def _refused_marks(store_dir: Path) -> list[dict[str, Any]]:
    store = DiskStore(str(store_dir))
    try:
        listed = list_conversations(store, per_page=50)["items"]
        marks = []
        for row in listed:
            tenant, conv = resolve(store, row["id"])
            marks.append(conversation_detail(store, tenant, conv)["meta"]["refused"])
        return [m for m in marks if m]
    finally:
        store.close()


@pytest.mark.slow
def test_through_litellm_a_refused_compaction_costs_one_request(tmp_path: Path) -> None:
    """LiteLLM sends the request itself, so the hook cannot send the client's body again:
    the client gets the refusal once, and the conversation's next request passes as sent."""
    store_dir = tmp_path / "store"
    with (
        ScriptedUpstream(refuse=refuse_summaries, expect_rejections=True) as up,
        running(tmp_path, up, INLINE, f"diskcache://{store_dir}", "env") as proc,
    ):
        client = proc.client(tenant="healing")
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
        refused = []
        for turn in range(24):
            messages.append({"role": "user", "content": f"Q{turn}: {filler_sentence(turn, 120)}"})
            try:
                reply = client.chat.completions.create(model="gpt-4o-mini", messages=messages)  # type: ignore[arg-type]
            except openai.BadRequestError:
                refused.append(turn)
                continue
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        bodies = _bodies(up, "/v1/chat/completions")
        assert len(refused) == 1 and len(up.rejections) == 1, (refused, up.rejections)
        assert [SUMMARY_PREFIX.encode() in b for b in bodies].count(True) == 1
        wait_for(lambda: bool(_refused_marks(store_dir)), what="the refused mark")
        assert _refused_marks(store_dir)[0]["route"] == "litellm.chat.completions"
