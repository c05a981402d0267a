"""Converters from public agent trajectories to the corpus's neutral format (``fixtures``).

    python -m tests.replay.convert mini-swe-agent TRAJ.json OUT.json --repo R --path P \
        --commit C --license MIT --note "..."

Cutting rule (the corpus's, ``runs/SOURCES.md``): any text, tool output or string tool
argument longer than ``LIMIT`` characters keeps its first ``KEEP`` characters plus
``\\n[…cut: N chars]`` (N: the original length); thinking is cut at ``THINKING_LIMIT``.
"""

from __future__ import annotations

import argparse
import json
import sys
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


CONVERTERS = {"mini-swe-agent": mini_swe_agent}


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
    run = CONVERTERS[args.kind](json.loads(args.trajectory.read_text()), source)
    args.out.write_text(json.dumps(run, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
