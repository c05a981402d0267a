"""OpenAI's /v1/responses through the same core, driven by the official openai client."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from proxy.core.tokens import TokenCounter
from tests.checks import INLINE, assert_facts_present
from tests.conversations import take_responses_output, user_turns
from tests.proxyproc import ProxyProcess
from tests.upstream import ScriptedUpstream

MODEL = "gpt-4o-mini"
INSTRUCTIONS = "You are a careful coding assistant for the billing service."
SUMMARY_PREFIX = "[History Summary - "
_counter = TokenCounter()


def _as_chat(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rough chat equivalent of the items, only to count tokens the same way on both sides."""
    out: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS}]
    for item in items:
        out.append({"role": item.get("role", "assistant"), "content": orjson.dumps(item).decode()})
    return out


def _drive(client: openai.OpenAI, turns: int, stream: bool) -> list[list[dict[str, Any]]]:
    items: list[dict[str, Any]] = []
    sent: list[list[dict[str, Any]]] = []

    def call() -> list[dict[str, Any]]:
        sent.append([dict(i) for i in items])
        kwargs: dict[str, Any] = dict(model=MODEL, instructions=INSTRUCTIONS, input=items)
        if stream:
            done = [e for e in client.responses.create(stream=True, **kwargs)]
            response = done[-1].response
        else:
            response = client.responses.create(**kwargs)
        return [o.model_dump(exclude_none=True) for o in response.output]

    for text in user_turns(turns):
        items.append({"role": "user", "content": text})
        for _ in range(5):
            output = call()
            if not take_responses_output(items, output):
                break
    return sent


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_responses_route_compacts_a_tool_using_conversation(tmp_path: Path, stream: bool) -> None:
    with ScriptedUpstream() as up:
        with ProxyProcess(
            tmp_path,
            up.base_url,
            compaction=INLINE,
        ) as px:
            client = openai.OpenAI(base_url=px.base_url, api_key="sk-resp", max_retries=0)
            sent = _drive(client, 30, stream)
            # A request that continues server-side state carries no history: untouched.
            raw = client.responses.with_raw_response.create(
                model=MODEL, input="and then?", previous_response_id="resp_123"
            )
            assert raw.headers["x-compaction-case"] == "off"
        forwarded = [r.json for r in up.requests if r.path == "/v1/responses" and r.purpose is None]
        assert forwarded[-1]["input"] == "and then?"
        forwarded = forwarded[:-1]
        assert len(forwarded) == len(sent)
        summaries = 0
        for client_items, body in zip(sent, forwarded, strict=True):
            assert body["instructions"] == INSTRUCTIONS
            items = body["input"]
            at = [
                i
                for i, item in enumerate(items)
                if item.get("type") == "message"
                and str(item.get("content")).startswith(SUMMARY_PREFIX)
            ]
            if at:
                summaries += 1
                # Before the summary only pins, verbatim: the task first.
                assert items[0] == client_items[0]
                assert all(m in client_items for m in items[: at[0]])
                tail = items[at[0] + 1 :]
            else:
                tail = items
            assert tail == client_items[len(client_items) - len(tail) :], (
                "recent items not verbatim"
            )
            # A user turn, or a cut between rounds (never a function output).
            assert tail[0].get("type") != "function_call_output"
            issued = {i["call_id"] for i in tail if i.get("type") == "function_call"}
            for i in tail:
                if i.get("type") == "function_call_output":
                    assert i["call_id"] in issued, "function output separated from its call"
        assert summaries >= 10
        last = forwarded[-1]["input"]
        before = _counter.count_total(_as_chat(sent[-1]), MODEL)
        after = _counter.count_total(_as_chat(last), MODEL)
        assert after <= 0.4 * before
        assert_facts_present(last)
