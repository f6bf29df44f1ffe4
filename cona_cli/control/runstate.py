"""The controller's state in `RUN_DIR/controller_state.json`, rewritten atomically whenever it changes.

Enough to continue a run after the controller was stopped or killed (`cona train --resume RUN_DIR`):
the running stage, the launch counter, run time so far, recent failures (the restart budget), the
last finished launch (for the next switch event), the torchrun process group, and the policy's state.
Also the run folder's lock, and what `--resume` uses to find and stop what is left of an orphaned job.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cona_cli.control.policies import Stage
from cona_cli.rundir import RunDir
from cona_cli.strategy import Strategy


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


KILL_WAIT_S = 5.0  # for SIGKILLed processes to be gone before --resume gives up on them


def _live_pids() -> dict[int, int]:
    """pid -> process group of every live (non-zombie) process, from /proc; empty without /proc."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            found[int(stat.parent.name)] = int(fields[2])
    return found


def _names_run(pid: int, run_dir: str) -> bool:
    """Whether process `pid`'s command line has `--run-dir RUN_DIR`: every process of a job (torchrun
    agent, fork server, forked ranks, a standby) has its agent's command line."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    return any(a == "--run-dir" and os.path.realpath(b) == run_dir for a, b in itertools.pairwise(argv))


def job_processes(run_dir: Path, groups: list[int]) -> list[int]:
    """Live processes of an earlier job on `run_dir`: those whose command line names the run folder
    (found even when the controller died before it recorded the job's process groups), and those in
    `groups`. Without /proc (not Linux) only the groups, by signal 0."""
    if not Path("/proc").is_dir():
        alive = []
        for pgid in groups:
            try:
                os.killpg(pgid, 0)
                alive.append(pgid)
            except (ProcessLookupError, PermissionError):
                pass
        return alive
    target, me = os.path.realpath(run_dir), os.getpid()
    return sorted(
        pid for pid, pgid in _live_pids().items() if pid != me and (pgid in groups or _names_run(pid, target))
    )


def stop_job(run_dir: Path, groups: list[int], grace_s: float) -> list[int]:
    """Let an orphaned job on `run_dir` (its controller was killed) finish its checkpoint for up to
    `grace_s`, then SIGKILL what is left of it. Returns the pids still alive after that (empty unless
    they cannot be killed, e.g. another user's)."""
    deadline = time.monotonic() + grace_s
    while job_processes(run_dir, groups) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = job_processes(run_dir, groups)
    if not left:
        return []
    for pgid in groups:
        _kill(os.killpg, pgid)
    for pid in left:
        _kill(os.kill, pid)
    deadline = time.monotonic() + KILL_WAIT_S
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = job_processes(run_dir, groups)
    return left


def _kill(send: Callable[[int, int], None], target: int) -> None:
    try:
        send(target, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
