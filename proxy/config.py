"""Configuration: YAML read once into frozen values; an error names the key (uvicorn style).

``load_config`` does the side effects (reading the file, the environment); the dataclasses
only hold values.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from proxy.core.settings import CompactionSettings

ENV_VAR = "COMPACTION_PROXY_CONFIG"
_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-(.*?))?\}")


TRANSPORTS = ("h1", "aiohttp", "httpx")


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key."""


@dataclass(frozen=True)
class Listen:
    host: str = "127.0.0.1"
    port: int = 4000


@dataclass(frozen=True)
class Upstream:
    base_url: str = "https://api.openai.com/v1"
    api_key: str | None = None
    timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    max_connections: int = 512
    transport: str = "h1"  # the wire under the httpx client: h1 | aiohttp | httpx


@dataclass(frozen=True)
class StoreConfig:
    url: str = "diskcache://~/.cache/compaction-proxy"
    retention_days: float = 30.0


@dataclass(frozen=True)
class Limits:
    max_body_mb: float = 32.0
    body_timeout_s: float = 60.0  # the whole request body, from its first byte to its last
    # Recent bodies a worker keeps (their bytes), so a body that resends one is parsed only
    # past what they share (proxy.core.reparse; with their parsed values a worker holds
    # ~2-3 times this).
    reparse_memory_mb: float = 8.0


@dataclass(frozen=True)
class Admin:
    token: str | None = None
    protect_metrics: bool = True


@dataclass(frozen=True)
class Tracing:
    """OpenTelemetry traces (``proxy.engine.tracing``): off unless an endpoint is set here or
    in ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``."""

    endpoint: str | None = None  # null: the standard OTEL_EXPORTER_OTLP_* variables
    protocol: str | None = None  # grpc | http/protobuf; null: OTEL_EXPORTER_OTLP_*PROTOCOL
    capture_content: bool = False  # message text in spans (never by default)


TRACE_PROTOCOLS = ("grpc", "http/protobuf")


@dataclass(frozen=True)
class Config:
    listen: Listen = field(default_factory=Listen)
    upstream: Upstream = field(default_factory=Upstream)
    store: StoreConfig = field(default_factory=StoreConfig)
    limits: Limits = field(default_factory=Limits)
    compaction: CompactionSettings = field(default_factory=CompactionSettings)
    admin: Admin = field(default_factory=Admin)
    tracing: Tracing = field(default_factory=Tracing)

    @property
    def max_body_bytes(self) -> int:
        return int(self.limits.max_body_mb * 1024 * 1024)

    @property
    def retention_s(self) -> float:
        return self.store.retention_days * 86400


def _expand(value: Any, where: str) -> Any:
    """Expand ``${VAR}`` / ``${VAR:-default}``; an unset variable without default is an error."""
    if isinstance(value, str):

        def sub(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in os.environ:
                return os.environ[name]
            if default is not None:
                return default
            raise ConfigError(f"{where}: environment variable {name} is not set")

        expanded = _ENV_RE.sub(sub, value)
        return None if expanded == "" and _ENV_RE.fullmatch(value) else expanded
    if isinstance(value, dict):
        return {k: _expand(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, where) for v in value]
    return value


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check ``value`` against a resolved type hint (``int``, ``str | None``, ``Literal``)."""
    args = get_args(annotation)
    if get_origin(annotation) is tuple:  # tuple[str, ...]: a YAML list of strings
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: must be a list of strings, not {value!r}")
        return tuple(value)
    if get_origin(annotation) is Literal:
        if value not in args:
            raise ConfigError(f"{where}: must be one of {list(args)}, not {value!r}")
        return value
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(f"{where}: must not be null")
    base = next((a for a in args if a is not type(None)), annotation) if args else annotation
    if base is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: must be true or false, not {value!r}")
        return value
    if base in (int, float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: must be a number, not {value!r}")
        if base is int and not float(value).is_integer():
            raise ConfigError(f"{where}: must be an integer, not {value!r}")
        if value < 0:
            raise ConfigError(f"{where}: must not be negative")
        return base(value)
    if base is str:
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            raise ConfigError(f"{where}: must be a string, not {value!r}")
        return value
    return value


def _section(cls: type, raw: Any, where: str) -> Any:
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping")
    known = {f.name: f for f in fields(cls)}
    hints = get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"{where}.{key}: unknown key (known: {', '.join(known)})")
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}")
    return cls(**kwargs)


_SECTIONS: dict[str, type] = {
    "listen": Listen,
    "upstream": Upstream,
    "store": StoreConfig,
    "limits": Limits,
    "compaction": CompactionSettings,
    "admin": Admin,
    "tracing": Tracing,
}


def parse_config(raw: Any, overrides: dict[str, dict[str, Any]] | None = None) -> Config:
    """A ``Config`` from parsed YAML; raises ``ConfigError`` naming the first bad key.

    ``overrides`` (command-line flags, ``{"listen": {"port": 70000}}``) replace the file's
    values before validation, so a flag gets exactly the checks and messages YAML gets.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("config: the top level must be a mapping")
    raw = _expand(raw, "config")
    for name, values in (overrides or {}).items():
        section = raw.get(name)
        raw[name] = {**(section if isinstance(section, dict) else {}), **values}
    sections = {}
    for key, value in raw.items():
        if key not in _SECTIONS:
            raise ConfigError(f"{key}: unknown section (known: {', '.join(_SECTIONS)})")
        sections[key] = _section(_SECTIONS[key], value, key)
    config = Config(**sections)
    compaction_raw = raw.get("compaction")
    if "verbatim_window_tokens" not in (compaction_raw or {}):
        config = replace(config, compaction=_scaled_window(config.compaction))
    _check(config)
    return config


def _scaled_window(c: CompactionSettings) -> CompactionSettings:
    """A trigger set below the default verbatim window (window not set): scale the window
    down in the default proportion (4,000 of 24,000) instead of refusing the config."""
    if 0 < c.trigger_tokens <= c.verbatim_window_tokens:
        default = CompactionSettings()
        ratio = default.verbatim_window_tokens / default.trigger_tokens
        return replace(c, verbatim_window_tokens=max(1, int(c.trigger_tokens * ratio)))
    return c


def _check(config: Config) -> None:
    c = config.compaction
    if c.trigger_tokens <= 0:
        raise ConfigError("compaction.trigger_tokens: must be positive")
    if c.verbatim_window_tokens >= c.trigger_tokens:
        raise ConfigError(
            f"compaction.verbatim_window_tokens: must be below trigger_tokens "
            f"(verbatim_window_tokens is {c.verbatim_window_tokens}, "
            f"trigger_tokens is {c.trigger_tokens})"
        )
    if c.emergency_factor is not None and c.emergency_factor < 1.0:
        raise ConfigError("compaction.emergency_factor: must be at least 1.0")
    if not 0.0 <= c.min_confidence <= 1.0:
        raise ConfigError("compaction.min_confidence: must be between 0 and 1")
    if not 0.0 <= c.shadow_sample_rate <= 1.0:
        raise ConfigError("compaction.shadow_sample_rate: must be between 0 and 1")
    if not 0.0 < c.pin_max_share <= 1.0:
        raise ConfigError("compaction.pin_max_share: must be above 0 and at most 1")
    for i, pattern in enumerate(c.pin_patterns):
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"compaction.pin_patterns[{i}]: not a valid regex: {exc}") from exc
    if not 0.0 < c.compact_to_share <= 1.0:
        raise ConfigError("compaction.compact_to_share: must be above 0 and at most 1")
    if c.summary_budget_tokens < 16:
        raise ConfigError("compaction.summary_budget_tokens: must be at least 16")
    if c.summary_base_url and not c.summary_base_url.startswith(("http://", "https://")):
        raise ConfigError("compaction.summary_base_url: must start with http:// or https://")
    if not config.upstream.base_url.startswith(("http://", "https://")):
        raise ConfigError("upstream.base_url: must start with http:// or https://")
    if config.upstream.transport not in TRANSPORTS:
        raise ConfigError(
            f"upstream.transport: must be one of {', '.join(TRANSPORTS)} "
            f"(not {config.upstream.transport!r})"
        )
    if config.tracing.protocol is not None and config.tracing.protocol not in TRACE_PROTOCOLS:
        raise ConfigError(
            f"tracing.protocol: must be one of {', '.join(TRACE_PROTOCOLS)} "
            f"(not {config.tracing.protocol!r})"
        )
    if config.limits.max_body_mb <= 0:
        raise ConfigError("limits.max_body_mb: must be positive")
    if not 0 < config.listen.port < 65536:
        raise ConfigError("listen.port: must be between 1 and 65535")


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> Config:
    """Read ``path`` (or ``$COMPACTION_PROXY_CONFIG``); no file means all defaults.

    Relative prompt paths (``compaction.detector_prompt`` / ``summarizer_prompt``) are taken
    relative to the config file's folder, so the config works from any working directory.
    """
    path = path or os.environ.get(ENV_VAR)
    if not path:
        return parse_config({}, overrides)
    file = Path(path).expanduser()
    try:
        raw = yaml.safe_load(file.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {file}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file}: not valid YAML: {exc}") from exc
    config = parse_config(raw, overrides)
    prompts: dict[str, Any] = {}
    for name in PROMPT_NAMES:
        configured = getattr(config.compaction, f"{name}_prompt")
        if configured and not Path(configured).expanduser().is_absolute():
            prompts[f"{name}_prompt"] = str(file.resolve().parent / configured)
    return replace(config, compaction=replace(config.compaction, **prompts)) if prompts else config


PROMPT_NAMES = ("detector", "summarizer")
PACKAGED_PROMPTS = Path(__file__).parent / "prompts"


def prompt_path(name: str, settings: CompactionSettings | None = None) -> Path:
    """Where prompt ``name`` is read from: ``compaction.<name>_prompt`` when set, else the
    packaged ``proxy/prompts/<name>.md``."""
    configured = getattr(settings, f"{name}_prompt", None) if settings else None
    return Path(configured).expanduser() if configured else PACKAGED_PROMPTS / f"{name}.md"


def load_prompt(name: str, settings: CompactionSettings | None = None) -> str:
    """Prompt ``name``'s text; an unreadable or empty file is a ``ConfigError`` naming the key
    (raised at start-up, never per request)."""
    path = prompt_path(name, settings)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"compaction.{name}_prompt: cannot read {path}: {reason}") from exc
    if not text.strip():
        raise ConfigError(f"compaction.{name}_prompt: {path} is empty")
    return text
