"""The fidelity evaluation end to end, small: SmolLM2-135M under llama.cpp is the detector
and summarizer, a real proxy process compacts a built-in support conversation, and the loss
report of every compaction is checked against the request the proxy really forwarded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from eval.fidelity import evaluate
from eval.report import render
from tests.llama import smollm2_server

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with smollm2_server(tmp_path_factory.mktemp("llama") / "llama.log") as base:
        yield base


@pytest.mark.slow
def test_small_fidelity_run_with_smollm2(smollm2: str, tmp_path: Path) -> None:
    small = {
        "trigger_tokens": 450,
        "verbatim_window_tokens": 150,
        "summary_budget_tokens": 96,
        "detector_window_messages": 6,
        "detector_chars_per_message": 160,
        "emergency_factor": 2.0,
    }
    results = evaluate(smollm2, MODEL, scale=0.25, qa_questions=1, only="support", compaction=small)
    assert len(results) == 1
    r = results[0]
    print(render(results, model=MODEL, upstream=smollm2, compaction=small, seconds=0))
    # The proxy compacted (or tried to, and says why it could not).
    assert r.compactions or r.failures, r.cases
    assert r.forwarded_tokens <= r.original_tokens
    # Every loss report says exactly what the forwarded request holds and lacks.
    assert r.mismatches == []
    assert r.bad_summaries == []  # no accepted summary fails the checks
    # At the same forwarded budget the proxy keeps at least what dropping the middle keeps.
    assert len(r.proxy_kept) >= len(r.middle_kept), (r.proxy_kept, r.middle_kept)
    assert len(r.qa) == 1
    text = render(results, model=MODEL, upstream=smollm2, compaction=small, seconds=1)
    assert "| support (support with ids and amounts) |" in text
