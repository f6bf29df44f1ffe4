"""Policies decide which strategy runs and when to switch; the controller carries the decisions out.

A policy sees every metric row the workers stream and the outcome of every launch. The controller
asks it for the first stage, may be told mid-launch to switch (it then has the workers checkpoint
and exit, or resizes the running job when only the batch changes and the policy allows it), and asks
for the next stage whenever a launch ends. After a failure or a `--resume` it
asks which stage continues from the restored step, and it saves and restores the policy's state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from cona_core.config import ChainStage
from cona_core.strategy import Strategy


@dataclass(frozen=True)
class Stage:
    """Run `strategy` until global step `stop_step` (None: until a stop rule of the config)."""

    strategy: Strategy
    stop_step: int | None
    reason: str  # why this stage starts: start, chain, decision


class EventSink(Protocol):
    def write(self, kind: str, **fields: Any) -> dict[str, Any]: ...


class Policy:
    """What every policy answers; by default: never switch on its own, ignore switch costs."""

    name = "base"

    def __init__(self) -> None:
        self.events: EventSink | None = None  # the controller's events.jsonl, for policies that log
        # Whether a switch it asks for that keeps the layout (see `strategy.resizable`) may resize the
        # running job instead of relaunching it; the controller then calls `resized`, not `after_launch`.
        self.in_place = False
        # Whether such a resize writes a checkpoint first where the job has none but the run's start
        # (`launch.worker`): a kill after it then restarts at the new batch, not from step 0.
        self.checkpoint_resizes = False
        self.standby_ready = False  # set by the controller: a pre-warmed job waits, switches are cheap now
        # Set by the controller while a standby imports beside the job: step times then are not the
        # strategy's own (on a CPU box the import takes cores from the ranks).
        self.standby_importing = False

    def first(self) -> Stage:
        raise NotImplementedError

    def strategies(self) -> list[Strategy]:
        """Every strategy this policy may run (what a virtual clock's table must time)."""
        return [self.first().strategy]

    def on_metric(self, row: dict[str, Any]) -> Stage | None:
        """A step row arrived; return a stage to switch to now, or None to keep going."""
        return None

    def may_switch(self) -> bool:
        """Whether a later stage may follow the running one."""
        return False

    def may_relaunch(self) -> bool:
        """Whether a later stage may need a new job, a layout the running one cannot resize into (only
        then is a standby worth its start: on GPUs it takes host cores and a device context from the job)."""
        return self.may_switch()

    def expected_next(self) -> Strategy | None:
        """The strategy the next switch most likely goes to, if the policy can tell (a standby builds it ahead)."""
        return None

    def on_eval(self, row: dict[str, Any]) -> None:
        """An evaluation row arrived (validation loss on the fixed probe set)."""

    def observe_switch(self, seconds: float, warm: bool = False) -> None:
        """A switch just cost `seconds` (checkpoint, exit, relaunch, load); `warm`: a ready standby took over."""

    def after_launch(self, outcome: dict[str, Any], requested: Stage | None) -> Stage | None:
        """A launch ended at a stage end or on request; return the next stage, or None when done."""
        return None

    def resized(self, stage: Stage, seconds: float) -> None:
        """The running job resized in place to the stage this policy asked for (`seconds` between its last
        step before and its first after)."""

    def restart(self, step: int, stage: Stage, trainer: dict[str, Any] | None = None) -> Stage | None:
        """The stage that continues from a checkpoint at `step` (0: none, the run's start), after `stage`
        failed or was stopped; `trainer`: that checkpoint's trainer.json (what the workers had then)."""
        return stage

    def infeasible(self, strategy: Strategy) -> Stage | None:
        """`strategy` ran out of memory: it never runs again in this run. The stage to continue with, or
        None to stop the run (a static strategy or a chain has no other)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """What `load_state_dict` needs to continue the run in a new controller (JSON-serialisable)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()` of an earlier controller of the same run."""


class StaticPolicy(Policy):
    """One strategy for the whole run."""

    name = "static"

    def __init__(self, strategy: Strategy) -> None:
        super().__init__()
        self.strategy = strategy

    def first(self) -> Stage:
        return Stage(self.strategy, None, "start")


class ChainPolicy(Policy):
    """Replay a given chain: stage i runs `steps` optimizer steps, then the next stage takes over."""

    name = "chain"

    def __init__(self, chain: tuple[ChainStage, ...]) -> None:
        super().__init__()
        self.stages: list[Stage] = []
        end = 0
        for i, c in enumerate(chain):
            end = end + c.steps if c.steps else None  # type: ignore[operator]
            self.stages.append(Stage(c.strategy, end, "start" if i == 0 else "chain"))
            if end is None:
                break

        self.position = 0  # index of the running stage

    def first(self) -> Stage:
        return self.stages[self.position]

    def strategies(self) -> list[Strategy]:
        return [s.strategy for s in self.stages]

    def may_switch(self) -> bool:
        return self.position < len(self.stages) - 1

    def expected_next(self) -> Strategy | None:
        return self.stages[self.position + 1].strategy if self.may_switch() else None

    def after_launch(self, outcome: dict[str, Any], requested: Stage | None) -> Stage | None:
        return self._stage_at(outcome["step"])

    def restart(self, step: int, stage: Stage, trainer: dict[str, Any] | None = None) -> Stage | None:
        return self._stage_at(step)

    def _stage_at(self, step: int) -> Stage | None:
        """The stage that runs step `step + 1`; None when the chain is over."""
        for i, stage in enumerate(self.stages):
            if stage.stop_step is None or stage.stop_step > step:
                self.position = i
                return stage
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state.get("position", 0))
