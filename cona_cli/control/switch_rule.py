"""The switch rule: take a candidate when it wins, net of what the switch costs.

Φ(s) = (gbs/T(s)) / (gbs + κ·G) is progress per second (`cona_core.efficiency`). Over the H seconds the
run has left, staying makes Φ·H of progress and switching Φ'·(H − C), C the switch's cost, so a
candidate pays when Φ'/Φ · (H − C)/H > 1.

The noise scale grows as the loss falls, so a candidate's Φ ratio drifts one way: up for a larger
batch, down for a smaller one. The errors are therefore not alike:
- **the next rung up** is taken at the ratio's point estimate (the paper's rule). Taken a little early,
  it is at worst a small loss that the growing noise scale soon turns into a gain; held until the
  evidence is sure, it loses the whole gain meanwhile (on wikitext2-gpt-tiny the point estimate of gbs
  16 over 8 crossed 1 at 52 s and its 99 % bound at 107 s, while gbs 16's static run was ahead).
- **a rung two or more up, or another layout at the same batch** must clear a lower confidence bound
  of the ratio: the ratio at the GNS's lower bound, less the step times' log-normal error.
- **a smaller batch** must win at any noise scale: its samples per second, less their error, must
  beat the running strategy's. The noise scale is what a smaller batch would win on, and that is where
  the measured one misleads: it under-states the critical batch of a preconditioned optimizer (Adam's
  is several times SGD's, Zhang et al. 2019; the fixed-batch runs of wikitext2-gpt-tiny fit κ 5.8
  [2.4–12.3], `scripts/fit_kappa.py`), it dips after the LR warm-up before it grows, and right after a
  climb the new batch often reads a fraction of what the old one read. Every early retreat (16 → 8 in
  the first minute) of the gpt-tiny benchmarks went back to a batch that seed's fixed runs beat
  (docs/switching.md). A rung that runs slower than predicted is still left.
At a true tie the run thus climbs at most once and does not come back: no flapping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cona_core.efficiency import phi_ratio
from cona_core.gns import NoiseInterval


@dataclass(frozen=True)
class Estimate:
    """A positive quantity and the standard deviation of its log (≈ its relative standard error)."""

    value: float
    log_std: float = 0.0


@dataclass(frozen=True)
class Decision:
    switch: bool
    ratio: float  # Φ'/Φ at the point estimates
    ratio_low: float  # its lower confidence bound
    payback: float  # (H − C)/H: the share of the time left that the candidate would train
    why: str
    probe: bool = False  # taken to measure its step time (a cheap move the model may be wrong about)
    point: bool = False  # decided at the ratio's point estimate (the next rung up), else at its lower bound

    @property
    def score(self) -> float:
        """Progress over the time left relative to staying, at the ratio that decides (> 1: switch)."""
        return (self.ratio if self.point else self.ratio_low) * self.payback


def decide(
    gbs: int,
    t_current: Estimate,
    gbs_candidate: int,
    t_candidate: Estimate,
    gns: NoiseInterval,
    switch_cost_s: float,
    time_left_s: float,
    z: float,
    kappa: float = 1.0,
    probe: bool = False,
    point: bool = False,
) -> Decision:
    """Compare the running strategy with a candidate; `gns` carries its bounds at the same confidence
    level as `z` (e.g. 1.645 for 95 % one-sided). `probe`: the candidate may be probed (its step time is
    the model's, with the model's error in `t_candidate.log_std`). `point`: the candidate is the next rung
    up, decided at the ratio's point estimate. A smaller candidate is judged at an infinite noise scale:
    on samples per second alone."""
    ratio = phi_ratio(gbs, t_current.value, gbs_candidate, t_candidate.value, kappa * gns.value)
    worst = gns.low if gbs_candidate > gbs else math.inf if gbs_candidate < gbs else gns.value
    log_std = math.hypot(t_current.log_std, t_candidate.log_std)
    low = phi_ratio(gbs, t_current.value, gbs_candidate, t_candidate.value, kappa * worst) * math.exp(-z * log_std)
    payback = max(0.0, 1.0 - switch_cost_s / time_left_s) if time_left_s > 0 else 0.0
    decisive = ratio if point else low
    switch = decisive * payback > 1.0
    why = (
        f"{'switch' if switch else 'stay'}: Φ ratio {ratio:.3f}, lower bound {low:.3f} (GNS {gns.value:.4g} in "
        f"[{gns.low:.4g}, {gns.high:.4g}], step times ±{log_std:.3f} in log), × {payback:.3f} for the "
        f"{switch_cost_s:.2f} s switch in the {time_left_s:.0f} s left = {decisive * payback:.3f} at the "
        f"{'point estimate (next rung up)' if point else 'lower bound'}"
    )
    if switch or not probe:
        return Decision(switch, ratio, low, payback, why, point=point)
    high = ratio * math.exp(z * log_std)
    if high * payback <= 1.0:
        return Decision(False, ratio, low, payback, why, point=point)
    why = f"probe: Φ ratio {ratio:.3f}, {high:.3f} were the predicted step time off by {z:.3g} of its error; " + why
    return Decision(True, ratio, low, payback, why, probe=True, point=point)
