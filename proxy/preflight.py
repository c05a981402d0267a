"""What the proxy needs before it serves, checked once at start-up and by ``check``.

``serve`` stops with one clear message when LiteLLM's data files or a prompt file are
missing, instead of failing every request later; ``compaction-proxy check`` also opens the
store and asks the upstream, and prints what it found.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from proxy.adapters.reach import classify, safe_url
from proxy.config import PROMPT_NAMES, Config, ConfigError, load_prompt, prompt_path
from proxy.core.modelmap import MAP_FILE, litellm_package_dir

# The encodings the proxy counts with (tokens._SUBSTITUTE maps every other one onto these).
ENCODINGS = ("o200k_base", "cl100k_base", "p50k_base")
INSTALL_HINT = "reinstall compaction-proxy (pip install -e .), which installs litellm"


@dataclass(frozen=True)
class Finding:
    what: str
    ok: bool
    detail: str


def data_finding() -> Finding:
    """LiteLLM's model map and tokenizer files, which the proxy reads offline.

    The files are checked against the sha256 tiktoken expects, not built: ``serve`` runs this
    in the process that then serves, where an encoding built only to be checked would stay
    resident (13 MiB for p50k_base, which few models use) - see docs/benchmarks.md.
    """
    from proxy.core import tokens

    pkg = litellm_package_dir()
    if pkg is None:
        return Finding(
            "tokenizer and model-map data", False, f"litellm is not installed: {INSTALL_HINT}"
        )
    model_map = pkg / MAP_FILE
    if not model_map.is_file():
        return Finding(
            "tokenizer and model-map data",
            False,
            f"LiteLLM's model map is missing ({model_map}): {INSTALL_HINT}",
        )
    for name in ENCODINGS:
        try:
            tokens.verify_encoding_files(name)
        except (OSError, ValueError) as exc:
            return Finding(
                "tokenizer and model-map data",
                False,
                f"LiteLLM's tokenizer file for {name} is missing or damaged ({exc}): "
                f"{INSTALL_HINT}",
            )
    return Finding(
        "tokenizer and model-map data", True, f"{', '.join(ENCODINGS)} and the model map in {pkg}"
    )


def prompt_findings(config: Config) -> list[Finding]:
    out = []
    for name in PROMPT_NAMES:
        path = prompt_path(name, config.compaction)
        try:
            text = load_prompt(name, config.compaction)
        except ConfigError as exc:
            out.append(Finding(f"{name} prompt", False, str(exc)))
        else:
            out.append(Finding(f"{name} prompt", True, f"{path} ({len(text)} characters)"))
    return out


def startup_problems(config: Config) -> list[str]:
    """What stops ``serve`` before it listens: missing data files, unreadable prompts."""
    findings = [data_finding(), *prompt_findings(config)]
    return [f.detail for f in findings if not f.ok]


def store_finding(config: Config) -> Finding:
    from proxy.adapters.store import open_store

    url = config.store.url
    shown = safe_url(url) if "://" in url and not url.startswith("diskcache://") else url
    try:
        store = open_store(url)
        try:
            store.set("check:probe", 1, ttl=60)
            ok = store.get("check:probe") == 1
            store.delete("check:probe")
        finally:
            store.close()
    except Exception as exc:  # any backend failure is the finding itself
        return Finding(
            "store", False, f"{shown}: cannot open or write ({type(exc).__name__}: {exc})"
        )
    return Finding(
        "store", ok, f"{shown}: writable" if ok else f"{shown}: a write did not read back"
    )


def upstream_finding(base_url: str, timeout_s: float, what: str = "upstream") -> Finding:
    """Whether anything answers at ``base_url`` (GET …/models, no credentials sent: any HTTP
    status, 401 included, proves the endpoint is there)."""
    url = base_url.rstrip("/") + "/models"
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False) as client:
            response = client.get(url)
    except httpx.HTTPError as exc:
        found = classify(exc, url)
        return Finding(what, False, f"{safe_url(base_url)} unreachable: {found.reason}")
    return Finding(
        what, True, f"{safe_url(base_url)} answers (GET /models: HTTP {response.status_code})"
    )


def check(config: Config) -> list[Finding]:
    """Everything ``compaction-proxy check`` reports, in order."""
    findings = [Finding("config", True, "valid"), data_finding(), *prompt_findings(config)]
    findings.append(store_finding(config))
    timeout = min(config.upstream.connect_timeout_s, 10.0)
    findings.append(upstream_finding(config.upstream.base_url, timeout))
    if config.compaction.summary_base_url:
        findings.append(
            upstream_finding(config.compaction.summary_base_url, timeout, "compaction endpoint")
        )
    return findings
