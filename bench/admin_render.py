"""The dashboard overview's store work at 100 / 1,000 / 10,000 conversations (issue #14).

    python -m bench.admin_render [--sizes 100,1000,10000] [--renders 7] [--out FILE]

For each size, fills a fresh DiskStore (a temporary folder) through the real write path: the
``BatchWriter`` flushing ``ledger.record_batch`` (3 requests per conversation with their
histories, 10 tenants, 3 models), and for every 4th conversation a compaction charged by
``ledger.record_compaction`` with its event stored by ``ledger.record_events``. Then it
renders the overview as ``/dashboard`` does (``reindex.ensure``, ``queries.stats`` for 24
hours, ``queries.list_conversations`` page 1 of 25, the HTML) through ``CountingStore``,
which counts every store call and the JSON bytes of what each returned.

For comparison, ``reindex.rebuild`` is one pass of the scan every render used to make twice
(every key listed, every conversation row and event list read). Prints a Markdown table;
figures only, nothing is asserted (tests/test_operators_reads.py checks that the count of
store operations stays flat).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from proxy.adapters.store import DiskStore, Store
from proxy.adapters.writer import BatchWriter
from proxy.core.types import Case
from proxy.operators import ledger, queries, reindex
from proxy.operators.overview_page import CHART_HOURS, PER_PAGE, overview_body

TENANTS = [f"{i:032x}" for i in range(1, 11)]
MODELS = ["gpt-4o-mini", "gpt-4o", "claude-sonnet-4-5"]
RETENTION_S = 30 * 86400.0


class CountingStore:
    """A store that counts its calls (by method) and the JSON bytes of what they return."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.calls: Counter[str] = Counter()
        self.bytes_read = 0

    def __getattr__(self, name: str) -> Any:
        inner = getattr(self._store, name)
        if not callable(inner):
            return inner

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            result = inner(*args, **kwargs)
            if name == "keys":
                result = list(result)
            if result is not None:
                self.bytes_read += len(orjson.dumps(result, default=str))
            return iter(result) if name == "keys" else result

        return counted

    @property
    def operations(self) -> int:
        return sum(self.calls.values())


def _entry(i: int, turn: int, now: float) -> ledger.RequestEntry:
    tokens = 2000 + 900 * turn
    return ledger.RequestEntry(
        ts=now - 3600 * 20 + i + turn, tenant=TENANTS[i % len(TENANTS)],
        conversation=f"conv-{i:06d}", model=MODELS[i % len(MODELS)], route="chat.completions",
        case=Case.NONE, status=200, original_messages=4 + 2 * turn,
        forwarded_messages=4 + 2 * turn, original_tokens=tokens,
        forwarded_tokens=tokens - 300 * turn, prompt_tokens=tokens, cached_tokens=tokens // 2,
        cache_write_tokens=0, completion_tokens=40, latency_s=0.8, overhead_s=0.0004,
    )  # fmt: skip


def _history(i: int, turn: int) -> list[dict[str, Any]]:
    text = f"Conversation {i}: please look at ticket OPS-{i} and the billing logs. " * 6
    return [{"role": "user" if k % 2 == 0 else "assistant", "content": text} for k in range(turn)]


def _compaction(store: Store, i: int, now: float) -> None:
    tenant, conv = TENANTS[i % len(TENANTS)], f"conv-{i:06d}"
    prefix_hash = f"{i:064x}"
    ledger.record_compaction(
        store, tenant, conv, record=prefix_hash, case=Case.SUMMARIZE, llm_tokens=900,
        llm_usd=0.0004, retention_s=RETENTION_S,
    )  # fmt: skip
    event = {
        "case": Case.SUMMARIZE, "ts": now - 3600, "model": MODELS[i % len(MODELS)], "k": 6,
        "covered": 5, "tokens_before": 3800, "tokens_after": 1400, "reason": "topic shift",
        "confidence": 0.8, "duration_s": 2.1, "llm_tokens": 900, "prefix_hash": prefix_hash,
        "facts_kept": 5, "facts_dropped": 1,
    }  # fmt: skip
    ledger.record_events(store, tenant, conv, [event], RETENTION_S)


async def fill(store: Store, n: int) -> None:
    """``n`` conversations through the BatchWriter, flushed every 600 requests."""
    writer = BatchWriter(
        store, RETENTION_S, ledger.record_batch, interval_s=3600
    )  # flushed here, not on a timer
    now = time.time()
    for i in range(n):
        for turn in range(1, 4):
            writer.record(_entry(i, turn, now), _history(i, turn))
        if i % 200 == 199:
            await writer.flush()
    await writer.flush()
    await writer.close()
    for i in range(0, n, 4):
        await asyncio.to_thread(_compaction, store, i, now)


def render(store: Store) -> str:
    """What ``/dashboard`` reads and renders (auth and the HTTP response aside)."""
    reindex.ensure(store, RETENTION_S)
    data = queries.stats(store, hours=CHART_HOURS)
    listing = queries.list_conversations(store, per_page=PER_PAGE)
    params = {"tenant": "", "model": "", "sort": "last_seen", "order": "desc"}
    return overview_body(data, listing, params)


def measure(fn: Callable[[Store], Any], store: Store, runs: int) -> tuple[int, int, float]:
    """(store operations, bytes read, median seconds) of ``fn``; counts from the last run."""
    times = []
    counting = CountingStore(store)
    for _ in range(runs):
        counting = CountingStore(store)
        started = time.perf_counter()
        fn(counting)  # type: ignore[arg-type]
        times.append(time.perf_counter() - started)
    return counting.operations, counting.bytes_read, statistics.median(times)


def run_size(n: int, renders: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="admin-render-") as tmp:
        store = DiskStore(Path(tmp) / "store")
        started = time.perf_counter()
        asyncio.run(fill(store, n))
        fill_s = time.perf_counter() - started
        render(store)  # the index marker is set once; not part of a render's cost
        ops, read, seconds = measure(render, store, renders)
        scan_ops, scan_read, scan_s = measure(lambda s: reindex.rebuild(s, RETENTION_S), store, 1)
        keys = sum(1 for _ in store.keys(""))
        store.close()
    return {
        "n": n, "keys": keys, "fill_s": fill_s, "ops": ops, "bytes": read, "s": seconds,
        "scan_ops": scan_ops, "scan_bytes": scan_read, "scan_s": scan_s,
    }  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]["s"]
    lines = [
        "| conversations | store keys | render: store ops | render: bytes read | "
        "render: median ms | × the first size | old scan (×2 per render): ops | bytes | ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['n']:,} | {r['keys']:,} | {r['ops']:,} | {r['bytes']:,} | "
            f"{1000 * r['s']:.1f} | {r['s'] / base:.2f} | {r['scan_ops']:,} | "
            f"{r['scan_bytes']:,} | {1000 * r['scan_s']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--renders", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        row = run_size(n, args.renders)
        print(f"{n:,} conversations: filled in {row['fill_s']:.1f} s", file=sys.stderr)
        rows.append(row)
    out = table(rows)
    print(out)
    if args.out is not None:
        args.out.write_text(out + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
