"""`cona train --resume RUN_DIR`: check that the run can continue, and rebuild its controller state.

Every refusal is a ConfigError with one line; nothing is launched before all checks pass.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from cona_cli.control import usable_checkpoints as checkpoints
from cona_cli.control.controller import INTERRUPT_GRACE_S
from cona_cli.control.policies import Policy
from cona_cli.control.run_setup import make_policy, resolve_config
from cona_cli.control.runstate import RunState, lock, wait_for_group
from cona_core.config import Config, ConfigError, config_from_json
from cona_core.rundir import RunDir, read_jsonl

RESUMABLE = ("interrupted", "failed", "requeued")  # exit reasons after which a run may continue


def first_difference(given: Any, stored: Any, where: str = "") -> str | None:
    """The first key (dotted) where two JSON documents differ, or None."""
    if isinstance(given, dict) and isinstance(stored, dict):
        for key in sorted(set(given) | set(stored)):
            diff = first_difference(given.get(key), stored.get(key), f"{where}.{key}" if where else key)
            if diff:
                return diff
        return None
    return None if given == stored else where or "config"


def run_time_so_far(run_dir: Path) -> float:
    """The latest run time recorded in metrics.jsonl or events.jsonl."""
    run = RunDir(run_dir)
    rows = read_jsonl(run.metrics, []) + read_jsonl(run.events, [])
    return max((r["time"] for r in rows if isinstance(r.get("time"), (int, float))), default=0.0)


def _finished(run_dir: Path) -> str | None:
    """The exit reason of a run that ended for good, else None."""
    for event in reversed(read_jsonl(RunDir(run_dir).events, [])):
        if event.get("kind") in ("start", "resume"):
            return None
        if event.get("kind") == "exit":
            return None if event.get("reason") in RESUMABLE else str(event.get("reason"))
    return None


def _check_config(
    run_dir: Path,
    stored: dict[str, Any],
    config: Path | None,
    strategy: str | None,
    chain: Path | None,
    max_steps: int | None,
    data: Path | None,
) -> None:
    """A CONFIG or flags given with --resume must resolve to the run's own config."""
    if config is None and strategy is None and chain is None and max_steps is None and data is None:
        return
    run = RunDir(run_dir)
    given, _ = make_policy(resolve_config(config or run.config_copy, strategy, chain, max_steps, data))
    diff = first_difference(json.loads(json.dumps(given.to_raw())), stored)
    if diff:
        raise ConfigError(
            f"--resume: {diff} differs from the run's config ({run.resolved_config}); "
            "resume with the same config and flags, or none"
        )


def prepare_resume(
    run_dir: Path,
    config: Path | None,
    strategy: str | None,
    chain: Path | None,
    max_steps: int | None,
    data: Path | None,
) -> tuple[Config, Policy, RunState]:
    """Validate RUN_DIR and the arguments; returns the run's config, its restored policy and state.

    Holds the run folder's lock from here on (another controller on it is refused)."""
    run = RunDir(run_dir)
    resolved = run.resolved_config
    if not resolved.is_file() or not run.holds_run():
        raise ConfigError(f"--resume: {run_dir} is not a run directory (no config.resolved.json or events.jsonl)")
    try:
        stored = json.loads(resolved.read_text())
        cfg = config_from_json(resolved.read_text(), str(resolved))
    except (json.JSONDecodeError, ConfigError) as e:
        raise ConfigError(f"--resume: {resolved}: {e}") from None
    _check_config(run_dir, stored, config, strategy, chain, max_steps, data)
    reason = _finished(run_dir)
    if reason is not None:
        raise ConfigError(f"--resume: {run_dir} already finished ({reason}); nothing to continue")
    try:
        lock(run_dir)
    except OSError:
        raise ConfigError(f"--resume: another controller is running on {run_dir}") from None
    try:
        state = RunState.load(run_dir) or RunState()
    except ValueError as e:
        raise ConfigError(f"--resume: {e}") from None
    try:
        corpus = json.loads(run.corpus.read_text())
    except (OSError, json.JSONDecodeError):
        raise ConfigError(f"--resume: {run.corpus} missing or unreadable") from None
    for key in ("train_path", "valid_path"):
        if not Path(corpus[key]).is_file():
            raise ConfigError(f"--resume: corpus file {corpus[key]} is gone (cache cleared?); cannot continue")
    for pgid in state.standby_pids:  # a pre-warmed job holds nothing worth waiting for
        wait_for_group(pgid, 0.0)
    state.standby_pids = []
    for pgid in state.agent_pids:  # an orphaned job may still be checkpointing
        wait_for_group(pgid, INTERRUPT_GRACE_S)
    root = run.checkpoints
    usable, skipped = checkpoints.newest_usable(
        root, checkpoints.expected_shapes(cfg, run), lambda m: print(f"cona: warning: {m}", file=sys.stderr)
    )
    if usable is None and skipped:
        raise ConfigError(f"--resume: no usable checkpoint in {root} ({skipped} unusable, moved to bad-*)")
    state.elapsed_s = max(state.elapsed_s, run_time_so_far(run_dir))
    cfg, policy = make_policy(cfg)
    policy.load_state_dict(state.policy)
    return cfg, policy, state
