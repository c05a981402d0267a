"""proxy.lossreport: the loss report is computed against the forwarded text (#12)."""

from __future__ import annotations

import re

from proxy.core.lossreport import facts_text, note_keeps_all, report, split_summary
from proxy.core.references import guard

SPAN = (
    "USER: the refund ticket is PAY-48213 for order KB-7734-BLK, amount $1,200.50.\n"
    "ASSISTANT: config at /srv/billing/config.yaml, host db-eu-west-7.internal."
)


def test_each_fact_is_where_the_forwarded_text_has_it() -> None:
    summary, _ = guard(SPAN, "Refund PAY-48213 is pending.", max_chars=40)
    rest = "USER: and the host db-eu-west-7.internal is still slow"
    r = report(SPAN, summary, rest)
    assert r.kept == ("PAY-48213",)
    assert "db-eu-west-7.internal" in r.elsewhere
    own, refs = split_summary(summary)
    for fact in r.appended:
        assert fact in refs and fact not in own
    for fact in r.dropped:
        assert fact not in summary and fact not in rest
    assert r.found == len(r.kept) + len(r.appended) + len(r.elsewhere) + len(r.dropped) == 5
    assert r.dropped  # 40 characters of key references cannot hold them all


def test_a_truncation_without_note_reports_every_fact_not_forwarded() -> None:
    r = report(SPAN, None, "USER: new topic about /srv/billing/config.yaml")
    assert r.elsewhere == ("/srv/billing/config.yaml",)
    assert set(r.dropped) == {"PAY-48213", "KB-7734-BLK", "$1,200.50", "db-eu-west-7.internal"}


def test_note_keeps_all_only_when_the_note_and_key_references_carry_every_fact() -> None:
    assert note_keeps_all(SPAN, "An earlier topic was set aside.", "", 600)
    assert not note_keeps_all(SPAN, "An earlier topic was set aside.", "", 20)
    assert not note_keeps_all(SPAN, None, "", 600)
    assert note_keeps_all("USER: hello there, how are you?", None, "", 0)


def test_reasoning_items_are_never_mined() -> None:
    reasoning = {
        "role": "assistant",
        "content": '[reasoning] {"encrypted_content": "gAAAA-OPS-9999"}',
        "_responses_item": {"type": "reasoning", "encrypted_content": "gAAAA-OPS-9999"},
    }
    text = facts_text([{"role": "user", "content": "ticket OPS-1234"}, reasoning])
    assert "OPS-1234" in text and "OPS-9999" not in text


def test_metrics_and_stats_count_facts_kept_and_dropped() -> None:
    from proxy.operators.metrics import Metrics
    from proxy.operators.stats_cli import render

    m = Metrics()
    m.observe_event({"case": "summarize", "duration_s": 1.0, "facts_kept": 7, "facts_dropped": 2})
    body = m.render()[0].decode()
    assert 'compaction_proxy_facts_kept_total{case="summarize"} 7.0' in body
    assert 'compaction_proxy_facts_dropped_total{case="summarize"} 2.0' in body
    totals = {
        "requests": 1, "original_tokens": 10, "forwarded_tokens": 5, "saved_tokens": 5,
        "saved_pct": 50.0, "saved_usd": 0.0, "net_saved_usd": 0.0, "cache_hit_rate": 0.0,
        "errors": 0, "facts_kept": 7, "facts_dropped": 2,
    }  # fmt: skip
    # (the label column is as wide as the longest label)
    assert re.search(r"key facts kept / dropped +7 / 2\n", render(totals, [], "diskcache://x"))
