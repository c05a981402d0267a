"""#26: the artifact trail from the common agents' tool calls, anchors by category, and each
anchor's fate in a compaction (pure)."""

from __future__ import annotations

import json

import pytest

from proxy.core import anchors, artifacts
from proxy.core.messages import render


def call(name: str, args: object) -> str:
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}}
        ],
    }  # fmt: skip
    return render(message)


@pytest.mark.parametrize(
    ("name", "args", "expected"),
    [
        ("Read", {"file_path": "/repo/src/app.py"}, [("read", "/repo/src/app.py")]),
        ("Write", {"file_path": "src/new.py", "content": "x"}, [("written", "src/new.py")]),
        ("Edit", {"file_path": "src/app.py", "old_string": "a", "new_string": "b"},
         [("edited", "src/app.py")]),
        ("MultiEdit", {"file_path": "src/m.py", "edits": []}, [("edited", "src/m.py")]),
        ("Bash", {"command": "cat src/a.py | head -5"}, [("read", "src/a.py")]),
        ("Bash", {"command": "rm build/out.txt && touch NOTES.md"},
         [("deleted", "build/out.txt"), ("created", "NOTES.md")]),
        ("shell", {"command": ["bash", "-lc", "sed -i s/a/b/ src/x.py"]}, [("edited", "src/x.py")]),
        ("exec_command", {"cmd": "cat > out/report.txt <<'EOF'\nhi\nEOF"},
         [("written", "out/report.txt")]),
        ("apply_patch", {"input": "*** Begin Patch\n*** Update File: src/a.py\n@@\n-x\n+y\n"
                                  "*** Add File: src/b.py\n+z\n*** Delete File: src/c.py\n"},
         [("edited", "src/a.py"), ("created", "src/b.py"), ("deleted", "src/c.py")]),
        ("str_replace_editor", {"command": "view", "path": "/workspace/django/db.py"},
         [("read", "/workspace/django/db.py")]),
        ("str_replace_editor", {"command": "create", "path": "/workspace/t.py", "file_text": ""},
         [("created", "/workspace/t.py")]),
        ("str_replace_editor", {"command": "str_replace", "path": "/workspace/m.py"},
         [("edited", "/workspace/m.py")]),
        ("read_file", {"path": "src/billing/cache.py"}, [("read", "src/billing/cache.py")]),
        ("write_file", {"path": "src/billing/new.py"}, [("written", "src/billing/new.py")]),
        ("grep", {"pattern": "TODO", "path": "src"}, []),  # a search touches no file
    ],
)  # fmt: skip
def test_artifact_trail_from_the_common_agents_tool_calls(
    name: str, args: object, expected: list[tuple[str, str]]
) -> None:
    found = [(a.action, a.path) for a in artifacts.trail(call(name, args))]
    assert found == expected


SPAN = "\n\n".join(
    [
        "USER: Never push to main. The customer acct 99310027 is affected.",
        call("Read", {"file_path": "src/billing/invoice.py"}),
        "TOOL RESULT (call_1): raise InvoiceRoundingError at line 12",
        call("TodoWrite", {"todos": [
            {"content": "fix half-cent rounding", "status": "in_progress"},
            {"content": "write the changelog", "status": "completed"}]}),
        "TOOL RESULT (call_2): FAILED tests/test_invoice.py::test_half_cent - AssertionError",
    ]
)  # fmt: skip


def test_anchors_fall_in_four_categories() -> None:
    found = {(a.category, a.key) for a in anchors.anchors(SPAN)}
    assert ("artifact", "src/billing/invoice.py") in found
    assert ("recall", "InvoiceRoundingError") in found
    assert ("decision", "Never push to main") in found
    assert ("continuation", "fix half-cent rounding") in found
    assert ("continuation", "tests/test_invoice.py::test_half_cent") in found
    assert ("continuation", "write the changelog") not in found  # done: not the frontier


def test_each_anchor_has_one_fate() -> None:
    summary = (
        "Fixing InvoiceRoundingError.\n\nKey references: read: src/billing/invoice.py; "
        "user: Never push to main"
    )
    report = anchors.report(SPAN, summary, rest_text="next: fix half-cent rounding")
    counts = report.counts
    assert counts["recall"]["summary"] >= 1
    assert counts["artifact"] == {"verbatim": 0, "summary": 0, "references": 1, "dropped": 0}
    assert counts["decision"]["references"] == 1
    assert counts["continuation"]["verbatim"] == 1
    assert "tests/test_invoice.py::test_half_cent" in report.dropped["continuation"]
    for category in anchors.CATEGORIES:
        assert sum(counts[category].values()) == len(
            [a for a in anchors.anchors(SPAN) if a.category == category]
        )
