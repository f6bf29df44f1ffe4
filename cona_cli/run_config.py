"""A run's config as the controller reads it: the YAML file, the command line's overrides, and
`cluster.nodes: slurm` resolved to the allocation's node count, then validated (`cona_core.config`).
The resolved config is what the run folder records and the workers read: they never look at Slurm."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cona_cli.cluster.slurm import SlurmError, allocation_hosts
from cona_core.config import Config, ConfigError, apply_overrides, config_from_dict, read_yaml


def resolve_allocation(raw: Any) -> Any:
    """`raw` with `cluster.nodes: slurm` replaced by the node count of the Slurm allocation this process runs
    in, and `launcher: slurm` unless it names one; any other document as it is."""
    cluster = raw.get("cluster") if isinstance(raw, dict) else None
    if not isinstance(cluster, dict) or cluster.get("nodes") != "slurm":
        return raw
    try:
        nodes = len(allocation_hosts())
    except SlurmError as e:
        raise ConfigError(f"cluster.nodes: slurm: {e}") from None
    return {**raw, "cluster": {"launcher": "slurm", **cluster, "nodes": nodes}}


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> Config:
    """Load and validate a YAML config; `overrides` replace top-level keys or `section.key` values."""
    raw = read_yaml(path)
    if isinstance(raw, dict):
        apply_overrides(raw, overrides)
    try:
        return config_from_dict(resolve_allocation(raw), str(path))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
