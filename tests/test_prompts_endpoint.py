"""Prompts come from one place (issue #15): ``compaction.detector_prompt`` /
``summarizer_prompt`` when set (relative to the config file), else the packaged files; and
``compaction.summary_base_url`` sends the compaction calls to their own endpoint."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from proxy.config import PACKAGED_PROMPTS, ConfigError, load_config, load_prompt
from tests.proxyproc import ProxyProcess
from tests.test_metrics_admin import run_conversation
from tests.upstream import ScriptedUpstream

ROOT = Path(__file__).resolve().parent.parent
INLINE = {
    "trigger_tokens": 4000,
    "verbatim_window_tokens": 1200,
    "summary_budget_tokens": 300,
    "mode": "inline",
}


def test_default_prompts_are_the_packaged_files() -> None:
    for name in ("detector", "summarizer"):
        assert load_prompt(name) == (PACKAGED_PROMPTS / f"{name}.md").read_text()


def test_configured_prompt_paths_are_relative_to_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "mine.md").write_text("MY DETECTOR")
    config_file = tmp_path / "proxy.yaml"
    config_file.write_text("compaction:\n  detector_prompt: mine.md\n")
    config = load_config(config_file)
    assert load_prompt("detector", config.compaction) == "MY DETECTOR"
    assert load_prompt("summarizer", config.compaction) == load_prompt("summarizer")
    config_file.write_text("compaction:\n  summarizer_prompt: missing.md\n")
    with pytest.raises(ConfigError, match=r"compaction\.summarizer_prompt: cannot read"):
        load_prompt("summarizer", load_config(config_file).compaction)


def test_readme_points_at_the_prompt_files_the_code_reads() -> None:
    readme = (ROOT / "README.md").read_text()
    mentioned = set(re.findall(r"`([\w/]+/prompts/\w+\.md)`", readme))
    assert mentioned, "the README names no prompt file"
    for path in mentioned:
        assert (ROOT / path).resolve().parent == PACKAGED_PROMPTS.resolve(), path
        assert (ROOT / path).is_file(), path
    # No second copy that editing would silently not use.
    assert not (ROOT / "config" / "prompts").exists()
    assert not PACKAGED_PROMPTS.is_symlink()


def test_custom_prompt_and_a_separate_compaction_endpoint(tmp_path: Path) -> None:
    marker = "CUSTOM-DETECTOR-PROMPT-7731"
    (tmp_path / "detector.md").write_text(f"{marker}\n" + load_prompt("detector"))
    with ScriptedUpstream() as upstream, ScriptedUpstream() as compaction_endpoint:
        proxy = ProxyProcess(
            tmp_path,
            upstream.base_url,
            compaction={
                **INLINE,
                "detector_prompt": str(tmp_path / "detector.md"),
                "summary_base_url": compaction_endpoint.base_url,
                "summary_api_key": "sk-compaction-only",
            },
        )
        with proxy:
            run_conversation(proxy.base_url, "sk-client-key", 14)
            logs = proxy.logs()
        detector_calls = compaction_endpoint.chat_requests("detector")
        summarizer_calls = compaction_endpoint.chat_requests("summarizer")
    assert detector_calls, logs
    assert upstream.chat_requests("detector") == upstream.chat_requests("summarizer") == []
    assert all(marker in call.json["messages"][0]["content"] for call in detector_calls)
    for call in detector_calls + summarizer_calls:
        # The compaction endpoint gets its own key, never the client's.
        assert call.headers.get("authorization") == "Bearer sk-compaction-only"
    assert f"compaction calls -> {compaction_endpoint.base_url}" in logs
