"""Benchmark of the per-request core: fingerprint + prefix chain + record lookup + token count.

    python -m bench.core [--smoke] [--json PATH] [--sizes 10,100,1000,5000] [--reps N]

For each history size it builds a deterministic conversation (~200 tokens a message, a tool
round every third turn), a DiskStore in a temporary folder holding one compaction record for
that conversation (as the engine's ``Persist`` command writes it), and times what every request pays
before any decision:

- ``fingerprints``: ``proxy.fingerprint.fingerprints`` over all messages;
- ``chain``: ``chain_of`` over those fingerprints, plus the conversation id;
- ``lookup``: the core's lookup flow (``proxy.core.lookup``: checkpoints, record) read from
  the store by ``run_reads``;
- ``count``: ``TokenCounter.count_messages`` with the fingerprints, cold (a fresh counter,
  empty memo) and warm (the memo already holds every message).

Each figure is the median of ``--reps`` repetitions (time.perf_counter); ``total`` is the
median of the per-repetition sums. Informational aims for 1,000 messages: warm < 2 ms,
cold < 50 ms. Nothing here is asserted; this is not a test.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from proxy.adapters.store import DiskStore
from proxy.core.fingerprint import chain_of, conversation_id, fingerprints, tenant_id
from proxy.core.lookup import lookup
from proxy.core.records import MAX_CHECKPOINTS, CompactionRecord, conv_key
from proxy.core.tokens import TokenCounter
from proxy.engine.reads import run_reads

MODEL = "gpt-4o"
SIZES = (10, 100, 1000, 5000)
WORDS = (
    "the invoice parser still drops the last line item when a refund arrives before the "
    "original charge so we should add a regression test and keep the diff small because "
    "reviewers prefer focused commits retry_with_backoff() src/billing/invoice.py KeyError "
    "OPS-4821 port 8443 pg-billing-02 settings loader ledger sync job metrics exporter"
).split()

Message = dict[str, Any]


def conversation(n_messages: int, seed: int = 0, words: int = 150) -> list[Message]:
    """``n_messages`` messages of ~200 tokens each (system first, tool rounds every 3rd turn)."""
    rng = random.Random(seed)

    def prose(label: str) -> str:
        return f"{label} " + " ".join(rng.choice(WORDS) for _ in range(words))

    msgs: list[Message] = [{"role": "system", "content": prose("You are a coding assistant.")}]
    turn = 0
    while len(msgs) < n_messages:
        msgs.append({"role": "user", "content": prose(f"Turn {turn}.")})
        if turn % 3 == 2:
            call_id = f"call_{turn}"
            msgs.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {
                                "name": "read_file",
                                "arguments": json.dumps({"path": f"src/mod{turn}.py"}),
                            },
                        }
                    ],
                }
            )
            msgs.append({"role": "tool", "tool_call_id": call_id, "content": prose("result")})
        msgs.append({"role": "assistant", "content": prose(f"Answer {turn}.")})
        turn += 1
    msgs = msgs[:n_messages]
    # Never end inside a tool round: drop a trailing call without its result.
    while msgs[-1].get("tool_calls"):
        msgs.pop()
    return msgs


def _store_record(store: DiskStore, tenant: str, messages: list[Message]) -> str:
    """Write one compaction record for the first half of ``messages``; return the conv id."""
    chain = chain_of(tenant, messages)
    conversation = conversation_id(chain, messages)
    k = next(
        (i for i in range(len(messages) // 2, len(messages)) if messages[i]["role"] == "user"),
        len(messages) - 1,
    )
    record = CompactionRecord(
        k=k,
        prefix_hash=chain[k].hex(),
        head_len=1,
        summary={"role": "system", "content": "[History Summary - x earlier messages]\n\nS."},
        case="summarize",
        covered=k - 1,
        created_at=time.time(),
    )
    store.set(conv_key("rec", tenant, conversation) + ":" + record.prefix_hash, record.to_json())
    # A realistic checkpoint list: earlier compactions of the same conversation first.
    for j in range(1, min(k, 8)):
        store.append(
            conv_key("ck", tenant, conversation),
            {"k": j, "h": chain[j].hex()},
            None,
            MAX_CHECKPOINTS,
        )
    store.append(
        conv_key("ck", tenant, conversation),
        {"k": record.k, "h": record.prefix_hash},
        None,
        MAX_CHECKPOINTS,
    )
    return conversation


def measure(n_messages: int, reps: int, store_dir: Path) -> dict[str, Any]:
    messages = conversation(n_messages)
    tenant = tenant_id("sk-bench")
    store = DiskStore(store_dir / f"store-{n_messages}")
    try:
        conversation_key = _store_record(store, tenant, messages)
        # Sanity: the lookup really finds the record (otherwise the figure is meaningless).
        chain = chain_of(tenant, messages)
        found = run_reads(lookup(tenant, conversation_key, None, chain), store)
        if found is None:
            raise RuntimeError("benchmark setup error: the stored record is not found")
        warm_counter = TokenCounter()
        tokens = sum(warm_counter.count_messages(messages, MODEL, fingerprints(messages))) + 3

        stages: dict[str, list[float]] = {
            "fingerprints": [],
            "chain": [],
            "lookup": [],
            "count_cold": [],
            "count_warm": [],
            "total_cold": [],
            "total_warm": [],
        }
        clock = time.perf_counter
        for _ in range(reps):
            gc.collect()
            t0 = clock()
            fps = fingerprints(messages)
            t1 = clock()
            chain = chain_of(tenant, messages, fps)
            conv = conversation_id(chain, messages)
            t3 = clock()
            run_reads(lookup(tenant, conv, None, chain), store)
            t4 = clock()
            cold_counter = TokenCounter()
            t5 = clock()
            cold_counter.count_messages(messages, MODEL, fps)
            t6 = clock()
            warm_counter.count_messages(messages, MODEL, fps)
            t7 = clock()
            t_fp, t_chain, t_lookup = t1 - t0, t3 - t1, t4 - t3
            t_cold, t_warm = t6 - t5, t7 - t6
            common = t_fp + t_chain + t_lookup
            for name, value in (
                ("fingerprints", t_fp),
                ("chain", t_chain),
                ("lookup", t_lookup),
                ("count_cold", t_cold),
                ("count_warm", t_warm),
                ("total_cold", common + t_cold),
                ("total_warm", common + t_warm),
            ):
                stages[name].append(value * 1000.0)
        medians = {name: statistics.median(values) for name, values in stages.items()}
        return {"messages": len(messages), "tokens": tokens, "reps": reps, "median_ms": medians}
    finally:
        store.close()


def markdown(results: list[dict[str, Any]]) -> str:
    header = (
        "| messages | tokens | fingerprints | chain | lookup | count cold | count warm "
        "| **total cold** | **total warm** |"
    )
    lines = [header, "|" + "---:|" * 9]
    for r in results:
        m = r["median_ms"]
        lines.append(
            f"| {r['messages']:,} | {r['tokens']:,} | {m['fingerprints']:.3f} | "
            f"{m['chain']:.3f} | {m['lookup']:.3f} | {m['count_cold']:.2f} | "
            f"{m['count_warm']:.3f} | **{m['total_cold']:.2f}** | **{m['total_warm']:.3f}** |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.core",
        description="Per-request core cost: fingerprints, chain, record lookup, token count.",
    )
    parser.add_argument("--smoke", action="store_true", help="5 repetitions instead of 20")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 20)")
    parser.add_argument(
        "--sizes",
        default=",".join(str(s) for s in SIZES),
        help="comma-separated history sizes in messages",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    reps = args.reps or (5 if args.smoke else 20)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]

    # Build the tokenizer once (a one-off per process, not per request).
    TokenCounter().count_text("warm up", MODEL)

    results = []
    with tempfile.TemporaryDirectory(prefix="bench-core-") as tmp:
        for n in sizes:
            results.append(measure(n, reps, Path(tmp)))
            print(f"measured {n} messages", file=sys.stderr)

    print(f"Per-request core cost, median of {reps} runs, milliseconds (model {MODEL}).\n")
    print(markdown(results))
    print(
        "\n`total` = fingerprints + chain + lookup + count. Cold: empty token-count memo; "
        "warm: every message already counted.\nAims (not asserted) for 1,000 messages: "
        "warm < 2 ms, cold < 50 ms."
    )
    if args.json:
        payload = {
            "model": MODEL,
            "repetitions": reps,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "results": results,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
