"""proxy.modelmap: facts from LiteLLM's bundled model map, read without importing litellm."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.core import modelmap
from proxy.core.modelmap import ModelInfo, context_window, model_info, provider_family

REPO = Path(__file__).resolve().parents[1]


def _raw_map() -> dict:
    pkg = modelmap.litellm_package_dir()
    assert pkg is not None
    return json.loads((pkg / "model_prices_and_context_window_backup.json").read_text())


def test_gpt_4o_context_window_matches_the_json() -> None:
    assert context_window("gpt-4o") == 128000
    assert context_window("gpt-4o") == _raw_map()["gpt-4o"]["max_input_tokens"]


def test_model_info_fields() -> None:
    info = model_info("gpt-4o")
    assert isinstance(info, ModelInfo)
    raw = _raw_map()["gpt-4o"]
    assert info.name == "gpt-4o"
    assert info.provider == "openai"
    assert info.input_cost_per_token == raw["input_cost_per_token"]
    assert info.output_cost_per_token == raw["output_cost_per_token"]
    assert info.cache_read_input_token_cost == raw["cache_read_input_token_cost"]


def test_claude_context_window_and_cache_costs() -> None:
    # The installed map has dropped retired Claude 3.x names, so use a current model.
    assert context_window("claude-sonnet-4-5-20250929") == 200000
    info = model_info("claude-sonnet-4-5-20250929")
    assert info is not None and info.provider == "anthropic"
    assert info.cache_creation_input_token_cost is not None
    assert info.cache_read_input_token_cost is not None


def test_provider_prefix_is_stripped() -> None:
    assert model_info("openai/gpt-4o") == model_info("gpt-4o")
    info = model_info("anthropic/claude-sonnet-4-5-20250929")
    assert info is not None and info.name == "claude-sonnet-4-5-20250929"


def test_exact_key_with_slash_wins() -> None:
    info = model_info("azure/gpt-4o-2024-08-06")
    assert info is not None and info.name == "azure/gpt-4o-2024-08-06"
    assert info.provider == "azure"


def test_dated_suffix_is_stripped() -> None:
    info = model_info("gpt-4o-2099-01-01")
    assert info is not None and info.name == "gpt-4o"
    info = model_info("claude-sonnet-4-5-20990101")
    assert info is not None and info.name == "claude-sonnet-4-5"


def test_max_tokens_fallback() -> None:
    raw = _raw_map()
    key = next(
        k
        for k, v in raw.items()
        if k != "sample_spec"
        and "max_input_tokens" not in v
        and isinstance(v.get("max_tokens"), int)
    )
    assert context_window(key) == raw[key]["max_tokens"]


@pytest.mark.parametrize("name", ["my-local-llama", "", "sample_spec", "nope/also-unknown"])
def test_unknown_is_none(name: str) -> None:
    assert model_info(name) is None
    assert context_window(name) is None


@pytest.mark.parametrize(
    ("model", "family"),
    [
        ("claude-sonnet-4-5-20250929", "anthropic"),
        ("claude-3-5-sonnet-20241022", "anthropic"),  # not in the map: by name
        ("anthropic/claude-opus-4-5", "anthropic"),
        ("bedrock/us-west-2/anthropic.claude-v2:1", "anthropic"),
        ("vertex_ai/claude-3-5-haiku@20241022", "anthropic"),
        ("gpt-4o", "openai"),
        ("openai/gpt-4o", "openai"),
        ("azure/my-deployment", "openai"),
        ("gpt-3.5-turbo", "openai"),
        ("o1", "openai"),
        ("o3-mini", "openai"),
        ("o4-mini", "openai"),
        ("gpt-5", "openai"),
        ("openrouter/openai/gpt-4o", "openai"),
        ("my-local-llama", "other"),
        ("gemini/gemini-1.5-pro", "other"),
        ("ollama/llama3", "other"),
        ("omni-model", "other"),
    ],
)
def test_provider_family(model: str, family: str) -> None:
    assert provider_family(model) == family


def test_does_not_import_litellm() -> None:
    code = (
        "import sys; from proxy.core.modelmap import context_window; "
        "assert context_window('gpt-4o'); assert 'litellm' not in sys.modules"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=REPO, env={"PYTHONPATH": str(REPO)}
    )
