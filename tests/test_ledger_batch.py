"""A batch of requests leaves the ledger as the same requests written one at a time (#28).

The batched writer adds each entry's counters once, into a sum per conversation and hour,
which the conversation's row, the hour's and the totals then take; before, each entry was
added to all three. Whatever the batch holds (several conversations, two hours, shadow
requests, errors, opt-outs, held compactions, over-window requests, an unpriced model), the
rows must come out as the entries recorded one by one make them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.adapters.store import DiskStore
from proxy.core.records import conv_key
from proxy.operators import ledger

GPT = "gpt-4o"
HOUR = 3600.0


def entry(n: int, **kw: Any) -> ledger.RequestEntry:
    base: dict[str, Any] = dict(
        ts=7 * HOUR + 1000.0 + n, tenant="t", conversation="a", model=GPT,
        route="chat.completions", case="compacted", status=200, original_messages=60,
        forwarded_messages=20, original_tokens=30_000 + 100 * n, forwarded_tokens=9_000,
        prompt_tokens=9_000, cached_tokens=8_192, cache_write_tokens=0, completion_tokens=40,
        latency_s=1.0, overhead_s=0.001, record="r1",
    )  # fmt: skip
    base.update(kw)
    return ledger.RequestEntry(**base)


BATCH = [
    entry(0),
    entry(1, conversation="b", model="claude-sonnet-4-5", cache_write_tokens=500),
    entry(2, shadow=True, case="shadow"),
    entry(3, status=502, case="error"),
    entry(4, case="opt-out", record=None, forwarded_tokens=30_400),
    entry(5, held="the cache is warm", record=None),
    entry(6, over_window=True, original_tokens=216_507),
    entry(7, ts=8 * HOUR + 5.0),  # the next hour
    entry(8, conversation="b", model="not-a-priced-model", status=499),
    entry(9, case="healed", cache_ttl_s=60.0),
]


def close(a: Any, b: Any) -> None:
    """Equal, floats to rounding (sums are added in another order)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (a, b)
        for key in a:
            close(a[key], b[key])
    elif isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12)
    else:
        assert a == b


def rows(store: DiskStore) -> dict[str, Any]:
    keys = [ledger.TOTALS_KEY, "hour:1970010107", "hour:1970010108"]
    keys += [conv_key("conv", "t", c) for c in ("a", "b")]
    return {key: store.get(key) for key in keys}


def test_a_batch_writes_what_its_entries_write_one_by_one(tmp_path: Path) -> None:
    batched, single = DiskStore(tmp_path / "batched"), DiskStore(tmp_path / "single")
    history = [{"role": "user", "content": "hi"}]
    nets = ledger.record_batch(batched, [(e, history) for e in BATCH], None)
    one_by_one = []
    for e in BATCH:
        one_by_one += ledger.record_batch(single, [(e, history)], None)
    got, want = rows(batched), rows(single)
    assert all(value is not None for value in got.values()), got
    close(got, want)
    close(nets, one_by_one)
    totals = got[ledger.TOTALS_KEY]
    assert totals["requests"] == len(BATCH)
    assert totals["errors"] == 1 and totals["cancelled"] == 1
    assert totals["shadow"]["requests"] == 1 and totals["held"] == {"the cache is warm": 1}
    assert totals["kept_within_window"] == 1 and totals["unpriced_requests"] == 1
    assert got["hour:1970010108"]["requests"] == 1
