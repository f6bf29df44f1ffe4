"""A pre-warmed job: torchrun starts it while another job trains, so the next switch skips start-up.

`python -m launch.forkrun ... -m launch.standby --run-dir RUN --launch N`: the agent imports this
module, and with it torch and the worker, once; each forked rank goes to idle scheduling and waits until
the controller writes `RUN/launches/NNN.handover.json` (strategy, checkpoint, stop step). It then
takes its normal scheduling back and runs the launch exactly as `launch.worker` would.
CPU ranks (gloo) do what they can while they wait: they join the standby's process group, and once
the controller writes `NNN.prepare.json` (the strategy it expects next) they build its mesh, model and
optimizer state, so that a hand-over to that strategy only loads the checkpoint. GPU ranks touch
nothing (NCCL communicators and a model would take GPU memory beside the running job).
It exits quietly if the hand-over says `cancel`, if it is not for this standby (another launch, or
sealed by another controller than the one whose telemetry token this job has: `rundir.handover_seal`),
or if the controller is gone (its process, for local nodes; its state file untouched for `STALE_S`,
elsewhere).
"""

from __future__ import annotations

import argparse
import functools
import hmac
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from cona_core.config import config_from_json
from cona_core.rundir import RunDir, handover_seal
from cona_core.strategy import Strategy
from launch import testhooks, worker
from launch.data.corpus import CorpusInfo
from launch.device import init_distributed, placement
from launch.layout import Layout, prepare_layout

signalled = False  # the launch it became was stopped on this rank by SIGTERM (`launch.forkrun` reads it)
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


def read_prepare(path: Path) -> str | None:
    """The strategy in the controller's prepare file, if it has written one."""
    try:
        return json.loads(path.read_text())["strategy"]
    except FileNotFoundError:
        return None


def for_this_standby(doc: dict, launch: int) -> bool:
    """Whether a hand-over is to launch `launch`, this standby's, from the controller that started it."""
    seal = handover_seal(os.environ.get("CONA_TELEMETRY_TOKEN", ""), launch)
    return doc.get("launch") == launch and hmac.compare_digest(str(doc.get("seal", "")), seal)


class Handover(NamedTuple):
    doc: dict
    layout: Layout | None


def wait_for_handover(run: RunDir, launch: int, prepare: Callable[[Strategy], Layout] | None) -> Handover | None:
    """The hand-over document and the layout prepared while waiting, or None when cancelled or orphaned.

    `prepare` (None: never) builds the layout the controller says to expect. The hand-over repeats
    that strategy, so every rank builds it exactly once, in step, even one that never saw the file."""
    path, plan = run.handover(launch), run.prepare(launch)
    layout: Layout | None = None
    checked = time.monotonic()
    while True:
        doc = json.loads(path.read_text()) if path.is_file() else None
        if doc is not None and (doc.get("cancel") or not for_this_standby(doc, launch)):
            if not doc.get("cancel"):
                print(f"cona-standby: {path.name} is not for this standby; leaving", flush=True)
            return None
        expected = None
        if prepare is not None and layout is None:
            expected = doc.get("prepared") if doc is not None else read_prepare(plan)
        if expected:
            t0 = time.perf_counter()
            layout = prepare(Strategy.parse(expected))
            if os.environ.get("RANK") == "0":
                print(f"cona-standby: built {expected} ahead in {time.perf_counter() - t0:.2f} s", flush=True)
        if doc is not None:
            return Handover(doc, layout)
        if time.monotonic() - checked > 1.0:
            if not controller_alive(run):
                return None
            checked = time.monotonic()
        time.sleep(POLL_S)


def main() -> None:
    global signalled
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--launch", required=True, type=int)
    args = parser.parse_args()
    old = lower_priority()
    run = RunDir(args.run_dir)
    cfg = config_from_json(run.resolved_config.read_text(), str(run.resolved_config))
    prepare = None
    if placement(cfg.cluster).backend == "gloo":  # ready means connected: the hand-over skips the rendezvous
        device = init_distributed(cfg.cluster)
        vocab = CorpusInfo.from_json(run.corpus.read_text()).vocab_size
        prepare = functools.partial(prepare_layout, cfg, device=device, vocab=vocab)
    if os.environ.get("RANK") == "0":
        run.launches.mkdir(exist_ok=True)
        run.standby_ready(args.launch).touch()
    handover = wait_for_handover(run, args.launch, prepare)
    if handover is None:
        return
    if not restore_priority(old):
        print("cona-standby: could not restore the normal scheduling priority", file=sys.stderr, flush=True)
    testhooks.maybe_die(run.path, "handover", 0, int(os.environ.get("RANK", "0")))
    doc = handover.doc
    resume = Path(doc["resume"]) if doc.get("resume") else None
    worker.run(run.path, Strategy.parse(doc["strategy"]), args.launch, resume, doc.get("stop_step"), handover.layout)
    signalled = worker.signalled


if __name__ == "__main__":
    main()
