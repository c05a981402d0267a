"""The benchmark harness keeps working: ``python -m bench.run --smoke`` end to end.

Only the shape of the report is checked (sections, tables, numbers in them, the chart, the
substitution really happening). No timing is asserted: figures belong in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS_REPORT = ROOT / "docs" / "benchmarks.md"
NUMBER = re.compile(r"\d")

pytestmark = pytest.mark.slow


def _stamp(path: Path) -> tuple[int, int] | None:
    return (path.stat().st_mtime_ns, path.stat().st_size) if path.exists() else None


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("bench-smoke")
    before = _stamp(DOCS_REPORT)
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-6000:]}"
    assert _stamp(DOCS_REPORT) == before, "smoke mode must never touch docs/benchmarks.md"
    return out, (out / "benchmarks.md").read_text()


def section(report: str, heading: str) -> str:
    """The text under ``## heading`` up to the next ``## ``."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", report, re.M | re.S)
    assert match, f"no section {heading!r} in the report"
    return match.group(1)


def table_rows(text: str) -> list[list[str]]:
    """Data rows of every markdown table in ``text`` (header and separator lines dropped)."""
    rows: list[list[str]] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        if i + 1 < len(lines) and set(lines[i + 1]) <= set("|-: ") and "-" in lines[i + 1]:
            continue  # a header line
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def is_figure(cell: str) -> bool:
    if cell == "—":
        return True
    try:
        float(cell.replace(",", ""))
    except ValueError:
        return False
    return True


def test_report_has_every_section_with_numbers(smoke: tuple[Path, str]) -> None:
    _, report = smoke
    assert "python -m bench.run --smoke" in report
    machine = section(report, "Machine and command")
    assert "CPUs" in machine and "Python 3." in machine
    headings = ("Aims", "1. Overhead", "2. Core cost", "3. Savings", "4. Compaction policies")
    more = ("5. Where the added time goes", "6. Servers and forwarders side by side")
    last = ("7. Agent session", "8. Memory of one worker", "9. Net billed dollars")
    for heading in (*headings, *more, *last):
        text = section(report, heading)
        assert "This section failed" not in text, text[-3000:]
        rows = table_rows(text)
        assert rows, f"no table rows under {heading!r}"
        assert all(any(NUMBER.search(cell) for cell in row) for row in rows), heading


def test_overhead_table_has_every_path_streaming_and_not(smoke: tuple[Path, str]) -> None:
    _, report = smoke
    text = section(report, "1. Overhead")
    assert "**Non-streaming**" in text and "**Streaming**" in text
    labels = {row[0] for row in table_rows(text)}
    for label in ("direct to upstream", "proxy, below trigger", "proxy, substitution",
                  "litellm (no callbacks)"):  # fmt: skip
        assert label in labels, f"no {label!r} row"
    assert "litellm + our hook" in labels or "Row left out: litellm + our hook" in text
    latency_rows = [row for row in table_rows(text) if len(row) == 9]
    assert latency_rows
    for row in latency_rows:
        # Shape, never timing: a figure is a number or the report's "—" for none, so a
        # busy machine that measured little still gives a well-formed report.
        for cell in (row[3], row[4], row[6]):  # p50 ms, p99 ms, req/s
            assert is_figure(cell), row


def test_substitution_rows_forwarded_a_stored_compaction(smoke: tuple[Path, str]) -> None:
    _, report = smoke
    rows = [row for row in table_rows(section(report, "1. Overhead")) if len(row) == 5]
    substituted = [row for row in rows if row[0] == "proxy, substitution"]
    assert substituted
    for _, _, case, sent, forwarded in substituted:
        assert case == "`summarize`"
        assert int(forwarded.replace(",", "")) < int(sent.replace(",", ""))


def test_savings_chart_is_written(smoke: tuple[Path, str]) -> None:
    out, report = smoke
    assert "](savings.png)" in section(report, "3. Savings")
    assert (out / "savings.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_agent_session_reports_forwarded_cacheable_and_cost(smoke: tuple[Path, str]) -> None:
    _, report = smoke
    labels = {row[0]: row[1:] for row in table_rows(section(report, "7. Agent session"))}
    for label in ("tokens forwarded upstream", "cacheable share of forwarded tokens",
                  "$ with compaction (incl. those calls)", "$ forwarding unchanged",
                  "prunings / compactions / failures"):  # fmt: skip
        assert label in labels, f"no {label!r} row"
    aims = {row[0] for row in table_rows(section(report, "Aims"))}
    assert any(a.startswith("$ ≤ 0.35× forwarding unchanged (agent session") for a in aims)


def test_net_billed_dollars_priced_with_both_providers_rules(smoke: tuple[Path, str]) -> None:
    _, report = smoke
    rows = table_rows(section(report, "9. Net billed dollars"))
    assert {row[2] for row in rows} == {"anthropic", "openai"}
    assert {row[3] for row in rows} == {"cost", "tokens"}
    # The floor (a free compaction to the target on every request past the trigger) never
    # bills more than the requests as sent.
    assert all(0 < float(row[9].rstrip("×")) <= 1.0 for row in rows), [r[9] for r in rows]
    # The bound (no input at all past the trigger) never bills more than the floor.
    assert all(0 < float(row[10].rstrip("×")) <= float(row[9].rstrip("×")) for row in rows)
    aims = {row[0] for row in table_rows(section(report, "Aims"))}
    assert any(a.startswith("net $ ≤ 1.0× unchanged, every session (trigger") for a in aims)


def test_smoke_refuses_to_write_into_docs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--smoke", "--out", str(ROOT / "docs")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "never writes into docs" in done.stderr


def test_rss_harness_reads_the_workers_memory(tmp_path: Path) -> None:
    out = tmp_path / "rss.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.rss", "--requests", "20", "--distinct", "2"]
        + ["--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    stages = json.loads(out.read_text())["stages"]
    assert len(stages) == 3
    assert "(0 errors)" in stages[1]["after"] and "(0 errors)" in stages[2]["after"]
    for stage in stages:
        assert 0 < stage["anonymous"] <= stage["rss"] <= stage["peak"]
    assert "| start-up (/healthz answered) |" in done.stdout


def test_the_fast_upstream_answers_every_summarizer_step_with_an_accepted_summary() -> None:
    """Seeding the substitution rows compacts histories long enough for the summarizer's
    map-reduce: the reduce step must get a summary the checks accept too, or the seeding
    ends in an emergency cut (the full run once failed so)."""
    import orjson

    from bench import overhead, upstream_fast
    from proxy.core.summarizer import summarize
    from proxy.core.summarycheck import SummaryRejected

    span = orjson.loads(overhead.request_body(500, stream=False))["messages"][1:-4]
    steps = summarize("Summarize in {budget} tokens.", span, None, 500, 60_000)
    ask, asked = next(steps), 0
    while True:
        # What the fast upstream answers this request, as the proxy would receive it.
        raw = upstream_fast.response_for(
            b"POST", b"/v1/chat/completions", orjson.dumps({"messages": ask}), True
        )
        answer = orjson.loads(raw.split(b"\r\n\r\n", 1)[1])
        asked += 1
        try:
            ask = steps.send((answer["choices"][0]["message"]["content"], "stop"))
        except StopIteration as done:
            summary = done.value
            break
        except SummaryRejected as exc:  # pragma: no cover - the failure this test is for
            raise AssertionError(f"step {asked} refused: {exc}") from exc
    assert asked > 2 and summary.startswith("The conversation so far covered")


def test_servers_table_gives_each_process_cpu(smoke: tuple[Path, str]) -> None:
    """Section 6 says which process was the limit of each row: the proxy's own CPU (its
    workers included) and the upstream's, beside the load generator's."""
    _, report = smoke
    rows = [row for row in table_rows(section(report, "6. Servers and forwarders side by side"))]
    proxy = [row for row in rows if row[0] == "uvicorn + h1" and len(row) == 13]
    direct = [row for row in rows if row[0] == "direct" and len(row) == 13]
    assert proxy and direct
    for row in proxy:
        assert all(cell.endswith("%") for cell in row[10:13]), row
        assert int(row[11].rstrip("%")) > 0, row  # it served requests: it used CPU
    for row in direct:
        assert row[11] == "—" and row[12].endswith("%"), row


def test_the_load_generator_reports_watched_processes_cpu_over_its_window(
    tmp_path: Path,
) -> None:
    """``--watch-pid``: a process spinning meanwhile used CPU, one asleep used none."""
    from bench.overhead import FastUpstream, Profile, load, request_body

    body = tmp_path / "body.json"
    body.write_bytes(request_body(2, stream=False))
    upstream = FastUpstream(tmp_path / "upstream.log").start()
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    # Asleep before the load starts: its own start-up CPU must fall outside the window.
    asleep = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
    )
    try:
        assert asleep.stdout is not None and asleep.stdout.readline() == b"ready\n"
        assert upstream.proc is not None
        pids = (spin.pid, asleep.pid, upstream.proc.pid)
        result = load(upstream.port, body, "k", 1, Profile("t", 2, (), (1,), 0.3, 0.5, 10**6), pids)
    finally:
        for proc in (spin, asleep):
            proc.kill()
            proc.wait()
        upstream.stop()
    used = result["watched_cpu_s"]
    assert result["requests"] > 0 and result["cpu_window_s"] > 0
    assert used[str(spin.pid)] > 0
    assert used[str(asleep.pid)] == 0
    assert used[str(upstream.proc.pid)] > 0  # it answered every request of the window
    assert result["client_cpu_s"] > 0


def test_economics_prices_the_calls_at_the_llm_model_given() -> None:
    """``--llm-model``: the detector and summarizer priced at that model's prices, and
    nothing else moved (the tokens policy does not look at prices). Both with the standalone
    calls (another model cannot read the conversation's cache: the next test)."""
    import asyncio

    from bench import agent_session, economics
    from proxy.core.tokens import TokenCounter

    session = economics.synthetic(agent_session.SMOKE_REQUESTS)
    runs = {}
    for model in (None, "claude-haiku-4-5"):
        settings = economics.settings_for(8_000, "tokens", "anthropic", model, "off")
        assert settings.summary_model == settings.detection_model == model
        runs[model] = asyncio.run(economics.replay(session, "anthropic", settings, TokenCounter()))
    own, small = runs[None], runs["claude-haiku-4-5"]
    assert own.proxy.calls == small.proxy.calls > 0
    assert own.proxy.usd == small.proxy.usd and own.floor_usd == small.floor_usd
    # Claude Haiku 4.5 costs a third of Sonnet 4.5, input and output alike.
    assert small.proxy.calls_usd == pytest.approx(own.proxy.calls_usd / 3)
    assert 0 < small.floor_usd < own.unchanged.usd


def test_economics_prices_the_summary_that_reads_the_cache() -> None:
    """``--summary-reads-cache``: with ``auto`` (the default) on Claude's prices the summary
    is asked in the client's shape and priced with its cache reads: the calls cost less than
    the standalone ones, as many of them are made, and they are billed."""
    import asyncio

    from bench import agent_session, economics
    from proxy.core.tokens import TokenCounter

    session = economics.synthetic(agent_session.SMOKE_REQUESTS)
    runs = {}
    for reads in ("auto", "off"):
        settings = economics.settings_for(8_000, "tokens", "anthropic", None, reads)
        runs[reads] = asyncio.run(economics.replay(session, "anthropic", settings, TokenCounter()))
    shared, alone = runs["auto"], runs["off"]
    assert shared.proxy.calls == alone.proxy.calls > 0
    assert 0 < shared.proxy.calls_usd < alone.proxy.calls_usd


def test_economics_compares_write_read_over_the_same_requests() -> None:
    """The proxy's cache-write ÷ read beside unchanged's is over the requests unchanged has
    (those that fit the window), not the proxy's whole session; the whole session's is
    reported apart."""
    from bench import economics

    result = economics.Result("s", "anthropic", "cost", 24_000, 3, 0, 1)
    result.unchanged = economics.Side(usd=1.0, read=100, written=10, requests=1)
    result.proxy_fit = economics.Side(usd=0.5, read=50, written=10, requests=1)
    result.proxy = economics.Side(usd=2.0, read=60, written=300, requests=3)
    s = economics.summary(result)
    assert s["write_read_proxy"] == pytest.approx(0.2)
    assert s["write_read_unchanged"] == pytest.approx(0.1)
    assert s["write_read_proxy_session"] == pytest.approx(5.0)
    assert s["vs_unchanged"] == pytest.approx(0.5)
    assert "0.200 / 0.100 (5.000)" in economics.markdown([s])


def test_economics_bound_holds_a_session_that_ends_just_past_the_trigger() -> None:
    """The bound: a session whose history passes the trigger only at its end bills about
    what it bills unchanged whatever a compaction does (its requests under the trigger go
    as sent), and neither the proxy nor the floor goes below it; a trigger the session
    passes early leaves far more to save."""
    import asyncio

    from bench import agent_session, economics
    from proxy.core.tokens import TokenCounter

    session = economics.synthetic(agent_session.SMOKE_REQUESTS)
    counter = TokenCounter()
    sizes = [counter.count_total(r, economics.PROVIDERS["openai"]) for r in session.requests]
    late = sizes[-3]  # only the last two requests are past it
    early = sizes[len(sizes) // 4]
    found = {}
    for trigger in (late, early):
        settings = economics.settings_for(trigger, "tokens", "openai")
        s = economics.summary(asyncio.run(economics.replay(session, "openai", settings, counter)))
        assert s["passes_trigger"]
        assert 0 < s["bound_vs_unchanged"] <= s["floor_vs_unchanged"] <= 1.0
        assert s["bound_vs_unchanged"] <= s["vs_unchanged"]
        found[trigger] = s
    assert found[late]["bound_vs_unchanged"] > 0.6 > found[early]["bound_vs_unchanged"]
    for trigger, beyond in ((late, 1), (early, 0)):
        aims = economics.aims([{**found[trigger], "policy": "cost"}])
        row = next(m for a, m, _ in aims if a.startswith("net $ ≤ 0.6×"))
        assert f"highest bound {found[trigger]['bound_vs_unchanged']:.3f}×" in row, row
        assert f"{beyond} of 1 above 0.6×" in row, row


def test_economics_joint_bound_of_the_write_read_and_dollar_aims() -> None:
    """The least a traffic within 1.5x of unchanged's cache write ÷ read can bill: it writes
    at least what each request adds, so it reads at least two thirds of what unchanged reads.
    Unchanged itself is that least traffic at 1.0x."""
    from bench import economics
    from proxy.core import billing, costs

    model = economics.PROVIDERS["anthropic"]
    prices, rules = costs.prices_for(model), billing.rules_for(model)
    as_sent = billing.bill(prices, rules, 105_000, 100_000)  # 100,000 read, 5,000 written
    result = economics.Result("s", "anthropic", "cost", 24_000, 1, 0, 1)
    result.unchanged.add(as_sent)
    result.fresh = 5_000
    assert economics.joint_bound(result, within=1.0) == pytest.approx(1.0, rel=1e-4)
    reads_usd = billing.bill(prices, rules, 100_000, 100_000).usd
    joint = economics.joint_bound(result)
    assert joint == pytest.approx(1 - reads_usd / 3 / as_sent.usd, rel=1e-4)
    assert joint > 0.6


def test_economics_replays_a_client_that_clears_its_own_old_results() -> None:
    """``--client-clears N``: every request keeps its last N tool results and has the older
    ones replaced in place, so a request changes messages the previous one sent."""
    from bench import agent_session, economics

    session = economics.synthetic(agent_session.SMOKE_REQUESTS)
    cleared = economics.clearing(session, 2)
    assert "all but its last 2 results cleared" in cleared.name
    assert cleared.replies == session.replies and len(cleared.requests) == len(session.requests)
    edited = 0
    for before, after in zip(session.requests, cleared.requests, strict=True):
        assert len(before) == len(after)
        results = [i for i, m in enumerate(before) if m["role"] == "tool"]
        for i, (m, n) in enumerate(zip(before, after, strict=True)):
            if i in results[:-2]:
                assert n == {**m, "content": economics.CLEARED}
            else:
                assert n == m
        edited += len(results) > 2
    assert edited > 0
    with pytest.raises(SystemExit) as refused:
        economics.main(["--smoke", "--client-clears", "-1"])
    assert refused.value.code == 2


def test_economics_replays_a_client_with_a_clock_in_its_system_prompt() -> None:
    """``--client-clock``: every request's system prompt says the time, the rest is the
    session's; replayed, it is compacted as the session is (before the chain took the head
    by role alone, each request was a new conversation: 5 LLM compactions here, not 1)."""
    import asyncio

    from bench import economics
    from proxy.core.tokens import TokenCounter

    session = next(
        s for s, _ in economics.sessions(True, economics.FOLDERS) if "openhands" in s.name
    )
    clocked = economics.clocked(session)
    assert "a clock in its system prompt" in clocked.name and clocked.replies == session.replies
    heads = [r[0]["content"] for r in clocked.requests]
    assert len(set(heads)) == len(heads)  # a new time on every request
    for before, after in zip(session.requests, clocked.requests, strict=True):
        assert after[0]["content"].startswith(before[0]["content"]) and after[1:] == before[1:]
    settings = economics.settings_for(8000, "tokens", "anthropic")
    made = [
        economics.summary(asyncio.run(economics.replay(s, "anthropic", settings, TokenCounter())))
        for s in (session, clocked)
    ]
    assert made[0]["llm_compactions"] == made[1]["llm_compactions"] == 1
    assert made[1]["prefix_breaks"] >= len(clocked.requests) - 1  # (the client's own)


def test_economics_refuses_an_unknown_llm_model() -> None:
    from bench import economics

    for pair in ("nobody=gpt-4o-mini", "openai=no-such-model", "gpt-4o-mini"):
        with pytest.raises(SystemExit) as refused:
            economics.main(["--smoke", "--llm-model", pair])
        assert refused.value.code == 2


def test_ledger_flush_times_the_writers_parts() -> None:
    """``bench.ledger_flush --parts``: each part is timed where the ledger calls it."""
    from bench import ledger_flush

    got = ledger_flush._child(20, True, 2, parts=True)
    assert set(got) == {"total", *ledger_flush.PARTS}
    assert all(got[part] > 0 for part in ledger_flush.PARTS), got
    assert sum(got[part] for part in ledger_flush.PARTS) < got["total"]
    from proxy.adapters.store import DiskStore
    from proxy.operators import ledger

    assert DiskStore.update.__qualname__ == "DiskStore.update"  # put back as it was
    assert ledger.adopt.__module__ == "proxy.operators.adopt"


def test_pyupstream_budget_is_what_the_machine_leaves_a_forwarder() -> None:
    """``bench.pyupstream.cpu_budget``: at 0.9x of direct's req/s, the CPUs less what the
    upstream and the load generator spend, over that rate; none left once they fill them."""
    from bench.pyupstream import cpu_budget

    # Direct: 10,000 req/s, the upstream 80 us and the client 20 us a request, 2 CPUs. At
    # 9,000 req/s they use 0.9 s of CPU a second; 1.1 s is left for 9,000 requests.
    assert cpu_budget(10_000, 80, 20, 2) == pytest.approx(1.1e6 / 9_000)
    assert cpu_budget(10_000, 80, 20, 2, ratio=1.0) == pytest.approx(100)
    assert cpu_budget(25_000, 80, 20, 2) < 0  # upstream and client alone need 2.25 CPUs


def test_pyupstream_summary_gives_each_forwarder_its_ratio_and_direct_the_budget() -> None:
    from bench import pyupstream

    def cell(rps: float, upstream: float = 70.0) -> dict[str, float]:
        return {"p50_ms": 1.0, "rps": rps, "errors": 0, "upstream_cpu_us": upstream,
                "proxy_cpu_us": 0.0, "client_cpu_us": 30.0}  # fmt: skip

    name = "python (Starlette + uvicorn)"
    cells = {
        (name, "direct", 2, 32): [cell(10_000), cell(12_000)],
        (name, "proxy", 2, 32): [cell(2_000), cell(3_000)],
        (name, "floor", 2, 32): [cell(10_000), cell(12_000)],
        (name, "direct", 2, 1): [cell(5_000)],
    }
    rows = {(r["via"], r["concurrency"]): r for r in pyupstream._summary(cells)["rows"]}
    assert rows["proxy", 32]["rps_ratio"] == pytest.approx(0.225)  # per round, then median
    assert rows["floor", 32]["rps_ratio"] == pytest.approx(1.0)
    assert "budget_us" in rows["direct", 32] and "budget_us" not in rows["direct", 1]
    assert "budget_us" not in rows["proxy", 32]
    table = pyupstream.markdown({"rows": list(rows.values())})
    assert "| floor |" in table and "budget for 0.9×" in table


def test_layers_variants_go_without_what_they_name(tmp_path: Path) -> None:
    """``bench.layers``: each variant is the tree with its layers really gone (no ledger entry
    without the ledger, no request log line either without ``finish``, no conversation
    identified without the engine), and every one still answers the client as the upstream
    did."""
    import openai
    import orjson

    from bench.cpu_ab import KEY, bodies_of
    from bench.layers import LAYERS, LayerTree
    from bench.overhead import FastUpstream

    upstream = FastUpstream(tmp_path / "upstream.log").start()
    body = orjson.loads(bodies_of(2, False, 1, tmp_path)[0].read_bytes())
    seen = {}
    try:
        for layer in LAYERS:
            tree = LayerTree(layer, tmp_path, upstream.base_url).start()
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{tree.port}/v1", api_key=KEY, timeout=60, max_retries=0
            )
            try:
                answer = client.chat.completions.with_raw_response.create(**body)
            finally:
                client.close()
                tree.stop()
            assert answer.status_code == 200 and answer.parse().choices, layer
            logged = '"msg":"request"' in (tree.tmp / "server.log").read_text()
            ledgered = _ledger_requests(tree.tmp / "store")
            seen[layer] = (logged, "x-compaction-conversation" in answer.headers, ledgered)
    finally:
        upstream.stop()
    assert seen == {
        "whole": (True, True, 1),
        "without the ledger": (True, True, 0),
        "without finish": (False, True, 0),
        "without the engine": (False, False, 0),
    }


def _ledger_requests(store_dir: Path) -> int:
    """How many requests the ledger of a stopped server's store counts."""
    from proxy.adapters.store import DiskStore
    from proxy.operators.queries import stats

    store = DiskStore(str(store_dir))
    try:
        return int(stats(store, 1)["totals"].get("requests", 0))
    finally:
        store.close()


def test_layers_summary_takes_each_layer_as_a_difference() -> None:
    from bench.layers import markdown, summary

    samples = {
        ("whole", 2, False): [500.0, 520.0, 480.0],
        ("without the ledger", 2, False): [440.0],
        ("without finish", 2, False): [400.0],
        ("without the engine", 2, False): [150.0],
        ("python relay (floor) + orjson", 2, False): [25.0],
    }
    (row,) = summary(samples, (0.5, 0.6, 0.7))["rows"]
    assert row["begin"] == 250.0 and row["finish"] == 100.0 and row["ledger"] == 60.0
    table = markdown(summary(samples, (0.5, 0.6, 0.7)))
    assert "| 2 | no | 500 | 440 | 400 | 150 | 250 | 100 | 60 | 25 |" in table


def test_the_fast_upstream_drips_a_stream_an_event_a_write(tmp_path: Path) -> None:
    """``bench.cpu_ab --drip-events N`` measures streams as providers send them: the fast
    upstream it starts answers a stream as N events (the usage besides, when asked), each in
    a write (HTTP chunk) of its own, the last one ``[DONE]``."""
    import httpx

    from bench.overhead import FastUpstream

    upstream = FastUpstream(tmp_path / "up.log", drip_events=7, drip_ms=0.5).start()
    try:
        for usage in (False, True):
            body = {
                "model": "gpt-4o-mini",
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
                **({"stream_options": {"include_usage": True}} if usage else {}),
            }
            url = f"{upstream.base_url}/chat/completions"
            with httpx.stream("POST", url, json=body, timeout=30) as r:
                assert r.status_code == 200
                raw = b"".join(r.iter_raw())
            events = [e for e in raw.split(b"\n\n") if e]
            assert len(events) == 7 + usage and events[-1] == b"data: [DONE]"
            assert (b'"usage"' in events[-2]) is usage
            assert all(e.startswith(b"data: ") for e in events)
    finally:
        upstream.stop()


def test_the_fast_upstream_serves_https_that_a_proxy_trusting_its_certificate_reaches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``bench.cpu_ab --tls``: the fast upstream behind TLS with ``bench.tlscert``'s
    certificate; a client that does not trust it is refused, and ``compaction-proxy serve``
    with ``SSL_CERT_FILE`` naming it forwards to it (what each tree gets)."""
    import ssl

    import httpx

    from bench import tlscert
    from bench.overhead import FastUpstream
    from tests.proxyproc import ProxyProcess

    pair = tlscert.self_signed(tmp_path)
    upstream = FastUpstream(tmp_path / "up.log", tls=pair).start()
    try:
        assert upstream.base_url.startswith("https://127.0.0.1:")
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
        url = f"{upstream.base_url}/chat/completions"
        with pytest.raises(httpx.ConnectError):
            httpx.post(url, json=body, timeout=30)  # (not trusted)
        trusted = ssl.create_default_context(cafile=str(pair[0]))
        assert httpx.post(url, json=body, timeout=30, verify=trusted).status_code == 200
        monkeypatch.setenv("SSL_CERT_FILE", str(pair[0]))  # (the proxy process inherits it)
        with ProxyProcess(tmp_path, upstream.base_url) as px:
            answer = httpx.post(f"{px.base_url}/chat/completions", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]
    finally:
        upstream.stop()
