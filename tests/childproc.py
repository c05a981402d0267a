"""A real server a test starts as a child process (Phoenix, Prometheus, a LiteLLM proxy): wait
until it answers, stop it. One copy of what each of them repeated."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import httpx


def wait_ready(
    proc: subprocess.Popen[bytes],
    url: str,
    timeout_s: float,
    what: str,
    logs: Callable[[], str],
) -> None:
    """Until a GET of ``url`` answers 200; ``RuntimeError`` (with ``logs()``) when ``proc``
    exits first or ``timeout_s`` passes (the process is then stopped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}):\n{logs()}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    stop(proc)
    raise RuntimeError(f"{what} did not start in {timeout_s:.0f} s:\n{logs()}")


def stop(proc: subprocess.Popen[bytes] | None, grace_s: float = 15) -> None:
    """Terminate ``proc`` (if still running), killing it after ``grace_s``."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
