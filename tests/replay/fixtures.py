"""The replay corpus: real public agent runs in ``runs/*.json`` (sources in ``runs/SOURCES.md``),
which the tests replay through real proxy processes, and ``more/*.json`` (sources in
``more/SOURCES.md``), further real sessions that the economics benchmark prices and
``tests/test_replay_more.py`` runs through the core in process, and one of them through a
real proxy (CI's time is bounded: each run in ``runs/`` is replayed six times through real
processes)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

RUNS_DIR = Path(__file__).parent / "runs"
MORE_DIR = Path(__file__).parent / "more"
MIN_ROUNDS = 30
# Long enough runs (100-190 model calls) to pass the default trigger of 24,000 tokens take
# ~235-315 KB with every output cut at 1,500 characters.
MAX_BYTES = 320_000
CUT = re.compile(r"\n\[…cut: \d+ chars\]\Z")
ROLES = {"user", "system", "assistant", "tool"}


def load_runs(folder: Path = RUNS_DIR) -> list[dict[str, Any]]:
    """Every run in ``folder`` (``runs/``), sorted by file name, with its file name under
    ``"file"``."""
    runs = []
    for path in sorted(folder.glob("*.json")):
        run: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        run["file"] = path.name
        runs.append(run)
    return runs


def _check_text(where: str, value: object, limit: int) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise ValueError(f"{where}: not a string")
    if len(value) > limit and not CUT.search(value):
        raise ValueError(f"{where}: {len(value)} chars and no cut marker")


def check_run(run: dict[str, Any]) -> None:
    """Raise ValueError naming the first way ``run`` breaks the corpus format."""
    name = run.get("file", run.get("agent", "?"))
    body = {k: v for k, v in run.items() if k != "file"}
    if len(json.dumps(body, indent=1, ensure_ascii=False).encode()) > MAX_BYTES:
        raise ValueError(f"{name}: larger than {MAX_BYTES} bytes")
    if not isinstance(run.get("agent"), str) or not isinstance(run.get("source"), dict):
        raise ValueError(f"{name}: needs 'agent' and 'source'")
    if not all(k in run["source"] for k in ("repo", "path", "commit", "license")):
        raise ValueError(f"{name}: source needs repo, path, commit and license")
    turns = run.get("turns")
    if not isinstance(turns, list) or not turns or turns[0].get("role") != "user":
        raise ValueError(f"{name}: turns must be a list opening with a user turn")
    pending: dict[str, str] = {}
    seen: set[str] = set()
    rounds = 0
    for i, turn in enumerate(turns):
        where, role = f"{name} turn {i}", turn.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}: unknown role {role!r}")
        if role != "tool" and pending:
            raise ValueError(f"{where}: {role} turn before the results of {sorted(pending)}")
        if role != "tool":
            _check_text(where, turn.get("text"), 1500)
        if role == "assistant":
            _check_text(where + " thinking", turn.get("thinking"), 600)
            calls = turn.get("tool_calls") or []
            for c in calls:
                cid = c.get("id")
                if not isinstance(cid, str) or cid in seen or not isinstance(c.get("input"), dict):
                    raise ValueError(f"{where}: bad or repeated tool call {cid!r}")
                seen.add(cid)
                pending[cid] = str(c.get("name"))
            rounds += bool(calls)
        elif role == "tool":
            cid = turn.get("tool_call_id")
            if cid not in pending:
                raise ValueError(f"{where}: result for {cid!r}, which no open call made")
            if turn.get("name") != pending.pop(cid) or not isinstance(turn.get("is_error"), bool):
                raise ValueError(f"{where}: tool name or is_error does not fit call {cid!r}")
            _check_text(where, turn.get("output"), 1500)
    if pending:
        raise ValueError(f"{name}: calls without results: {sorted(pending)}")
    if rounds < MIN_ROUNDS:
        raise ValueError(f"{name}: {rounds} tool rounds, fewer than {MIN_ROUNDS}")
