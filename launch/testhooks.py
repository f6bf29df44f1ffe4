"""Fault injection for tests and scripts/chaos.py, off unless the environment asks for it.

`CONA_TEST_DIE_AT_STEP=N:RANK` makes RANK SIGKILL itself in the middle of step N (after its
forward/backward, before the step's all-reduce); `N:RANK:save` makes it die inside the checkpoint
save at step N, after writing its shards and before the commit; `N:RANK:resize` just after an in-place
resize took effect at step N, before the first step under the new batch; `N:RANK:handover` in a
standby's rank just after it read its hand-over, before it loads. N `*` is any step. Several specs are
separated by commas. Each fires once per run directory (a `.test-died-STEP-RANK-PLACE` file records
it), so the relaunched job gets past the same point.
`CONA_TEST_SAVE_DELAY_S=S` makes every rank linger S seconds inside each save (a wider window for
random kills); `CONA_TEST_STEP_DELAY_S=S` makes every rank linger S seconds in each training step
(so that time-based checkpoints fall between given steps on a host of any speed).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def maybe_die(run_dir: Path, where: str, step: int, rank: int) -> None:
    """SIGKILL this process if CONA_TEST_DIE_AT_STEP names this step, rank and place (once per run)."""
    specs = [s.split(":") for s in os.environ.get("CONA_TEST_DIE_AT_STEP", "").split(",") if s]
    if not any(
        p[0] in ("*", str(step)) and int(p[1]) == rank and (p[2] if len(p) > 2 else "step") == where for p in specs
    ):
        return
    try:
        fd = os.open(run_dir / f".test-died-{step}-{rank}-{where}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def _linger(variable: str) -> None:
    delay = float(os.environ.get(variable, "0") or 0)
    if delay > 0:
        time.sleep(delay)


def save_delay() -> None:
    _linger("CONA_TEST_SAVE_DELAY_S")


def step_delay() -> None:
    _linger("CONA_TEST_STEP_DELAY_S")
