"""#26 evaluation: anchors in four categories after compaction, against two baselines at the
same forwarded budget, on the replayed real runs and on the bench's agent session.

    python -m eval.anchor_eval [--trigger 6000] [--summarizer structured|digits] [--out PATH]

For each run the client's requests (``tests/replay/shapes.py``, chat-completions shape) go
through the compaction core in process, request after request (background mode: a compaction
is used from the next request on), with a scripted detector (no boundary) and a scripted
summarizer. The last forwarded request is scored, and so are two baselines cut from the same
last history to a budget no smaller than ours:
- *drop the middle*: the head, then the oldest and newest messages, half the budget each;
- *observation masking*: every message kept, tool results older than the newest K replaced
  by a placeholder (what the providers' own context editing does), K the largest that fits;
  when even K = 0 does not fit, the masked history's middle is dropped to the budget as above.
An anchor (``proxy.core.anchors``: artifact trail, recall, decisions, continuation, taken
from the whole history) counts as kept when its string is in the rendered request.

Summarizers (scripted, deterministic, not models): ``structured`` writes what a capable
model's summary holds (the task, files read and changed, errors, the user's directives, the
last step), within the summary budget; ``digits`` keeps transcript lines with a digit or '/'.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from bench import agent_session
from eval.baselines import drop_the_middle
from proxy.adapters.store import DiskStore
from proxy.config import load_prompt
from proxy.core import anchors, artifacts, keyfacts, references
from proxy.core.messages import Message, render
from proxy.core.prepared import Prompts
from proxy.core.settings import CompactionSettings
from proxy.core.tokens import TokenCounter
from proxy.engine.compactor import Compactor

MODEL = "gpt-4o-mini"
MASK = "[old tool result cleared]"


def structured(transcript: str, budget: int) -> str:
    """A scripted summary in the shape a capable model writes (not a model)."""
    text = references.unframed(transcript).replace("EARLIER SUMMARY:", "")
    users = [ln[6:] for ln in text.splitlines() if ln.startswith("USER: ")]
    said = [ln[11:] for ln in text.splitlines() if ln.startswith("ASSISTANT: ")]
    trail = artifacts.trail(text)
    # Like a capable model folding in its earlier summary: its file lists carry over.
    read = _listed(text, "Files read: ") + [a.path for a in trail if a.action == artifacts.READ]
    changed = _listed(text, "Files changed: ") + [
        f"{a.action} {a.path}" for a in trail if a.action in artifacts.CHANGED
    ]
    errors = [f.text for f in keyfacts.facts_in(text) if f.kind == "error"]
    parts = [
        f"The user asked: {users[0][:300]}" if users else "",
        f"Files changed: {', '.join(dict.fromkeys(changed))}." if changed else "",
        f"Errors seen: {', '.join(dict.fromkeys(errors))}." if errors else "",
        f"Files read: {', '.join(dict.fromkeys(read))}." if read else "",
        f"Latest instruction: {users[-1][:300]}" if len(users) > 1 else "",
        f"Last step: {said[-1][:300]}" if said else "",
    ]
    out = "\n".join(p for p in parts if p)
    return out[: budget * 4].rsplit("\n", 1)[0] if len(out) > budget * 4 else out


def _listed(text: str, label: str) -> list[str]:
    out: list[str] = []
    for line in text.splitlines():
        if line.startswith(label):
            out += [x.strip() for x in line[len(label) :].rstrip(".").split(", ") if x.strip()]
    return out


SUMMARIZERS: dict[str, Callable[[str, int], str]] = {
    "structured": structured,
    "digits": agent_session.digits,
}


async def drive(
    msgs: list[Message], ends: list[int], summarizer: str, settings: CompactionSettings
) -> tuple[list[list[Message]], int]:
    """``msgs[:end]`` for each of ``ends``, resent in turn through the core in process (a
    diskcache store, the scripted ``summarizer``): what was forwarded for each, and how many
    compactions were made."""
    counter = TokenCounter()
    llm = agent_session.ScriptedLLM(SUMMARIZERS[summarizer], counter)
    prompts = Prompts(detector=load_prompt("detector"), summarizer=load_prompt("summarizer"))
    compactions = 0

    def on_event(event: dict[str, Any]) -> None:
        nonlocal compactions
        compactions += event.get("case") in ("prune", "summarize", "truncate", "emergency")

    forwarded: list[list[Message]] = []
    with tempfile.TemporaryDirectory(prefix="anchor-eval-") as tmp:
        store = DiskStore(tmp)
        engine = Compactor(settings, store, llm, prompts, counter=counter, on_event=on_event)
        for end in ends:
            p = await engine.prepare(msgs[:end], model=MODEL, tenant="eval", credential="k")
            forwarded.append(p.forwarded)
            engine.schedule(p)
            await engine.drain(timeout=60)
        store.close()
    return forwarded, compactions


def observation_masking(
    messages: Sequence[Message], counts: Sequence[int], budget: int
) -> list[Message]:
    tools = [i for i, m in enumerate(messages) if m.get("role") == "tool"]
    masked_tokens = TokenCounter().count_text(MASK, MODEL)
    for keep in range(len(tools), -1, -1):
        old = set(tools[: len(tools) - keep])
        total = sum(masked_tokens if i in old else c for i, c in enumerate(counts))
        if total <= budget or keep == 0:
            masked = [{**m, "content": MASK} if i in old else m for i, m in enumerate(messages)]
            if total <= budget:
                return masked
            # Even with every result masked the history is over the budget: a client using
            # the providers' context editing would still have to cut it, so the middle goes
            # (the same cut as the drop-the-middle baseline), keeping the comparison at an
            # equal budget rather than crediting masking with tokens we did not spend.
            masked_counts = [masked_tokens if i in old else c for i, c in enumerate(counts)]
            return drop_the_middle(masked, masked_counts, budget)
    return list(messages)


def score(found: list[anchors.Anchor], messages: Sequence[Message]) -> dict[str, tuple[int, int]]:
    text = "\n\n".join(render(m) for m in messages)
    out = {}
    for category in anchors.CATEGORIES:
        mine = [a for a in found if a.category == category]
        out[category] = (sum(1 for a in mine if a.key in text), len(mine))
    return out


def request_ends(msgs: list[Message]) -> list[int]:
    """Where each request of a replayed open loop ends: ``msgs[:end]`` is the history the
    client resent before each of its assistant turns."""
    return [i for i, m in enumerate(msgs) if m["role"] == "assistant" and i > 0]


def evaluate(name: str, msgs: list[Message], summarizer: str, trigger: int) -> dict[str, Any]:
    ends = request_ends(msgs)
    # policy: tokens, like bench.agent_session: this driver writes no ledger, which the cost
    # policy (the default) reads to judge whether a compaction pays.
    settings = CompactionSettings(
        trigger_tokens=trigger, verbatim_window_tokens=trigger // 3, policy="tokens"
    )
    sent, compactions = asyncio.run(drive(msgs, ends, summarizer, settings))
    ours = sent[-1]
    last = msgs[: ends[-1]]
    counter = TokenCounter()
    counts = counter.count_messages(last, MODEL)
    budget = counter.count_total(ours, MODEL)
    found = anchors.anchors("\n\n".join(render(m) for m in last))
    rows = {
        "proxy": (ours, budget),
        "drop the middle": (
            d := drop_the_middle(last, counts, budget),
            counter.count_total(d, MODEL),
        ),
        "observation masking": (
            o := observation_masking(last, counts, budget),
            counter.count_total(o, MODEL),
        ),
    }
    return {
        "run": name,
        "sent_tokens": counter.count_total(last, MODEL),
        "compactions": compactions,
        "methods": {k: {"tokens": t, "anchors": score(found, m)} for k, (m, t) in rows.items()},
    }


def corpus(limit: int | None = None) -> list[tuple[str, list[Message]]]:
    from tests.replay.fixtures import load_runs
    from tests.replay.shapes import chat_body

    out = []
    for run in load_runs()[:limit]:
        body = chat_body(run, run["turns"], MODEL)
        out.append((run["file"].removesuffix(".json"), body["messages"]))
    return out


def markdown(results: list[dict[str, Any]], summarizer: str, trigger: int) -> str:
    lines = [
        f"Summarizer: `{summarizer}` (scripted, deterministic, not a model); trigger {trigger:,}.",
        "",
        "| run | method | forwarded tokens | artifact trail | recall | decisions | continuation |",
        "|---|---|---|---|---|---|---|",
    ]
    totals: dict[str, dict[str, list[int]]] = {}
    for r in results:
        for method, m in r["methods"].items():
            cells = []
            for c in anchors.CATEGORIES:
                kept, n = m["anchors"][c]
                pair = totals.setdefault(method, {}).setdefault(c, [0, 0])
                pair[0], pair[1] = pair[0] + kept, pair[1] + n
                cells.append(f"{kept}/{n}")
            lines.append(f"| {r['run']} | {method} | {m['tokens']:,} | " + " | ".join(cells) + " |")
    for method, per in totals.items():
        cells = [
            f"{per[c][0]}/{per[c][1]} ({per[c][0] / per[c][1]:.0%})" if per[c][1] else "–"
            for c in anchors.CATEGORIES
        ]
        lines.append(f"| **all** | {method} | | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.anchor_eval", description=__doc__)
    parser.add_argument("--trigger", type=int, default=6000)
    parser.add_argument("--summarizer", choices=sorted(SUMMARIZERS), default="structured")
    parser.add_argument("--session", action="store_true", help="also the bench's agent session")
    parser.add_argument("--out", metavar="PATH")
    args = parser.parse_args(argv)
    runs = corpus()
    if args.session:
        runs.append(
            ("bench agent session (120 requests, writes)", agent_session.session(120, writes=True))
        )
    results = [evaluate(name, msgs, args.summarizer, args.trigger) for name, msgs in runs]
    text = markdown(results, args.summarizer, args.trigger)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
