"""#26 acceptance on every replayed real run (``tests/replay/runs``, through the compaction core
in process; ``eval.anchor_eval``): with the scripted ``structured`` summarizer at a 6,000-token
trigger, the artifact trail and recall we forward are at least observation masking's, at a
forwarded budget no larger than its, on every run; and every run really compacts (under the
default cost policy, which reads a ledger this driver does not write, 4 of the 6 never did,
and the comparison measured nothing)."""

from __future__ import annotations

from eval import anchor_eval


def test_on_every_replayed_run_we_keep_the_artifact_trail_and_recall_of_masking() -> None:
    runs = anchor_eval.corpus()
    assert len(runs) >= 6
    for name, msgs in runs:
        result = anchor_eval.evaluate(name, msgs, "structured", 6000)
        ours = result["methods"]["proxy"]
        masking = result["methods"]["observation masking"]
        print(name, result["compactions"], ours, masking)
        assert result["compactions"] >= 1, name
        assert ours["tokens"] < result["sent_tokens"], name
        assert ours["tokens"] <= masking["tokens"], name
        for category in ("artifact", "recall"):
            kept, total = ours["anchors"][category]
            assert total > 0 or category == "artifact", name
            assert kept >= masking["anchors"][category][0], (name, category)
