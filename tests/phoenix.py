"""Start Arize Phoenix (``phoenix serve``) as a real OTLP collector on free ports, and read
the spans it stored back through its REST API.

Phoenix lives in its own virtualenv (``.venv-phoenix``, made by ``.ci/run`` from
``tests/requirements-phoenix.txt``) or wherever ``$PHOENIX_BIN`` points.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import httpx

from tests import childproc
from tests.proxyproc import free_port

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 180.0


def phoenix_bin() -> str:
    found = os.environ.get("PHOENIX_BIN") or str(ROOT / ".venv-phoenix" / "bin" / "phoenix")
    assert Path(found).exists(), (
        f"Arize Phoenix is not installed at {found}: python3 -m venv .venv-phoenix && "
        ".venv-phoenix/bin/pip install -r tests/requirements-phoenix.txt (as .ci/run does)"
    )
    return found


class Phoenix:
    """``phoenix serve`` on 127.0.0.1: OTLP over HTTP at ``/v1/traces`` of ``url``, over gRPC
    at ``grpc_url``; its database in ``work``, no telemetry of its own."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.port, self.grpc_port = free_port(), free_port()
        self.log_path = work / "phoenix.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def grpc_url(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    def start(self) -> Phoenix:
        env = {
            **os.environ,
            "PHOENIX_HOST": "127.0.0.1",
            "PHOENIX_PORT": str(self.port),
            "PHOENIX_GRPC_PORT": str(self.grpc_port),
            "PHOENIX_WORKING_DIR": str(self.work),
            "PHOENIX_TELEMETRY_ENABLED": "false",
            "PHOENIX_DISABLE_AGENT_ASSISTANT": "true",
        }
        for name in [k for k in env if k.startswith("OTEL_")]:
            env.pop(name)  # Phoenix would trace itself to wherever they point
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [phoenix_bin(), "serve"], stdout=log, stderr=subprocess.STDOUT, env=env,
                cwd=self.work,
            )  # fmt: skip
        childproc.wait_ready(
            self.proc, f"{self.url}/healthz", START_TIMEOUT_S, "phoenix", self.logs
        )
        return self

    def stop(self) -> None:
        childproc.stop(self.proc, grace_s=20)

    def logs(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except OSError:
            return "(no log)"

    def spans(self, project: str) -> list[dict[str, Any]]:
        """Every span Phoenix stored for ``project`` (its REST API, page by page)."""
        out: list[dict[str, Any]] = []
        cursor = None
        while True:
            params: dict[str, Any] = {"limit": 1000}
            if cursor:
                params["cursor"] = cursor
            r = httpx.get(f"{self.url}/v1/projects/{project}/spans", params=params, timeout=30)
            if r.status_code == 404:
                return []  # no span of that project has arrived yet
            r.raise_for_status()
            body = r.json()
            out.extend(body["data"])
            cursor = body.get("next_cursor")
            if not cursor:
                return out

    def __enter__(self) -> Phoenix:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
