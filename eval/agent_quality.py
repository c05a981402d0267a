"""#26 acceptance on the 300-request agent session (``bench.agent_session``) with the scripted
``digits`` summarizer (it keeps only transcript lines containing a digit or '/').

    python -m eval.agent_quality [--requests 300] [--summarizer digits]

Measured on the last forwarded request:
- planted facts forwarded *with their label*: the fact's value on one line (or one item of a
  ``Key references:`` line) together with every word of the label written here by hand from
  the planted sentence (``LABELS``; "staging database host" for pg-stage-07.internal);
- framing artefacts: items of the ``Key references:`` lines naming something the client never
  sent (our own "658 earlier", "1189 tokens"), or our own wording;
- written file paths: every file the session's write_file/edit_file calls named, still
  forwarded (the session is run with ``writes=True``).
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

import orjson

from bench import agent_session
from proxy.core import artifacts, keyfacts, messages

# The words that say what each planted value is, from its sentence in bench.agent_session.
LABELS = [
    "staging database host", "invoice rounding bug", "retry limit sync_ledger", "release branch",
    "failing test", "config file", "currency table", "owner ledger service", "queue timeout",
    "feature flag", "metrics endpoint", "hotfix must ship", "cache TTL rates", "broken commit",
    "refund worker", "max batch size", "API version header", "tenant bug", "migration file",
    "on-call channel",
]  # fmt: skip
_OWN_WORDING = re.compile(r"earlier messages|compaction-proxy|call the tool again|\d+ earlier\b")


def _words(text: str) -> set[str]:
    return {w.strip(".,;:!?()[]{}\"'`").lower() for w in text.split()}


def _units(text: str) -> list[str]:
    """Lines, and the items of references lines: what one statement of a fact is."""
    return [part for line in text.splitlines() for part in line.split("; ")]


def with_label(text: str, value: str, label: str) -> bool:
    need = {w.lower() for w in label.split()}
    return any(value in unit and need <= _words(unit) for unit in _units(text))


def forwarded_text(forwarded: list[dict[str, Any]]) -> str:
    return "\n\n".join(messages.render(m) for m in forwarded)


def reference_items(text: str) -> list[str]:
    items: list[str] = []
    for m in re.finditer(r"Key references: ([^\n]*)", text):
        items += [i for i in m.group(1).split("; ") if i]
    return items


def framing_artefacts(text: str, sent: str) -> list[str]:
    """Reference items that are ours, not the client's."""
    out = []
    for item in reference_items(text):
        facts = keyfacts.extract_key_facts(item)
        if _OWN_WORDING.search(item) or any(f not in sent for f in facts):
            out.append(item)
    return out


def written_paths(session: list[dict[str, Any]]) -> list[str]:
    text = "\n\n".join(messages.render(m) for m in session)
    return list(
        dict.fromkeys(a.path for a in artifacts.trail(text) if a.action in artifacts.CHANGED)
    )


def measure(result: dict[str, Any]) -> dict[str, Any]:
    """The #26 figures of one ``agent_session.run(..., keep_text=True)`` result."""
    final = forwarded_text(result["final_forwarded"])
    sent = orjson.dumps(result["messages"]).decode()
    planted = [
        (fact, key, label)
        for fact, key, label in zip(
            agent_session.FACTS, agent_session.FACT_KEYS, LABELS, strict=True
        )
        if fact in sent
    ]
    labelled = [key for _, key, label in planted if with_label(final, key, label)]
    bare = [key for _, key, _ in planted if key in final]
    paths = written_paths(result["messages"])
    kept_paths = [p for p in paths if p in final]
    return {
        "facts_planted": len(planted),
        "facts_forwarded": len(bare),
        "facts_with_label": len(labelled),
        "facts_without_label": sorted(set(bare) - set(labelled)),
        "facts_lost": [key for _, key, _ in planted if key not in final],
        "framing_artefacts": framing_artefacts(final, sent),
        "reference_items": len(reference_items(final)),
        "written_paths": len(paths),
        "written_paths_forwarded": len(kept_paths),
        "compactions": result["compactions"],
        "prunings": result["prunings"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.agent_quality", description=__doc__)
    parser.add_argument("--requests", type=int, default=agent_session.FULL_REQUESTS)
    parser.add_argument("--summarizer", choices=sorted(agent_session.SUMMARIZERS), default="digits")
    args = parser.parse_args(argv)
    result = agent_session.run(args.requests, args.summarizer, writes=True, keep_text=True)
    figures = measure(result)
    for name, value in figures.items():
        print(f"{name}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
