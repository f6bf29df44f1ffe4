"""A launch's stops: the controller's commands (rank 0 reads them from telemetry) and the stop rules.

Rank 0 votes in each step's all-reduce (`launch.step_control`) for a stop the controller asked for
(`checkpoint_and_exit`, carrying an id the outcome echoes), for a lost controller or for max_time, and
passes on the controller's `resize`; every rank applies the config's stop rules (target perplexity,
max_steps, max_tokens) alike.
"""

from __future__ import annotations

import time
from typing import Any

from cona_core.clock import WallClock
from cona_core.config import Config
from cona_core.strategy import Strategy, resizable
from launch.step_control import StepControl, Stop
from launch.telemetry_client import TelemetryClient
from launch.testhooks import FaultHooks


class Commands:
    def __init__(self, cfg: Config, telemetry: TelemetryClient | None, clock: WallClock, hooks: FaultHooks) -> None:
        """`telemetry`: rank 0's connection to the controller (None on the other ranks)."""
        self.cfg, self.telemetry, self.clock, self.hooks = cfg, telemetry, clock, hooks
        self.controlled = telemetry is not None and telemetry.expected  # a controller started this job
        self.signalled = False  # a SIGTERM reached this rank
        self.stop_command: dict[str, Any] | None = None  # rank 0: the controller's checkpoint_and_exit
        self.controller_lost = False  # rank 0: the telemetry connection broke, or was never made
        self.awaiting_sync: int | None = None  # virtual clock: the step whose commands rank 0 must have
        self.switch_requested = False  # the controller's stop command is for a switch, not the run's end
        self.resize_requested: Strategy | None = None  # rank 0: the batch the controller asked for
        self.save_before_resize = False  # rank 0: that resize's command asks for a checkpoint first

    # -- rank 0: the controller's commands ---------------------------------------------------

    def stop_vote(self, step: int, strategy: Strategy) -> Stop:
        """Rank 0's stop decision in step `step` for every rank: the controller's command, a lost
        controller, max_time. Polled as late as possible: a command that came during the step stops the
        job after it."""
        self.poll(step, strategy)
        if self.stop_command is not None:
            return Stop.SWITCH if self.stop_command.get("switch") else Stop.COMMAND
        if self.controller_lost:
            return Stop.CONTROLLER_LOST
        return Stop.MAX_TIME if self.time_is_up() else Stop.NONE

    def take_resize(self) -> tuple[Strategy | None, bool]:
        """The resize the controller asked for since the last step (if any), and whether its command asks
        for a checkpoint first; taken once."""
        resize, self.resize_requested = self.resize_requested, None
        return resize, resize is not None and self.save_before_resize

    def poll(self, step: int, strategy: Strategy) -> None:
        """Rank 0, in step `step` under `strategy`: a stop command, or a controller that went away
        (killed) or was never reached, stops the job after this step."""
        if self.telemetry is None or not self.controlled:
            return
        if self.hooks.disconnect(step):
            self.telemetry.close()
        for msg in self._messages():
            if msg.get("cmd") == "checkpoint_and_exit":
                self.stop_command = msg
            elif msg.get("cmd") == "resize":
                target = Strategy.parse(msg["strategy"])
                if resizable(strategy, target):
                    self.resize_requested, self.save_before_resize = target, bool(msg.get("checkpoint"))
                else:
                    print(f"cona-worker: ignoring resize {strategy} -> {target}: not the same layout", flush=True)
        if not self.telemetry.connected:
            self.controller_lost = True

    def _messages(self) -> list[dict[str, Any]]:
        """The controller's commands since the last poll. Under the virtual clock, all of them up to its
        answer to the last step's rows (waited for), so a command lands at the same step in every run."""
        assert self.telemetry is not None
        msgs = self.telemetry.poll()
        step, self.awaiting_sync = self.awaiting_sync, None
        if step is None:
            return msgs
        deadline = time.monotonic() + self.cfg.cluster.collective_timeout_s
        while not any(m.get("cmd") == "sync" and m.get("step") == step for m in msgs):
            if not self.telemetry.connected or time.monotonic() > deadline:
                print(f"cona-worker: no answer from the controller to step {step}; going on", flush=True)
                break
            msgs += self.telemetry.poll(timeout=1.0)
        return msgs

    def sync(self, step: int, launch: int) -> None:
        """After step `step`'s rows: under the virtual clock the next step waits for the answer to them."""
        if self.clock.virtual and self.controlled:
            assert self.telemetry is not None
            self.telemetry.send({"type": "sync", "step": step, "launch": launch})
            self.awaiting_sync = step

    # -- every rank: the stop rules -----------------------------------------------------------

    def agree(self, control: StepControl) -> None:
        """Every rank learns what rank 0 voted for (`ends_run` must agree on every rank)."""
        self.switch_requested = control.stop == Stop.SWITCH

    def time_is_up(self) -> bool:
        return self.cfg.train.max_time is not None and self.clock.now() >= self.cfg.train.max_time

    def stop_rule(self, step: int, consumed_samples: int, val_ppl: float | None) -> str | None:
        """The config's stop rule that holds after `step`, if one does."""
        t = self.cfg.train
        if t.target_ppl is not None and val_ppl is not None and val_ppl <= t.target_ppl:
            return "target_reached"
        if t.max_steps is not None and step >= t.max_steps:
            return "max_steps"
        if t.max_tokens is not None and consumed_samples * self.cfg.model.seq_len >= t.max_tokens:
            return "max_tokens"
        return None

    def ends_run(self, reason: str, stop_step: int | None) -> bool:
        """Whether the launch's stop ends the run: a stop rule, max_time, an interrupt or the last stage of
        a chain; not a switch (a chain's stage end, or a stop command the controller sent for a switch)."""
        if reason == "stage_end":
            chain = self.cfg.chain if self.cfg.policy == "chain" else None
            return bool(chain and chain[-1].steps) and stop_step == sum(c.steps or 0 for c in chain)
        return not (reason == "command" and self.switch_requested)

    def last_save_reason(self, reason: str) -> str:
        """The launch's last checkpoint is a switch's, an interrupt's (any stop by command or signal, or a
        lost controller) or the run's final one (a stop rule)."""
        if reason == "stage_end" or (reason == "command" and self.switch_requested):
            return "switch"
        return "interrupt" if reason in ("command", "signal", "controller_lost") else "final"

    def stop_id(self, reason: str) -> Any:
        """The id of the controller's command that stopped the launch, echoed in its outcome."""
        return self.stop_command.get("id") if reason == "command" and self.stop_command is not None else None
