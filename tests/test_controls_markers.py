"""A client's own compaction request is recognised by its prompt, in any case, wherever the
prompt sits in the scanned part of its head or last turns; the answers remembered for long
texts (``controls._compaction_marker``, #28) are the answers of the scan itself, and the
memory is bounded."""

from __future__ import annotations

from proxy.core import controls
from proxy.core.controls import _SEEN_TEXTS, client_compaction

FILLER = "Use the tools to read files before you edit them. " * 400  # ~20,000 characters
ASK = "Your task is to create a detailed summary of the conversation so far"
CODEX = "You are performing a CONTEXT CHECKPOINT COMPACTION."


def test_a_marker_is_found_in_any_case_in_short_and_long_texts() -> None:
    for filler in ("", FILLER[:5_000]):
        head = {"role": "system", "content": filler + CODEX}
        user = {"role": "user", "content": "go on"}
        assert client_compaction([head, user]) == "codex"
        ask = {"role": "user", "content": filler + ASK.upper()}
        assert client_compaction([{"role": "system", "content": filler}, ask]) == "claude-code"
        assert client_compaction([{"role": "system", "content": filler}, user]) is None


def test_remembered_answers_are_the_scan_s_own() -> None:
    texts = [
        FILLER[: 1_000 + i * 97] + (CODEX if i % 3 == 0 else "") for i in range(3 * _SEEN_TEXTS)
    ]
    for _ in range(2):  # first sight, then (for those still remembered) from memory
        for text in texts:
            copy = "".join(list(text))  # an equal string, not the same object
            assert controls._compaction_marker(copy) == controls._marker_of(text)
            assert controls._compaction_marker(copy) == ("codex" if CODEX in text else None)
    assert controls._remembered_marker.cache_info().currsize <= _SEEN_TEXTS


def test_a_marker_past_the_scanned_part_is_not_read() -> None:
    late = {"role": "system", "content": FILLER + FILLER + CODEX}
    assert client_compaction([late, {"role": "user", "content": "go on"}]) is None
