"""The switch rule: move to a candidate when its surrogate beats the current one's, net of switch cost.

Φ(s) = (gbs / T(s)) / (gbs + GNS) is loss reduction per second. Over a horizon of H seconds,
switching pays when Φ' (H - C) > Φ H, C the switch cost, i.e. when Φ'/Φ > H / (H - C); the rule
also asks for a margin (Φ'/Φ > 1 + margin) so that noise in T and GNS does not cause flapping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cona_cli.planner.surrogate import phi


@dataclass(frozen=True)
class Decision:
    switch: bool
    phi_current: float
    phi_candidate: float
    ratio: float
    needed: float  # the ratio the candidate had to beat
    why: str


def needed_ratio(switch_cost_s: float, horizon_s: float, margin: float) -> float:
    """The Φ ratio a candidate must exceed: the margin, and paying back the switch within the horizon."""
    payback = math.inf if switch_cost_s >= horizon_s else horizon_s / (horizon_s - switch_cost_s)
    return max(1.0 + margin, payback)


def decide(
    gbs: int,
    t_current: float,
    gbs_candidate: int,
    t_candidate: float,
    gns: float,
    switch_cost_s: float,
    horizon_s: float,
    margin: float,
    kappa: float = 1.0,
) -> Decision:
    """Compare the running strategy (measured T) with a candidate (predicted T) at the current GNS
    (scaled by κ, the optimizer's noise-scale multiplier)."""
    phi_cur = float(phi(gbs, t_current, gns, kappa))
    phi_new = float(phi(gbs_candidate, t_candidate, gns, kappa))
    ratio = phi_new / phi_cur
    needed = needed_ratio(switch_cost_s, horizon_s, margin)
    if ratio > needed:
        why = (
            f"Φ ratio {ratio:.3f} > {needed:.3f} (margin {margin:g}, switch cost {switch_cost_s:.1f} s "
            f"paid back within {horizon_s:g} s)"
        )
    elif ratio > 1.0 + margin:
        why = (
            f"Φ ratio {ratio:.3f} does not pay back the {switch_cost_s:.1f} s switch within {horizon_s:g} s "
            f"(needs {needed:.3f})"
        )
    else:
        why = f"Φ ratio {ratio:.3f} <= {1.0 + margin:.3f}"
    return Decision(ratio > needed, phi_cur, phi_new, ratio, needed, why)
