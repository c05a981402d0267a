"""proxy.keyfacts: identifiers a summary must not lose, and the bounded guard."""

from __future__ import annotations

import pytest

from proxy.keyfacts import extract_key_facts, guard


@pytest.mark.parametrize(
    ("text", "fact"),
    [
        ("the config lives at /srv/billing/config.yaml now", "/srv/billing/config.yaml"),
        ("see ~/projects/app/main.py", "~/projects/app/main.py"),
        ("relative ./scripts/deploy.sh works", "./scripts/deploy.sh"),
        ("edit src/billing/invoice.py please", "src/billing/invoice.py"),
        ("open settings.toml", "settings.toml"),
        (r"on Windows C:\Users\me\notes.txt exists", r"C:\Users\me\notes.txt"),
        (
            "the runbook is https://wiki.example.internal/runbooks/billing-rollback.",
            "https://wiki.example.internal/runbooks/billing-rollback",
        ),
        ("docs at http://localhost:8080/v1/docs?x=1 ok", "http://localhost:8080/v1/docs?x=1"),
        ("the deploy ticket is OPS-4821.", "OPS-4821"),
        ("see JIRA2-77 and", "JIRA2-77"),
        ("it raised KeyError again", "KeyError"),
        ("a ConnectionResetException in prod", "ConnectionResetException"),
        ("DeprecationWarning shows up", "DeprecationWarning"),
        ("crash in parse_invoice() today", "parse_invoice()"),
        ("call os.path.join to fix it", "os.path.join"),
        ("the retry_with_backoff helper", "retry_with_backoff"),
        ("rename computeTax soon", "computeTax"),
        ("latency is 120 ms at p99", "120 ms"),
        ("it took 250ms", "250ms"),
        ("a 2.5 GB dump", "2.5 GB"),
        ("uptime was 99.9% last month", "99.9%"),
        ("budget of 500 tokens", "500 tokens"),
        ("it costs $1,200.50 per month", "$1,200.50"),
        ("staging port 8443 is open", "port 8443"),
        ("upgrade to v2.3.1 first", "v2.3.1"),
        ("the database is pg-billing-02.", "pg-billing-02"),
    ],
)
def test_extracts(text: str, fact: str) -> None:
    assert fact in extract_key_facts(text)


def test_extraction_is_ordered_distinct_and_limited() -> None:
    text = "KeyError then OPS-1 no OPS-12 then KeyError again and /a/b/c and OPS-12"
    facts = extract_key_facts(text)
    assert facts == ["KeyError", "OPS-1", "OPS-12", "/a/b/c"]
    many = " ".join(f"TKT-{i}" for i in range(100))
    assert len(extract_key_facts(many, limit=10)) == 10
    assert extract_key_facts(many, limit=10)[0] == "TKT-0"


def test_plain_prose_has_no_facts() -> None:
    assert extract_key_facts("We talked about the weather and agreed to meet later.") == []
    assert extract_key_facts("") == []


def test_trailing_punctuation_is_trimmed() -> None:
    assert extract_key_facts("Look at /srv/app/config.yaml.") == ["/srv/app/config.yaml"]


SPAN = (
    "The crash is a KeyError in parse_invoice(). The config lives at /srv/billing/config.yaml "
    "and the ticket is OPS-4821. Staging listens on port 8443."
)


def test_guard_appends_only_lost_facts_and_reports() -> None:
    summary = "The user is fixing a KeyError in parse_invoice() (ticket OPS-4821)."
    out, report = guard(SPAN, summary, max_chars=600)
    assert set(report.kept) == {"KeyError", "parse_invoice()", "OPS-4821"}
    assert set(report.appended) == {"/srv/billing/config.yaml", "port 8443"}
    assert report.dropped == ()
    assert out.startswith(summary)
    tail = out[len(summary) :]
    assert tail.startswith("\n\nKey references: ")
    assert "/srv/billing/config.yaml" in tail and "port 8443" in tail
    for kept in report.kept:
        assert kept not in tail  # facts already in the summary are not repeated


def test_guard_leaves_a_complete_summary_alone() -> None:
    summary = "KeyError in parse_invoice(); /srv/billing/config.yaml; OPS-4821; port 8443."
    out, report = guard(SPAN, summary, max_chars=600)
    assert out == summary
    assert report.appended == () and report.dropped == ()
    assert len(report.kept) == 5


def test_guard_is_bounded_by_max_chars_and_reports_dropped() -> None:
    span = " ".join(f"/srv/service{i:03d}/config.yaml" for i in range(50))
    out, report = guard(span, "A summary.", max_chars=120)
    appended_line = out.split("Key references: ", 1)[1]
    assert len(appended_line) <= 120
    assert report.appended and report.dropped
    assert set(report.appended) | set(report.dropped) == set(extract_key_facts(span))
    assert not set(report.appended) & set(report.dropped)
    for fact in report.dropped:
        assert fact not in out


def test_guard_with_zero_budget_appends_nothing() -> None:
    out, report = guard(SPAN, "Short summary.", max_chars=0)
    assert out == "Short summary."
    assert report.appended == ()
    assert len(report.dropped) == 5
