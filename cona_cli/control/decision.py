"""The decision rule: which strategy to run next, as one pure function of named quantities.

**What it maximises.** Progress per second, Φ(s) = (gbs/T(s)) / (gbs + G) (McCandlish et al. 2018;
`planner.surrogate`), G the noise scale the efficiency signal reads. Over the H seconds the run has
left, staying makes Φ·H of progress and a move Φ'·(H − C), C its cost, so a move is worth
Φ'/Φ · (H − C)/H of staying: its *score* at the point estimates. The best-scoring move whose score
at its judged end of the evidence (below) exceeds 1 is taken; none, and the run stays.

**What it tolerates.** Each kind of move is judged at the end of its evidence that `JUDGED_AT` names:

    move     a candidate ...            noise scale G        step times
    up       of the next rung up        point estimate       point; an untried rung: its hopeful end
    jump     two or more rungs up       lower bound          lower bound
    layout   at the running batch       cancels              lower bound
    down     of a lower rung            infinite             lower bound

The noise scale grows as the loss falls, so the errors are not alike. A climb to the next rung taken
at a near tie is at worst a small loss that the growing noise scale soon turns into a gain; held until
the evidence is sure, it loses the whole gain meanwhile (the paper's rule: the point estimate). A
never-run next rung is judged as if the model over-predicted its step by z of its error (at least the
uncalibrated model's where no measured strategy varies along the rung's direction, `planner.calibration`):
a model that is wrong about a rung cannot hold a climb back, and one step there measures it. A jump rests on an early,
noisy reading of G, so it needs the lower bound. A retreat goes against the trend and against the
measured G's known bias under Adam (it under-states the critical batch), so it must win on samples per
second alone. At a true tie the run thus climbs at most once and never comes back: no flapping.

A layout move and a retreat do not read G, so they are judged before the running batch has a noise-scale
reading of its own (after a change of batch the estimator is held while Adam's moments adapt): a rung
that runs slower than the one below it is left without waiting for it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from cona_core.efficiency import phi_ratio
from cona_core.gns import NoiseInterval


@dataclass(frozen=True)
class Estimate:
    """A positive quantity and the standard deviation of its log (≈ its relative standard error)."""

    value: float
    log_std: float = 0.0


class Move(enum.Enum):
    UP = "up"
    JUMP = "jump"
    LAYOUT = "layout"
    DOWN = "down"


@dataclass(frozen=True)
class Judged:
    """Where a kind of move's Φ ratio is read: G at `noise` ("point", "low", "infinite", or "cancels": the
    batches are equal, so any G gives the same ratio) and the step
    times at `times` ("point", "bound" = less z of their error, "hopeful" = point, or more z of the model's
    error for an untried rung)."""

    noise: str
    times: str


JUDGED_AT = {
    Move.UP: Judged(noise="point", times="hopeful"),
    Move.JUMP: Judged(noise="low", times="bound"),
    Move.LAYOUT: Judged(noise="cancels", times="bound"),
    Move.DOWN: Judged(noise="infinite", times="bound"),
}


@dataclass(frozen=True)
class Running:
    """What the job runs now: its global batch and measured step time, on the ladder `rungs`."""

    gbs: int
    step_time: Estimate
    rungs: tuple[int, ...]


@dataclass(frozen=True)
class Option:
    """A strategy the job could move to. `step_time`: measured, else the model's (with its error);
    `untried`: no strategy of its batch has run yet, so its time is the model's alone; `switch_cost_s`: what
    the move costs (a resize, a hand-over or a relaunch)."""

    name: str
    gbs: int
    step_time: Estimate
    switch_cost_s: float
    untried: bool = False


@dataclass(frozen=True)
class Evidence:
    """The noise scale with its bounds at the confidence level of `z` (one-sided; None before the running
    batch has a reading), and the time left."""

    noise: NoiseInterval | None
    time_left_s: float
    z: float


@dataclass(frozen=True)
class Verdict:
    option: Option
    move: Move
    ratio: float  # Φ'/Φ at the point estimates
    judged: float  # Φ'/Φ at the end of the evidence its kind of move is judged at
    payback: float  # (H − C)/H: the share of the time left the option would train
    switch: bool  # judged × payback > 1
    why: str

    @property
    def score(self) -> float:
        """Progress over the time left relative to staying, at the point estimates."""
        return self.ratio * self.payback


def move_of(running: Running, gbs: int) -> Move:
    if gbs == running.gbs:
        return Move.LAYOUT
    if gbs < running.gbs:
        return Move.DOWN
    above = [g for g in running.rungs if g > running.gbs]
    return Move.UP if above and gbs == min(above) else Move.JUMP


def needs_noise(move: Move) -> bool:
    return JUDGED_AT[move].noise not in ("cancels", "infinite")


def judge(running: Running, option: Option, evidence: Evidence) -> Verdict:
    """One option against staying (a move that reads G needs `evidence.noise`)."""
    move = move_of(running, option.gbs)
    at = JUDGED_AT[move]
    g = evidence.noise
    if not needs_noise(move):
        judged_g = math.inf  # "cancels" and "infinite": any G gives this ratio, the throughput ratio
    elif g is None:
        raise ValueError(f"judge: a move {move.value} reads the noise scale, and there is no reading")
    else:
        judged_g = g.value if at.noise == "point" else g.low
    point_g = g.value if g is not None else judged_g
    t, t_opt = running.step_time, option.step_time
    ratio = phi_ratio(running.gbs, t.value, option.gbs, t_opt.value, point_g)
    error = math.hypot(t.log_std, t_opt.log_std)
    shift = {"point": 0.0, "bound": -error, "hopeful": t_opt.log_std if option.untried else 0.0}[at.times]
    judged = phi_ratio(running.gbs, t.value, option.gbs, t_opt.value, judged_g) * math.exp(evidence.z * shift)
    left = evidence.time_left_s
    payback = max(0.0, 1.0 - option.switch_cost_s / left) if left > 0 else 0.0
    switch = judged * payback > 1.0
    reading = f"G {g.value:.4g} in [{g.low:.4g}, {g.high:.4g}]" if g is not None else "no G reading yet"
    why = (
        f"{'switch' if switch else 'stay'} ({move.value}): Φ ratio {ratio:.3f}, {judged:.3f} at G {at.noise} "
        f"and step times {at.times} ({reading}, times ±{error:.3f} in log), "
        f"× {payback:.3f} for the {option.switch_cost_s:.2f} s switch in the {left:.0f} s left"
    )
    return Verdict(option, move, ratio, judged, payback, switch, why)


def decide(*, running: Running, options: Sequence[Option], evidence: Evidence) -> Verdict | None:
    """The verdict on the best option: the best-scoring one that passes, else the best-scoring one (a stay);
    None without options. Without a noise-scale reading only the moves that read none are judged."""
    if evidence.noise is None:
        options = [o for o in options if not needs_noise(move_of(running, o.gbs))]
    verdicts = [judge(running, o, evidence) for o in options]
    passing = [v for v in verdicts if v.switch]
    return max(passing or verdicts, key=lambda v: v.score, default=None)
