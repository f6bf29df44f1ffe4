"""The controller's state in `RUN_DIR/controller_state.json`, rewritten atomically whenever it changes.

Enough to continue a run after the controller was stopped or killed (`cona train --resume RUN_DIR`):
the running stage, the launch counter, run time so far, recent failures (the restart budget), the
last finished launch (for the next switch event), the torchrun process group, and the policy's state.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cona_cli.control.policies import Stage
from cona_core.rundir import RunDir
from cona_core.strategy import Strategy


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def stage_to_dict(stage: Stage | None) -> dict[str, Any] | None:
    if stage is None:
        return None
    return {"strategy": str(stage.strategy), "stop_step": stage.stop_step, "reason": stage.reason}


def stage_from_dict(d: dict[str, Any] | None) -> Stage | None:
    return None if d is None else Stage(Strategy.parse(d["strategy"]), d["stop_step"], d["reason"])


@dataclass
class RunState:
    stage: dict[str, Any] | None = None  # the stage running (or about to run)
    launch: int = 0  # launches so far
    elapsed_s: float = 0.0  # run time when written (time stopped between a kill and --resume excluded)
    failures: list[float] = field(default_factory=list)  # run times of failed launches
    prev: dict[str, Any] | None = None  # {"strategy", "outcome"} of the last launch that ended normally
    agent_pids: list[int] = field(default_factory=list)  # process groups of the last launch's node agents
    standby_pids: list[int] = field(default_factory=list)  # process groups of a pre-warmed standby's agents
    policy: dict[str, Any] = field(default_factory=dict)
    clock_s: float = 0.0  # the latest run time the workers reported (the virtual clock's next launch starts there)

    def save(self, run_dir: Path) -> None:
        write_atomic(RunDir(run_dir).controller_state, json.dumps(asdict(self)))

    @classmethod
    def load(cls, run_dir: Path) -> RunState | None:
        """The saved state, or None if there is none (the controller died before writing it)."""
        path = RunDir(run_dir).controller_state
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: unreadable ({e})") from None
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def lock(run_dir: Path) -> int:
    """Hold an exclusive lock on the run folder for this process's lifetime; OSError if another holds it."""
    fd = os.open(RunDir(run_dir).controller_lock, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def _group_alive(pgid: int) -> bool:
    """Whether a live (non-zombie) process is in process group `pgid`."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


KILL_WAIT_S = 10.0  # after SIGKILL, for a process group's processes to be gone


def wait_for_group(pgid: int, grace_s: float) -> None:
    """Let a process group that outlived what controlled it (an orphaned torchrun job, a failed launch's
    ranks) finish its checkpoint for up to `grace_s`, then SIGKILL it and wait (bounded) for it to go."""
    deadline = time.monotonic() + grace_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not _group_alive(pgid):
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + KILL_WAIT_S
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
