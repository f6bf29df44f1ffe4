"""A simulated cluster and training run that drives the real policies on a simulated clock.

- **Step time**: the planner's cost model (`planner.costmodel.iteration_time`) on the `truth` profile,
  times lognormal noise of std `noise` per step. With `truth` the config's own profile the policy's
  model and the world agree; another profile is a world the planner mis-predicts. A strategy with
  `measured` step times is timed by a draw from them instead, and the others by the model scaled by
  the median of measured over modelled.
- **Switch cost**: a resize costs one step of the new strategy; a relaunch saves and loads the
  checkpoint (12 bytes per parameter: fp32 weights and Adam's two moments) at `storage_gbs` each way,
  starts the processes (`relaunch_s`) and runs a first step.
- **Evaluations and start-up**: the run starts `start_s` in and pauses `eval_s` at each evaluation of the
  config's schedule (0 unless measured: `--from-run`).
- **Progress**: `dynamics`, a function of the loss reached: Kaplan's law (`simulate.law`) or curves
  measured in static runs (`simulate.from_runs`). It also gives each step's GNS estimate, held for
  1/(1 − β2) steps after every change of batch, as the workers hold their estimator.

The policy sees the rows `cona train`'s workers stream (step, time, iter_s, consumed_samples, layout,
grad_sq_raw, trace_raw) and is told of switches as the controller tells it (`resized`, `observe_switch`,
`after_launch`). Its decisions follow from the rows alone (each uses the search started at the
decision point before), so a seed reproduces.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from cona_cli.control.policies import Policy, StaticPolicy
from cona_cli.planner.costmodel import iteration_time
from cona_cli.planner.hardware import HardwareProfile
from cona_cli.planner.space import enumerate_space, gbs_ladder
from cona_cli.planner.workload import Workload
from cona_cli.report.crossing import crossing
from cona_core.config import Config
from cona_core.strategy import Strategy, resizable

CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights, Adam's first and second moments
OPTIMUM_POINTS = 2000  # progress steps of the costed optimum's dynamic programme


class Dynamics(Protocol):
    """How training goes in the world, as a function of the loss reached (`simulate.law`, `from_runs`)."""

    def start_loss(self) -> float: ...

    def floor(self) -> float: ...

    def after(self, gbs: int, loss: float) -> float: ...

    def grid(self, stop_loss: float, points: int) -> list[float]: ...

    def samples(self, gbs: int, high: float, low: float) -> float: ...

    def report(self, gbs: int, loss: float, rng: random.Random) -> tuple[float, float]: ...


@dataclass(frozen=True)
class WorldSpec:
    dynamics: Dynamics
    truth: HardwareProfile
    noise: float = 0.05
    measured: dict[Strategy, list[float]] = field(default_factory=dict)
    # A launch's first steps beyond steady ones, per strategy measured (else a relaunch charges one step).
    warmup_s: dict[Strategy, float] = field(default_factory=dict)
    start_s: float = 0.0  # run time before the first step
    eval_s: float = 0.0  # the pause of one evaluation (at the config's train.eval_interval[_s])
    relaunch_s: float = 20.0
    storage_gbs: float = 2.0
    max_time: float = 7 * 24 * 3600.0


@dataclass
class Curve:
    """One simulated run: the loss after every step, and its switches (time, from, to)."""

    times: list[float] = field(default_factory=lambda: [0.0])
    losses: list[float] = field(default_factory=lambda: [math.inf])  # the first: the loss at the start
    switches: list[tuple[float, Strategy, Strategy]] = field(default_factory=list)
    first: Strategy | None = None  # what it started with
    evals: list[tuple[float, float]] = field(default_factory=list)  # (time, loss) of the workers' evaluations

    def time_to(self, loss: float) -> float | None:
        """When the loss first reached `loss` (linear between steps), None if it never did."""
        for i in range(1, len(self.losses)):
            if self.losses[i] <= loss:
                before = self.losses[i - 1]
                if not math.isfinite(before):
                    return self.times[i]
                share = (before - loss) / (before - self.losses[i])
                return self.times[i - 1] + share * (self.times[i] - self.times[i - 1])
        return None

    def time_evaluated(self, loss: float) -> float | None:
        """When the loss reached `loss` as a real run's evaluations time it (`scripts/bench_ttp.py`:
        linear in loss between the evaluations that bracket it), None if no evaluation saw it."""
        return crossing([e for e in self.evals if math.isfinite(e[1])], loss)


class DecisionLog:
    """A policy's `events` off a real run: keeps the decisions it writes, drops the rest."""

    def __init__(self) -> None:
        self.decisions: list[dict] = []

    def write(self, kind: str, **fields: object) -> dict:
        row = {"kind": kind, **fields}
        if kind == "decision":
            self.decisions.append(row)
        return row


class Simulation:
    """The world of one config: true step times of every feasible strategy, and runs in it."""

    def __init__(self, cfg: Config, spec: WorldSpec) -> None:
        self.cfg, self.spec = cfg, spec
        self.ladder = gbs_ladder(cfg)
        self.workload = Workload.from_config(cfg)
        self.space = enumerate_space(cfg, spec.truth, self.ladder).feasible
        rows = np.array([[s.dp, s.tp, s.pp, s.mbs, s.gbs] for s in self.space], dtype=np.float64)
        times = iteration_time(rows, self.workload, spec.truth) if self.space else []
        modelled = {s: float(t) for s, t in zip(self.space, times)}
        timed = {s: statistics.median(v) for s, v in spec.measured.items() if s in modelled and v}
        scale = statistics.median(timed[s] / modelled[s] for s in timed) if timed else 1.0
        self.true_time = {s: timed.get(s, t * scale) for s, t in modelled.items()}
        self.hold = math.ceil(1 / (1 - cfg.train.beta2))
        params = self.workload.shape.total_params
        self.checkpoint_s = 2 * CHECKPOINT_BYTES_PER_PARAM * params / (spec.storage_gbs * 1e9)

    def best_at(self, gbs: int) -> Strategy:
        """The fastest true strategy of a rung."""
        return min((s for s in self.space if s.gbs == gbs), key=self.true_time.__getitem__)

    def static_at(self, gbs: int) -> Strategy:
        """A static run's strategy at a rung: the fastest one the world's runs measured there (a world
        made of static runs has them run as they ran), else the fastest true one."""
        measured = [s for s in self.spec.measured if s.gbs == gbs and s in self.true_time]
        return min(measured, key=self.true_time.__getitem__) if measured else self.best_at(gbs)

    def switch_cost(self, old: Strategy, new: Strategy, in_place: bool) -> float:
        if in_place and resizable(old, new):
            return self.true_time[new]
        return self.spec.relaunch_s + self.checkpoint_s + self.spec.warmup_s.get(new, self.true_time[new])

    def step_time(self, strategy: Strategy, rng: random.Random) -> float:
        """One step's seconds: a draw from its measured steps, else the true time with lognormal noise."""
        measured = self.spec.measured.get(strategy)
        if measured:
            return rng.choice(measured)
        return self.true_time[strategy] * math.exp(rng.gauss(0.0, self.spec.noise))

    def run(self, policy: Policy, stop_loss: float, seed: int) -> Curve:
        """Train under `policy` until the loss reaches `stop_loss` (and, where the workers evaluate, an
        evaluation saw it), the simulated time budget ends or a stop rule of the config (max_time,
        max_steps, max_tokens) does, as the workers would."""
        spec, dyn = self.spec, self.spec.dynamics
        rng = random.Random(seed)
        policy.events = DecisionLog()
        cur = policy.first().strategy
        curve = Curve(times=[spec.start_s], losses=[dyn.start_loss()], first=cur)
        curve.evals.append((spec.start_s, dyn.start_loss()))
        t, step, consumed, launch, held = spec.start_s + spec.warmup_s.get(cur, 0.0), 0, 0, 1, self.hold
        tr = self.cfg.train
        last_eval = spec.start_s  # the evaluation at the start
        budget = min(spec.max_time, tr.max_time or math.inf)
        steps = tr.max_steps or math.inf
        samples = tr.max_tokens / self.cfg.model.seq_len if tr.max_tokens else math.inf
        evaluates = tr.eval_interval is not None or tr.eval_interval_s is not None

        def reached() -> bool:  # the loss is at stop_loss and, where the workers evaluate, an evaluation saw it
            return (curve.evals[-1][1] if evaluates else curve.losses[-1]) <= stop_loss

        while t < budget and step < steps and consumed < samples and not reached():
            loss = curve.losses[-1]
            iter_s = self.step_time(cur, rng)
            t, step, consumed = t + iter_s, step + 1, consumed + cur.gbs
            curve.times.append(t)
            curve.losses.append(dyn.after(cur.gbs, loss))
            row = {"kind": "step", "step": step, "launch": launch, "time": t, "iter_s": iter_s}
            row |= {"consumed_samples": consumed, **cur.to_dict()}
            t, last_eval = self._evaluation(curve, step, t, last_eval)
            if held > 0:
                held -= 1
            else:
                row["grad_sq_raw"], row["trace_raw"] = dyn.report(cur.gbs, loss, rng)
            stage = policy.on_metric(row)
            if stage is None or stage.strategy == cur:
                continue
            new = stage.strategy
            cost = self.switch_cost(cur, new, policy.in_place)
            t += cost
            curve.switches.append((t, cur, new))
            if policy.in_place and resizable(cur, new):
                policy.resized(stage, cost)
            else:
                policy.observe_switch(cost)
                policy.after_launch({"step": step}, stage)
                launch += 1
            curve.times.append(t)
            curve.losses.append(curve.losses[-1])
            cur, held = new, self.hold
        return curve

    def _evaluation(self, curve: Curve, step: int, t: float, last_eval: float) -> tuple[float, float]:
        """The pause of an evaluation after `step` if the workers would make one there (as launch.worker
        schedules it), added to `curve`: (the time after it, the last evaluation's time)."""
        tr = self.cfg.train
        by_steps = tr.eval_interval is not None and (step + 1) % tr.eval_interval == 0
        by_time = tr.eval_interval_s is not None and t - last_eval >= tr.eval_interval_s
        if not (by_steps or by_time):
            return t, last_eval
        if self.spec.eval_s:
            t += self.spec.eval_s
            curve.times.append(t)
            curve.losses.append(curve.losses[-1])
        curve.evals.append((t, curve.losses[-1]))
        return t, t

    def static(self, strategy: Strategy, stop_loss: float, seed: int) -> Curve:
        return self.run(StaticPolicy(strategy), stop_loss, seed)

    def _rate(self, s: Strategy, loss: float) -> float:
        """True loss decrease per second of a step of `s` from `loss` (from the start: 1 / step time)."""
        if not math.isfinite(loss):
            return 1.0 / self.true_time[s]
        return (loss - self.spec.dynamics.after(s.gbs, loss)) / self.true_time[s]

    def optimum(self, stop_loss: float) -> Curve:
        """The optimum sequence with free switches (the paper's): at every step the rung with the most
        true progress per second, at its fastest strategy, without noise."""
        spec, dyn, best = self.spec, self.spec.dynamics, [self.best_at(g) for g in self.ladder]
        curve, t, cur, step = Curve(times=[spec.start_s], losses=[dyn.start_loss()]), spec.start_s, None, 0
        last_eval = t
        while t < spec.max_time and curve.losses[-1] > stop_loss:
            loss = curve.losses[-1]
            s = max(best, key=lambda s: self._rate(s, loss))
            if cur is None:
                curve.first = s
            elif s != cur:
                curve.switches.append((t, cur, s))
            cur, step = s, step + 1
            t += self.true_time[s]
            curve.times.append(t)
            curve.losses.append(dyn.after(s.gbs, loss))
            t, last_eval = self._evaluation(curve, step, t, last_eval)
        return curve

    def _with_evals(self, seconds: float, steps: float) -> float:
        """Training time with the evaluations that fall in it, by whichever of the config's schedules (in
        steps, in seconds) evaluates more often (for the programme, which has no single steps)."""
        tr = self.cfg.train
        by_steps = steps / tr.eval_interval if tr.eval_interval else 0.0
        by_time = seconds / tr.eval_interval_s if tr.eval_interval_s else 0.0
        return seconds + max(by_steps, by_time) * self.spec.eval_s

    def optimum_with_costs(self, stop_loss: float, in_place: bool, points: int = OPTIMUM_POINTS) -> Curve:
        """The fastest sequence of rungs (each at its fastest strategy) to `stop_loss` with every switch's
        cost charged: dynamic programming over `points` stretches of loss (`dynamics.grid`), where a
        stretch at rung g takes the samples g needs over it at g's true step time."""
        dyn, rungs = self.spec.dynamics, [self.best_at(g) for g in self.ladder]
        floor = dyn.floor()
        if stop_loss <= floor:
            raise ValueError(f"target loss {stop_loss:.4g} is at or below the world's floor {floor:.4g}")
        grid = dyn.grid(stop_loss, points)
        n = len(rungs)
        cost = [[0.0 if i == j else self.switch_cost(rungs[j], rungs[i], in_place) for j in range(n)] for i in range(n)]
        best = [0.0] * n  # fastest time to the current grid point ending at rung i
        came: list[list[int]] = []  # per stretch, the rung each rung's best path came from
        stretches: list[list[float]] = []  # per stretch, its seconds at each rung
        for hi, lo in itertools.pairwise(grid):
            steps = [dyn.samples(r.gbs, hi, lo) / r.gbs for r in rungs]
            stretch = [self._with_evals(k * self.true_time[r], k) for k, r in zip(steps, rungs)]
            links = [min(range(n), key=lambda j: best[j] + cost[i][j]) for i in range(n)]
            best = [best[j] + cost[i][j] + stretch[i] for i, j in enumerate(links)]
            came.append(links)
            stretches.append(stretch)
        path = [min(range(n), key=best.__getitem__)]
        for links in reversed(came[1:]):
            path.append(links[path[-1]])
        path.reverse()
        t = self.spec.start_s
        curve = Curve(times=[t], losses=[grid[0]], first=rungs[path[0]])
        for k, (i, lo) in enumerate(zip(path, grid[1:])):
            if k and i != path[k - 1]:
                t += cost[i][path[k - 1]]
                curve.switches.append((t, rungs[path[k - 1]], rungs[i]))
                curve.times.append(t)
                curve.losses.append(curve.losses[-1])
            t += stretches[k][i]
            if t > self.spec.max_time:
                break
            curve.times.append(t)
            curve.losses.append(lo)
        return curve
