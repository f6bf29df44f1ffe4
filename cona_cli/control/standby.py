"""Pre-warmed standby jobs: the next launch, started while the current one trains.

A standby is a torchrun job of the same world size and launcher (its own rendezvous) running
`launch.standby`: its agent imports torch and the worker once (`launch.forkrun`) and forks the ranks,
and they wait at idle priority for `RUN/launches/NNN.handover.json`. When the policy knows which
strategy it expects next, the controller says so in `NNN.prepare.json` and CPU ranks build its mesh,
model and optimizer while they wait. On a switch the controller writes the strategy, the committed
checkpoint and the stop step to the hand-over; the ranks then load and step (building the layout
first if it is not the prepared one), as a cold launch would, minus torchrun's and Python's start-up.
The hand-over names its launch and is sealed with the controller's telemetry token (`handover_seal`): a
standby takes over only a hand-over to the launch it was started for, from the controller that started
it (an orphan of an earlier controller of the run leaves instead). A standby that died or was never
started is simply not used: the launch starts cold.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cona_cli.cluster.launchers import Agent
from cona_cli.cluster.nodes import may_use_gpus
from cona_cli.control.jobs import EventLog
from cona_cli.control.policies import Policy, Stage
from cona_cli.control.runstate import RunState, write_atomic
from cona_core.config import Config
from cona_core.rundir import RunDir, handover_seal
from cona_core.strategy import Strategy


def standby_args(run_dir: Path, launch: int) -> list[str]:
    """What torchrun runs on every rank of a standby that may become launch `launch`."""
    return ["-m", "launch.standby", "--run-dir", str(run_dir.absolute()), "--launch", str(launch)]


@dataclass
class Standby:
    """A started standby job: the launch number it will take and its node agents."""

    launch: int
    agents: list[Agent]
    pumps: list[threading.Thread] = field(default_factory=list)
    handed_over: bool = False
    ready_logged: bool = False
    lost: bool = False  # died before its hand-over (logged once)
    prepared: Strategy | None = None  # the strategy its ranks were told to build while they wait

    def newly_ready(self, run: RunDir) -> bool:
        """True once, when rank 0 says its imports are done."""
        if self.ready_logged or not run.standby_ready(self.launch).is_file():
            return False
        self.ready_logged = True
        return True

    def alive(self) -> bool:
        return all(a.poll() is None for a in self.agents)

    def prepare(self, run: RunDir, strategy: Strategy) -> None:
        """Tell the waiting ranks which strategy to build ahead (once per standby, before the hand-over:
        the ranks build it together, so what they build must never change under them)."""
        assert self.prepared is None and not self.handed_over
        write_atomic(run.prepare(self.launch), json.dumps({"strategy": str(strategy)}))
        self.prepared = strategy

    def hand_over(self, run: RunDir, stage: Stage, resume: Path | None, token: str) -> None:
        """Give the waiting ranks their launch: strategy, checkpoint, stop step, and the strategy they
        were told to prepare (a rank that missed that file builds it now, in step with the others), sealed
        with the controller's telemetry `token`."""
        doc = {
            "launch": self.launch,
            "seal": handover_seal(token, self.launch),
            "strategy": str(stage.strategy),
            "resume": str(resume.absolute()) if resume else None,
            "stop_step": stage.stop_step,
            "prepared": str(self.prepared) if self.prepared else None,
        }
        write_atomic(run.handover(self.launch), json.dumps(doc))
        self.handed_over = True

    def cancel(self, run: RunDir) -> None:
        """Tell the ranks to leave, and stop the agents (a standby holds no state worth saving)."""
        if not self.handed_over:
            write_atomic(run.handover(self.launch), json.dumps({"cancel": True}))
        for agent in self.agents:
            agent.signal(signal.SIGKILL)
        for pump in self.pumps:
            pump.join(timeout=5)
        for path in (run.handover(self.launch), run.standby_ready(self.launch), run.prepare(self.launch)):
            path.unlink(missing_ok=True)


StartJob = Callable[[int, list[str]], tuple[list[Agent], list[threading.Thread]]]


class StandbyPool:
    """The controller's one pre-warmed standby: when to start it, what it prepares, who takes it over."""

    def __init__(
        self,
        cfg: Config,
        files: RunDir,
        policy: Policy,
        events: EventLog,
        state: RunState,
        start: StartJob,
        token: str,
    ) -> None:
        """`token`: the controller's telemetry token, which seals its hand-overs."""
        self.cfg, self.files, self.policy, self.events, self.state, self.start = (
            cfg,
            files,
            policy,
            events,
            state,
            start,
        )
        self.token = token
        self.standby: Standby | None = None

    def maybe_start(self, launch: int, relaunch_expected: Strategy | None, step: int) -> None:
        """Once launch `launch - 1` is stepping, pre-warm launch `launch` if a relaunch may come. With CPU
        ranks and a policy that resizes in place, only once the switch it expects next needs a new layout
        (`relaunch_expected`): there a standby's start takes cores from the job. `step`: the last step row
        the policy was fed (the events that change its standby flags record it, so a run replays exactly)."""
        if self.standby is not None or not self.cfg.cluster.standby or not self.policy.may_relaunch():
            return
        if self.cfg.train.clock == "virtual":  # it charges a relaunch its modelled cost; a standby's readiness
            return  # would make the charge depend on the host's speed
        if self.policy.in_place and not may_use_gpus(self.cfg.cluster) and relaunch_expected is None:
            return
        self.files.launches.mkdir(exist_ok=True)
        self.files.handover(launch).unlink(missing_ok=True)
        self.files.standby_ready(launch).unlink(missing_ok=True)
        agents, pumps = self.start(launch, standby_args(self.files.path, launch))
        self.standby = Standby(launch, agents, pumps)
        self.state.standby_pids = [a.pid for a in agents]
        self.policy.standby_importing = True
        self.events.write("standby", launch=launch, step=step)

    def maybe_prepare(self, strategy: Strategy | None) -> None:
        """Tell the standby which strategy to build while it waits (once; CPU ranks only act on it)."""
        sb = self.standby
        if strategy is None or sb is None or sb.prepared is not None or not sb.alive():
            return
        sb.prepare(self.files, strategy)
        self.events.write("standby_prepare", launch=sb.launch, strategy=strategy.to_dict())

    def poll(self, step: int) -> None:
        """Tell the policy whether the standby is still importing, once when it is ready, and once when it
        died before its hand-over (`step`: the last step row the policy was fed)."""
        sb = self.standby
        if sb is None or sb.lost:
            return
        if not sb.alive():
            sb.lost = True
            self.events.write("standby_lost", launch=sb.launch, step=step)
            self.policy.standby_importing = self.policy.standby_ready = False
        elif sb.newly_ready(self.files):
            self.events.write("standby_ready", launch=sb.launch, step=step)
            self.policy.standby_importing, self.policy.standby_ready = False, True

    def warm_for(self, launch: int) -> Standby | None:
        """The live standby that was started to become launch `launch`, if there is one."""
        sb = self.standby
        return sb if sb is not None and sb.launch == launch and sb.alive() else None

    def hand_over(self, stage: Stage, resume: Path | None) -> Standby:
        """Give the standby its launch; it leaves the pool."""
        sb = self.standby
        assert sb is not None
        sb.hand_over(self.files, stage, resume, self.token)
        self.standby, self.state.standby_pids = None, []
        return sb

    def drop(self) -> None:
        if self.standby is not None:
            self.standby.cancel(self.files)
            self.standby, self.state.standby_pids = None, []
