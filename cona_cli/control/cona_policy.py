"""The online CONA policy: feeds the decision rule (`control.decision`) from the rows the workers stream.

Every `search.decision_every` steps, once the running strategy has `search.min_steps` timed steps of its
own (the dwell; a launch's or resize's first `WARMUP_STEPS` are not timed), it gathers:
- the running strategy's step time: the median, its error by batch means over blocks of `BLOCK` steps;
- the noise scale G of Adam-preconditioned gradients, pooled over the running batch size's estimates,
  with Fieller's bounds at `search.confidence` (times `search.kappa`, 1 unless overridden); until the
  running batch has one, only the moves that read no G (a layout, a retreat) are judged;
- the options: a better layout at the running rung and the best predicted strategy of every higher rung
  (and its best one the job can resize into) from the search, and the best measured strategy of every
  lower rung. A strategy that ran competes at its own measured times (their error plus the host's drift
  since), one never run at the model's time (calibrated online from every measured step: predicted, not
  profiled);
- each option's switch cost (measured resizes, hand-overs and relaunches; the configured estimates
  before any) and the time the run has left by its stop rules;
and takes the decision's verdict. The first time a search was calibrated on measured steps, the decision
also checks that the hardware profile, fitted to them, describes them (a `profile_mismatch` event
otherwise: the planner models another machine).

A background thread recalibrates the iteration-time model from the measured step times and reruns the
search whenever the measurements moved, and after every switch. A decision uses the search started at
the previous decision point, joined first: decisions follow from the rows alone, whatever the host's
load, so a recorded run replays exactly.
"""

from __future__ import annotations

import math
import statistics
import threading
from statistics import NormalDist
from typing import Any

from cona_cli.control.decision import Estimate, Evidence, Option, Running, Verdict, decide
from cona_cli.control.policies import Policy, Stage
from cona_cli.planner.calibration import Calibrator
from cona_cli.planner.hardware import HardwareProfile
from cona_cli.planner.search import Candidate, SearchResult, search_gbs
from cona_cli.planner.space import enumerate_space, gbs_ladder
from cona_cli.planner.workload import Workload
from cona_core.clock import MAD_TO_STD
from cona_core.config import Config
from cona_core.gns import NoiseInterval, NoiseWindow, measurable
from cona_core.strategy import Strategy, resizable

WARMUP_STEPS = 2  # first steps of a launch (pipeline shape inference, allocator) are not timed
REMEASURE = 0.1  # rerun the search when the running strategy's median moved by this fraction
SAMPLE_WINDOW = 100  # step times kept per strategy (the controller saves its state every few steps)
BLOCK = 10  # steps per block of the batch-means error of a step time
MISFIT = 2.0  # measured / fitted step time beyond which the hardware profile cannot describe the host


def fastest_strategy(cfg: Config, hw: HardwareProfile) -> Strategy:
    """What an offline planner picks: the shortest predicted iteration time at search.gbs_static."""
    gbs = cfg.search.gbs_static or gbs_ladder(cfg)[0]
    space = enumerate_space(cfg, hw, [gbs])
    best = search_gbs(space, Calibrator(Workload.from_config(cfg), hw, seed=cfg.search.seed), gbs, cfg.search).best
    if best is None:
        raise ValueError(f"search: no feasible strategy at gbs {gbs}")
    return best.strategy


def _block_means(logs: list[float]) -> list[float]:
    return [statistics.fmean(logs[i : i + BLOCK]) for i in range(0, len(logs) - BLOCK + 1, BLOCK)]


def time_estimate(times: list[float]) -> Estimate:
    """Median step time and the standard error of its log, by batch means over blocks of `BLOCK`
    consecutive steps (slow spells of the host make neighbouring steps alike: the spread of single
    steps would understate it); with fewer than 3 blocks, from the median absolute deviation."""
    logs = [math.log(t) for t in times]
    blocks = _block_means(logs)
    if len(blocks) >= 3:
        return Estimate(statistics.median(times), statistics.stdev(blocks) / math.sqrt(len(blocks)))
    mid = statistics.median(logs)
    mad = statistics.median(abs(v - mid) for v in logs) * MAD_TO_STD  # a robust std of one step
    return Estimate(statistics.median(times), 1.2533 * mad / math.sqrt(len(logs)))  # 1.2533: a median's efficiency


def drift(times: list[float]) -> float:
    """How far the host moves the step time between blocks of `BLOCK` steps (log std; 0 with < 3 blocks):
    the extra error of a step time measured at another moment than the one it is compared with."""
    blocks = _block_means([math.log(t) for t in times])
    return statistics.stdev(blocks) if len(blocks) >= 3 else 0.0


class ConaPolicy(Policy):
    name = "cona"

    def __init__(self, cfg: Config, hw: HardwareProfile) -> None:
        super().__init__()
        self.cfg, self.hw, self.s = cfg, hw, cfg.search
        self.z = NormalDist().inv_cdf(self.s.confidence)
        self.ladder = gbs_ladder(cfg)
        space = enumerate_space(cfg, hw, self.ladder)
        blind = {x for x in space.feasible if not measurable(x, cfg.train.dp_impl)}
        self.space = space.without(blind, "measures no noise scale (one replica, one micro-batch)")
        self.out_of_memory: set[Strategy] = set()  # strategies that ran out of memory in this run
        self.workload = Workload.from_config(cfg)
        self.samples: dict[Strategy, list[float]] = {}  # measured s/iter of strategies that ran
        self.sample_steps: dict[Strategy, list[int]] = {}  # the step each of those times was measured at
        self.switch_costs: list[float] = []  # measured cold relaunches
        self.warm_switch_costs: list[float] = []  # measured hand-overs to a ready standby
        self.resize_costs: list[float] = []  # measured in-place resizes
        self.in_place = self.s.in_place
        self.checkpoint_resizes = True  # its climbs in place are its trajectory: a kill must not undo them
        # Raw two-batch estimates (gbs, |G|², tr Σ) of the running batch size's last `train.gns_window` samples.
        self.noise = NoiseWindow(cfg.train.gns_window, per_batch=True)
        self._lock = threading.Lock()
        self._results: dict[int, SearchResult] = {}
        self._searched_for: tuple[Strategy, float, int] | None = None  # (strategy, median, steps) searched at
        self._thread: threading.Thread | None = None
        self._launch: int | None = None
        self._launch_steps = 0
        self._dwell: list[float] = []  # step times of the running strategy since it started (the last 100)
        self.leading: Strategy | None = None  # the last decision's best candidate
        self._misfit: tuple[Strategy, float] | None = None  # the last search's calibration against its steps
        self._profile_checked = False
        first = self._search_now(self.ladder[0]).best
        if first is None:
            lowest_blind = any(x.gbs == self.ladder[0] for x in blind)
            why = " that measures the noise scale (needs dp > 1 or gbs > mbs)" if lowest_blind else ""
            raise ValueError(f"search: no feasible strategy at gbs {self.ladder[0]}{why}")
        self.start = self.current = Stage(first.strategy, None, "start")

    # -- search ------------------------------------------------------------------------------

    def _calibrated(self, samples: dict[Strategy, list[float]]) -> Calibrator:
        cal = Calibrator(self.workload, self.hw, seed=self.s.seed)
        for strategy, times in samples.items():
            for t in times:
                cal.add(strategy, t)
        cal.fit()
        return cal

    def _search_now(self, gbs: int) -> SearchResult:
        return search_gbs(self.space, self._calibrated(self.samples), gbs, self.s)

    def _maybe_search(self) -> None:
        """Search the running rung and every higher one in the background if none runs and the
        calibration data moved enough: the running strategy's steps have doubled since the last search
        (its median's error has shrunk by √2), or its median moved by `REMEASURE`. The first steps after
        a move run slow, and a search on them alone once fixed a higher rung's prediction 16 % high for a
        whole run (docs/switching.md)."""
        cur = self.current.strategy
        median, steps = statistics.median(self._dwell), len(self._dwell)
        if self._thread is not None and self._thread.is_alive():
            return
        last = self._searched_for
        if last is not None and last[0] == cur and steps < 2 * last[2] and abs(median - last[1]) <= REMEASURE * last[1]:
            return
        self._searched_for = (cur, median, steps)
        rungs = [g for g in self.ladder if g >= cur.gbs]
        snapshot = {s: list(v) for s, v in self.samples.items()}

        def run() -> None:
            cal = self._calibrated(snapshot)
            results = {g: search_gbs(self.space, cal, g, self.s) for g in rungs}
            with self._lock:
                self._results, self._misfit = results, cal.misfit()

        self._thread = threading.Thread(target=run, name="cona-search", daemon=True)
        self._thread.start()

    def _join_search(self) -> dict[int, SearchResult]:
        """Wait for the background search, if one runs; its results per rung."""
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            return dict(self._results)

    # -- policy ------------------------------------------------------------------------------

    def first(self) -> Stage:
        return self.current

    def strategies(self) -> list[Strategy]:
        return list(self.space.feasible)

    def may_switch(self) -> bool:
        return len(self.ladder) > 1

    def may_relaunch(self) -> bool:
        cur = self.current.strategy
        return self.may_switch() and not (
            self.in_place and all(s == cur or resizable(cur, s) for s in self.space.feasible)
        )

    def expected_next(self) -> Strategy | None:
        return self.leading

    def switch_cost(self, target: Strategy | None = None) -> float:
        """The median of measured switches of the kind a switch to `target` would be now: an in-place
        resize (0 until one was measured), a hand-over to a ready standby (warm) or a cold relaunch
        (the configured estimates until one was measured)."""
        if target is not None and self.in_place and resizable(self.current.strategy, target):
            return statistics.median(self.resize_costs) if self.resize_costs else 0.0
        if self.standby_ready:
            return statistics.median(self.warm_switch_costs) if self.warm_switch_costs else self.s.warm_switch_cost_s
        return statistics.median(self.switch_costs) if self.switch_costs else self.s.switch_cost_s

    def observe_switch(self, seconds: float, warm: bool = False) -> None:
        (self.warm_switch_costs if warm else self.switch_costs).append(seconds)

    def gns(self) -> NoiseInterval | None:
        """The GNS of the recent window with its bounds at `search.confidence` (None before enough estimates)."""
        return self.noise.interval(self.s.confidence)

    def _observe_noise(self, row: dict[str, Any]) -> None:
        """Pool the row's two-batch estimate with those of the same batch size only (`per_batch`)."""
        self.noise.add(int(row["gbs"]), row.get("grad_sq_raw"), row.get("trace_raw"))

    def on_metric(self, row: dict[str, Any]) -> Stage | None:
        if row.get("launch") != self._launch:
            self._launch, self._launch_steps, self._dwell = row.get("launch"), 0, []
        self._launch_steps += 1
        self._observe_noise(row)
        cur = self.current.strategy
        if self._launch_steps > WARMUP_STEPS and not self.standby_importing:
            times, steps = self.samples.setdefault(cur, []), self.sample_steps.setdefault(cur, [])
            times.append(row["iter_s"])
            steps.append(int(row["step"]))
            del (
                times[:-SAMPLE_WINDOW],
                steps[:-SAMPLE_WINDOW],
            )  # recent steps only: follows host drift, bounds the saved state
            self._dwell.append(row["iter_s"])
            del self._dwell[:-SAMPLE_WINDOW]
        if len(self._dwell) < self.s.min_steps or self._launch_steps % self.s.decision_every:
            return None
        results = self._join_search()
        if not self._profile_checked:
            self._check_profile(row)
        self._maybe_search()
        return self._decide(row, self.gns(), results)

    def _check_profile(self, row: dict[str, Any]) -> None:
        """Once, from the first search calibrated on measured steps: an event if the hardware profile fitted to
        them is still more than `MISFIT` times off them, so that every strategy not yet run is predicted from a
        wrong machine (the calibration moves the profile's efficiencies and overheads, not its peak)."""
        if self._misfit is None:
            return
        self._profile_checked = True
        strategy, ratio = self._misfit
        if 1 / MISFIT <= ratio <= MISFIT or self.events is None:
            return
        self.events.write(
            "profile_mismatch", step=row["step"], hardware=self.hw.name, strategy=strategy.to_dict(), ratio=ratio
        )

    def time_left(self, row: dict[str, Any], t_step: float) -> float:
        """Seconds the run still has by its stop rules, at the running strategy's speed; a run that
        stops only at a target perplexity is expected to need as long again as it has run."""
        t = self.cfg.train
        now, gbs = float(row.get("time") or 0.0), self.current.strategy.gbs
        left = [t.max_time - now] if t.max_time is not None else []
        if t.max_steps is not None:
            left.append((t.max_steps - row["step"]) * t_step)
        if t.max_tokens is not None:
            left.append((t.max_tokens / self.cfg.model.seq_len - row["consumed_samples"]) / gbs * t_step)
        return max(min(left), 0.0) if left else now

    def options(self, results: dict[int, SearchResult]) -> list[Option]:
        """Everything the running strategy is compared with (named by its strategy), `results` the search's per rung: a
        better layout at the running rung and the best predicted strategy of every higher rung (plus its best
        one the job can resize into), and the best measured strategy of every lower rung. A strategy
        measured in an earlier visit competes at its own times, with the host's drift since then in their
        error; one never run, at the model's time: with the model's error if the job can resize into it (a dwell
        measures it), else without (the paper's rule: predicted, not profiled)."""
        cur = self.current.strategy
        moved = drift(self._dwell)
        ran = {s.gbs for s, v in self.samples.items() if v}
        out: list[Option] = []

        def add(s: Strategy, t: Estimate) -> None:
            out.append(Option(str(s), s.gbs, t, self.switch_cost(s), untried=s.gbs not in ran))

        def measured(s: Strategy) -> Estimate:
            t = time_estimate(self.samples[s])
            return Estimate(t.value, math.hypot(t.log_std, moved))

        for _, result in sorted(results.items()):
            picks: list[Candidate] = result.ranked[:1]
            if self.in_place:
                picks += [c for c in result.ranked if resizable(cur, c.strategy)][:1]
            for c in dict.fromkeys(picks):
                s = c.strategy
                if s == cur or s in self.out_of_memory:
                    continue
                if s in self.samples:
                    add(s, measured(s))
                elif self.in_place and resizable(cur, s):
                    add(s, Estimate(c.time_s, c.time_std / c.time_s))
                else:
                    add(s, Estimate(c.time_s))
        for gbs in (g for g in self.ladder if g < cur.gbs):
            below = [(measured(s), s) for s, v in self.samples.items() if s.gbs == gbs and v]
            if below:
                t, s = min(below, key=lambda m: m[0].value)
                add(s, t)
        return out

    def _decide(self, row: dict[str, Any], gns: NoiseInterval | None, results: dict[int, SearchResult]) -> Stage | None:
        """The verdict on the options; without a noise-scale reading (`gns` None), on those that read none."""
        cur = self.current.strategy
        t_cur = time_estimate(self._dwell)
        left = self.time_left(row, t_cur.value)
        k = self.s.kappa
        noise = NoiseInterval(k * gns.value, k * gns.low, k * gns.high) if gns is not None else None
        running = Running(cur.gbs, t_cur, tuple(self.ladder))
        verdict = decide(running=running, options=self.options(results), evidence=Evidence(noise, left, self.z))
        if verdict is None:
            why = "no GNS estimate yet" if gns is None else "no candidate yet (search running)"
            self._log(row, None, None, why, gns=gns, t_cur=t_cur)
            return None
        s = Strategy.parse(verdict.option.name)
        self.leading = s
        self._log(row, s, verdict, verdict.why, gns=gns, t_cur=t_cur, left=left)
        return Stage(s, None, "decision") if verdict.switch else None

    def after_launch(self, outcome: dict[str, Any], requested: Stage | None) -> Stage | None:
        if requested is None:
            return None
        self._moved(requested)
        return requested

    def resized(self, stage: Stage, seconds: float) -> None:
        self.resize_costs.append(seconds)
        self._moved(stage)
        self._launch_steps, self._dwell = 0, []  # the first steps under the new batch: as after a launch

    def _moved(self, stage: Stage) -> None:
        self.current = stage
        self.leading = None  # the next standby prepares what the next decision leads with, not this move
        self._searched_for = None  # a new frontier: search again once the new strategy is measured
        self._join_search()  # one started before the move must not write its results after it
        with self._lock:
            self._results = {}

    def restart(self, step: int, stage: Stage, trainer: dict[str, Any] | None = None) -> Stage | None:
        """Continue from a checkpoint at `step` as the run was there: the step times of later steps (the dead
        launch's, to be run again) are dropped and the noise window is the checkpoint's. Without one (step
        0) the run starts over where an unkilled run starts: at the first strategy, with no noise
        estimates and no step times of its own (measured switch costs and out-of-memory strategies, facts
        of the host, stay)."""
        for s, steps in self.sample_steps.items():
            kept = [i for i, at in enumerate(steps) if at <= step]
            self.samples[s], self.sample_steps[s] = [self.samples[s][i] for i in kept], [steps[i] for i in kept]
        self._launch, self._dwell = None, []
        if step == 0:
            self.noise.clear()
            self._moved(self._first_stage())
            return self.current
        if trainer is not None:
            self.noise = _checkpoint_window(self.cfg.train.gns_window, trainer)
        return stage

    def _first_stage(self) -> Stage:
        """Where the run starts: the first rung's best strategy (another one if that ran out of memory)."""
        if self.start.strategy not in self.out_of_memory:
            return self.start
        best = self._search_now(self.ladder[0]).best
        return Stage(best.strategy, None, "start") if best is not None else self.start

    def infeasible(self, strategy: Strategy) -> Stage | None:
        """Drop a strategy that ran out of memory from the space; continue with the best one left at the
        running rung (None if none is left)."""
        self.out_of_memory.add(strategy)
        self.space = self.space.without(self.out_of_memory, "ran out of memory")
        self.samples.pop(strategy, None)
        self._join_search()
        with self._lock:
            self._results.clear()
        self._searched_for = None
        best = self._search_now(self.current.strategy.gbs).best
        if best is None:
            return None
        self.current = Stage(best.strategy, None, "out_of_memory")
        return self.current

    def state_dict(self) -> dict[str, Any]:
        """Ladder position, calibration samples, switch costs and GNS window (for --resume)."""
        return {
            "current": str(self.current.strategy),
            "reason": self.current.reason,
            "samples": {str(k): v for k, v in self.samples.items()},
            "sample_steps": {str(k): v for k, v in self.sample_steps.items()},
            "switch_costs": self.switch_costs,
            "warm_switch_costs": self.warm_switch_costs,
            "resize_costs": self.resize_costs,
            "noise": [list(e) for e in self.noise.entries],
            "out_of_memory": sorted(str(s) for s in self.out_of_memory),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.current = Stage(Strategy.parse(state["current"]), None, state["reason"])
        self.samples = {Strategy.parse(k): list(v) for k, v in state["samples"].items()}
        steps = state.get("sample_steps", {})  # a state from before steps were kept: all count as step 0's
        self.sample_steps = {s: list(steps.get(str(s), [0] * len(v))) for s, v in self.samples.items()}
        self.switch_costs = list(state["switch_costs"])
        self.warm_switch_costs = list(state.get("warm_switch_costs", []))
        self.resize_costs = list(state.get("resize_costs", []))
        self.noise = NoiseWindow(self.cfg.train.gns_window, state.get("noise", []), per_batch=True)
        self.out_of_memory = {Strategy.parse(s) for s in state.get("out_of_memory", [])}
        self.space = self.space.without(self.out_of_memory, "ran out of memory")
        self._searched_for = None

    def _log(
        self,
        row: dict[str, Any],
        cand: Strategy | None,
        d: Verdict | None,
        why: str,
        gns: NoiseInterval | None = None,
        t_cur: Estimate | None = None,
        left: float | None = None,
    ) -> None:
        if self.events is None:
            return
        fields: dict[str, Any] = {
            "step": row["step"],
            "current": self.current.strategy.to_dict(),
            "switch": bool(d and d.switch),
            "why": why,
            "switch_cost_s": round(self.switch_cost(cand), 3),
            "kappa": self.s.kappa,
        }
        if gns is not None:
            fields.update(gns=gns.value, gns_low=gns.low, gns_high=gns.high if math.isfinite(gns.high) else None)
        if t_cur is not None:
            fields.update(measured_t=t_cur.value, measured_t_log_std=round(t_cur.log_std, 4))
        if cand is not None:
            fields.update(candidate=cand.to_dict(), measured=cand in self.samples)
        if d is not None:  # `predicted_t`: the step time the candidate was compared at (cona report)
            t = d.option.step_time
            fields.update(candidate_kind=d.move.value, predicted_t=t.value, predicted_t_log_std=round(t.log_std, 4))
            fields.update(ratio=d.ratio, ratio_judged=d.judged, payback=d.payback, score=d.score, time_left_s=left)
        self.events.write("decision", **fields)


def _checkpoint_window(window: float, trainer: dict[str, Any]) -> NoiseWindow:
    """The policy's noise window at a checkpoint, rebuilt per batch from the workers' own window (trainer.json
    `extra.gns`), which holds the same raw estimates the policy pooled: the checkpoint's batch's trailing ones."""
    noise = NoiseWindow(
        window, trainer.get("trainer", {}).get("extra", {}).get("gns", {}).get("entries", []), per_batch=True
    )
    if "strategy" in trainer:  # the checkpoint's batch, which may have no estimate of its own yet
        noise.add(Strategy.from_mapping(trainer["strategy"]).gbs, None, None)
    return noise
