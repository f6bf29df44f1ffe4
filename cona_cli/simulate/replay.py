"""Replay a recorded `policy: cona` run through the policy class: feed a fresh `ConaPolicy` the run's
own rows and switches as the controller fed them, and compare its decisions with the recorded ones.

This is the check that the simulator drives the policy as `cona train` does (the same rows, the same
calls), and the tool for asking what the current
decision rule makes of a run recorded under an older one: the replay is exact up to the first decision
that differs, after which the recorded rows no longer follow from the replayed decisions.

What the controller told the policy is read from `events.jsonl`: in-place resizes (`resized` at the
first step under the new batch), relaunches (`observe_switch` and `after_launch` at the first step of
the next launch) and standbys (`standby_importing` from a standby's start to its `standby_ready` or
`standby_lost`, `standby_ready` until then or the next launch), each after the step row its event
names: the last one the policy was fed when the flag changed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cona_cli.control.cona_policy import ConaPolicy
from cona_cli.control.policies import Stage
from cona_cli.planner.hardware import load_hardware
from cona_cli.simulate.world import DecisionLog
from cona_core.config import config_from_dict
from cona_core.rundir import RunDir, read_jsonl
from cona_core.strategy import Strategy

COMPARED = ("step", "switch", "candidate", "ratio", "ratio_judged")  # what a decision is compared on
# The policy's (standby_importing, standby_ready) after each standby event.
STANDBY_FLAGS = {"standby": (True, False), "standby_ready": (False, True), "standby_lost": (False, False)}


class NotReplayable(ValueError):
    """The folder is not one controller's run of policy cona from its start."""


@dataclass(frozen=True)
class Replay:
    recorded: list[dict[str, Any]]  # the run's decision events
    replayed: list[dict[str, Any]]  # the fresh policy's, fed the same rows

    @property
    def first_difference(self) -> int | None:
        """Index of the first decision that differs in any of `COMPARED` (None: all agree)."""
        for i, (a, b) in enumerate(zip(self.recorded, self.replayed, strict=False)):
            if any(a.get(k) != b.get(k) for k in COMPARED):
                return i
        return None if len(self.recorded) == len(self.replayed) else min(len(self.recorded), len(self.replayed))


def replay(run_dir: Path) -> Replay:
    """Feed the run's rows to a fresh `ConaPolicy` built from its resolved config."""
    run, warnings = RunDir(run_dir), []
    if not run.resolved_config.is_file():
        raise NotReplayable(f"{run_dir}: not a run directory (no {run.resolved_config.name})")
    events = read_jsonl(run.events, warnings)
    cfg = config_from_dict(json.loads(run.resolved_config.read_text()), str(run.resolved_config))
    if cfg.policy != "cona":
        raise NotReplayable(f"{run_dir}: a run of policy {cfg.policy}; only policy cona makes decisions")
    kinds = {e.get("kind") for e in events}
    if kinds & {"resume", "failure"}:
        raise NotReplayable(f"{run_dir}: the run was resumed or restarted; only one uninterrupted run replays")
    policy = ConaPolicy(cfg, load_hardware(cfg.search.hardware))
    log = DecisionLog()
    policy.events = log
    switches = {int(e["step"]): e for e in events if e.get("kind") == "switch"}
    flags = [e for e in events if e.get("kind") in STANDBY_FLAGS]
    if any("step" not in e for e in flags):
        raise NotReplayable(f"{run_dir}: its standby events name no step (recorded by an older cona)")
    standby = sorted((int(e["step"]), i, STANDBY_FLAGS[e["kind"]]) for i, e in enumerate(flags))
    requested: Stage | None = None
    launch = None
    for row in read_jsonl(run.metrics, warnings):
        if row.get("kind") == "eval":
            policy.on_eval(row)
            continue
        if row.get("kind") != "step":
            continue
        while standby and standby[0][0] < int(row["step"]):
            policy.standby_importing, policy.standby_ready = standby.pop(0)[2]
        if launch is not None and row.get("launch") != launch:
            policy.standby_importing = policy.standby_ready = False  # the controller's launch resets them
        switch = switches.get(int(row["step"]) - 1)
        if requested is not None and switch is not None and Strategy.from_mapping(row) == requested.strategy:
            if switch.get("in_place"):
                policy.resized(requested, float(switch["seconds"]))
            else:
                policy.observe_switch(float(switch["seconds"]), warm=bool(switch.get("standby_ready")))
                policy.after_launch({"step": switch["step"]}, requested)
            requested = None
        elif launch is not None and row.get("launch") != launch and requested is None:
            raise NotReplayable(f"{run_dir}: launch {row.get('launch')} started without a decision to switch")
        launch = row.get("launch")
        stage = policy.on_metric(row)
        if stage is not None and requested is None:
            requested = stage
    return Replay([e for e in events if e.get("kind") == "decision"], log.decisions)
