"""Fault injection for tests and scripts/chaos.py, off unless the environment asks for it.

`CONA_TEST_DIE_AT_STEP=N:RANK` makes RANK SIGKILL itself in the middle of step N (after its
forward/backward, before the step's all-reduce); `N:RANK:save` makes it die inside the checkpoint
save at step N, after writing its shards and before the commit; `N:RANK:resize` just after an in-place
resize took effect at step N, before the first step under the new batch; `N:RANK:handover` in a
standby's rank just after it read its hand-over, before it loads. N `*` is any step. A fourth field
names another signal than SIGKILL: `N:RANK:step:TERM` sends that rank a stray SIGTERM. Several specs
are separated by commas. Each fires once per run directory (a `.test-died-STEP-RANK-PLACE` file
records it), so the relaunched job gets past the same point.
`CONA_TEST_DISCONNECT_AT_STEP=N` makes rank 0 close its telemetry connection in step N (once per run
directory), as a network fault or the controller's side closing it would.
`CONA_TEST_LOAD_ERRNO=NAME` (e.g. `EIO`) makes each rank's first read of a checkpoint's shards in a
process fail with that error, as flaky shared storage does (a transient one is tried again).
`CONA_TEST_SAVE_DELAY_S=S` makes every rank linger S seconds inside each save (a wider window for
random kills); `CONA_TEST_STEP_DELAY_S=S` makes every rank linger S seconds in each training step
(so that time-based checkpoints fall between given steps on a host of any speed).

The worker calls its faults through a `FaultHooks` object it is given: the base does nothing (production),
`from_env` returns the one these variables drive where any of them is set.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

_load_failed = False  # this process's first checkpoint read has failed (CONA_TEST_LOAD_ERRNO)


def _once(run_dir: Path, name: str) -> bool:
    """True the first time `name` is asked for in this run directory (a file records it)."""
    try:
        fd = os.open(run_dir / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def maybe_die(run_dir: Path, where: str, step: int, rank: int) -> None:
    """Signal this process (SIGKILL unless the spec names another) if CONA_TEST_DIE_AT_STEP names this step,
    rank and place (once per run)."""
    specs = [s.split(":") for s in os.environ.get("CONA_TEST_DIE_AT_STEP", "").split(",") if s]
    for p in specs:
        if p[0] in ("*", str(step)) and int(p[1]) == rank and (p[2] if len(p) > 2 else "step") == where:
            if _once(run_dir, f".test-died-{step}-{rank}-{where}"):
                os.kill(os.getpid(), signal.Signals[f"SIG{p[3]}"] if len(p) > 3 else signal.SIGKILL)
            return


def disconnect_due(run_dir: Path, step: int) -> bool:
    """Whether rank 0 should drop its telemetry connection in step `step` (CONA_TEST_DISCONNECT_AT_STEP)."""
    at = os.environ.get("CONA_TEST_DISCONNECT_AT_STEP", "")
    return at == str(step) and _once(run_dir, f".test-disconnected-{step}")


def load_fault() -> None:
    """Raise the error CONA_TEST_LOAD_ERRNO names, once per process (its first checkpoint read)."""
    global _load_failed
    name = os.environ.get("CONA_TEST_LOAD_ERRNO")
    if name and not _load_failed:
        _load_failed = True
        code = getattr(errno, name)
        raise OSError(code, os.strerror(code), "checkpoint shards (CONA_TEST_LOAD_ERRNO)")


def _linger(variable: str) -> None:
    delay = float(os.environ.get(variable, "0") or 0)
    if delay > 0:
        time.sleep(delay)


def save_delay() -> None:
    _linger("CONA_TEST_SAVE_DELAY_S")


def step_delay() -> None:
    _linger("CONA_TEST_STEP_DELAY_S")


class FaultHooks:
    """The worker's fault-injection points; this base injects nothing."""

    def in_step(self, step: int) -> None:
        """Inside step `step`, after the forward/backward and before the step's all-reduce."""

    def in_save(self, step: int) -> None:
        """Inside step `step`'s save, after this rank's shards are written and before the commit."""

    def after_resize(self, step: int) -> None:
        """Just after an in-place resize took effect after step `step`."""

    def disconnect(self, step: int) -> bool:
        """Whether rank 0 drops its telemetry connection in step `step`."""
        return False


class EnvFaults(FaultHooks):
    """The faults the CONA_TEST_* variables ask for (module docstring), in run folder `run_dir`."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir, self.rank = run_dir, rank

    def in_step(self, step: int) -> None:
        maybe_die(self.run_dir, "step", step, self.rank)
        step_delay()

    def in_save(self, step: int) -> None:
        save_delay()
        maybe_die(self.run_dir, "save", step, self.rank)

    def after_resize(self, step: int) -> None:
        maybe_die(self.run_dir, "resize", step, self.rank)

    def disconnect(self, step: int) -> bool:
        return disconnect_due(self.run_dir, step)


_WORKER_FAULTS = (
    "CONA_TEST_DIE_AT_STEP",
    "CONA_TEST_DISCONNECT_AT_STEP",
    "CONA_TEST_SAVE_DELAY_S",
    "CONA_TEST_STEP_DELAY_S",
)


def from_env(run_dir: Path, rank: int) -> FaultHooks:
    """The worker's faults: those the environment asks for, else none."""
    return EnvFaults(run_dir, rank) if any(os.environ.get(v) for v in _WORKER_FAULTS) else FaultHooks()
