"""Recovery: what a run does after a launch failed, and where a restart or `--resume` continues from.

A failed launch is recorded (events.jsonl, its last lines, a checkpoint it could not load
quarantined) and classified: a worker's refusal or a checkpoint that could not be written ends the
run (relaunching would fail the same way); out of memory marks the strategy infeasible and continues
with the policy's next one; anything else relaunches under the same strategy from the newest usable
checkpoint, up to `train.max_restarts` times within `train.restart_window_s`. A job that stopped on its
own (a rank's SIGTERM, a lost telemetry connection: the controller did not ask) failed too, though its
ranks exited 0. A restart continues from what the checkpoint holds: the policy is told its trainer state
(cona takes its noise window and drops the step times of later steps; without a checkpoint it starts
over at its first strategy), and after an in-place resize it runs the batch in force when the
checkpoint was taken.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from cona_cli.cluster.launchers import Agent
from cona_cli.control import usable_checkpoints as checkpoints
from cona_cli.control.failures import Failure, failed_host, parse_failure
from cona_cli.control.jobs import EventLog
from cona_cli.control.policies import Policy, Stage
from cona_cli.control.runstate import RunState
from cona_core.config import Config
from cona_core.exits import REFUSED_EXIT, STORAGE_EXIT
from cona_core.rundir import RunDir, read_trainer_state
from cona_core.strategy import Strategy, resizable


class NoUsableCheckpoint(RuntimeError):
    """Checkpoints exist but none of them can be used; the message is one line."""


@dataclass
class LaunchResult:
    returncode: int
    outcome: dict | None  # what the workers wrote to launches/NNN.json
    failed: Agent | None  # the node agent whose failure came first (not one that only lost a peer)
    failure: Failure | None  # what its output says (or that the job stopped on its own)
    log_path: Path  # that agent's output (else the first node's)

    @property
    def needs_recovery(self) -> bool:
        """A rank or agent failed, no outcome was written, or the job stopped without being asked to."""
        return self.returncode != 0 or self.outcome is None or self.failure is not None


@dataclass
class Restart:
    """Launch `stage` from `checkpoint` (None: from the start); no stage: the policy has nothing left to run."""

    stage: Stage | None
    checkpoint: Path | None
    reason: str  # "restart", "out_of_memory" or "resume"


@dataclass
class Stop:
    """The run ends: exit `code`, recorded as `reason`."""

    code: int
    reason: str


class Recovery:
    def __init__(
        self,
        cfg: Config,
        files: RunDir,
        policy: Policy,
        events: EventLog,
        console: Console,
        state: RunState,
        run_start: float,
        multi_node: bool,
    ) -> None:
        self.cfg, self.files, self.policy, self.events, self.console = cfg, files, policy, events, console
        self.state, self.run_start, self.multi_node = state, run_start, multi_node
        self._shapes: checkpoints.Shapes | None = None

    def resume(self, running: Stage | None, launch: int) -> Restart:
        """Where `cona train --resume` continues (after launch `launch`): the newest usable checkpoint,
        under the stage that ran."""
        ckpt = self.newest_checkpoint()
        step = checkpoints.checkpoint_step(ckpt) if ckpt else 0
        self.events.write("resume", step=step, checkpoint=str(ckpt) if ckpt else None, launch=launch)
        return Restart(self.continue_from(ckpt, running or self.policy.first()), ckpt, "resume")

    def after_failure(self, result: LaunchResult, ckpt: Path | None, stage: Stage, launch: int) -> Restart | Stop:
        """Record launch `launch` (started from `ckpt` under `stage`) that failed; what the run does next."""
        failure = self._record(result, ckpt, launch)
        if failure.refusal is not None:  # deterministic: relaunching would only fail again
            return Stop(REFUSED_EXIT, "refused")
        if failure.storage is not None:  # relaunching fails at the next save; --resume once there is room
            return Stop(STORAGE_EXIT, "failed")
        if failure.out_of_memory:
            instead = self._out_of_memory(Strategy.parse(failure.strategy or str(stage.strategy)), failure)
            if instead is None:
                return Stop(1, "out_of_memory")
            stage = instead
        elif not self._may_restart():
            return Stop(1, "failed")
        ckpt = self.newest_checkpoint()
        if failure.out_of_memory:  # the strategy the policy chose instead, as it chose it
            return Restart(self.policy.restart(_step(ckpt), stage, _trainer_state(ckpt)), ckpt, "out_of_memory")
        return Restart(self.continue_from(ckpt, stage), ckpt, "restart")

    def continue_from(self, ckpt: Path | None, stage: Stage) -> Stage | None:
        """The stage that continues from `ckpt` (None: from the run's start) after `stage` ran: the policy's,
        told what the checkpoint holds, at the batch in force when it was taken."""
        return self.batch_at(ckpt, self.policy.restart(_step(ckpt), stage, _trainer_state(ckpt)))

    def batch_at(self, ckpt: Path | None, stage: Stage | None) -> Stage | None:
        """The stage a restart from `ckpt` runs: the batch in force when `ckpt` was taken (its saved strategy),
        where an in-place resize since changed only the batch; the policy resizes again if it still wants
        to. The policy is told, as after a launch that ended on its request."""
        if ckpt is None or stage is None or not self.policy.in_place:
            return stage
        try:
            saved = Strategy.from_mapping(read_trainer_state(ckpt)["strategy"])
        except (ValueError, KeyError, TypeError):  # a checkpoint from before saved strategies: as it was
            return stage
        if saved == stage.strategy or not resizable(stage.strategy, saved):
            return stage
        taken = Stage(saved, stage.stop_step, stage.reason)
        self.policy.after_launch({"step": checkpoints.checkpoint_step(ckpt)}, taken)
        return taken

    def newest_checkpoint(self) -> Path | None:
        """The newest usable checkpoint (unusable ones are quarantined with a warning); None if none
        was ever committed. Raises NoUsableCheckpoint if there are some but none is usable."""
        if self._shapes is None:
            self._shapes = checkpoints.expected_shapes(self.cfg, self.files)
        root = self.files.checkpoints
        path, skipped = checkpoints.newest_usable(root, self._shapes, self.warn)
        if path is None and skipped:
            raise NoUsableCheckpoint(f"no usable checkpoint in {root} ({skipped} unusable, moved to bad-*)")
        return path

    def warn(self, message: str) -> None:
        self.events.write("warning", message=message)
        self.console.print(f"[yellow]cona: {message}[/yellow]")

    def _record(self, result: LaunchResult, ckpt: Path | None, launch: int) -> Failure:
        """Record a failed launch (and quarantine a checkpoint it could not load); what its output says."""
        log_path = result.log_path
        text = log_path.read_text(errors="replace") if log_path.is_file() else ""
        failure = result.failure or parse_failure(text, result.returncode)
        host = failed_host(result.failed, text) if result.failed is not None else None
        self.events.write(
            "failure",
            launch=launch,
            **({"stopped": failure.stopped} if failure.stopped else {}),
            exit_code=result.returncode,
            rank=failure.rank,
            rank_exit_code=failure.rank_exit_code,
            exit_codes=failure.exit_codes,
            bad_checkpoint=failure.bad_checkpoint,
            out_of_memory=failure.out_of_memory,
            last_lines=failure.last_lines,
            **({"host": host} if self.multi_node else {}),
        )
        where = f"node {host}: " if self.multi_node and host else ""
        if failure.refusal is not None:  # the worker's one line says it all
            self.console.print(f"cona: {where}{failure.refusal}", style="red", markup=False, highlight=False)
            return failure
        if failure.storage is not None:  # so does a checkpoint that could not be written
            self.console.print(f"cona: {where}{failure.storage}", style="red", markup=False, highlight=False)
            return failure
        if failure.last_lines:
            self.console.print("\n".join(failure.last_lines), markup=False, highlight=False)
        self.console.print(f"[red]cona: launch {launch} failed: {where}{failure.describe()}; see {log_path}[/red]")
        if failure.bad_checkpoint and ckpt is not None and ckpt.is_dir():
            moved = checkpoints.quarantine(ckpt)
            self.warn(f"checkpoint {ckpt} could not be loaded; skipped (moved to {moved.name})")
        return failure

    def _may_restart(self) -> bool:
        """Count a failed launch; whether the restart budget allows another launch."""
        now = time.time() - self.run_start
        t = self.cfg.train
        self.state.failures = [f for f in self.state.failures if now - f <= t.restart_window_s] + [now]
        if len(self.state.failures) > t.max_restarts:
            self.console.print(
                f"[red]cona: giving up: {len(self.state.failures)} failed launches within "
                f"{t.restart_window_s:g} s (train.max_restarts = {t.max_restarts})[/red]"
            )
            return False
        return True

    def _out_of_memory(self, strategy: Strategy, failure: Failure) -> Stage | None:
        """A strategy ran out of memory: infeasible for the rest of the run. The policy's next stage, or
        None (the run stops) when it has no other strategy."""
        estimate = self.files.memory_estimates().get(str(strategy))
        peak = failure.peak_bytes
        self.events.write(
            "infeasible",
            strategy=strategy.to_dict(),
            reason="out_of_memory",
            rank=failure.rank,
            peak_bytes=peak,
            estimate_bytes=estimate,
        )
        stage = self.policy.infeasible(strategy)
        measured = f"measured peak {peak / 2**30:.2f} GiB" if peak is not None else "peak not reported"
        planned = f", planner estimate {estimate / 2**30:.2f} GiB" if estimate is not None else ""
        what = f"strategy {strategy} ran out of memory on rank {failure.rank} ({measured}{planned})"
        if stage is None:
            self.console.print(f"[red]cona: {what}: it does not fit here; stopping (policy {self.policy.name})[/red]")
        else:
            self.console.print(f"[yellow]cona: {what}: marked infeasible; continuing with {stage.strategy}[/yellow]")
        return stage


def _step(ckpt: Path | None) -> int:
    return checkpoints.checkpoint_step(ckpt) if ckpt else 0


def _trainer_state(ckpt: Path | None) -> dict[str, Any] | None:
    """The checkpoint's trainer.json (read before as a usable checkpoint's), None without a checkpoint."""
    if ckpt is None:
        return None
    try:
        return read_trainer_state(ckpt)
    except ValueError:
        return None
