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


def _imports(path: Path) -> set[str]:
    """Project modules ``path`` imports at module level (not under TYPE_CHECKING)."""
    import ast

    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
            found.update(n if _module_path(n) else node.module for n in names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.split(".")[0] in ("proxy", "hooks") and _module_path(m)}


def _module_path(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def test_no_import_cycles() -> None:
    """compactor, ledger and writer once imported each other: no module may reach itself."""
    modules = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts): p
        for top in ("proxy", "hooks")
        for p in (ROOT / top).rglob("*.py")
        if p.name != "__init__.py"
    }
    graph = {m: _imports(p) & set(modules) for m, p in modules.items()}
    cycles = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join([*path, nxt]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not cycles, cycles[:5]


def test_no_file_is_over_400_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for top in ("proxy", "hooks")
        for p in (ROOT / top).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, long


# The package's layers, lowest first (docs/architecture.md): a module imports only from its
# own layer or the ones below, at module level or inside a function. The pure core; start-up
# values (config, logs); I/O adapters; the operators' side (ledger, metrics, pages), which
# reads the store; the engine that drives a request (it records through the operators); the
# two front doors; the command line.
LAYERS = (
    ("proxy.core",),
    ("proxy.config", "proxy.logs"),
    ("proxy.adapters",),
    ("proxy.operators",),
    ("proxy.engine",),
    ("proxy.server", "hooks"),
    ("proxy.cli", "proxy.preflight"),
)
# Known upward imports, each with its reason; the list only shrinks (the last one, the
# OpenTelemetry backend building the engine's ``Root``, went with #28: ``core/traceids``).
UPWARD_ALLOWED: set[tuple[str, str]] = set()


def _layer(module: str) -> int:
    for rank, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return rank
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def _all_imports(path: Path) -> set[str]:
    """Project modules ``path`` imports anywhere (functions too), except for type checking."""
    import ast

    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.split(".")[0] in ("proxy", "hooks") and m != "proxy"}


def test_no_layer_imports_a_higher_one() -> None:
    upward = []
    for top in ("proxy", "hooks"):
        for p in (ROOT / top).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if module == "proxy":
                continue
            for imported in _all_imports(p):
                if _layer(imported) > _layer(module) and (module, imported) not in UPWARD_ALLOWED:
                    upward.append(f"{module} -> {imported}")
    assert not upward, sorted(upward)
