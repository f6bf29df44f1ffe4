"""A pre-warmed job: torchrun starts it while another job trains, so the next switch skips start-up.

`python -m launch.forkrun ... -m launch.standby --run-dir RUN --launch N`: the agent imports this
module, and with it torch and the worker, once; each forked rank goes to idle scheduling, joins the
standby's process group if it is gloo (CPU ranks; NCCL communicators would take GPU memory beside the
running job), and waits, touching no model memory, until the controller writes
`RUN/launches/NNN.handover.json` (strategy, checkpoint, stop step). It then takes its normal
scheduling back and runs the launch exactly as `launch.worker` would.
It exits quietly if the hand-over says `cancel`, or if the controller is gone (its process, for local
nodes; its state file untouched for `STALE_S`, elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

from cona_cli.config import config_from_json
from cona_cli.rundir import RunDir
from cona_cli.strategy import Strategy
from launch import worker
from launch.device import init_distributed, placement

POLL_S = 0.1  # a waiting rank wakes this often (at 20 ms, 4 waiting ranks slowed a 4-rank job ~8% on 2 cores)
STALE_S = 900.0  # a controller that has not rewritten its state file for this long is gone


def lower_priority() -> tuple[int, int] | None:
    """Idle scheduling for this process where it can be undone (root, or RLIMIT_NICE allows the
    current nice value back); returns the (policy, nice) to restore, None if left as it was."""
    old = (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))
    if os.geteuid() != 0 and resource.getrlimit(resource.RLIMIT_NICE)[0] < 20 - old[1]:
        return None
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        return None
    return old


def restore_priority(old: tuple[int, int] | None) -> bool:
    """Back to the scheduling a normal launch has; False where the system does not allow it."""
    if old is None:
        return True
    try:
        os.sched_setscheduler(0, old[0], os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, 0, old[1])
    except OSError:
        return False
    return True


def controller_alive(run: RunDir) -> bool:
    pid = os.environ.get("CONA_CONTROLLER_PID")
    if pid is not None:
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    try:
        return time.time() - run.controller_state.stat().st_mtime < STALE_S
    except FileNotFoundError:
        return True


def wait_for_handover(run: RunDir, launch: int) -> dict | None:
    """The hand-over document, or None when cancelled or orphaned."""
    path = run.handover(launch)
    checked = time.monotonic()
    while True:
        if path.is_file():
            doc = json.loads(path.read_text())
            return None if doc.get("cancel") else doc
        if time.monotonic() - checked > 1.0:
            if not controller_alive(run):
                return None
            checked = time.monotonic()
        time.sleep(POLL_S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--launch", required=True, type=int)
    args = parser.parse_args()
    old = lower_priority()
    run = RunDir(args.run_dir)
    cluster = config_from_json(run.resolved_config.read_text(), str(run.resolved_config)).cluster
    if placement(cluster).backend == "gloo":  # ready means connected: the hand-over skips the rendezvous
        init_distributed(cluster)
    if os.environ.get("RANK") == "0":
        run.launches.mkdir(exist_ok=True)
        run.standby_ready(args.launch).touch()
    doc = wait_for_handover(run, args.launch)
    if doc is None:
        return
    if not restore_priority(old):
        print("cona-standby: could not restore the normal scheduling priority", file=sys.stderr, flush=True)
    resume = doc.get("resume")
    worker.run(
        run.path, Strategy.parse(doc["strategy"]), args.launch, Path(resume) if resume else None, doc.get("stop_step")
    )


if __name__ == "__main__":
    main()
