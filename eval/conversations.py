"""Three built-in long conversations with planted facts in their first third. Pure data.

Each is deterministic: a system prompt, then user turns with scripted assistant replies (and,
for the coding agent, tool calls with their results). A planted fact is a sentence in a user
turn or tool result whose ``answer`` (an exact string) a faithful history must still contain.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]


@dataclass(frozen=True)
class Fact:
    sentence: str  # planted in the conversation
    answer: str  # the exact string that must survive
    question: str  # asked at the end (QA exact-match)


@dataclass(frozen=True)
class Conversation:
    name: str
    kind: str
    system: str
    turns: list[list[Message]] = field(default_factory=list)  # each starts with a user message
    facts: list[Fact] = field(default_factory=list)


CODING_FACTS = [
    Fact(
        "The failing test is tests/billing/test_refunds.py.",
        "tests/billing/test_refunds.py",
        "Which test file fails?",
    ),
    Fact(
        "The staging database host is pg-billing-02.internal.",
        "pg-billing-02.internal",
        "What is the staging database host?",
    ),
    Fact("Track the work under ticket OPS-4821.", "OPS-4821", "Which ticket tracks the work?"),
    Fact(
        "The crash is an InvoiceRoundingError.",
        "InvoiceRoundingError",
        "Which exception is raised?",
    ),
    Fact(
        "Set BILLING_RETRY_LIMIT=5 in the environment.",
        "BILLING_RETRY_LIMIT",
        "Which environment variable sets the retry limit?",
    ),
    Fact("The last good commit is 3f9a2c1d.", "3f9a2c1d", "What is the last good commit?"),
    Fact("The latency budget per call is 120 ms.", "120 ms", "What is the latency budget?"),
    Fact(
        "Pin the client with pip install httpx==0.27.2 first.",
        "httpx==0.27.2",
        "Which httpx version is pinned?",
    ),
]
PLANNING_FACTS = [
    Fact(
        "We decided to use PostgreSQL over DynamoDB because of the joins.",
        "DynamoDB",
        "Which database did we decide against?",
    ),
    Fact("The launch date is 2025-03-14.", "2025-03-14", "What is the launch date?"),
    Fact("The total budget is €48,500.", "€48,500", "What is the total budget?"),
    Fact("Priya Raman owns the rollout.", "Priya Raman", "Who owns the rollout?"),
    Fact(
        "The logistics vendor is Northwind Logistics.",
        "Northwind Logistics",
        "Which logistics vendor was chosen?",
    ),
    Fact("The target throughput is 312 req/min.", "312 req/min", "What is the target throughput?"),
    Fact(
        "We will use Unleash for feature flags because it is self-hosted.",
        "Unleash",
        "Which feature-flag tool will we use?",
    ),
    Fact("The pilot region is eu-west-7.", "eu-west-7", "What is the pilot region?"),
]
SUPPORT_FACTS = [
    Fact("My order number is PAY-48213.", "PAY-48213", "What is the order number?"),
    Fact("The return label is KB-7734-BLK.", "KB-7734-BLK", "What is the return label?"),
    Fact("I was charged $1,249.90 twice.", "$1,249.90", "How much was charged twice?"),
    Fact("My name is Maria Gonzalez.", "Maria Gonzalez", "What is the customer's name?"),
    Fact(
        "The tracking number is 1Z999AA10123456784.",
        "1Z999AA10123456784",
        "What is the tracking number?",
    ),
    Fact("The parcel weighs 2.4 kg.", "2.4 kg", "How much does the parcel weigh?"),
    Fact("It was delivered on 2025-02-28.", "2025-02-28", "When was it delivered?"),
    Fact("Your case number is CASE-20931.", "CASE-20931", "What is the case number?"),
]

_CODING_WORDS = (
    "refund invoice ledger retry parser worker cache settings deploy branch staging queue "
    "timeout handler client schema migration fixture rounding currency logging backoff"
).split()
_PLANNING_WORDS = (
    "milestone rollout budget vendor risk timeline staffing review pilot region launch scope "
    "dependency stakeholder estimate backlog training support metrics onboarding contract"
).split()
_SUPPORT_WORDS = (
    "order parcel refund courier delivery label return charge account address invoice "
    "warehouse replacement package damaged payment receipt card statement shipment"
).split()


def _prose(rng: random.Random, words: list[str], n: int) -> str:
    text = " ".join(rng.choice(words) for _ in range(n))
    return text[0].upper() + text[1:] + "."


def _plant(turns: int, facts: list[Fact], rng: random.Random) -> dict[int, Fact]:
    """Facts spread over the first third of the turns (never the very first one)."""
    slots = list(range(1, max(len(facts) + 1, turns // 3)))
    rng.shuffle(slots)
    return dict(zip(sorted(slots[: len(facts)]), facts, strict=True))


def coding_agent(turns: int = 36, seed: int = 1) -> Conversation:
    rng = random.Random(seed)
    planted = _plant(turns, CODING_FACTS, rng)
    out: list[list[Message]] = []
    for t in range(turns):
        fact = planted.get(t)
        user = f"Step {t}: {_prose(rng, _CODING_WORDS, 18)}"
        call_id = f"call_{seed}{t:03d}x{rng.randrange(16**6):06x}"
        # Tool output looks like a real test run: progress percentages and timestamps (noise).
        log = "\n".join(
            f"tests/test_{rng.choice(_CODING_WORDS)}.py ....  [{(i + 1) * 25:3d}%]"
            for i in range(4)
        )
        result = f"2025-01-0{1 + t % 9} 10:{t % 60:02d}:07,120 INFO run started\n{log}"
        if fact and t % 2:
            result += f"\nNOTE: {fact.sentence}"
        elif fact:
            user += f" {fact.sentence}"
        path = f"src/{rng.choice(_CODING_WORDS)}_{t}.py"
        out.append(
            [
                {"role": "user", "content": user},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {
                                "name": "run_tests",
                                "arguments": json.dumps({"path": path}),
                            },
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call_id, "content": result},
                {
                    "role": "assistant",
                    "content": f"Checked {path}. {_prose(rng, _CODING_WORDS, 22)}",
                },
            ]
        )
    return Conversation(
        "coding-agent",
        "coding agent with tool calls",
        "You are a coding agent working in the billing repository. Use tools.",
        out,
        list(planted.values()),
    )


def _chat(name: str, kind: str, system: str, facts: list[Fact], words: list[str],
          turns: int, seed: int) -> Conversation:  # fmt: skip
    rng = random.Random(seed)
    planted = _plant(turns, facts, rng)
    out: list[list[Message]] = []
    for t in range(turns):
        fact = planted.get(t)
        user = _prose(rng, words, 22)
        if fact:
            user = f"{user} {fact.sentence}"
        reply = f"Noted. {_prose(rng, words, 30)}"
        out.append([{"role": "user", "content": user}, {"role": "assistant", "content": reply}])
    return Conversation(name, kind, system, out, list(planted.values()))


def planning(turns: int = 40, seed: int = 2) -> Conversation:
    return _chat(
        "planning",
        "planning with decisions",
        "You help a team plan the launch of a logistics product.",
        PLANNING_FACTS,
        _PLANNING_WORDS,
        turns,
        seed,
    )


def support(turns: int = 40, seed: int = 3) -> Conversation:
    return _chat(
        "support",
        "support with ids and amounts",
        "You are a customer support agent for an online shop.",
        SUPPORT_FACTS,
        _SUPPORT_WORDS,
        turns,
        seed,
    )


def builtin(scale: float = 1.0) -> list[Conversation]:
    """The three conversations; ``scale`` < 1 makes them shorter (the CI version)."""
    return [
        coding_agent(max(9, int(36 * scale))),
        planning(max(9, int(40 * scale))),
        support(max(9, int(40 * scale))),
    ]


def history(conv: Conversation, upto: int) -> list[Message]:
    """The messages a client sends with turn ``upto``'s user message last."""
    msgs: list[Message] = [{"role": "system", "content": conv.system}]
    for turn in conv.turns[:upto]:
        msgs.extend(turn)
    msgs.append(conv.turns[upto][0])
    return msgs


def full(conv: Conversation) -> list[Message]:
    msgs: list[Message] = [{"role": "system", "content": conv.system}]
    for turn in conv.turns:
        msgs.extend(turn)
    return msgs
