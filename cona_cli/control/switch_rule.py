"""The switch rule: take a candidate when it wins with confidence, net of what the switch costs.

Φ(s) = (gbs/T(s)) / (gbs + κ·G) is progress per second (`planner.surrogate`). Over the H seconds the
run has left, staying makes Φ·H of progress and switching Φ'·(H − C), C the switch's cost, so a
candidate pays when Φ'/Φ · (H − C)/H > 1. The rule asks this of the ratio's lower confidence bound,
not of its point estimate: step times and the GNS are log-normal estimates, and the ratio's log
standard deviation follows from theirs (delta method). A tie within the noise then switches in
neither direction, and a real gain switches as soon as the measurements can tell it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cona_cli.planner.surrogate import phi


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

    @property
    def score(self) -> float:
        """Progress over the time left relative to staying, at the ratio's lower bound (> 1: switch)."""
        return self.ratio_low * self.payback


def decide(
    gbs: int,
    t_current: Estimate,
    gbs_candidate: int,
    t_candidate: Estimate,
    gns: Estimate,
    switch_cost_s: float,
    time_left_s: float,
    z: float,
    kappa: float = 1.0,
) -> Decision:
    """Compare the running strategy with a candidate at noise scale `gns`; `z` sets the confidence level
    of the lower bound (e.g. 1.645 for 95 % one-sided)."""
    g = kappa * gns.value
    ratio = float(phi(gbs_candidate, t_candidate.value, g) / phi(gbs, t_current.value, g))
    d_gns = g / (gbs + g) - g / (gbs_candidate + g)  # ∂ log(Φ'/Φ) / ∂ log G
    log_std = math.sqrt(t_current.log_std**2 + t_candidate.log_std**2 + (d_gns * gns.log_std) ** 2)
    low = ratio * math.exp(-z * log_std)
    payback = max(0.0, 1.0 - switch_cost_s / time_left_s) if time_left_s > 0 else 0.0
    d = Decision(low * payback > 1.0, ratio, low, payback, "")
    verdict = "switch" if d.switch else "stay"
    why = (
        f"{verdict}: Φ ratio {ratio:.3f}, lower bound {low:.3f} (±{log_std:.3f} in log), "
        f"× {payback:.3f} for the {switch_cost_s:.2f} s switch in the {time_left_s:.0f} s left = {d.score:.3f}"
    )
    return Decision(d.switch, ratio, low, payback, why)
