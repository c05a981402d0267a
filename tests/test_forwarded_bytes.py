"""The bytes the proxy forwards do not change when its request path does (#28).

The real agent runs of ``tests/replay/runs`` (each in its own client's shape, and once more as
Claude Code or Codex would send it: all three chat routes, streamed and not) are replayed
with the official clients through a real proxy process against the strict upstream, once
compacting inline at a low trigger (substitution, pruning, summaries, cache marks) and once
never compacting (what goes through as sent, with the usage option the proxy adds to a
stream). Every request the upstream receives - the client's, and the detector's and
summarizer's - is hashed in order, and the list must equal the checked-in one,
``tests/replay/forwarded.json``, made by the code before the hot path's rework.

A change meant to alter what is forwarded (a new summary prompt, another cut) regenerates
the file from the tree that makes it, and says so in its commit:

    UPDATE_FORWARDED=1 python -m pytest tests/test_forwarded_bytes.py
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.checks import INLINE
from tests.test_replay_runs import replayed

pytestmark = pytest.mark.slow  # real processes, every replayed run twice (~9 min when busy)

EXPECTED = Path(__file__).parent / "replay" / "forwarded.json"
SETTINGS: dict[str, dict[str, Any]] = {
    "inline, low trigger": INLINE,
    "never compacting": {"trigger_tokens": 10_000_000, "policy": "tokens"},
}


def _forwarded(tmp_path: Path, compaction: dict[str, Any]) -> list[str]:
    """Each request the upstream received, in order: route, purpose and the body's hash
    (the low trigger's replay is the one ``test_replay_runs`` checks too: made once)."""
    return [
        f"{r.path} {r.purpose or 'client'} {hashlib.sha256(r.body).hexdigest()[:16]}"
        for r in replayed(tmp_path, compaction).received
    ]


@pytest.mark.parametrize("settings", sorted(SETTINGS))
def test_the_forwarded_bytes_are_the_recorded_ones(tmp_path: Path, settings: str) -> None:
    got = _forwarded(tmp_path, SETTINGS[settings])
    assert len(got) > 200, "the replay sent too few requests to compare"
    expected: dict[str, list[str]] = json.loads(EXPECTED.read_text()) if EXPECTED.exists() else {}
    if os.environ.get("UPDATE_FORWARDED"):
        expected[settings] = got
        EXPECTED.write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    want = expected.get(settings)
    assert want is not None, f"no recorded hashes for {settings!r}: see the module's docstring"
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    assert first is None, f"request {first} differs: {got[first]} != {want[first]}"
    assert len(got) == len(want), f"{len(got)} requests forwarded, {len(want)} recorded"
