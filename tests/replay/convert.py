"""Converters from public agent trajectories to the corpus's neutral format (``fixtures``).

    python -m tests.replay.convert mini-swe-agent TRAJ.json OUT.json --repo R --path P \
        --commit C --license MIT --note "..."
    python -m tests.replay.convert claude-code SESSION.jsonl OUT.json ...

Cutting rule (the corpus's, ``runs/SOURCES.md``): any text, tool output or string tool
argument longer than ``LIMIT`` characters keeps its first ``KEEP`` characters plus
``\\n[…cut: N chars]`` (N: the original length); thinking is cut at ``THINKING_LIMIT``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

LIMIT, KEEP = 1500, 1200
THINKING_LIMIT, THINKING_KEEP = 600, 500


def cut(text: Any, limit: int = LIMIT, keep: int = KEEP) -> Any:
    """``text`` within ``limit`` characters, marked where it was cut."""
    if not isinstance(text, str) or len(text) <= limit:
        return text
    return f"{text[:keep]}\n[…cut: {len(text)} chars]"


def _cut_args(value: Any) -> Any:
    if isinstance(value, str):
        return cut(value)
    if isinstance(value, dict):
        return {k: _cut_args(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cut_args(v) for v in value]
    return value


def mini_swe_agent(traj: dict[str, Any], source: dict[str, str]) -> dict[str, Any]:
    """A mini-swe-agent ``*.traj.json`` (``trajectory_format`` mini-swe-agent-1, native tool
    calls): the system message becomes ``system``, every other message a turn; the closing
    ``exit`` record is dropped, and so is a last tool call without a result (the submit
    command, answered by that record), its assistant text kept. No tool result is
    flagged as an error (mini-swe-agent puts the return code in the output)."""
    info = traj.get("info") or {}
    model = ((info.get("config") or {}).get("model") or {}).get("model_name", "")
    system = ""
    turns: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    answered = {m.get("tool_call_id") for m in traj["messages"] if m.get("role") == "tool"}
    for m in traj["messages"]:
        role = m.get("role")
        if role == "system" and not turns:
            system = str(m.get("content") or "")
        elif role in ("user", "system"):
            turns.append({"role": role, "text": cut(str(m.get("content") or ""))})
        elif role == "assistant":
            calls = []
            for c in m.get("tool_calls") or []:
                if c["id"] not in answered:
                    continue
                fn = c["function"]
                names[c["id"]] = fn["name"]
                calls.append({"id": c["id"], "name": fn["name"],
                              "input": _cut_args(json.loads(fn["arguments"] or "{}"))})  # fmt: skip
            turns.append({"role": "assistant", "text": cut(m.get("content") or None),
                          "thinking": None, "tool_calls": calls})  # fmt: skip
        elif role == "tool":
            turns.append({
                "role": "tool", "tool_call_id": m["tool_call_id"],
                "name": names[m["tool_call_id"]], "output": cut(str(m.get("content") or "")),
                "is_error": False,  # the return code is in the output: the agent flags none
            })  # fmt: skip
    return {
        "agent": "mini-swe-agent",
        "agent_version": str(info.get("mini_version", "")),
        "model": model,
        "source": source,
        "system": system,
        "turns": turns,
    }


def _result_text(content: Any) -> str:
    """A ``tool_result``'s content as text (an image stands as ``[image]``)."""
    if isinstance(content, str):
        return content
    parts = [
        str(b.get("text", "")) if b.get("type") == "text" else f"[{b.get('type')}]"
        for b in content or []
        if isinstance(b, dict)
    ]
    return "\n".join(parts)


def claude_code(
    lines: list[dict[str, Any]], source: dict[str, str], part: int = 0
) -> dict[str, Any]:
    """A Claude Code session transcript (``~/.claude/projects/*/<session>.jsonl``, one record
    a line): the main chain's user and assistant records (not subagents' sidechains) up to
    the first ``compact_boundary``, i.e. the history as it grew until Claude Code compacted
    it itself; ``part`` n > 0: the records after the n-th boundary up to the next, i.e. a
    history that opens with Claude Code's own summary as its first user turn. An assistant
    message is several records (one per content block, one message id): merged into one
    turn, with any text-only assistant turn right before it. Thinking is left out (the
    transcript keeps no valid signature for it); calls without a result are dropped; the
    system prompt and tool schemas are not in a transcript."""
    turns: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    answered = {
        b.get("tool_use_id")
        for r in lines
        if r.get("type") == "user" and isinstance((r.get("message") or {}).get("content"), list)
        for b in r["message"]["content"]
        if isinstance(b, dict) and b.get("type") == "tool_result"
    }
    model = version = ""
    last_id, turn = None, None
    boundaries = 0
    for r in lines:
        if r.get("subtype") == "compact_boundary":
            boundaries += 1
            if boundaries > part:
                break
            continue
        if boundaries < part:
            continue
        kind = r.get("type")
        if kind not in ("user", "assistant") or r.get("isSidechain") or r.get("isApiErrorMessage"):
            continue
        version = version or str(r.get("version") or "")
        message = r.get("message") or {}
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        if kind == "assistant":
            model = model or str(message.get("model") or "")
            # One message's blocks may come between the results of its earlier calls (Claude
            # Code runs a call while the message streams): all go to that message's turn.
            if message.get("id") != last_id or turn is None:
                after_text = turns and turns[-1]["role"] == "assistant"
                if not (after_text and not turns[-1]["tool_calls"]):
                    turns.append({"role": "assistant", "text": None, "thinking": None,
                                  "tool_calls": []})  # fmt: skip
                turn = turns[-1]
            last_id = message.get("id")
            for b in blocks:
                if b.get("type") == "text" and b.get("text"):
                    turn["text"] = "\n\n".join(t for t in (turn["text"], b["text"]) if t)
                elif b.get("type") == "tool_use" and b.get("id") in answered:
                    names[b["id"]] = b["name"]
                    turn["tool_calls"].append(
                        {"id": b["id"], "name": b["name"], "input": _cut_args(b.get("input") or {})}
                    )
            continue
        texts = []
        for b in blocks:
            if b.get("type") == "tool_result":
                if b.get("tool_use_id") in names:
                    turns.append({
                        "role": "tool", "tool_call_id": b["tool_use_id"],
                        "name": names.pop(b["tool_use_id"]),
                        "output": cut(_result_text(b.get("content"))),
                        "is_error": bool(b.get("is_error")),
                    })  # fmt: skip
            elif b.get("type") == "text":
                texts.append(str(b.get("text") or ""))
            else:
                texts.append(f"[{b.get('type')}]")
        if texts:
            if turns and turns[-1]["role"] == "user":  # one user turn, as the API sends it
                texts.insert(0, turns.pop()["text"])
            turns.append({"role": "user", "text": "\n\n".join(texts)})
    for turn in turns:
        if turn["role"] == "assistant":  # calls answered only after the boundary: dropped
            turn["tool_calls"] = [c for c in turn["tool_calls"] if c["id"] not in names]
        if turn["role"] != "tool":  # cut once merged, so the marker has the whole length
            turn["text"] = cut(turn["text"])
    while turns and turns[-1]["role"] == "assistant" and not turns[-1]["text"]:
        turns.pop()
    return {
        "agent": "claude-code",
        "agent_version": version,
        "model": model,
        "source": source,
        "system": "",
        "turns": turns,
    }


def _claude_code_file(path: Path, source: dict[str, str], part: int = 0) -> dict[str, Any]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return claude_code(lines, source, part)


def _mini_swe_agent_file(path: Path, source: dict[str, str]) -> dict[str, Any]:
    return mini_swe_agent(json.loads(path.read_text()), source)


CONVERTERS: dict[str, Callable[[Path, dict[str, str]], dict[str, Any]]] = {
    "mini-swe-agent": _mini_swe_agent_file,
    "claude-code": _claude_code_file,
    # The part after Claude Code's own (first) compaction: it opens with the client's summary.
    "claude-code-continued": functools.partial(_claude_code_file, part=1),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.replay.convert", description=__doc__)
    parser.add_argument("kind", choices=sorted(CONVERTERS))
    parser.add_argument("trajectory", type=Path)
    parser.add_argument("out", type=Path)
    for name in ("repo", "path", "commit", "license", "note"):
        parser.add_argument(f"--{name}", required=True)
    args = parser.parse_args(argv)
    source = {"repo": args.repo, "path": args.path, "commit": args.commit,
              "license": args.license, "url_note": args.note}  # fmt: skip
    run = CONVERTERS[args.kind](args.trajectory, source)
    args.out.write_text(json.dumps(run, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
