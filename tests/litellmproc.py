"""Start ``litellm --config`` as a real process, built from the shipped ``config/litellm.yaml``
with its model pointed at a scripted upstream (the LiteLLM hook as users run it)."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import yaml

from tests import childproc
from tests.proxyproc import free_port
from tests.upstream import ScriptedUpstream

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_CONFIG = ROOT / "config" / "litellm.yaml"
MODEL = "gpt-4o-mini"
START_TIMEOUT_S = 120.0
HOOK = "hooks.litellm_compaction.compaction_hook"


def litellm_cli() -> str:
    found = Path(sys.executable).parent / "litellm"
    assert found.exists(), "litellm is not installed (pip install -e '.[dev]')"
    return str(found)


class LiteLLMProcess:
    """``litellm --config`` with the shipped config, its model pointed at the scripted upstream.

    ``via`` says where the hook finds its settings: ``env`` ($COMPACTION_PROXY_CONFIG) or
    ``litellm`` (the ``compaction_proxy:`` section of LiteLLM's own config file).
    """

    def __init__(
        self,
        tmp: Path,
        upstream_url: str,
        compaction: dict[str, Any],
        store_url: str,
        via: str,
        prometheus: bool = False,
    ) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.master_key = "sk-" + secrets.token_hex(24)
        self.store_url = store_url
        # As in ProxyProcess: the mechanics of compaction, not its money rules (test_economics).
        settings = {"store": {"url": store_url}, "compaction": {"policy": "tokens", **compaction}}
        config = yaml.safe_load(SHIPPED_CONFIG.read_text())
        assert config["litellm_settings"]["callbacks"] == "hooks.litellm_compaction.compaction_hook"
        if prometheus:  # LiteLLM's /metrics, which shows the hook's metrics too
            config["litellm_settings"]["callbacks"] = [HOOK, "prometheus"]
        config["model_list"] = [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"openai/{MODEL}",
                    "api_base": upstream_url,
                    "api_key": "sk-fake",
                },
            }
        ]
        self.env = {
            **os.environ,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_MASTER_KEY": self.master_key,
            "COMPACTION_PROXY_LOG_LEVEL": "DEBUG",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "NO_PROXY": "127.0.0.1,localhost",
        }
        self.env.pop("COMPACTION_PROXY_CONFIG", None)
        if via == "env":
            config.pop("compaction_proxy", None)
            settings_path = tmp / "compaction.yaml"
            settings_path.write_text(yaml.safe_dump(settings))
            self.env["COMPACTION_PROXY_CONFIG"] = str(settings_path)
        else:
            config["compaction_proxy"] = settings
        self.config_path = tmp / "litellm.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = tmp / "litellm.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self, tenant: str) -> openai.OpenAI:
        # A tenant per test: runs of the same scripted conversation never share records.
        return openai.OpenAI(
            base_url=self.base_url,
            api_key=self.master_key,
            max_retries=0,
            timeout=60,
            default_headers={"x-compaction-tenant": tenant},
        )

    def start(self) -> LiteLLMProcess:
        command = [litellm_cli(), "--config", str(self.config_path)]
        command += ["--host", "127.0.0.1", "--port", str(self.port)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.tmp
            )
        url = f"http://127.0.0.1:{self.port}/health/liveliness"
        childproc.wait_ready(self.proc, url, START_TIMEOUT_S, "litellm", self.logs)
        return self

    def stop(self) -> None:
        childproc.stop(self.proc)

    def logs(self, tail: int = 30_000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return "(no log)"

    @contextlib.contextmanager
    def logs_on_failure(self) -> Iterator[None]:
        """Print the LiteLLM log (pytest shows it) when the block fails."""
        try:
            yield
        except BaseException:
            print(f"---- litellm log ({self.log_path}) ----\n{self.logs()}")
            raise

    def hook_log_lines(self) -> list[str]:
        return [line for line in self.logs(10**7).splitlines() if "compaction_proxy" in line]


@contextlib.contextmanager
def running(
    tmp: Path,
    upstream: ScriptedUpstream,
    compaction: dict[str, Any],
    store_url: str,
    via: str,
    prometheus: bool = False,
) -> Iterator[LiteLLMProcess]:
    proc = LiteLLMProcess(tmp, upstream.base_url, compaction, store_url, via, prometheus)
    try:
        yield proc.start()
    finally:
        proc.stop()
