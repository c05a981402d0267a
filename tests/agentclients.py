"""The real agent CLIs (Claude Code, Codex) the end-to-end tests drive, installed with npm.

``tests/agents/package.json`` pins their versions and ``package-lock.json`` locks them; the
README's test command (and so CI) runs ``npm ci --prefix tests/agents`` before pytest. A test
run started without that step installs them here once; when that is impossible (no npm, no
registry) the tests fail with the reason, they never skip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from tests.upstream import message_text

AGENTS_DIR = Path(__file__).parent / "agents"
BINARIES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex"}


def pinned_version(package: str) -> str:
    deps: dict[str, str] = json.loads((AGENTS_DIR / "package.json").read_text())["dependencies"]
    return deps[package]


def _installed_version(package: str) -> str | None:
    manifest = AGENTS_DIR / "node_modules" / package / "package.json"
    if not manifest.exists():
        return None
    version: str = json.loads(manifest.read_text())["version"]
    return version


@cache
def _npm_ci() -> None:
    npm = shutil.which("npm")
    if npm is None:
        pytest.fail(
            "npm is not on PATH: the agent end-to-end tests need Node.js and npm "
            "(then `npm ci --prefix tests/agents`)",
            pytrace=False,
        )
    result = subprocess.run(
        [npm, "ci", "--no-audit", "--no-fund"],
        cwd=AGENTS_DIR,
        capture_output=True,
        text=True,
        timeout=900,
        stdin=subprocess.DEVNULL,
    )
    if result.returncode != 0:
        pytest.fail(
            f"`npm ci` in {AGENTS_DIR} failed ({result.returncode}):\n"
            f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}",
            pytrace=False,
        )


@cache
def agent_binary(name: str) -> str:
    """Absolute path of the named CLI at its pinned version, installing it if needed."""
    package = BINARIES[name]
    if _installed_version(package) != pinned_version(package):
        _npm_ci()
    path = AGENTS_DIR / "node_modules" / ".bin" / name
    installed = _installed_version(package)
    if installed != pinned_version(package) or not path.exists():
        pytest.fail(
            f"{package} {pinned_version(package)} is not installed in {AGENTS_DIR} "
            f"(found {installed}); run `npm ci --prefix tests/agents`",
            pytrace=False,
        )
    version = subprocess.run(
        [str(path), "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        env=clean_env({}),
    )
    if version.returncode != 0 or pinned_version(package) not in version.stdout:
        pytest.fail(
            f"{path} --version did not answer {pinned_version(package)}: "
            f"{version.stdout[-500:]} {version.stderr[-1500:]}",
            pytrace=False,
        )
    return str(path)


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """A minimal environment for an agent: PATH and locale only, so a developer's own keys,
    base URLs or agent settings never leak into (or out through) a test run."""
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TMPDIR")}
    return {**keep, **extra}


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll until ``condition`` holds; the deadline only bounds a failure, so a busy machine
    makes the test slower, never wrong."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def run_agent(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300.0
) -> subprocess.CompletedProcess[str]:
    """Run an agent CLI to completion in its own process group, so that on a timeout its
    helpers (Codex's node wrapper starts a native binary) are ended with it."""
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"{Path(args[0]).name} did not finish in {timeout:.0f} s:\n{out[-2000:]}\n{err[-3000:]}"
        ) from None
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def summarize_in_prose(request_json: dict[str, Any]) -> str:
    """A scripted summarizer that writes a short prose memory from the transcript's own words
    (the proxy refuses summaries that are off-topic or shaped like a transcript)."""
    users = [m for m in request_json.get("messages") or [] if m.get("role") == "user"]
    transcript = message_text(users[-1]) if users else ""
    words: list[str] = []
    for word in re.findall(r"\b[a-z][a-z-]{3,}\b", transcript):  # lower case: no markers, ids
        if word not in words:
            words.append(word)
    subject = ", ".join(words[:30]) or "the project"
    return f"So far the work covered {subject}. The assistant answered every request."
