"""What makes a checkpoint folder committed: one definition for the workers (loading) and the controller
(choosing a checkpoint, pruning, export).

A save writes its shards and `trainer.json` into a temporary folder, renames it to `step_000120/`
and writes the `COMMITTED` marker last (`launch.checkpoint.save`). A folder is committed when it has
the marker and a `trainer.json` that names the step and the consumed samples. Whether its shards are
all there and fit the model is a further check of the controller's (`control.usable_checkpoints`).
Standard library only: the controller imports it without torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

MARKER = "COMMITTED"  # written last into a checkpoint folder: the checkpoint is complete
TRAINER_STATE = "trainer.json"  # step, consumed samples, strategy, schedule and statistics state


def read_trainer_state(path: Path) -> dict[str, Any]:
    """trainer.json of a checkpoint; ValueError naming the folder if unreadable."""
    try:
        state = json.loads((path / TRAINER_STATE).read_text())
        return state if isinstance(state, dict) else {}
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable {TRAINER_STATE} ({e})") from None


def not_committed(path: Path) -> str | None:
    """Why `path` is not a committed checkpoint (a few words), or None if it is one."""
    if not (path / MARKER).is_file():
        return f"no {MARKER} marker"
    try:
        trainer = read_trainer_state(path)["trainer"]
        int(trainer["step"]), int(trainer["consumed_samples"])
    except (ValueError, KeyError, TypeError) as e:
        return f"bad {TRAINER_STATE} ({str(e).split(': ')[-1]})"
    return None


def committed(root: Path) -> list[Path]:
    """The committed `step_*` folders under a checkpoints root, newest first."""
    if not root.is_dir():
        return []
    dirs = [d for d in root.iterdir() if d.name.startswith("step_") and not_committed(d) is None]
    return sorted(dirs, key=lambda d: d.name, reverse=True)


def write_marker(path: Path, step: int) -> None:
    """Commit `path` (its trainer.json already written): the marker, synced to disk."""
    with open(path / MARKER, "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
