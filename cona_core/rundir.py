"""The run folder: one type that knows the name of every file in it (docs/run-dir.md is the reference).

Controller and workers share it (`cona_core`: the standard library only). The checkpoint
folder's layout (`checkpoints/step_000120/` with `trainer.json` and a `COMMITTED` marker written
last) is named here too; what reads and writes the DCP shards lives in `launch.checkpoint`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = "COMMITTED"  # written last into a checkpoint folder: the checkpoint is complete
TRAINER_STATE = "trainer.json"  # step, consumed samples, strategy, schedule and statistics state


@dataclass(frozen=True)
class RunDir:
    """`RUN_DIR/` of one run; every path a controller, worker or report touches."""

    path: Path

    @property
    def config_copy(self) -> Path:
        """The config as given."""
        return self.path / "config.yaml"

    @property
    def resolved_config(self) -> Path:
        """The validated config handed to the workers (JSON)."""
        return self.path / "config.resolved.json"

    @property
    def metrics(self) -> Path:
        """Step and eval rows, written by worker rank 0."""
        return self.path / "metrics.jsonl"

    @property
    def events(self) -> Path:
        """Launches, decisions, switches, failures, exits: written by the controller."""
        return self.path / "events.jsonl"

    @property
    def controller_state(self) -> Path:
        """The controller's state for `--resume`, rewritten atomically."""
        return self.path / "controller_state.json"

    @property
    def clock(self) -> Path:
        """Under the virtual clock: its table and charges (`cona_core.clock.ClockSpec`)."""
        return self.path / "clock.json"

    @property
    def controller_lock(self) -> Path:
        """flock held by the running controller."""
        return self.path / "controller.lock"

    @property
    def corpus(self) -> Path:
        """The prepared corpus (token files, vocabulary)."""
        return self.path / "corpus.json"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def launches(self) -> Path:
        return self.path / "launches"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def data(self) -> Path:
        """Token arrays of multi-node runs without `data.cache_dir` (shared storage)."""
        return self.path / "data"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard event files of step, eval and decision metrics (`train.tensorboard`), by the controller."""
        return self.path / "tensorboard"

    @property
    def wandb_run_id(self) -> Path:
        """The W&B run's id (`train.wandb`), so a `--resume` continues that run, by the controller."""
        return self.path / "wandb_run_id"

    @property
    def memory_estimate_file(self) -> Path:
        """The planner's peak-memory estimate (bytes per device) of each strategy launched, by the controller."""
        return self.path / "memory_estimates.json"

    def memory_estimates(self) -> dict[str, float]:
        """Strategy (as a string) -> the planner's estimate; empty before the controller wrote any."""
        try:
            return json.loads(self.memory_estimate_file.read_text())
        except FileNotFoundError:
            return {}

    @property
    def probe(self) -> Path:
        """The shared-storage check's files while it runs."""
        return self.path / ".probe"

    def launch_outcome(self, launch: int) -> Path:
        """How launch `launch` ended (reason, step, checkpoint), written by worker rank 0."""
        return self.launches / f"{launch:03d}.json"

    def handover(self, launch: int) -> Path:
        """What the controller hands a pre-warmed standby job that becomes launch `launch`."""
        return self.launches / f"{launch:03d}.handover.json"

    def prepare(self, launch: int) -> Path:
        """The strategy a standby that may become launch `launch` should build while it waits."""
        return self.launches / f"{launch:03d}.prepare.json"

    def standby_ready(self, launch: int) -> Path:
        """Touched by a standby's rank 0 once its imports are done and it waits for the hand-over."""
        return self.launches / f"{launch:03d}.standby-ready"

    def launch_log(self, launch: int, node: str | None = None) -> Path:
        """torchrun's output of a launch; with several nodes one file per node."""
        suffix = f".{re.sub(r'[^A-Za-z0-9_.-]', '_', node)}" if node is not None else ""
        return self.logs / f"launch_{launch:03d}{suffix}.log"

    def holds_run(self) -> bool:
        """Whether a run was started here (its controller wrote events)."""
        return self.events.is_file()

    def vocab_size(self) -> int:
        """The vocabulary of the prepared corpus."""
        return int(json.loads(self.corpus.read_text())["vocab_size"])


def cache_root() -> Path:
    """Where cona caches what outlives a run folder (prepared corpora, measured step times) by default:
    $CONA_CACHE, else ~/.cache/cona."""
    return Path(os.environ.get("CONA_CACHE") or Path.home() / ".cache" / "cona")


def handover_seal(token: str, launch: int) -> str:
    """What a hand-over to launch `launch` carries to show it comes from the controller that started the
    standby (an HMAC under that controller's telemetry token, which no file holds)."""
    return hmac.new(token.encode(), f"handover {launch}".encode(), hashlib.sha256).hexdigest()


def step_dir(root: Path, step: int) -> Path:
    """The committed checkpoint folder of `step` under a checkpoints root."""
    return root / f"step_{step:06d}"


def step_of(path: Path) -> int:
    """The step a checkpoint folder's name says (`step_000120`: 120; it grows past six digits), -1 if none."""
    digits = path.name.removeprefix("step_")
    return int(digits) if digits.isdigit() else -1


def committed(root: Path) -> list[Path]:
    """Checkpoint folders with a COMMITTED marker, highest step first."""
    if not root.is_dir():
        return []
    dirs = [d for d in root.iterdir() if d.name.startswith("step_") and (d / MARKER).is_file()]
    return sorted(dirs, key=step_of, reverse=True)


def read_trainer_state(path: Path) -> dict[str, Any]:
    """trainer.json of a checkpoint; ValueError naming the folder if unreadable."""
    try:
        state = json.loads((path / TRAINER_STATE).read_text())
        return state if isinstance(state, dict) else {}
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable {TRAINER_STATE} ({e})") from None


def read_jsonl(path: Path, warnings: list[str]) -> list[dict[str, Any]]:
    """The JSON objects of a .jsonl file; bad lines are skipped (a warning unless it is the last)."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif i < len(lines):
            warnings.append(f"{path}:{i}: skipped a line that is not a JSON object")
    return rows
