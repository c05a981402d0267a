"""The #26 series of ``/metrics``: anchors by category and fate, the agent's repeated work
after compactions, and the loop breaker's decisions. Fed from the compactor's events."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from proxy.core.anchors import CATEGORIES, FATES
from proxy.core.types import COMPACTION_CASES

log = logging.getLogger("compaction_proxy.metrics")
PREFIX = "compaction_proxy"


class QualityMetrics:
    """Counters registered on the app's own registry; ``observe`` never raises."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.anchors = Counter(
            f"{PREFIX}_anchors",
            "Anchors of replaced or pruned spans by category (artifact, recall, decision, "
            "continuation) and fate (verbatim, summary, references, dropped).",
            ["category", "fate"],
            registry=registry,
        )
        self.repeated_calls = Counter(
            f"{PREFIX}_agent_repeated_tool_calls",
            "Tool calls an agent repeated after a compaction, with the same arguments as a "
            "call whose result that compaction had cleared.",
            registry=registry,
        )
        self.rereads = Counter(
            f"{PREFIX}_agent_file_rereads",
            "Repeated tool calls after a compaction that read a file again.",
            registry=registry,
        )
        # Turns per user instruction before and after compactions: the ratio of these two
        # (a conversation's counts are added once per compaction, labelled by its case).
        self.turns = Counter(
            f"{PREFIX}_agent_turns",
            "Assistant turns of conversations before and after a compaction (phase), by the "
            "compaction's case; divided by agent_instructions_total: turns per instruction.",
            ["phase", "case"],
            registry=registry,
        )
        self.instructions = Counter(
            f"{PREFIX}_agent_instructions",
            "User instructions (user messages that are not only tool results) before and after "
            "a compaction (phase), by the compaction's case.",
            ["phase", "case"],
            registry=registry,
        )
        self.loop_breaker = Counter(
            f"{PREFIX}_loop_breaker",
            "Times the loop breaker backed off for a conversation, by action.",
            ["action"],
            registry=registry,
        )
        for category in CATEGORIES:
            for fate in FATES:
                self.anchors.labels(category, fate)

    def observe(self, event: Mapping[str, Any]) -> None:
        try:
            case = event.get("case")
            if case == "behaviour":
                self.repeated_calls.inc(max(0, int(event.get("repeated_calls") or 0)))
                self.rereads.inc(max(0, int(event.get("rereads") or 0)))
                for row in event.get("turns") or []:
                    self._turns(row)
            elif case == "loop_breaker":
                self.loop_breaker.labels(str(event.get("action") or "?")[:80]).inc()
            elif isinstance(event.get("anchors"), Mapping):
                for category, fates in event["anchors"].items():
                    if category not in CATEGORIES or not isinstance(fates, Mapping):
                        continue
                    for fate, n in fates.items():
                        if fate in FATES and isinstance(n, int) and n > 0:
                            self.anchors.labels(category, fate).inc(n)
        except Exception:
            log.exception("metrics: quality observe failed")

    def _turns(self, row: Any) -> None:
        if not isinstance(row, Mapping) or row.get("phase") not in ("before", "after"):
            return
        case = row.get("case")
        if case not in COMPACTION_CASES:
            return  # bounded label values: the compaction cases only
        labels = (row["phase"], case)
        self.turns.labels(*labels).inc(max(0, int(row.get("turns") or 0)))
        self.instructions.labels(*labels).inc(max(0, int(row.get("instructions") or 0)))
