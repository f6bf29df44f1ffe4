"""`--set key.path=value` on the command line: a dotted path of any depth into the config's mappings, and
a value parsed as YAML (a scalar, a list or a mapping)."""

from __future__ import annotations

import re
from typing import Any

import yaml

from cona_core.config import ConfigError

# PyYAML reads 3e-4 (no dot) as a string; on the command line it is the number a user means.
_EXP_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _number(value: Any) -> Any:
    if isinstance(value, str) and _EXP_FLOAT.fullmatch(value.strip()):
        return float(value)
    if isinstance(value, list):
        return [_number(v) for v in value]
    if isinstance(value, dict):
        return {k: _number(v) for k, v in value.items()}
    return value


def overlaps(a: str, b: str) -> bool:
    """Whether two dotted keys name the same value or one holds the other (`cluster.env`, `cluster.env.X`)."""
    return a == b or a.startswith(f"{b}.") or b.startswith(f"{a}.")


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    """`["train.lr=3e-4", "cluster.env.NCCL_DEBUG=INFO"]` -> {"train.lr": 0.0003, "cluster.env.NCCL_DEBUG":
    "INFO"}; ConfigError (one line naming the key) for a malformed item or two items setting the same value.
    Unknown keys are the config's to refuse."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set {item}: expected key.path=value, e.g. train.lr=3e-4")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            raise ConfigError(f"--set {key}: {text!r} is not a YAML value") from None
        given = next((k for k in out if overlaps(k, key)), None)
        if given is not None:
            raise ConfigError(f"--set {key}: given twice" if given == key else f"--set {key}: overlaps --set {given}")
        out[key] = _number(value)
    return out
