"""The architecture holds (DESIGN §2): a pure core that imports no I/O library, and two front
doors (the Starlette server, the LiteLLM hook) that do not import each other.

Each module is imported in a fresh interpreter, so what another test imported before cannot
hide a dependency.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The pure core: data in, data out. Token counting reads tiktoken's files, nothing else.
CORE = (
    "controls", "costs", "detector", "fingerprint", "headers", "keyfacts", "layout",
    "lossreport", "messages", "pins", "planner", "prune", "records", "settings", "stability",
    "summarizer", "summarycheck", "surfaces", "tokens",
)  # fmt: skip
IO_LIBRARIES = (
    "httpx", "aiohttp", "starlette", "uvicorn", "diskcache", "redis", "litellm",
    "prometheus_client", "yaml",
)  # fmt: skip

_PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(m for m in sys.modules)))
"""


def loaded_by(module: str) -> set[str]:
    """Top-level names of every module that importing ``module`` loads."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, module],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return {name.split(".")[0] for name in json.loads(done.stdout.splitlines()[-1])}


def test_every_core_module_exists() -> None:
    missing = [m for m in CORE if not (ROOT / "proxy" / f"{m}.py").exists()]
    assert not missing, f"core modules renamed or gone: {missing} (update CORE)"


@pytest.mark.parametrize("module", CORE)
def test_core_module_imports_no_io_library(module: str) -> None:
    found = loaded_by(f"proxy.{module}") & set(IO_LIBRARIES)
    assert not found, f"proxy.{module} pulls in {sorted(found)} at import"


def test_the_server_does_not_import_the_litellm_hook() -> None:
    assert "hooks" not in loaded_by("proxy.server")


def test_the_litellm_hook_does_not_import_the_server() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, hooks.litellm_compaction; print('proxy.server' in sys.modules, "
            "'starlette' in sys.modules and 'proxy.dashboard' in sys.modules)",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False"]
