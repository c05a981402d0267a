"""SmolLM2-135M under llama.cpp's OpenAI-compatible server, for the real-model tests."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from eval.llama_server import smollm2_path
from tests.proxyproc import free_port


@contextmanager
def smollm2_server(log: Path) -> Iterator[str]:
    """The server's base URL while it runs (``eval.llama_server``: llama_cpp.server with the
    AMX path off, which segfaults on VMs that report AMX without granting it)."""
    assert importlib.util.find_spec("llama_cpp") is not None, "llama-cpp-python[server] missing"
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "eval.llama_server", "--model", smollm2_path(),
                "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "8192",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{base}/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "llama.cpp server did not start"
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
