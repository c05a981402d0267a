"""Agent frameworks through the proxy: the OpenAI Agents SDK (a chat-completions model and a
Responses model) and langchain-openai ``bind_tools``, each with two function tools that the
scripted model calls in parallel, over many turns, streaming and not, against the strict
scripted upstream."""

from __future__ import annotations

import asyncio
import operator
from functools import reduce
from pathlib import Path
from typing import Any

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from langchain_core.messages import BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai.types.shared import Reasoning

from tests.agentclients import summarize_in_prose
from tests.checks import INLINE, SUMMARY_PREFIX
from tests.proxyproc import ProxyProcess
from tests.upstream import ScriptedUpstream, filler_sentence, message_text

pytestmark = pytest.mark.slow

TURNS = 15
REASONING = "REASONING-SECRET-"
# Lower than the shared setting: these sessions are short (15 turns of a few hundred tokens
# each) and must still compact several times.
COMPACTION = {
    **INLINE,
    "trigger_tokens": 2000,
    "verbatim_window_tokens": 700,
    "summary_budget_tokens": 200,
}
INSTRUCTIONS = "You are the billing team's on-call assistant. Use the tools when asked."


class ToolScript:
    """A model that calls both tools at once whenever the user asks for a check, and answers
    in prose otherwise; with ``reasoning`` it starts every reply with a reasoning item."""

    def __init__(self, reasoning: bool = False) -> None:
        self.n, self.reasoning = 0, reasoning

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        self.n += 1
        last = body["messages"][-1] if body["messages"] else {}
        reply: dict[str, Any] = {"role": "assistant"}
        if self.reasoning:
            reply["reasoning"] = f"{REASONING}{self.n}"
        if last.get("role") == "user" and "check" in message_text(last):
            reply["content"] = None
            reply["tool_calls"] = [
                {"id": f"call_{self.n:06d}_w", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": f"call_{self.n:06d}_t", "type": "function",
                 "function": {"name": "get_ticket", "arguments": '{"ticket": "OPS-4711"}'}},
            ]  # fmt: skip
        else:
            reply["content"] = f"Reply {self.n}. {filler_sentence(self.n, 60)}"
        return reply


def _prompt(turn: int) -> str:
    ask = "Please check the weather and the ticket. " if turn % 3 == 1 else ""
    return f"Turn {turn}: {ask}{filler_sentence(3000 + turn, 40)}"


calls: dict[str, int] = {"weather": 0, "ticket": 0}


def weather_report(city: str) -> str:
    calls["weather"] += 1
    return f"WEATHER-RESULT: {city} is sunny, 21 C. " + filler_sentence(calls["weather"], 30)


def ticket_status(ticket: str) -> str:
    calls["ticket"] += 1
    return f"TICKET-RESULT: {ticket} is waiting for review. " + filler_sentence(calls["ticket"])


def _check_upstream(up: ScriptedUpstream, path: str, reasoning: bool = False) -> None:
    """0 rejections, both tools answered in one request, compaction seen, and (with
    reasoning items) none of them shown to the summarizer or the detector."""
    assert up.rejections == [], f"the strict upstream rejected: {up.rejections}"
    bodies = [r.body.decode() for r in up.requests if r.path == path and r.purpose is None]
    assert any("WEATHER-RESULT" in b and "TICKET-RESULT" in b for b in bodies)
    compacted = [b for b in bodies if SUMMARY_PREFIX in b]
    assert len(compacted) >= 3, f"only {len(compacted)} of {len(bodies)} requests compacted"
    assert up.summarizer_calls(), "the summarizer was never called"
    assert calls["weather"] >= TURNS // 3 and calls["ticket"] >= TURNS // 3
    if reasoning:
        assert any('"type":"reasoning"' in b for b in bodies), "no reasoning item went back"
        for rec in up.requests:
            if rec.purpose in ("summarizer", "detector"):
                text = rec.body.decode()
                assert REASONING not in text and "gAAAAB" not in text, (
                    f"reasoning leaked to the {rec.purpose}"
                )


# ---- OpenAI Agents SDK -----------------------------------------------------------------


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return weather_report(city)


@function_tool
def get_ticket(ticket: str) -> str:
    """The status of a ticket."""
    return ticket_status(ticket)


async def _agents_session(agent: Agent[Any], stream: bool) -> list[str]:
    history: list[Any] = []
    finals: list[str] = []
    for turn in range(TURNS):
        run_input = [*history, {"role": "user", "content": _prompt(turn)}]
        if stream:
            streamed = Runner.run_streamed(agent, run_input)
            async for _event in streamed.stream_events():
                pass
            result: Any = streamed
        else:
            result = await Runner.run(agent, run_input)
        finals.append(str(result.final_output))
        history = result.to_input_list()
    return finals


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_openai_agents_sdk(tmp_path: Path, api: str, stream: bool) -> None:
    set_tracing_disabled(True)  # the SDK would otherwise export traces to the internet
    calls.update(weather=0, ticket=0)
    reasoning = api == "responses"
    with (
        ScriptedUpstream(reply=ToolScript(reasoning), summarizer=summarize_in_prose) as up,
        ProxyProcess(tmp_path, up.base_url, compaction=COMPACTION) as px,
    ):

        async def run() -> list[str]:
            client = openai.AsyncOpenAI(base_url=px.base_url, api_key="sk-agents-e2e")
            try:
                settings = ModelSettings(parallel_tool_calls=True)
                model: Any
                if api == "chat":
                    model = OpenAIChatCompletionsModel("gpt-4o-mini", client)
                else:
                    model = OpenAIResponsesModel("o4-mini", client)
                    settings = ModelSettings(
                        parallel_tool_calls=True,
                        reasoning=Reasoning(effort="low"),
                        store=False,
                        response_include=["reasoning.encrypted_content"],
                    )
                agent = Agent(
                    name="billing-assistant",
                    instructions=INSTRUCTIONS,
                    model=model,
                    model_settings=settings,
                    tools=[get_weather, get_ticket],
                )
                return await _agents_session(agent, stream)
            finally:
                await client.close()

        finals = asyncio.run(run())
    assert all(f.startswith("Reply ") for f in finals), finals
    _check_upstream(up, "/v1/chat/completions" if api == "chat" else "/v1/responses", reasoning)


# ---- langchain-openai ------------------------------------------------------------------


@tool("get_weather")
def lc_weather(city: str) -> str:
    """The weather in a city."""
    return weather_report(city)


@tool("get_ticket")
def lc_ticket(ticket: str) -> str:
    """The status of a ticket."""
    return ticket_status(ticket)


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_langchain_bind_tools(tmp_path: Path, api: str, stream: bool) -> None:
    calls.update(weather=0, ticket=0)
    tools = {"get_weather": lc_weather, "get_ticket": lc_ticket}
    with (
        ScriptedUpstream(reply=ToolScript(), summarizer=summarize_in_prose) as up,
        ProxyProcess(tmp_path, up.base_url, compaction=COMPACTION) as px,
    ):
        llm = ChatOpenAI(
            model="gpt-4o-mini",
            base_url=px.base_url,
            api_key="sk-langchain-e2e",
            max_retries=0,
            use_responses_api=api == "responses",
        ).bind_tools(list(tools.values()), parallel_tool_calls=True)
        messages: list[BaseMessage] = []
        finals: list[str] = []
        for turn in range(TURNS):
            messages.append(HumanMessage(_prompt(turn)))
            for _round in range(3):
                ai: Any = reduce(operator.add, llm.stream(messages)) if stream else (
                    llm.invoke(messages))  # fmt: skip
                messages.append(ai)
                if not ai.tool_calls:
                    break
                for call in ai.tool_calls:
                    output = tools[call["name"]].invoke(call["args"])
                    messages.append(ToolMessage(output, tool_call_id=call["id"]))
            finals.append(ai.text if isinstance(ai.text, str) else ai.text())
    assert all(f.startswith("Reply ") for f in finals), finals
    _check_upstream(up, "/v1/chat/completions" if api == "chat" else "/v1/responses")
