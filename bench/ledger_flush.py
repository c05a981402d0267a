"""The ledger's writer CPU per request when each flush holds one request per conversation.

    python -m bench.ledger_flush --before /tmp/before [--after .] [--rounds 5] [--history N]
        [--conversations 8] [--parts] [--json PATH]

An agent sends a request every few seconds; the batched writer flushes every 0.2 s, so in
real traffic each of its flushes holds one request of each conversation, and everything the
ledger writes per conversation is paid per request. ``bench.cpu_ab`` sends one conversation
(a flush holds ~80 of its requests), so its rows do not show that. Here, in process, for each
source tree (run as a subprocess with the tree first on ``PYTHONPATH``): ``CONVERSATIONS``
agent conversations each start at ``--history`` messages (``bench.agent_body``'s messages,
repeated) and grow by a turn (an assistant message and a tool result) per flush; each flush
is ``ledger.record_batch`` of one entry per conversation into a diskcache store, in one
transaction as the writer does (each entry names the id its session had before its first
reply, as an agent's requests do; its history goes with the messages' exact digests, as the
engine hands it on, where the tree has them). The figure is the thread's CPU over
``FLUSHES`` flushes, divided by the requests they held (the first flush, which writes
everything, is left out).
``--conversations`` sets how many (the operators' sorted-set indexes grow with them).
``--parts`` adds each part's share (the writer's functions timed where the ledger calls them:
the conversation row's update, the request rows, the history, the indexes, the adopt check),
in us of CPU per request. ``shared``: each request's messages are the previous one's very
objects plus the new turn (a canonical body parsed from the previous one,
``proxy.core.reparse``); ``copied``: all parsed afresh (any other body). Rounds alternate the
trees; medians. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

CONVERSATIONS = 8
FLUSHES = 40
HISTORIES = (50, 300, 2000)


PARTS = ("conv row", "request rows", "history", "indexes", "adopt check")


@contextlib.contextmanager
def _timed(parts: dict[str, float]) -> Iterator[None]:
    """Time the ledger's parts where ``ledger`` calls them (``parts``: CPU seconds each);
    put back as they were on the way out."""
    from proxy.adapters.store import DiskStore
    from proxy.operators import ledger

    put_back: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, part: str, only: str | None = None) -> None:
        real = getattr(owner, name)
        put_back.append((owner, name, real))

        def timed(*args: Any, **kwargs: Any) -> Any:
            if only is not None and not str(args[1]).startswith(only):
                return real(*args, **kwargs)
            started = time.thread_time()
            try:
                return real(*args, **kwargs)
            finally:
                parts[part] = parts.get(part, 0.0) + time.thread_time() - started

        setattr(owner, name, timed)

    wrap(DiskStore, "update", "conv row", only="conv:")
    wrap(ledger.reqlog, "append", "request rows")
    wrap(ledger.history, "write", "history")
    wrap(ledger.index, "add", "indexes")
    wrap(ledger, "adopt", "adopt check")
    try:
        yield
    finally:
        for owner, name, real in put_back:
            setattr(owner, name, real)


def _child(history: int, shared: bool, conversations: int, parts: bool) -> dict[str, float]:
    """In the tree on ``sys.path``: CPU us of the ledger per request (and of its parts)."""
    spent_in: dict[str, float] = {}
    with _timed(spent_in) if parts else contextlib.nullcontext():
        return _flushes(history, shared, conversations, spent_in)


def _flushes(
    history: int, shared: bool, conversations: int, spent_in: dict[str, float]
) -> dict[str, float]:
    from bench.agent_body import agent_body
    from proxy.adapters.store import DiskStore
    from proxy.operators import ledger

    try:  # the request's exact digests go with its history, as the engine hands them on
        from proxy.core.fingerprint import fingerprints
        from proxy.core.prepared import Sent
    except ImportError:  # (a tree from before them: the messages alone)
        Sent = None  # type: ignore[assignment,misc]

    def exact_of(messages: list[Any]) -> list[Any]:
        digests: list[Any] = []
        fingerprints(messages, None, digests)
        return digests

    body = orjson.loads(agent_body(False))
    turns = body["messages"][1:]
    store = DiskStore(tempfile.mkdtemp(prefix="ledger-flush-"))
    convs: dict[str, list[dict[str, Any]]] = {}
    for c in range(conversations):
        messages = [{**body["messages"][0], "content": f"conversation {c}"}]
        while len(messages) < history:
            messages.extend(turns)
        convs[f"conv-{c}"] = messages[:history]
    exacts = {c: exact_of(m) if Sent is not None else [] for c, m in convs.items()}

    def entry(conv: str, n: int) -> Any:
        return ledger.RequestEntry(
            ts=time.time(), tenant="t" * 32, conversation=conv, model="gpt-4o-mini",
            route="chat", case="none", status=200, original_messages=n,
            forwarded_messages=n, original_tokens=20_000, forwarded_tokens=20_000,
            prompt_tokens=20_000, cached_tokens=19_000, cache_write_tokens=0,
            completion_tokens=100, latency_s=1.0, overhead_s=0.001,
            earlier_conversation=f"first-{conv}",  # as every request after a first reply
        )  # fmt: skip

    spent = 0.0
    for flush in range(FLUSHES + 1):
        batch = []
        for conv, messages in convs.items():
            grown = messages if shared else orjson.loads(orjson.dumps(messages))
            turn = [
                {"role": "assistant", "content": f"step {flush}: reading the next file"},
                {"role": "user", "content": f"tool output {flush} " + "y" * 400},
            ]
            grown = grown + turn
            convs[conv] = grown
            sent: Any = grown
            if Sent is not None:  # (the earlier messages' digests taken, as the engine does)
                exacts[conv] = exacts[conv] + exact_of(turn)
                sent = Sent(grown, exacts[conv])
            batch.append((entry(conv, len(grown)), sent))
        if flush == 1:
            spent_in.clear()  # (the first flush, which writes everything, is left out)
        started = time.thread_time()
        with store.batch():
            ledger.record_batch(store, batch, 7 * 86400)
        if flush:
            spent += time.thread_time() - started
    per = 1e6 / (FLUSHES * conversations)
    return {"total": spent * per, **{part: spent_in.get(part, 0.0) * per for part in PARTS}}


def _run(
    tree: Path, history: int, shared: bool, conversations: int, parts: bool
) -> dict[str, float]:
    """This file run as a script with ``tree`` on the path: its ``proxy`` is the one measured
    (the old tree need not have this benchmark)."""
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    args = [sys.executable, __file__, "--child", str(history), str(int(shared))]
    args += [str(conversations), str(int(parts))]
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    got: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        out = _child(int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4]), sys.argv[5] == "1")
        print(json.dumps(out))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the old source tree")
    parser.add_argument("--after", type=Path, default=Path.cwd(), help="the new source tree")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--history", type=int, action="append", help="(repeatable)")
    parser.add_argument("--conversations", type=int, default=CONVERSATIONS)
    parser.add_argument("--parts", action="store_true", help="each part's CPU too")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    print("| history | messages | before (us of CPU per request) | after | ratio |")
    print("|---|---|---:|---:|---:|")
    for history in args.history or HISTORIES:
        for shared in (True, False):
            got: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
            for r in range(args.rounds):
                order = ("before", "after") if r % 2 == 0 else ("after", "before")
                for name in order:
                    tree = getattr(args, name)
                    run = _run(tree, history, shared, args.conversations, args.parts)
                    got[name].append(run)
            medians = {
                name: {k: statistics.median(run[k] for run in runs) for k in runs[0]}
                for name, runs in got.items()
            }
            before, after = medians["before"]["total"], medians["after"]["total"]
            kind = "shared" if shared else "copied"
            pairs = zip(got["after"], got["before"], strict=True)
            ratios = ", ".join(f"{a['total'] / b['total']:.2f}" for a, b in pairs)
            print(f"  ({history} {kind}: per-round ratios {ratios})", file=sys.stderr)
            rows.append({"history": history, "messages": kind, **medians})
            print(f"| {history} | {kind} | {before:,.0f} | {after:,.0f} | {after / before:.2f} |")
    if args.parts:  # each part's median; "rest": the total's median less theirs
        print("\n| history | messages | tree | " + " | ".join(PARTS) + " | rest |")
        print("|---|---|---|" + "---:|" * (len(PARTS) + 1))
        for row in rows:
            for name in ("before", "after"):
                m = row[name]
                cells = [f"{m[part]:,.0f}" for part in PARTS]
                rest = m["total"] - sum(m[part] for part in PARTS)
                head = f"| {row['history']} | {row['messages']} | {name} | "
                print(head + " | ".join(cells) + f" | {rest:,.0f} |")
    print(f"load average {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
