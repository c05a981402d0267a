"""#26 acceptance through a real proxy process: a scripted agent (the official openai client,
the strict scripted upstream) reads seven files, pruning clears the oldest results, and the
agent then reads the first file again three times. The behaviour is counted, the loop breaker
fires, the next prunings keep that file's latest result, and so does the summary that follows
(its test logs cannot be pruned): the round stays in place, pinned, and the record says why.
A control run with the breaker off clears it. The dashboard and /metrics say why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai

from tests.proxyproc import ProxyProcess
from tests.upstream import ScriptedUpstream, filler_sentence

MODEL = "gpt-4o-mini"
TOKEN = "admin-secret-for-loops"
REREAD = "src/f1.py"
# The agent's tool calls, in order: seven reads, the first file three more times, six new
# files (whose results push the history past the trigger twice more), then test runs whose
# logs pruning may not clear (``prune_exclude_tools``): only a summary makes room for them.
SCHEDULE = (
    [f"src/f{i}.py" for i in range(1, 8)]
    + [REREAD] * 3
    + [f"src/g{i}.py" for i in range(1, 7)]
    + [f"tests/test_t{i}.py" for i in range(1, 6)]
)
TESTS = {
    "type": "function",
    "function": {
        "name": "run_tests",
        "description": "Run a test file.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
        },
    },
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
    TESTS,
]


def tool(path: str) -> str:
    return "run_tests" if path.startswith("tests/") else "read_file"


def agent(request: dict[str, Any]) -> dict[str, Any]:
    """The scripted model: the call after the latest one it sees answered (its ids count
    them, whatever a compaction replaced before), then a final answer."""
    done = [_number(m.get("tool_call_id")) for m in request["messages"] if m.get("role") == "tool"]
    done += [
        _number(b.get("tool_use_id"))
        for m in request["messages"]
        if isinstance(m.get("content"), list)
        for b in m["content"]
        if isinstance(b, dict) and b.get("type") == "tool_result"
    ]
    n = max(done) + 1 if done else 0
    if n >= len(SCHEDULE):
        return {"role": "assistant", "content": "Done."}
    call = {
        "id": f"call_{n:04d}",
        "type": "function",
        "function": {"name": tool(SCHEDULE[n]), "arguments": json.dumps({"path": SCHEDULE[n]})},
    }
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _number(call_id: Any) -> int:
    """call_0007 (chat) or toolu_0007 (the scripted upstream's Anthropic id for it) -> 7."""
    return int(str(call_id).rsplit("_", 1)[1])


def contents(path: str, n: int) -> str:
    """~400 tokens of a file (~700 of a test log); the n-th read of it differs (a marker)."""
    rows = 50 if tool(path) == "run_tests" else 28
    body = [f"{i:03d} {filler_sentence(i + n, 10)}" for i in range(rows)]
    lines = [f"# {path} (read {n})", *body]
    return "\n".join(lines)


def run(tmp: Path, repeats: int) -> tuple[list[list[dict[str, Any]]], dict[str, Any], str, str]:
    """Drive the agent; the forwarded bodies, the conversation's admin detail, its dashboard
    page and /metrics."""
    compaction = {
        "trigger_tokens": 2500,
        "prune_keep_tool_results": 1,
        "prune_protect_tokens": 500,
        "prune_clear_at_least": 300,
        "loop_breaker_repeats": repeats,
        "prune_exclude_tools": ["run_tests"],
        # Inline: a compaction happens at the request that needs it, never later in the
        # background, so each request sees the same records on every run.
        "mode": "inline",
    }
    with ScriptedUpstream(reply=agent) as upstream:
        with ProxyProcess(
            tmp, upstream.base_url, compaction=compaction, admin={"token": TOKEN}
        ) as px:
            client = openai.OpenAI(base_url=px.base_url, api_key="sk-loop", max_retries=0)
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Find the rounding bug."},
            ]
            for n in range(len(SCHEDULE) + 1):
                reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
                message = reply.choices[0].message
                if not message.tool_calls:
                    break
                call = message.tool_calls[0]
                messages.append(
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": call.id,
                                "type": "function",
                                "function": {
                                    "name": call.function.name,
                                    "arguments": call.function.arguments,
                                },
                            }
                        ],
                    }
                )
                path = json.loads(call.function.arguments)["path"]
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": contents(path, n)}
                )
            forwarded = [r.json["messages"] for r in upstream.chat_requests() if r.purpose is None]
            auth = {"authorization": f"Bearer {TOKEN}"}
            listing = httpx.get(f"{px.root}/admin/api/conversations", headers=auth, timeout=10)
            conv = listing.json()["items"][0]["id"]
            detail = httpx.get(
                f"{px.root}/admin/api/conversations/{conv}", headers=auth, timeout=10
            )
            page = httpx.get(f"{px.root}/dashboard/conversations/{conv}", headers=auth, timeout=10)
            metrics = httpx.get(f"{px.root}/metrics", headers=auth, timeout=10).text
    return forwarded, detail.json(), page.text, metrics


def _summarized(body: list[dict[str, Any]]) -> bool:
    return any(str(m.get("content") or "").startswith("[History Summary") for m in body)


def _holds_latest_reread(body: list[dict[str, Any]]) -> bool:
    last = SCHEDULE.index("src/g1.py") - 1  # the third re-read
    return any(m.get("role") == "tool" and m.get("content") == contents(REREAD, last) for m in body)


def test_rereads_of_a_pruned_file_fire_the_loop_breaker_and_keep_the_result(tmp_path: Path) -> None:
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    forwarded, detail, page, metrics = run(tmp_path / "on", repeats=3)
    # The behaviour: three calls repeated read_file(path=src/f1.py), whose result was cleared.
    figures = detail["behaviour"]
    assert figures, detail.keys()
    first = next(iter(figures.values()))
    assert first["case"] == "prune"
    assert first["repeated_calls"] == 3 and first["rereads"] == 3
    assert first["repeated"] == [f"read_file(path={REREAD})"]
    loop = detail["loop"]
    assert loop["action"] == "keep re-fetched results out of pruning and summaries"
    assert "repeated 3 tool calls" in loop["reason"] and REREAD in loop["reason"]
    # The next prunings came after the breaker fired, then a summary (the test logs left
    # pruning nothing to clear): every request after the third re-read holds its result, the
    # summarized ones too (the control run below clears it).
    prunings = [c for c in detail["compactions"] if c["case"] == "prune"]
    assert len(prunings) >= 2
    after = forwarded[SCHEDULE.index("src/g1.py") + 1 :]
    assert len(after) >= 8 and all(_holds_latest_reread(body) for body in after)
    assert sum(1 for body in after if _summarized(body)) >= 2, [_summarized(b) for b in after]
    # The summary's record says why the round stayed in place.
    summaries = [c for c in detail["compactions"] if c["case"] == "summarize"]
    assert summaries
    kept = f"kept by the loop breaker: read_file(path={REREAD})"
    assert all(any(kept in line for line in c["pinned"]) for c in summaries), summaries
    # The dashboard says what happened and why; /metrics counts it.
    assert "loop breaker: keep re-fetched results out of pruning and summaries" in page
    assert "kept through later compactions for 40 turns" in page
    assert f"read_file(path={REREAD})" in page and kept in page
    assert (
        'compaction_proxy_loop_breaker_total{action="keep re-fetched results out of pruning and '
        'summaries"} 1.0' in metrics
    )
    # /metrics counts every compaction's repeats.
    repeats = sum(f["repeated_calls"] for f in figures.values())
    rereads = sum(f["rereads"] for f in figures.values())
    assert repeats >= 3
    counted = [line for line in metrics.splitlines() if line.startswith("compaction_proxy_agent")]
    assert f"compaction_proxy_agent_repeated_tool_calls_total {repeats}.0" in counted, counted
    assert f"compaction_proxy_agent_file_rereads_total {rereads}.0" in counted
    assert 'compaction_proxy_anchors_total{category="recall",fate=' in metrics
    # Turns per user instruction before and after each compaction (#26, build item 3): each
    # compaction's "before" counts once it is in use, its "after" counts once the next one
    # took over (the last one's are on the conversation's page only), by case.
    records = list(figures.values())
    for phase, field, rows in (
        ("before", "counts_before", records),
        ("after", "counts_after", records[:-1]),
    ):
        for case in {f["case"] for f in records}:
            turns = sum(f[field][0] for f in rows if f["case"] == case)
            told = sum(f[field][1] for f in rows if f["case"] == case)
            labels = f'{{case="{case}",phase="{phase}"}}'
            if turns:
                assert f"compaction_proxy_agent_turns_total{labels} {turns}.0" in counted, counted
            if told:
                assert f"compaction_proxy_agent_instructions_total{labels} {told}.0" in counted
    assert any(f["counts_after"][0] for f in records[:-1])  # the "after" phase was counted
    # ... and per conversation on its page: before its first compaction, after every one.
    turns = sum(f["counts_after"][0] for f in records)
    told = sum(f["counts_after"][1] for f in records)
    first_turns, first_told = records[0]["counts_before"]
    row = page[page.index('<tr class="conversation">') :].split("</tr>")[0]
    assert f'<td class="num">{first_turns / first_told:.1f}</td>' in row, row
    # (The scripted agent gets one instruction, at the start: "–" after, not a ratio.)
    assert f'<td class="num">{f"{turns / told:.1f}" if told else "–"}</td>' in row, row

    control, control_detail, _, _ = run(tmp_path / "off", repeats=0)
    assert control_detail["loop"] is None
    assert len([c for c in control_detail["compactions"] if c["case"] == "prune"]) >= 3
    assert any(c["case"] == "summarize" for c in control_detail["compactions"])
    assert not _holds_latest_reread(control[-1]), "without the breaker compaction clears it"


def test_on_the_anthropic_route_a_kept_round_stays_whole_through_a_summary(tmp_path: Path) -> None:
    # The same agent on /v1/messages (tool_use blocks, tool_result blocks in user turns): the
    # kept round is pinned whole before the summary, and the strict upstream accepts every
    # body (tool_use/tool_result pairing, alternation); every request after the third re-read
    # still holds its result, the summarized ones too.
    compaction = {
        # 700: Claude's token counts make the kept round (call and result) ~600 tokens.
        "trigger_tokens": 2500, "prune_keep_tool_results": 1, "prune_protect_tokens": 700,
        # With Claude's token counts a pruning falls between the re-reads (2 + 1 repeats
        # after two prunings): they add up since the breaker last fired.
        "prune_clear_at_least": 300, "loop_breaker_repeats": 3,
        "prune_exclude_tools": ["run_tests"], "mode": "inline",
    }  # fmt: skip
    tools = [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ]
    with ScriptedUpstream(reply=agent) as upstream:
        with ProxyProcess(
            tmp_path, upstream.base_url, compaction=compaction, admin={"token": TOKEN}
        ) as px:
            client = anthropic.Anthropic(base_url=px.root, api_key="sk-ant-loop", max_retries=0)
            messages: list[dict[str, Any]] = [{"role": "user", "content": "Find the rounding bug."}]
            for n in range(len(SCHEDULE) + 1):
                reply = client.messages.create(
                    model="claude-sonnet-4-5-20250929", max_tokens=256, messages=messages,
                    system="You are a coding agent.", tools=tools,  # type: ignore[arg-type]
                )  # fmt: skip
                uses = [b for b in reply.content if b.type == "tool_use"]
                if not uses:
                    break
                use = uses[0]
                path = str(use.input["path"])  # type: ignore[index]
                messages.append(
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}
                        ],
                    }
                )
                messages.append(
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": use.id,
                                "content": contents(path, n),
                            }
                        ],
                    }
                )
            bodies = [
                r.json["messages"]
                for r in upstream.requests
                if r.path == "/v1/messages" and r.purpose is None
            ]
            auth = {"authorization": f"Bearer {TOKEN}"}
            listing = httpx.get(f"{px.root}/admin/api/conversations", headers=auth, timeout=10)
            conv = listing.json()["items"][0]["id"]
            detail = httpx.get(
                f"{px.root}/admin/api/conversations/{conv}", headers=auth, timeout=10
            ).json()
    assert detail["loop"]["action"] == "keep re-fetched results out of pruning and summaries"
    assert "repeated 3 tool calls" in detail["loop"]["reason"], detail["loop"]
    assert len(bodies) == len(SCHEDULE) + 1  # every request answered: the upstream took them
    latest = contents(REREAD, SCHEDULE.index("src/g1.py") - 1)

    def holds(body: list[dict[str, Any]]) -> bool:
        return any(
            isinstance(b, dict) and b.get("type") == "tool_result" and b.get("content") == latest
            for m in body
            if isinstance(m.get("content"), list)
            for b in m["content"]
        )

    def summarized(body: list[dict[str, Any]]) -> bool:
        return "[History Summary" in json.dumps(body)

    after = bodies[SCHEDULE.index("src/g1.py") + 1 :]
    assert len(after) >= 8 and all(holds(body) for body in after)
    assert sum(1 for body in after if summarized(body)) >= 2, [summarized(b) for b in after]
    kept = f"kept by the loop breaker: read_file(path={REREAD})"
    summaries = [c for c in detail["compactions"] if c["case"] == "summarize"]
    assert summaries and all(any(kept in line for line in c["pinned"]) for c in summaries)
