"""The online CONA policy: climb the global-batch ladder when the surrogate says it pays.

Every `decision_every` steps it compares the running strategy (measured median s/iter) with the
frontier candidates (the best predicted strategies at the next `lookahead` rungs), with the best
layout at the same rung and with the rung it climbed from (at that rung's measured speed, which undoes
a move that did not pay), using Φ_κ at the current smoothed GNS and the learned cost of the switch
it would take (`switch_rule.decide`): an in-place resize when only the batch changes, else a hand-over
to a ready standby or a cold relaunch. Moving down is decided by the same rule, never by the GNS trend alone.
Step times of a strategy the run could resize to are forgotten `search.remeasure_s` after it last ran:
on a host that drifts they describe another host, and measuring again costs a resize and a few steps.
A background thread recalibrates the iteration-time model from the measured step times and reruns
the search whenever the measurements moved, and after every switch.
"""

from __future__ import annotations

import statistics
import threading
from typing import Any

import numpy as np

from cona_cli.config import Config
from cona_cli.control.policies import Policy, Stage
from cona_cli.control.switch_rule import decide
from cona_cli.planner.calibration import Calibrator
from cona_cli.planner.hardware import HardwareProfile
from cona_cli.planner.kappa import Curve, KappaFit, fit_kappa
from cona_cli.planner.search import Candidate, SearchResult, search_gbs
from cona_cli.planner.space import enumerate_space, gbs_ladder
from cona_cli.planner.workload import Workload
from cona_cli.strategy import Strategy, resizable

WARMUP_STEPS = 2  # first steps of a launch (pipeline shape inference, allocator) are not timed
REMEASURE = 0.1  # rerun the search when the running strategy's median moved by this fraction
SAMPLE_WINDOW = 100  # step times kept per strategy (the controller saves its state every few steps)


def fastest_strategy(cfg: Config, hw: HardwareProfile) -> Strategy:
    """What an offline planner picks: the shortest predicted iteration time at search.gbs_static."""
    gbs = cfg.search.gbs_static or gbs_ladder(cfg)[0]
    space = enumerate_space(cfg, hw, [gbs])
    best = search_gbs(space, Calibrator(Workload.from_config(cfg), hw, seed=cfg.search.seed), gbs, cfg.search).best
    if best is None:
        raise ValueError(f"search: no feasible strategy at gbs {gbs}")
    return best.strategy


class ConaPolicy(Policy):
    name = "cona"

    def __init__(self, cfg: Config, hw: HardwareProfile) -> None:
        super().__init__()
        self.cfg, self.hw, self.s = cfg, hw, cfg.search
        self.ladder = gbs_ladder(cfg)
        self.space = enumerate_space(cfg, hw, self.ladder)
        self.out_of_memory: set[Strategy] = set()  # strategies that ran out of memory in this run
        self.workload = Workload.from_config(cfg)
        self.samples: dict[Strategy, list[float]] = {}  # measured s/iter of strategies that ran
        self.timed_at: dict[Strategy, float] = {}  # run time of each strategy's last timed step
        self.forgotten: dict[Strategy, float] = {}  # medians of forgotten step times (`_forget_stale`)
        self.switch_costs: list[float] = []  # measured cold relaunches
        self.warm_switch_costs: list[float] = []  # measured hand-overs to a ready standby
        self.resize_costs: list[float] = []  # measured in-place resizes
        self.in_place = self.s.in_place
        self.previous: list[Strategy] = []  # strategies of the lower rungs we climbed from
        self._lock = threading.Lock()
        self._results: dict[int, SearchResult] = {}
        self._searched_for: tuple[Strategy, float] | None = None
        self._thread: threading.Thread | None = None
        self._launch: int | None = None
        self._launch_steps = 0
        self._launch_timed = 0  # steps of this launch timed into `samples`
        self._last_gns: float | None = None
        self.probe: list[tuple[float, float, int, float]] = []  # (samples, val loss, gbs, GNS) per evaluation
        self.kappa_fit = fit_kappa([])  # no evidence yet: κ 1, the interval every κ
        self.leading: Strategy | None = None  # the last decision's best candidate
        first = self._search_now(self.ladder[0]).best
        if first is None:
            raise ValueError(f"search: no feasible strategy at gbs {self.ladder[0]}")
        self.current = Stage(first.strategy, None, "start")

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

    def _rungs_to_search(self) -> list[int]:
        i = self.ladder.index(self.current.strategy.gbs)
        back = self.previous[-1] if self.previous else None
        below = [back.gbs] if back is not None and back not in self.samples else []  # its times were forgotten
        return below + self.ladder[i : i + 1 + self.s.lookahead]  # this rung (better layout?) and the frontier

    def _maybe_search(self) -> None:
        """Start a background search if none runs and the calibration data moved enough."""
        cur = self.current.strategy
        median = statistics.median(self.samples[cur])
        if self._thread is not None and self._thread.is_alive():
            return
        last = self._searched_for
        if last is not None and last[0] == cur and abs(median - last[1]) <= REMEASURE * last[1]:
            return
        self._searched_for = (cur, median)
        rungs = self._rungs_to_search()
        snapshot = {s: list(v) for s, v in self.samples.items()}
        known = {**{s: [t] for s, t in self.forgotten.items()}, **snapshot}
        forgotten_rungs = {s.gbs for s in self.forgotten}

        def run() -> None:
            # A forgotten strategy's rung is predicted without its times; every other rung with all of
            # them (forgetting them must not make the model more optimistic about rungs never run).
            cal = self._calibrated(known)
            fresh = self._calibrated(snapshot) if forgotten_rungs & set(rungs) else cal
            results = {g: search_gbs(self.space, fresh if g in forgotten_rungs else cal, g, self.s) for g in rungs}
            with self._lock:
                self._results.update(results)

        self._thread = threading.Thread(target=run, name="cona-search", daemon=True)
        self._thread.start()

    def wait_for_search(self) -> None:
        if self._thread is not None:
            self._thread.join()

    # -- policy ------------------------------------------------------------------------------

    def first(self) -> Stage:
        return self.current

    def may_switch(self) -> bool:
        return len(self.ladder) > 1

    def expected_next(self) -> Strategy | None:
        return self.leading

    def kappa(self) -> float:
        """Φ_κ's multiplier on the measured GNS: `search.kappa`, or the fit of this run's evidence."""
        return self.kappa_fit.kappa if self.s.kappa == "auto" else float(self.s.kappa)

    def on_eval(self, row: dict[str, Any]) -> None:
        """Probe-loss evidence for κ: samples so far, validation loss, the batch and GNS in force."""
        if self._last_gns is not None and row.get("consumed_samples"):
            self.probe.append((row["consumed_samples"], row["val_loss"], self.current.strategy.gbs, self._last_gns))

    def refit_kappa(self) -> threading.Thread | None:
        """Refit κ in the background from this run's evaluations (after a switch: only then do two
        batch sizes show); a second of least squares stays off the switch's critical path."""
        if self.s.kappa != "auto" or len(self.probe) < 6:
            return None
        samples, loss, gbs, gns = (np.array(col, dtype=float) for col in zip(*self.probe))

        def run() -> None:
            self.kappa_fit = fit_kappa([Curve(samples, loss, gbs, gns)])

        thread = threading.Thread(target=run, name="cona-kappa", daemon=True)
        thread.start()
        return thread

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

    def on_metric(self, row: dict[str, Any]) -> Stage | None:
        if row.get("launch") != self._launch:
            self._launch, self._launch_steps, self._launch_timed = row.get("launch"), 0, 0
        self._launch_steps += 1
        cur = self.current.strategy
        if self._launch_steps > WARMUP_STEPS and not self.standby_importing:
            times = self.samples.setdefault(cur, [])
            times.append(row["iter_s"])
            del times[:-SAMPLE_WINDOW]  # recent steps only: follows host drift, bounds the saved state
            self._launch_timed += 1
            self.forgotten.pop(cur, None)
            if row.get("time") is not None:
                self.timed_at[cur] = row["time"]
        gns = row.get("gns")
        if gns is not None:
            self._last_gns = gns
        # Fresh steps of this launch, not only those of an earlier visit to the strategy: a decision
        # right after a switch back would otherwise rest on old times alone.
        if self._launch_timed < self.s.min_steps or self._launch_steps % self.s.decision_every:
            return None
        if row.get("time") is not None:
            self._forget_stale(row["time"])
        self._maybe_search()
        if gns is None:
            self._log(row, None, "no GNS estimate yet", False)
            return None
        return self._decide(row, gns)

    def _decide(self, row: dict[str, Any], gns: float) -> Stage | None:
        cur = self.current.strategy
        t_cur = statistics.median(self.samples[cur])
        with self._lock:
            results = dict(self._results)
        i = self.ladder.index(cur.gbs)
        candidates = []
        same = results.get(cur.gbs)
        if same is not None and same.best is not None and same.best.strategy != cur:
            candidates.append(("same_gbs", same.best))
        for up, gbs in enumerate(self.ladder[i + 1 : i + 1 + self.s.lookahead], 1):
            above = results.get(gbs)
            if above is not None and above.best is not None:
                candidates.append(("next_gbs" if up == 1 else f"next_gbs+{up - 1}", above.best))
        if self.previous:  # the rung we came from, at its measured speed: undo a move that did not pay
            back = self.previous[-1]
            if back in self.samples:
                t_back = statistics.median(self.samples[back])
                candidates.append(("previous_gbs", Candidate(back, t_back, 0.0, 0.0, 0.0)))
            elif (below := results.get(back.gbs)) is not None and below.best is not None:
                candidates.append(("previous_gbs", below.best))  # its times were forgotten: predicted
        if not candidates:
            self._log(row, None, "no candidate yet (search running or top rung)", False, gns=gns, t_cur=t_cur)
            return None
        best = None
        for kind, cand in candidates:
            t_cand = self._optimistic_time(cand, t_cur)
            d = decide(
                cur.gbs,
                t_cur,
                cand.strategy.gbs,
                t_cand,
                gns,
                self.switch_cost(cand.strategy),
                self.s.horizon_s,
                self.s.margin,
                self.kappa(),
            )
            if best is None or d.ratio > best[2].ratio:
                best = (kind, cand, d, t_cand)
        kind, cand, d, t_cand = best
        self.leading = cand.strategy
        self._log(row, cand, d.why, d.switch, gns=gns, t_cur=t_cur, decision=d, candidate_kind=kind, candidate_t=t_cand)
        if not d.switch:
            return None
        return Stage(cand.strategy, None, "decision")

    def _forget_stale(self, now: float) -> None:
        """Forget the step times of strategies the running one could resize to in place that have not
        run for `search.remeasure_s` seconds: they compete at their prediction again (with optimism;
        the model still calibrates on their medians for every other rung), so a rung measured during
        a slow spell of the host, or in the first steps after a resize, is measured again instead of
        holding the run off it for good."""
        if not (self.in_place and self.s.remeasure_s):
            return
        cur = self.current.strategy
        stale = [
            s
            for s in self.samples
            if s != cur and resizable(cur, s) and now - self.timed_at.get(s, now) > self.s.remeasure_s
        ]
        for s in stale:
            self.forgotten[s] = statistics.median(self.samples.pop(s))
            self.timed_at.pop(s, None)
        if stale:
            with self._lock:
                self._results.clear()  # they held the forgotten medians
            self._searched_for = None

    def _optimistic_time(self, cand: Candidate, t_cur: float) -> float:
        """Measured median for a strategy that ran; otherwise optimism in the face of uncertainty:
        the prediction minus `search.optimism` standard deviations, but never below half the
        prediction, nor (unless the model itself says so) below the running step's measured time,
        nor below the measured trend of its layout (`_trend_time`).
        A wrong guess costs one switch: once measured, the previous rung competes at its real speed."""
        if cand.strategy in self.samples:
            return statistics.median(self.samples[cand.strategy])
        t = max(cand.time_s - self.s.optimism * cand.time_std, 0.5 * cand.time_s, min(cand.time_s, t_cur))
        trend = self._trend_time(cand.strategy)
        return t if trend is None else max(t, trend)

    def _trend_time(self, s: Strategy) -> float | None:
        """The step time of `s` extrapolated from the two measured global batches just below it with
        the same (dp, tp, pp): T = fixed + gbs * per-sample, a line through their medians. The model
        fitted to the same two points lets the per-sample cost keep falling with the batch, which on
        CPUs it does not (gpt-tiny, dp4, static runs: 8 and 16 at 0.153 and 0.247-0.256 s put gbs 32
        at 0.435-0.46 s on the line, measured 0.431-0.459; the calibrated model said 0.39). Forgotten
        medians count too: a floor may be stale, an up-probe on optimism alone costs more."""
        medians = {**self.forgotten, **{m: statistics.median(v) for m, v in self.samples.items() if v}}
        measured: dict[int, float] = {}
        for m, t in medians.items():
            if (m.dp, m.tp, m.pp) == (s.dp, s.tp, s.pp) and m.gbs < s.gbs:
                measured[m.gbs] = min(t, measured.get(m.gbs, t))  # the best layout at each batch
        if len(measured) < 2:
            return None
        (g1, t1), (g2, t2) = sorted(measured.items())[-2:]
        return t2 + (t2 - t1) / (g2 - g1) * (s.gbs - g2)

    def after_launch(self, outcome: dict[str, Any], requested: Stage | None) -> Stage | None:
        if requested is None:
            return None
        self._moved(requested)
        return requested

    def resized(self, stage: Stage, seconds: float) -> None:
        self.resize_costs.append(seconds)
        self._moved(stage)
        self._launch_steps = self._launch_timed = 0  # the first steps under the new batch: as after a launch

    def _moved(self, stage: Stage) -> None:
        old = self.current.strategy
        if stage.strategy.gbs < old.gbs:  # back down (to the rung climbed from, or its best layout)
            while self.previous and self.previous[-1].gbs >= stage.strategy.gbs:
                self.previous.pop()
        elif stage.strategy.gbs > old.gbs:
            self.previous.append(old)
        self.current = stage
        self.leading = None  # the next standby prepares what the next decision leads with, not this move
        self.refit_kappa()
        self._searched_for = None  # a new frontier: search again once the new strategy is measured

    def infeasible(self, strategy: Strategy) -> Stage | None:
        """Drop a strategy that ran out of memory from the space; continue with the best one left at the
        running rung (None if none is left)."""
        self.out_of_memory.add(strategy)
        self.space = self.space.without(self.out_of_memory, "ran out of memory")
        self.previous = [p for p in self.previous if p != strategy]
        with self._lock:
            self._results.clear()
        self._searched_for = None
        best = self._search_now(self.current.strategy.gbs).best
        if best is None:
            return None
        self.current = Stage(best.strategy, None, "out_of_memory")
        return self.current

    def state_dict(self) -> dict[str, Any]:
        """Ladder position, calibration samples, switch costs and κ evidence (for --resume)."""
        return {
            "current": str(self.current.strategy),
            "reason": self.current.reason,
            "samples": {str(k): v for k, v in self.samples.items()},
            "timed_at": {str(k): v for k, v in self.timed_at.items()},
            "forgotten": {str(k): v for k, v in self.forgotten.items()},
            "switch_costs": self.switch_costs,
            "warm_switch_costs": self.warm_switch_costs,
            "resize_costs": self.resize_costs,
            "previous": [str(p) for p in self.previous],
            "probe": self.probe,
            "kappa_fit": vars(self.kappa_fit),
            "out_of_memory": sorted(str(s) for s in self.out_of_memory),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.current = Stage(Strategy.parse(state["current"]), None, state["reason"])
        self.samples = {Strategy.parse(k): list(v) for k, v in state["samples"].items()}
        self.timed_at = {Strategy.parse(k): float(v) for k, v in state.get("timed_at", {}).items()}
        self.forgotten = {Strategy.parse(k): float(v) for k, v in state.get("forgotten", {}).items()}
        self.switch_costs = list(state["switch_costs"])
        self.warm_switch_costs = list(state.get("warm_switch_costs", []))
        self.resize_costs = list(state.get("resize_costs", []))
        self.previous = [Strategy.parse(p) for p in state["previous"]]
        self.probe = [tuple(p) for p in state.get("probe", [])]
        if "kappa_fit" in state:
            self.kappa_fit = KappaFit(**state["kappa_fit"])
        self.out_of_memory = {Strategy.parse(s) for s in state.get("out_of_memory", [])}
        self.space = self.space.without(self.out_of_memory, "ran out of memory")
        self._searched_for = None

    def _log(self, row: dict[str, Any], cand: Any, why: str, switch: bool, **extra: Any) -> None:
        if self.events is None:
            return
        fields: dict[str, Any] = {
            "step": row["step"],
            "current": self.current.strategy.to_dict(),
            "switch": switch,
            "why": why,
            "switch_cost_s": round(self.switch_cost(cand.strategy if cand is not None else None), 3),
            "kappa": round(self.kappa(), 4),
            "kappa_interval": [round(self.kappa_fit.low, 4), round(self.kappa_fit.high, 4)]
            if self.s.kappa == "auto"
            else None,
        }
        if cand is not None:
            fields.update(candidate=cand.strategy.to_dict(), predicted_t=cand.time_s, predicted_t_std=cand.time_std)
        d = extra.pop("decision", None)
        if d is not None:
            fields.update(phi_current=d.phi_current, phi_candidate=d.phi_candidate, ratio=d.ratio, needed=d.needed)
        if "t_cur" in extra:
            extra["measured_t"] = extra.pop("t_cur")
        self.events.write("decision", **fields, **extra)
