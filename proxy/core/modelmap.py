"""Model facts (context window, prices, provider) from LiteLLM's bundled model map.

The map is read straight from the JSON file shipped inside the installed ``litellm``
package, without importing ``litellm``: that import is slow and may reach for the network
to refresh the map. Everything here is offline and deterministic for a given install.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("compaction_proxy.modelmap")

MAP_FILE = "model_prices_and_context_window_backup.json"
_MAP_FILE = MAP_FILE

# A trailing release date: OpenAI style "-2024-08-06", Anthropic style "-20241022",
# Vertex style "@20241022". Only stripped when the undated name is itself in the map.
_DATE_SUFFIX = re.compile(r"[-@](?:\d{4}-\d{2}-\d{2}|\d{8})$")

_ANTHROPIC_PROVIDERS = frozenset({"anthropic", "vertex_ai-anthropic_models"})
_OPENAI_PROVIDERS = frozenset({"openai", "text-completion-openai", "azure", "azure_text"})
# Bare OpenAI model names: gpt-*, chatgpt-*, and the o-series reasoning models.
_OPENAI_NAME = re.compile(r"^(?:gpt-|chatgpt-|o[134](?:-|$))")


@dataclass(frozen=True)
class ModelInfo:
    """What the LiteLLM map says about one model.

    ``name`` is the map key that matched (which may differ from the name asked for).
    Every other field is None when the map does not give it; costs are USD per token.
    ``max_input_tokens`` falls back to the map's ``max_tokens`` when absent.
    """

    name: str
    provider: str | None
    max_input_tokens: int | None
    input_cost_per_token: float | None
    output_cost_per_token: float | None
    cache_read_input_token_cost: float | None
    cache_creation_input_token_cost: float | None


def litellm_package_dir() -> Path | None:
    """The installed ``litellm`` package directory, found without importing it."""
    spec = importlib.util.find_spec("litellm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


# What the proxy reads of an entry: ModelInfo's fields after ``name``, in order.
_Entry = tuple[str | None, int | None, float | None, float | None, float | None, float | None]


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _entry(raw: dict[str, Any]) -> _Entry:
    provider = raw.get("litellm_provider")
    return (
        provider if isinstance(provider, str) else None,
        _int(raw.get("max_input_tokens")) or _int(raw.get("max_tokens")),
        _float(raw.get("input_cost_per_token")),
        _float(raw.get("output_cost_per_token")),
        _float(raw.get("cache_read_input_token_cost")),
        _float(raw.get("cache_creation_input_token_cost")),
    )


@functools.cache
def _model_map() -> dict[str, _Entry]:
    """The map, loaded once, each entry reduced to what ``ModelInfo`` reads: the whole file
    parsed is about 4 MiB of objects that would otherwise live as long as the process.
    Empty (with a warning) if litellm's file is missing."""
    pkg = litellm_package_dir()
    path = pkg / _MAP_FILE if pkg else None
    if path is None or not path.is_file():
        logger.warning("LiteLLM model map not found (%s); model facts unavailable", path)
        return {}
    with path.open("rb") as f:
        raw = json.load(f)
    # "sample_spec" documents the schema; its values are prose, not facts.
    return {k: _entry(v) for k, v in raw.items() if isinstance(v, dict) and k != "sample_spec"}


def _candidates(model: str) -> Iterator[str]:
    """Names to try, most specific first: exact, provider prefixes stripped, then undated."""
    names = [model]
    rest = model
    while "/" in rest:
        rest = rest.split("/", 1)[1]
        if rest:
            names.append(rest)
    yield from names
    for name in names:
        undated = _DATE_SUFFIX.sub("", name)
        if undated != name:
            yield undated


@functools.lru_cache(maxsize=4096)
def model_info(model: str) -> ModelInfo | None:
    """Facts about ``model``, or None if the map does not know it.

    Lookup order: the exact key; the name with leading ``provider/`` segments stripped
    (``openai/gpt-4o`` -> ``gpt-4o``); then the same names with a trailing release date
    removed (``gpt-4o-2099-01-01`` -> ``gpt-4o``). Results are memoised per name.
    """
    table = _model_map()
    for name in _candidates(model.strip()):
        entry = table.get(name)
        if entry is not None:
            return ModelInfo(name, *entry)
    return None


def context_window(model: str) -> int | None:
    """The model's maximum input tokens per the map, or None if unknown."""
    info = model_info(model)
    return info.max_input_tokens if info else None


@functools.lru_cache(maxsize=4096)
def provider_family(model: str) -> str:
    """``"anthropic"``, ``"openai"`` or ``"other"``: whose API conventions the model follows.

    "anthropic": Claude models wherever served (Anthropic, Bedrock, Vertex, ...), i.e. the
    name contains "claude", has an ``anthropic/`` prefix, or the map's provider is Anthropic.
    "openai": the map's provider is OpenAI or Azure (OpenAI), the name has an ``openai/`` or
    ``azure/`` prefix, or the bare name is a gpt-*/chatgpt-*/o1/o3/o4 model.
    Anything else (including unknown names) is "other". Memoised per name.
    """
    name = model.strip().lower()
    info = model_info(model)
    provider = info.provider if info else None
    if "claude" in name or name.startswith("anthropic/") or provider in _ANTHROPIC_PROVIDERS:
        return "anthropic"
    bare = name.rsplit("/", 1)[-1]
    if (
        provider in _OPENAI_PROVIDERS
        or name.startswith(("openai/", "azure/"))
        or _OPENAI_NAME.match(bare)
    ):
        return "openai"
    return "other"


def input_price(model: str) -> float:
    """USD per input token from LiteLLM's model map; 0.0 for an unknown or free model."""
    info = model_info(model)
    return info.input_cost_per_token if info and info.input_cost_per_token else 0.0
