"""`--set section.key=value` on the command line: each value parsed as a YAML scalar or list."""

from __future__ import annotations

import re
from typing import Any

import yaml

from cona_cli.config import ConfigError

# PyYAML reads 3e-4 (no dot) as a string; on the command line it is the number a user means.
_EXP_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _number(value: Any) -> Any:
    if isinstance(value, str) and _EXP_FLOAT.fullmatch(value.strip()):
        return float(value)
    if isinstance(value, list):
        return [_number(v) for v in value]
    return value


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    """`["train.lr=3e-4", "search.mbs=[1,2]"]` -> {"train.lr": 0.0003, "search.mbs": [1, 2]}; ConfigError
    (one line naming the key) for a malformed item. Unknown keys are the config's to refuse."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not key or any(not part for part in key.split(".")) or key.count(".") > 1:
            raise ConfigError(f"--set {item}: expected section.key=value (or a top-level key=value)")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            raise ConfigError(f"--set {key}: {text!r} is not a YAML value") from None
        if isinstance(value, dict) and "." in key:
            raise ConfigError(f"--set {key}: must be a scalar or a list, got a mapping")
        if key in out:
            raise ConfigError(f"--set {key}: given twice")
        out[key] = _number(value)
    return out
