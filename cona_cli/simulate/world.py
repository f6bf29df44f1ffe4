"""A simulated cluster and training run that drives the real policies on a simulated clock.

- **Step time**: the planner's cost model (`planner.costmodel.iteration_time`) on the `truth` profile,
  times lognormal noise of std `noise` per step. With `truth` the config's own profile the policy's
  model and the world agree; another profile is a world the planner mis-predicts.
- **Switch cost**: a resize costs one step of the new strategy; a relaunch saves and loads the
  checkpoint (12 bytes per parameter: fp32 weights and Adam's two moments) at `storage_gbs` each way,
  starts the processes (`relaunch_s`) and runs a first step.
- **Progress**: `law` (Kaplan's fits). The GNS the workers would report is B_crit / `true_kappa` with
  per-step two-batch noise (`gns_noise`), and it is held for 1/(1 − β2) steps after every change of batch,
  as the workers hold their estimator.

The policy sees the rows `cona train`'s workers stream (step, time, iter_s, consumed_samples, layout,
grad_sq_raw, trace_raw) and is told of switches as the controller tells it (`resized`, `observe_switch`,
`after_launch`). Its background search is waited for after every row, so a seed reproduces.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field

import numpy as np

from cona_cli.config import Config
from cona_cli.control.policies import Policy, StaticPolicy
from cona_cli.planner.costmodel import iteration_time
from cona_cli.planner.hardware import HardwareProfile
from cona_cli.planner.space import enumerate_space, gbs_ladder
from cona_cli.planner.workload import Workload
from cona_cli.simulate.law import KaplanLaw
from cona_cli.strategy import Strategy, resizable

CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights, Adam's first and second moments
OPTIMUM_POINTS = 2000  # progress steps of the costed optimum's dynamic programme


@dataclass(frozen=True)
class WorldSpec:
    law: KaplanLaw
    truth: HardwareProfile
    noise: float = 0.05
    gns_noise: float = 0.5
    true_kappa: float = 1.0
    relaunch_s: float = 20.0
    storage_gbs: float = 2.0
    max_time: float = 7 * 24 * 3600.0


@dataclass
class Curve:
    """One simulated run: the loss after every step, and its switches (time, from, to)."""

    times: list[float] = field(default_factory=lambda: [0.0])
    losses: list[float] = field(default_factory=lambda: [math.inf])
    switches: list[tuple[float, Strategy, Strategy]] = field(default_factory=list)
    first: Strategy | None = None  # what it started with

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


class _Decisions:
    def __init__(self) -> None:
        self.count = 0

    def write(self, kind: str, **fields: object) -> dict:
        self.count += kind == "decision"
        return {"kind": kind, **fields}


class Simulation:
    """The world of one config: true step times of every feasible strategy, and runs in it."""

    def __init__(self, cfg: Config, spec: WorldSpec) -> None:
        self.cfg, self.spec = cfg, spec
        self.ladder = gbs_ladder(cfg)
        self.workload = Workload.from_config(cfg)
        self.space = enumerate_space(cfg, spec.truth, self.ladder).feasible
        rows = np.array([[s.dp, s.tp, s.pp, s.mbs, s.gbs] for s in self.space], dtype=np.float64)
        times = iteration_time(rows, self.workload, spec.truth) if self.space else []
        self.true_time = {s: float(t) for s, t in zip(self.space, times)}
        self.hold = math.ceil(1 / (1 - cfg.train.beta2))
        params = self.workload.shape.total_params
        self.checkpoint_s = 2 * CHECKPOINT_BYTES_PER_PARAM * params / (spec.storage_gbs * 1e9)

    def best_at(self, gbs: int) -> Strategy:
        """The fastest true strategy of a rung."""
        return min((s for s in self.space if s.gbs == gbs), key=self.true_time.__getitem__)

    def switch_cost(self, old: Strategy, new: Strategy, in_place: bool) -> float:
        if in_place and resizable(old, new):
            return self.true_time[new]
        return self.spec.relaunch_s + self.checkpoint_s + self.true_time[new]

    def run(self, policy: Policy, stop_loss: float, seed: int) -> Curve:
        """Train under `policy` until the loss reaches `stop_loss`, the simulated time budget ends or a
        stop rule of the config (max_time, max_steps, max_tokens) does, as the workers would."""
        spec, law = self.spec, self.spec.law
        rng = random.Random(seed)
        policy.events = _Decisions()
        cur = policy.first().strategy
        curve, t, s_min, step, consumed, launch, held = Curve(first=cur), 0.0, 0.0, 0, 0, 1, self.hold
        tr = self.cfg.train
        budget = min(spec.max_time, tr.max_time or math.inf)
        steps = tr.max_steps or math.inf
        samples = tr.max_tokens / self.cfg.model.seq_len if tr.max_tokens else math.inf
        while t < budget and step < steps and consumed < samples and curve.losses[-1] > stop_loss:
            loss = curve.losses[-1]
            iter_s = self.true_time[cur] * math.exp(rng.gauss(0.0, spec.noise))
            s_min += law.progress(cur.gbs, loss)
            t, step, consumed = t + iter_s, step + 1, consumed + cur.gbs
            curve.times.append(t)
            curve.losses.append(law.loss(s_min))
            row = {"kind": "step", "step": step, "launch": launch, "time": t, "iter_s": iter_s}
            row |= {"consumed_samples": consumed, **cur.to_dict()}
            if held > 0:
                held -= 1
            else:
                measured = law.critical_batch(loss) / spec.true_kappa
                row["grad_sq_raw"] = 1.0 + 0.3 * rng.gauss(0.0, 1.0)
                row["trace_raw"] = measured * (1.0 + spec.gns_noise * rng.gauss(0.0, 1.0))
            stage = policy.on_metric(row)
            policy.wait_for_search()
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

    def static(self, strategy: Strategy, stop_loss: float, seed: int) -> Curve:
        return self.run(StaticPolicy(strategy), stop_loss, seed)

    def optimum(self, stop_loss: float) -> Curve:
        """The optimum sequence with free switches (the paper's): at every step the rung with the most
        true progress per second, at its fastest strategy, without noise."""
        law, best = self.spec.law, {g: self.best_at(g) for g in self.ladder}
        curve, t, s_min, cur = Curve(), 0.0, 0.0, None
        while t < self.spec.max_time and curve.losses[-1] > stop_loss:
            loss = curve.losses[-1]
            s = max(best.values(), key=lambda s: law.progress(s.gbs, loss) / self.true_time[s])
            if cur is None:
                curve.first = s
            elif s != cur:
                curve.switches.append((t, cur, s))
            cur = s
            s_min += law.progress(s.gbs, loss)
            t += self.true_time[s]
            curve.times.append(t)
            curve.losses.append(law.loss(s_min))
        return curve

    def optimum_with_costs(self, stop_loss: float, in_place: bool, points: int = OPTIMUM_POINTS) -> Curve:
        """The fastest sequence of rungs (each at its fastest strategy) to `stop_loss` with every switch's
        cost charged: dynamic programming over `points` geometric steps of progress (minimal steps), where
        one stretch at rung g takes its progress over 1/(1 + B_crit/g) steps of the true step time."""
        law, rungs = self.spec.law, [self.best_at(g) for g in self.ladder]
        floor = law.loss_floor()
        if stop_loss <= floor:
            raise ValueError(f"target loss {stop_loss:.4g} is at or below the law's floor {floor:.4g}")
        s_stop = law.s_c / (stop_loss - floor) ** (1 / law.alpha_s)
        grid = [0.0, *np.geomspace(1.0, max(s_stop * (1 + 1e-9), 1.0), points)]  # just past: reaches stop_loss
        n = len(rungs)
        cost = [[0.0 if i == j else self.switch_cost(rungs[j], rungs[i], in_place) for j in range(n)] for i in range(n)]
        best = [0.0] * n  # fastest time to the current grid point ending at rung i
        came: list[list[int]] = []  # per stretch, the rung each rung's best path came from
        stretches: list[list[float]] = []  # per stretch, its seconds at each rung
        for lo, hi in itertools.pairwise(grid):
            loss = law.loss((lo + hi) / 2)
            stretch = [(hi - lo) / law.progress(r.gbs, loss) * self.true_time[r] for r in rungs]
            links = [min(range(n), key=lambda j: best[j] + cost[i][j]) for i in range(n)]
            best = [best[j] + cost[i][j] + stretch[i] for i, j in enumerate(links)]
            came.append(links)
            stretches.append(stretch)
        path = [min(range(n), key=best.__getitem__)]
        for links in reversed(came[1:]):
            path.append(links[path[-1]])
        path.reverse()
        curve, t = Curve(first=rungs[path[0]]), 0.0
        for k, (i, hi) in enumerate(zip(path, grid[1:])):
            if k and i != path[k - 1]:
                t += cost[i][path[k - 1]]
                curve.switches.append((t, rungs[path[k - 1]], rungs[i]))
                curve.times.append(t)
                curve.losses.append(curve.losses[-1])
            t += stretches[k][i]
            if t > self.spec.max_time:
                break
            curve.times.append(t)
            curve.losses.append(law.loss(hi))
        return curve
