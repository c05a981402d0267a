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

# The pure core (``proxy/core/``): data in, data out. Token counting reads tiktoken's files,
# nothing else. Every module in the package is checked, so a new one cannot slip past.
CORE = tuple(sorted(p.stem for p in (ROOT / "proxy" / "core").glob("*.py") if p.stem != "__init__"))
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


def test_the_core_is_where_the_layout_says() -> None:
    assert {"messages", "planner", "records", "fingerprint", "tokens"} <= set(CORE)


@pytest.mark.parametrize("module", CORE)
def test_core_module_imports_no_io_library(module: str) -> None:
    found = loaded_by(f"proxy.core.{module}") & set(IO_LIBRARIES)
    assert not found, f"proxy.core.{module} pulls in {sorted(found)} at import"


def test_the_server_does_not_import_the_litellm_hook() -> None:
    assert "hooks" not in loaded_by("proxy.server.app")


def test_the_litellm_hook_does_not_import_the_server() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, hooks.litellm_compaction; print('proxy.server' in sys.modules, "
            "'starlette' in sys.modules and 'proxy.operators.dashboard' in sys.modules)",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False"]
