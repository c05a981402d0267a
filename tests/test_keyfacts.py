"""proxy.keyfacts: identifiers a summary must not lose, and the bounded guard."""

from __future__ import annotations

import pytest

from proxy.core.keyfacts import extract_key_facts, facts_in, ranked, scaled_budget
from proxy.core.references import guard


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
    summary = (
        "The crash is a KeyError in parse_invoice(); the config lives at "
        "/srv/billing/config.yaml; the ticket is OPS-4821; staging listens on port 8443."
    )
    out, report = guard(SPAN, summary, max_chars=600)
    assert out == summary
    assert report.appended == () and report.dropped == ()
    assert len(report.kept) == 5


def test_guard_labels_bare_identifiers_the_summary_kept_without_meaning() -> None:
    # #26: "8443" alone says nothing; the reference says what it is, in the span's words.
    summary = "KeyError in parse_invoice(); /srv/billing/config.yaml; OPS-4821; port 8443."
    out, report = guard(SPAN, summary, max_chars=600)
    refs = out.split("Key references: ", 1)[1]
    assert "Staging listens on port 8443" in refs
    assert "the ticket is OPS-4821" in refs or "ticket is OPS-4821" in refs
    assert "config lives at /srv/billing/config.yaml" in refs
    assert "port 8443" in report.appended and report.dropped == ()


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


# ---- #12: every kind of fact the issue names, with its strings --------------------------------


@pytest.mark.parametrize(
    ("text", "fact"),
    [
        ("the return is filed under KB-7734-BLK today", "KB-7734-BLK"),
        ("refund PAY-48213 went through", "PAY-48213"),
        ("connect to db-eu-west-7.internal first", "db-eu-west-7.internal"),
        ("it failed with ECONNREFUSED", "ECONNREFUSED"),
        ("the API answered HTTP 503 twice", "HTTP 503"),
        ("set BILLING_RETRY_LIMIT to 5", "BILLING_RETRY_LIMIT"),
        ("the key is billing.retry.max_attempts", "billing.retry.max_attempts"),
        ("pin requests 2.31.0 please", "2.31.0"),
        ("we run Python 3.12 in prod", "Python 3.12"),
        ("the fix is commit 3f9a2c1d on main", "3f9a2c1d"),
        ("the release is on 2025-03-14", "2025-03-14"),
        ("it shipped on March 3rd, 2025 finally", "March 3rd, 2025"),
        ("the invoice was €49.90 in total", "€49.90"),
        ("a charge of 1,200 EUR was disputed", "1,200 EUR"),
        ("the parcel weighs 2.4 kg", "2.4 kg"),
        ("peak load is 312 req/min now", "312 req/min"),
        ("the table has 18,240 rows", "18,240 rows"),
        ("Maria Gonzalez owns the rollout", "Maria Gonzalez"),
        ("we sell Acme Cloud Storage to them", "Acme Cloud Storage"),
        ("Hi, my name is Dana and I run billing", "Dana"),
        (
            "After a long call we chose Postgres over MySQL because of JSONB. Next topic.",
            "we chose Postgres over MySQL because of JSONB",
        ),
        ("We decided to use Redis for the queue.", "We decided to use Redis for the queue"),
        ("then run pip install requests==2.31.0 and retry", "pip install requests==2.31.0"),
        ("try git checkout -b fix/retry first", "git checkout -b fix/retry first"),
        ("$ docker compose up -d billing\n", "docker compose up -d billing"),
    ],
)
def test_extracts_every_kind_the_issue_names(text: str, fact: str) -> None:
    assert fact in extract_key_facts(text), extract_key_facts(text)


@pytest.mark.parametrize(
    ("text", "noise"),
    [
        ("tests/test_api.py ........                [ 45%]", "45%"),
        ("100%|##########| 20/20 [00:03<00:00]", "100%"),
        ("Downloading model: 35% done", "35%"),
        ("TOOL RESULT (call_Xa81bQ92LmZ): ok", "call_Xa81bQ92LmZ"),
        (
            "called tool read_file({}) [id toolu_01D7FLrfh4GYYTEvPzn2CzN1]",
            "toolu_01D7FLrfh4GYYTEvPzn2CzN1",
        ),
        (
            "ASSISTANT: [reasoning] "
            '{"type": "reasoning", "encrypted_content": "gAAAAABnX9f8_Secret-Fact-OPS-9999"}',
            "OPS-9999",
        ),
        (
            "sha 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 thought",
            "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        ),
        (
            "sig Eo8DCkYIBRgCKkBvZ3JhbmdlQ2F0MjAyNFRoaW5raW5nU2lnbmF0dXJlMTIz here",
            "Eo8DCkYIBRgCKkBvZ3JhbmdlQ2F0MjAyNFRoaW5raW5nU2lnbmF0dXJlMTIz",
        ),
        ("2024-03-15 10:22:01,123 INFO worker started", "2024-03-15 10:22:01,123"),
        ("[2024-03-15T10:22:01Z] GET /healthz 200", "2024-03-15T10:22:01Z"),
        ("12:04:55 DEBUG cache warm", "12:04:55"),
    ],
)
def test_noise_is_not_a_fact(text: str, noise: str) -> None:
    facts = extract_key_facts(text)
    assert not any(noise in f for f in facts), facts


def test_log_lines_still_yield_their_real_facts() -> None:
    facts = extract_key_facts("2024-03-15 10:22:01,123 ERROR KeyError in /srv/app/main.py")
    assert "KeyError" in facts and "/srv/app/main.py" in facts
    assert not any(f.startswith("2024") for f in facts)


def test_a_percentage_in_prose_is_a_fact() -> None:
    assert "99.9%" in extract_key_facts("uptime was 99.9% last month")


def test_ranking_puts_identifying_facts_first() -> None:
    text = (
        "read_file then retry_with_backoff, 3 files, the ticket KB-7734-BLK, "
        "refund $1,200.50, host db-eu-west-7.internal"
    )
    order = [f.text for f in ranked(facts_in(text))]
    assert order.index("KB-7734-BLK") < order.index("read_file")
    assert order.index("$1,200.50") < order.index("retry_with_backoff")
    assert order.index("db-eu-west-7.internal") < order.index("read_file")


def test_guard_ranks_before_the_budget() -> None:
    # Many low-value symbols first, the planted ticket last: the ticket still fits.
    symbols = " ".join(f"helper_{i}" for i in range(80))
    span = f"{symbols} and finally the ticket KB-7734-BLK"
    _, report = guard(span, "A summary.", max_chars=60)
    assert report.appended[0] == "KB-7734-BLK"


def test_guard_does_not_repeat_facts_still_in_the_verbatim_window() -> None:
    out, report = guard(SPAN, "A summary.", max_chars=600, elsewhere="we use port 8443 still")
    assert "port 8443" in report.elsewhere
    assert "port 8443" not in report.appended and "port 8443" not in out


def test_budget_scales_with_the_span_and_is_bounded() -> None:
    assert scaled_budget(600, 1_000) == 600
    assert scaled_budget(600, 48_000) == 1_200
    assert scaled_budget(600, 10_000_000) == 2_400
    assert scaled_budget(0, 10_000_000) == 0


def test_a_300_turn_test_log_does_not_crowd_out_planted_facts() -> None:
    noise = "\n".join(
        f"tests/test_m{i % 7}.py ....  [{i % 100:3d}%]\nTOOL RESULT (call_{i:08x}abc): ok"
        for i in range(300)
    )
    span = f"USER: the refund ticket is PAY-48213 on host db-eu-west-7.internal\n{noise}"
    _, report = guard(span, "Tests ran.", max_chars=600)
    assert "PAY-48213" in report.appended and "db-eu-west-7.internal" in report.appended


def test_a_tracking_number_is_a_fact_and_an_amount_is_not_cut_into_a_quantity() -> None:
    facts = extract_key_facts("tracking 1Z999AA10123456784, charged $1,249.90 twice")
    assert "1Z999AA10123456784" in facts and "$1,249.90" in facts
    assert not any("twice" in f for f in facts)


def test_a_log_timestamp_after_a_tool_result_label_is_noise() -> None:
    text = "TOOL RESULT (call_1): 2025-01-01 10:00:07,120 INFO run started"
    assert extract_key_facts(text) == []


def test_facts_of_one_routine_form_rank_below_one_off_facts() -> None:
    routine = " ".join(f"read src/queue_{i}.py" for i in range(12))
    order = [f.text for f in ranked(facts_in(f"{routine} and the config is /etc/billing.yaml"))]
    assert order[0] == "/etc/billing.yaml"
