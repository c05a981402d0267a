"""The README and config/proxy.yaml say what the code does (issue #15): every config key is in
the README's table and the example config, and every response case is documented."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import yaml

from proxy.config import _SECTIONS, parse_config

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def schema_keys() -> set[str]:
    return {f"{name}.{f.name}" for name, cls in _SECTIONS.items() for f in fields(cls)}


def readme_table_keys() -> set[str]:
    """Keys named in the first cell of the configuration table's rows; a short name after a
    full one (`compaction.detection_model` / `summary_model`) shares its section."""
    section = README.split("## Configuration reference", 1)[1].split("\n## ", 1)[0]
    keys: set[str] = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        prefix = ""
        for name in re.findall(r"`([^`]+)`", line.split("|")[1]):
            if "." in name:
                prefix = name.split(".", 1)[0]
                keys.add(name)
            else:
                keys.add(f"{prefix}.{name}")
    return keys


def test_readme_config_table_lists_every_key() -> None:
    table = readme_table_keys()
    assert schema_keys() - table == set(), "keys missing from the README's table"
    assert table - schema_keys() == set(), "the README's table names keys the code lacks"


def test_example_config_lists_every_key_and_parses() -> None:
    raw = yaml.safe_load((ROOT / "config" / "proxy.yaml").read_text())
    listed = {f"{section}.{key}" for section, values in raw.items() for key in values}
    assert listed == schema_keys()
    parse_config(raw)


def test_every_compaction_case_header_value_is_documented() -> None:
    row = next(line for line in README.splitlines() if line.startswith("| `x-compaction-case`"))
    for case in ("none", "summarize", "truncate", "emergency", "off", "error"):
        assert f"`{case}`" in row, case


def test_the_table_of_waits_names_real_keys_with_their_defaults() -> None:
    """docs/security.md's table of bounds: each `section.key` (N s) is a config key whose
    default is N, and every timeout key of the config is in the table."""
    security = (ROOT / "docs" / "security.md").read_text()
    table = security.split("## Every wait has a bound", 1)[1].split("\n## ", 1)[0]
    named = dict(re.findall(r"`(\w+\.\w+_s)` \(([\d.]+) s\)", table))
    defaults = {
        f"{name}.{f.name}": f.default for name, cls in _SECTIONS.items() for f in fields(cls)
    }
    assert named, "no bounds found in the table"
    for key, value in named.items():
        assert key in defaults, f"{key}: no such config key"
        assert float(value) == defaults[key], f"{key}: the table says {value}"
    timeouts = {k for k in defaults if k.endswith("timeout_s")}
    assert timeouts <= set(named), f"missing from the table: {sorted(timeouts - set(named))}"
