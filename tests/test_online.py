"""The online policy on scripted telemetry: a world with known step times and GNS drives the real
`ConaPolicy` (no flapping at a true tie, a switch at a true gain, the selection among candidates)."""

from __future__ import annotations

import io
import itertools
import math
import queue
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from cona_cli.control.cona_policy import ConaPolicy
from cona_cli.control.controller import Controller
from cona_cli.control.policies import Stage
from cona_cli.control.recovery import LaunchResult, Recovery, Restart
from cona_cli.control.runstate import RunState
from cona_cli.planner.calibration import Calibrator
from cona_cli.planner.hardware import load_hardware
from cona_cli.planner.search import Candidate, SearchResult
from cona_core.config import ConfigError, config_from_dict
from cona_core.rundir import RunDir
from cona_core.strategy import Strategy, resizable
from tests.support import TINY, RecordedEvents


def _policy(**search: object) -> ConaPolicy:
    doc = {k: v for k, v in TINY.items() if k != "strategy"}
    doc["train"] = {**doc["train"], "max_steps": None, "max_time": 3600}
    doc["search"] = {"gbs_min": 8, "gbs_max": 16, "mbs": [2, 4, 8], "switch_cost_s": 1.0, **search}
    policy = ConaPolicy(config_from_dict(doc, "test"), load_hardware("cpu-local"))
    policy.events = RecordedEvents()
    return policy


@dataclass
class World:
    """True step times (the planner's uncalibrated model, so that prediction and truth agree) with
    lognormal noise, and a true GNS whose per-step two-batch estimates are noisy."""

    policy: ConaPolicy
    gns: float
    time_noise: float = 0.05
    gns_noise: float = 0.5
    seed: int = 0
    step: int = 0
    time: float = 0.0
    launch: int = 1
    consumed: int = 0
    switches: list[tuple[float, Strategy, Strategy]] = field(default_factory=list)
    slower: dict[Strategy, float] = field(default_factory=dict)  # where the truth is slower than the model
    hold: int = 0  # steps after a change of batch without a two-batch estimate (the workers' hold)
    held: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        p = self.policy
        self.model = Calibrator(p.workload, p.hw, seed=0)

    def true_time(self, s: Strategy) -> float:
        return float(self.model.predict(_row(s))[0][0]) * self.slower.get(s, 1.0)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            s = self.policy.current.strategy
            iter_s = self.true_time(s) * math.exp(self.rng.gauss(0, self.time_noise))
            self.step, self.time, self.consumed = self.step + 1, self.time + iter_s, self.consumed + s.gbs
            self.held = max(0, self.held - 1)
            row = {
                "kind": "step",
                "step": self.step,
                "launch": self.launch,
                "time": self.time,
                "iter_s": iter_s,
                "consumed_samples": self.consumed,
                **s.to_dict(),
                "grad_sq_raw": 1.0 + 0.3 * self.rng.gauss(0, 1),
                "trace_raw": self.gns * (1.0 + self.gns_noise * self.rng.gauss(0, 1)),
            }
            if self.held:
                row.update(grad_sq_raw=None, trace_raw=None)
            stage = self.policy.on_metric(row)
            if stage is not None:
                self.switches.append((self.time, s, stage.strategy))
                if stage.strategy.gbs != s.gbs:
                    self.held = self.hold
                if self.policy.in_place and resizable(s, stage.strategy):
                    self.policy.resized(stage, self.true_time(stage.strategy))
                else:
                    self.policy.after_launch({"step": self.step}, stage)
                    self.launch += 1
                    self.time += self.policy.s.switch_cost_s

    def reversals(self) -> int:
        return sum(1 for a, b in zip(self.switches, self.switches[1:]) if a[1] == b[2])


def _row(s: Strategy):
    import numpy as np

    return np.array([[s.dp, s.tp, s.pp, s.mbs, s.gbs]])


def _gns_for_ratio(world: World, a: Strategy, b: Strategy, ratio: float) -> float:
    """The GNS at which b's true Φ is `ratio` times a's: xb/(gb+G) = ratio·xa/(ga+G), x = samples/s."""
    xa, xb = a.gbs / world.true_time(a), b.gbs / world.true_time(b)
    gns = (ratio * xa * b.gbs - xb * a.gbs) / (xb - ratio * xa)
    assert gns > 0, (ratio, xa, xb)
    return gns


S8, S16 = Strategy(4, 1, 1, 2, 8), Strategy(4, 1, 1, 4, 16)


def test_a_true_twenty_percent_gain_switches_at_the_first_decisions() -> None:
    policy = _policy()
    assert policy.first().strategy == S8
    world = World(policy, gns=0.0)
    world.gns = _gns_for_ratio(world, S8, S16, 1.2)
    world.run(60)
    assert world.switches and world.switches[0][2] == S16
    # The dwell is min_steps timed steps after 2 warm-up steps; decisions every 5 steps.
    first_decision_step = 2 + policy.s.min_steps
    switched_at = next(e["step"] for e in policy.events.decisions() if e["switch"])
    assert switched_at <= first_decision_step + 2 * policy.s.decision_every


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_flapping_at_a_true_tie_after_both_rungs_were_measured(seed: int) -> None:
    """A gain takes the run to gbs 16; the GNS then falls to where 8 and 16 are exactly even (both
    measured): 3000 noisy steps later the run has not gone back, nor anywhere else."""
    policy = _policy()
    world = World(policy, gns=0.0, seed=seed)
    world.gns = _gns_for_ratio(world, S8, S16, 1.3)
    world.run(80)
    assert [w[2] for w in world.switches] == [S16]
    _measured(world, S8)
    world.gns = _gns_for_ratio(world, S8, S16, 1.0)
    world.run(3000)
    assert [w[2] for w in world.switches] == [S16], world.switches
    lows = [e["ratio_judged"] for e in policy.events.decisions() if e.get("candidate") == S8.to_dict()]
    assert lows and max(lows) < 1.0


def _measured(world: World, s: Strategy, n: int = 40) -> None:
    """`s`'s step times as if measured in an earlier visit."""
    world.policy.samples[s] = [world.true_time(s) * math.exp(world.rng.gauss(0, world.time_noise)) for _ in range(n)]


def test_the_next_rung_up_is_taken_at_its_point_estimate() -> None:
    """At gbs 8 with 16 measured, 16 truly 8 % ahead: too little for the ratio's 99 % lower bound at these
    noise levels (the bound a retreat must clear), but the climb is taken at the point estimate within a
    few decisions of the dwell."""
    policy = _policy()
    world = World(policy, gns=0.0, time_noise=0.1)
    world.gns = _gns_for_ratio(world, S8, S16, 1.08)
    _measured(world, S16)
    world.run(60)
    assert [w[2] for w in world.switches] == [S16]
    climb = next(e for e in policy.events.decisions() if e["switch"])
    error = math.hypot(climb["measured_t_log_std"], climb["predicted_t_log_std"])
    bound = climb["ratio"] * math.exp(-policy.z * error)  # what a confident move would have been judged at
    assert climb["candidate"] == S16.to_dict() and bound < 1.0 < climb["ratio"] == climb["ratio_judged"]
    assert climb["step"] <= 2 + policy.s.min_steps + 3 * policy.s.decision_every


def test_a_rung_two_up_needs_the_lower_bound() -> None:
    """At gbs 8, with 16 measured 30 % slower than the model and 32 measured 8 % ahead of 8 at the point
    estimate but not at the 99 % bound: the run stays. A rung two up is not taken at the point estimate (a
    wild early GNS would send the run there for good: docs/switching.md)."""
    s32 = Strategy(4, 1, 1, 8, 32)
    policy = _policy(gbs_max=32)
    world = World(policy, gns=0.0, time_noise=0.1)
    world.slower[S16] = 1.3
    world.gns = _gns_for_ratio(world, S8, s32, 1.08)
    _measured(world, S16)
    _measured(world, s32)
    world.run(60)
    assert world.switches == []
    on_32 = [e for e in policy.events.decisions() if e.get("candidate") == s32.to_dict()]
    assert sum(e["ratio"] > 1.0 for e in on_32) >= 3 and all(e["ratio_judged"] < 1.0 for e in on_32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_at_a_true_tie_the_run_climbs_at_most_once_and_does_not_come_back(seed: int) -> None:
    """From gbs 8 with 16 measured, at an exact tie: 3000 noisy steps take at most one switch, up."""
    policy = _policy()
    world = World(policy, gns=0.0, seed=seed)
    world.gns = _gns_for_ratio(world, S8, S16, 1.0)
    _measured(world, S16)
    world.run(3000)
    assert [w[2] for w in world.switches] in ([], [S16]), world.switches


def test_a_retreat_goes_to_the_best_measured_lower_rung_when_it_wins_with_confidence() -> None:
    policy = _policy()
    world = World(policy, gns=0.0)
    world.gns = _gns_for_ratio(world, S8, S16, 1.3)
    world.run(80)
    assert world.switches[-1][2] == S16
    world.gns = _gns_for_ratio(world, S8, S16, 1.0)
    world.run(100)  # a tie at 16 (8's own steps: 12 of them, 10 timed)
    world.slower[S16] = 2.5  # then gbs 16's steps turn 2.5x slower (the host, or a model that was wrong):
    # its samples per second fall to 0.75 of gbs 8's (the model has them at 1.88)
    world.run(100)
    assert world.switches[-1][2] == S8 and world.reversals() == 1
    chosen = [e for e in policy.events.decisions() if e["switch"]][-1]
    assert chosen["candidate_kind"] == "down" and chosen["ratio_judged"] > 1.0


@pytest.mark.parametrize("slower,retreats", [(1.6, False), (2.5, True)])
def test_a_smaller_batch_must_win_on_samples_per_second(slower: float, retreats: bool) -> None:
    """After the climb to gbs 16, its steps turn `slower` times what the model predicts and the noise scale
    reads 2, which puts gbs 8 1.5x ahead at the measured GNS where gbs 16 still has 1.18x its samples per
    second (1.6x slower): no way back on a small noise scale alone; at 2.5x slower gbs 16 has 0.75x gbs 8's
    samples per second, and the run goes back."""
    policy = _policy()
    world = World(policy, gns=1000.0)
    world.run(80)
    assert world.switches[-1][2] == S16
    world.slower[S16], world.gns = slower, 2.0
    world.run(300)
    assert (world.reversals() == 1) is retreats
    assert world.switches[-1][2] == (S8 if retreats else S16)


def test_a_slow_rung_is_left_before_its_noise_scale_has_a_reading() -> None:
    """The climb to gbs 16 finds it 2.5x slower than predicted (0.75x gbs 8's samples per second); while
    the workers hold the estimator after the change of batch, the retreat, which reads no G, is taken."""
    policy = _policy()
    world = World(policy, gns=1000.0, hold=200)
    world.slower[S16] = 2.5
    world.run(60)
    assert [(a, b) for _, a, b in world.switches] == [(S8, S16), (S16, S8)]
    assert world.held > 0  # back at gbs 8 within the hold
    chosen = [e for e in policy.events.decisions() if e["switch"]][-1]
    assert chosen["candidate_kind"] == "down" and "gns" not in chosen and "no G reading yet" in chosen["why"]


def test_the_choice_is_among_the_candidates_that_pass() -> None:
    """A relaunch with the larger Φ ratio that cannot pay back its switch must not hide a resize that
    passes (the rule used to keep the highest ratio and switch only if that one passed)."""
    policy = _policy(switch_cost_s=3000.0)  # most of the hour left: the relaunch's payback is 1/6
    relaunch = Strategy(2, 1, 2, 4, 16)
    assert not resizable(S8, relaunch)
    t8 = 0.05
    results = {
        8: SearchResult(8, [Candidate(S8, t8, 0.0, 0.0, 0.0)], [], 1, True),
        16: SearchResult(
            16,
            [Candidate(relaunch, 0.06, 0.03, 0.0, 0.0), Candidate(S16, 0.072, 0.0005, 0.0, 0.0)],  # a sure model
            [],
            2,
            True,
        ),
    }
    policy._maybe_search = lambda: None  # the search results are the test's
    policy._results = results
    rows = [
        {"kind": "step", "step": i, "launch": 1, "time": i * t8, "iter_s": t8, "consumed_samples": 8 * i,
         **S8.to_dict(), "grad_sq_raw": 1.0 + 0.01 * (-1) ** i, "trace_raw": 200.0 * (1 + 0.01 * (-1) ** i)}
        for i in range(1, 16)
    ]  # fmt: skip
    stages = [policy.on_metric(r) for r in rows]
    stage = next(s for s in stages if s is not None)
    assert stage.strategy == S16
    d = [e for e in policy.events.decisions() if e["switch"]][-1]
    relaunch_ratio = (16 / 0.06) / (8 / t8) * (8 + 200) / (16 + 200)
    assert d["candidate_kind"] == "up" and 1.0 < d["ratio"] <= d["ratio_judged"] and d["ratio"] < relaunch_ratio


def test_a_relaunch_must_pay_back_in_the_time_left() -> None:
    """The same gain pays for a 1 s relaunch with an hour left, not with under a second left."""
    for max_time, switches in ((3600, True), (1.5, False)):  # decisions from 0.43 s on
        policy = _policy(in_place=False)
        policy.cfg = replace(policy.cfg, train=replace(policy.cfg.train, max_time=max_time))
        world = World(policy, gns=0.0, time_noise=0.0, gns_noise=0.0)
        world.gns = _gns_for_ratio(world, S8, S16, 1.5)
        world.run(30)
        assert bool(world.switches) == switches, (max_time, world.switches)


def test_step_times_taken_while_a_standby_imports_are_not_the_strategys() -> None:
    policy = _policy()
    start = policy.first().strategy
    policy.standby_importing = True  # the controller just started a standby beside the job
    world = World(policy, gns=0.5)
    world.run(10)
    assert policy.samples.get(start, []) == [] and policy.events.decisions() == []
    policy.standby_importing = False
    world.run(10)
    assert len(policy.samples[start]) == 10  # the launch's 2 warm-up steps were among the first 10


def test_a_batch_only_switch_is_costed_as_a_resize_then_at_measured_resizes() -> None:
    policy = _policy(switch_cost_s=100.0, warm_switch_cost_s=100.0)
    bigger = replace(S8, mbs=4, gbs=16)
    assert resizable(S8, bigger) and policy.switch_cost(bigger) == 0.0
    assert policy.switch_cost(Strategy(1, 1, 4, 2, 16)) == 100.0  # a new layout: a relaunch
    policy.resized(Stage(bigger, None, "decision"), 0.02)
    assert policy.switch_cost(replace(bigger, gbs=32, mbs=8)) == 0.02
    assert policy.state_dict()["resize_costs"] == [0.02]


def test_state_round_trips_for_resume() -> None:
    policy = _policy()
    world = World(policy, gns=0.0)
    world.gns = _gns_for_ratio(world, S8, S16, 1.3)
    world.run(60)
    again = _policy()
    again.load_state_dict(policy.state_dict())
    assert again.current.strategy == policy.current.strategy == S16
    assert again.samples == policy.samples and list(again.noise.entries) == list(policy.noise.entries)
    assert again.gns() == policy.gns()


def test_the_noise_scale_pools_only_the_running_batch_sizes_estimates() -> None:
    """Adam's preconditioner describes the batch it was built at, so after a change of batch the GNS
    forgets the old batch's estimates: it reads the new rung's alone, and none until it has its own."""
    policy = _policy()
    small, big = Strategy(4, 1, 1, 2, 8), Strategy(4, 1, 1, 4, 16)

    def row(s: Strategy, step: int, trace: float) -> dict:
        return {"step": step, "launch": 1, "iter_s": 0.1, **s.to_dict(), "grad_sq_raw": 1.0, "trace_raw": trace}

    for step in range(1, 11):
        policy._observe_noise(row(small, step, 10.0 + step % 2))
    assert policy.gns() is not None and 10.0 <= policy.gns().value <= 11.0
    policy._observe_noise({**row(big, 11, 0.0), "grad_sq_raw": None, "trace_raw": None})  # held after the resize
    assert policy.gns() is None
    for step in range(12, 16):
        policy._observe_noise(row(big, step, 40.0 + step % 2))
    assert {gbs for gbs, _, _ in policy.noise.entries} == {16} and 40.0 <= policy.gns().value <= 41.0


def test_one_process_runs_only_strategies_that_measure_the_noise_scale() -> None:
    doc = {k: v for k, v in TINY.items() if k != "strategy"}
    doc["cluster"] = {"procs_per_node": 1}
    doc["train"] = {**doc["train"], "max_steps": None, "max_time": 3600}
    doc["search"] = {"gbs_min": 8, "gbs_max": 32, "mbs": [2, 4, 8, 16, 32]}
    policy = ConaPolicy(config_from_dict(doc, "test"), load_hardware("cpu-local"))
    assert policy.current.strategy.mbs < policy.current.strategy.gbs
    assert all(s.mbs < s.gbs for s in policy.space.feasible)
    assert Strategy(1, 1, 1, 8, 8) in {s for s, _ in policy.space.rejected}
    doc["search"]["mbs"] = [8, 16, 32]  # gbs 8 then runs as one micro-batch only
    with pytest.raises(ValueError, match="no feasible strategy at gbs 8 that measures the noise scale"):
        ConaPolicy(config_from_dict(doc, "test"), load_hardware("cpu-local"))


def test_a_standby_is_wanted_only_where_a_switch_may_need_a_relaunch() -> None:
    """On one device every strategy keeps the mesh, so every switch resizes in place and a standby would
    only take host cores and a device context from the job; with four ranks layouts differ."""
    doc = {k: v for k, v in TINY.items() if k != "strategy"}
    doc["cluster"] = {"procs_per_node": 1}
    doc["search"] = {"gbs_min": 8, "gbs_max": 32, "mbs": [2, 4, 8, 16]}
    one = ConaPolicy(config_from_dict(doc, "test"), load_hardware("cpu-local"))
    assert one.may_switch() and not one.may_relaunch()
    doc["search"] = {**doc["search"], "in_place": False}
    assert ConaPolicy(config_from_dict(doc, "test"), load_hardware("cpu-local")).may_relaunch()
    assert _policy().may_relaunch()


def test_policy_cona_refuses_a_run_without_the_noise_scale() -> None:
    doc = {k: v for k, v in TINY.items() if k != "strategy"}
    doc["train"] = {**doc["train"], "gns": False}
    with pytest.raises(ConfigError, match="train.gns: policy cona"):
        config_from_dict(doc, "test")


def test_the_controller_acts_on_the_first_stage_of_a_queued_batch() -> None:
    """A loaded host queues several rows: every one reaches the policy, and the decision acted on is the
    first one the policy returned, as when the rows arrive one at a time (what a replay assumes)."""
    controller = Controller.__new__(Controller)
    controller.telemetry = SimpleNamespace(messages=queue.Queue())
    for i in range(4):
        controller.telemetry.messages.put({"i": i})
    seen: list[int] = []
    stages = {1: "first", 2: "second"}

    def handle(msg: dict, prev: object) -> object:
        seen.append(msg["i"])
        return stages.get(msg["i"])

    controller._handle = handle  # type: ignore[method-assign]
    assert controller._drain(None) == "first"
    assert seen == [0, 1, 2, 3]


def test_rows_of_another_launch_than_the_running_one_are_ignored_and_logged() -> None:
    """Rows and syncs of a launch that should be gone never reach the policy or answer for the running job;
    the first of them is logged (one warning per such launch)."""
    controller = Controller.__new__(Controller)
    controller.telemetry = SimpleNamespace(messages=queue.Queue())
    controller.launch, controller._ignored, controller._sync_step = 3, set(), None
    warned: list[str] = []
    controller.recovery = SimpleNamespace(warn=warned.append)  # type: ignore[assignment]
    for launch in (2, 3, 2):
        controller.telemetry.messages.put({"type": "metric", "kind": "step", "step": 5, "launch": launch})
    controller.telemetry.messages.put({"type": "sync", "step": 5, "launch": 2})
    seen: list[int] = []
    controller._handle = lambda msg, prev: seen.append(msg["launch"])  # type: ignore[method-assign]
    assert controller._drain(None) is None
    assert seen == [3] and controller._sync_step is None
    assert warned == ["ignoring rows of launch 2: launch 3 is running"]


def test_the_search_reruns_as_the_running_strategys_steps_double_or_its_median_moves() -> None:
    """A search made on a strategy's first slow steps must not fix a higher rung's prediction for the rest
    of the run: it reruns at twice the steps it saw (until the window is full), and when the median moves."""
    policy = _policy()
    searched: list[tuple[float, int]] = []
    rng = random.Random(0)

    def feed(steps: range, iter_s: float) -> None:
        for step in steps:
            row = {"kind": "step", "step": step, "launch": 1, "time": step * iter_s, **S8.to_dict()}
            row |= {"iter_s": iter_s * (1 + 0.001 * rng.random()), "grad_sq_raw": 1.0, "trace_raw": 1.0}
            policy.on_metric(row)
            last = policy._searched_for
            if last is not None and (not searched or searched[-1] != (last[1], last[2])):
                searched.append((last[1], last[2]))

    feed(range(1, 400), 0.1)
    counts = [n for _, n in searched]
    assert len(counts) >= 3 and all(b >= 2 * a for a, b in itertools.pairwise(counts))  # doubling, median unchanged
    assert counts[-1] <= 100  # the window holds 100 steps: then only a moved median reruns it
    feed(range(400, 500), 0.12)
    assert searched[-1][0] > 0.11 and len(searched) == len(counts) + 1  # one rerun for a 20 % move
    policy._join_search()


def _recovery(policy: ConaPolicy, run_dir: Path) -> Recovery:
    files = RunDir(run_dir)
    return Recovery(policy.cfg, files, policy, RecordedEvents(), Console(file=io.StringIO()), RunState(), 0.0, False)  # type: ignore[arg-type]


def test_a_restart_without_a_checkpoint_after_an_in_place_climb_starts_at_the_first_rung_reset(
    tiny_run_dir: Path,
) -> None:
    """A kill after the job climbed 8 -> 16 in place, before any checkpoint: the restart runs from step 0,
    so it starts where an unkilled run starts, at the first rung, and the policy forgets what the dead
    launch taught it about that trajectory (its stage, noise window and step times), as `--resume` does."""
    policy = _policy()
    first = policy.first()
    world = World(policy, gns=0.0)
    world.gns = _gns_for_ratio(world, S8, S16, 1.3)
    world.run(60)
    assert policy.current.strategy == S16 and policy.noise.entries and policy.samples
    failed = LaunchResult(1, None, None, None, tiny_run_dir / "logs" / "launch_001.log")
    restart = _recovery(policy, tiny_run_dir).after_failure(failed, None, policy.current, 1)
    assert isinstance(restart, Restart) and restart.checkpoint is None
    assert restart.stage == first and policy.current == first
    assert not policy.noise.entries and not any(policy.samples.values()) and policy.leading is None
    again = _policy()
    again.load_state_dict(policy.state_dict())
    assert again.current == first and not any(again.samples.values())


def test_a_restart_from_a_checkpoint_keeps_what_the_policy_knew_at_its_step() -> None:
    """From a checkpoint at step 30: the step times of later steps (the dead launch's, to be run again) are
    dropped, and the noise window is the checkpoint's own (its trailing estimates at its batch)."""
    policy = _policy()
    world = World(policy, gns=0.0)
    world.gns = _gns_for_ratio(world, S8, S16, 1.3)
    world.run(60)
    entries = [[8, 1.0, 5.0]] * 3 + [[16, 2.0, 7.0], [16, 3.0, 9.0]]
    trainer = {"trainer": {"step": 30, "extra": {"gns": {"entries": entries}}}, "strategy": S16.to_dict()}
    policy.restart(30, policy.current, trainer)
    assert list(policy.noise.entries) == [(16, 2.0, 7.0), (16, 3.0, 9.0)]
    steps = [step for kept in policy.sample_steps.values() for step in kept]
    assert steps and max(steps) == 30 and len(steps) == sum(len(v) for v in policy.samples.values())


def test_a_host_the_hardware_profile_cannot_describe_is_named_once_at_the_first_decision() -> None:
    """Steps 200× faster than the profile describes (more than its overheads and efficiencies can absorb,
    as a GPU's times under a CPU profile): the fit cannot reach them, every strategy not yet run is
    predicted from the wrong machine, and the run says so once, at the first decision with a calibrated
    search, naming the profile; steps 20× slower,
    which the fit absorbs, say nothing."""
    from cona_cli.control.run_console import event_line

    policy = _policy()
    fast = World(policy, gns=50.0, slower={S8: 1 / 200})
    fast.run(40)
    warned = [e for e in policy.events.rows if e["kind"] == "profile_mismatch"]
    assert len(warned) == 1
    # the first decision starts the first search on measured steps; the next one reads it
    assert warned[0]["step"] == policy.events.decisions()[1]["step"]
    assert warned[0]["hardware"] == "cpu-local" and warned[0]["ratio"] < 0.5
    assert "search.hardware 'cpu-local'" in (event_line(warned[0]) or "")

    described = _policy()
    World(described, gns=50.0, slower={S8: 20.0}).run(40)
    assert not [e for e in described.events.rows if e["kind"] == "profile_mismatch"]
